"""`python -m tests.support.flood ADDRESS KEY TASK_ID CALLS`: one tenant reading as fast as it is let, from its own
process — CALLS GetTask calls in flight, a refused one sent again after its RetryInfo delay (as the SDK does).

Driven by lines on stdin: `go N` starts the flood (answered `flooding` once N calls were answered: past the burst,
in full flow), `pause` stops sending and waits for the calls in
flight (answered `paused SERVED REFUSED`, the counts so far), end of input ends it: it prints `served refused` and
exits."""

from __future__ import annotations

import asyncio
import sys

import grpc
from google.rpc import error_details_pb2

from taskgate_api.v1 import gateway_pb2, gateway_pb2_grpc
from tests.support.harness import trailing_details


async def main(address: str, key: str, task_id: str, calls: int) -> None:
    counts = {"served": 0, "refused": 0}
    metadata = (("authorization", f"Bearer {key}"),)
    going = asyncio.Event()
    busy = 0
    idle = asyncio.Condition()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.TaskGatewayStub(channel)

        async def call() -> float:
            """One GetTask; how long to wait before the next (a refusal's RetryInfo delay)."""
            try:
                await stub.GetTask(gateway_pb2.GetTaskRequest(task_id=task_id), metadata=metadata, timeout=30)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                counts["refused"] += 1
                delays = [
                    d.retry_delay.ToTimedelta().total_seconds()
                    for d in trailing_details(exc)
                    if isinstance(d, error_details_pb2.RetryInfo)
                ]
                return delays[0] if delays else 0.01
            counts["served"] += 1
            return 0.0

        async def reader() -> None:
            nonlocal busy
            while True:
                await going.wait()
                busy += 1
                try:
                    delay = await call()
                finally:
                    busy -= 1
                    async with idle:
                        idle.notify_all()
                if delay:
                    await asyncio.sleep(delay)

        readers = [asyncio.create_task(reader()) for _ in range(calls)]
        while line := (await asyncio.to_thread(sys.stdin.readline)).strip():
            if line.startswith("go"):
                going.set()
                enough = counts["served"] + counts["refused"] + int(line.split()[1])

                def warm(n: int = enough) -> bool:
                    return counts["served"] + counts["refused"] >= n

                async with idle:
                    await idle.wait_for(warm)
                print("flooding", flush=True)
            elif line == "pause":
                going.clear()
                async with idle:
                    await idle.wait_for(lambda: busy == 0)
                print("paused", counts["served"], counts["refused"], flush=True)
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
    print(counts["served"], counts["refused"], flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
