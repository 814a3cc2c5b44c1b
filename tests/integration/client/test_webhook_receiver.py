"""The example webhook receiver (examples/webhook_receiver.py) gets a verified webhook from a real notifier."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from taskgate import auth
from taskgate.config import ModelSpec, Settings
from taskgate.runtime import Backends
from taskgate_client import AsyncTaskgateClient, Status, connect_async
from tests.support.harness import load_example, wait_for


async def test_example_receiver_gets_a_verified_webhook_from_the_notifier(
    settings: Settings, backends: Backends
) -> None:
    from services.notifier import service as notifier_service
    from services.submit import service as submit_service
    from services.worker import service as worker_service

    settings = settings.model_copy(
        update={
            "models": {**settings.models, "sleepy": ModelSpec(kind="sleep", sleep_seconds=0.1)},
            "worker_models": ["sleepy"],
        }
    )
    example = load_example()
    received: list[dict[str, Any]] = []
    arrived = threading.Event()

    def on_event(event: dict[str, Any]) -> None:
        received.append(event)
        arrived.set()

    api_key, secret = await auth.create_key(backends.pool, settings.api_key_pepper, "hooked")
    assert secret is not None
    receiver = example.make_server("127.0.0.1", 0, [secret], on_event)
    thread = threading.Thread(target=receiver.serve_forever, daemon=True)
    thread.start()
    submit = await submit_service.start(settings, backends)
    notifier = await notifier_service.start(settings)
    worker = await worker_service.start(settings)
    try:
        async with connect_async(
            f"127.0.0.1:{submit.port}", api_key, events_address=f"127.0.0.1:{notifier.port}"
        ) as client:
            url = f"http://127.0.0.1:{receiver.server_port}/hook"
            task = await client.submit("call me back", "sleepy", callback_url=url, metadata={"order": "7"})
            assert (await client.wait(task.task_id, 30)).status is Status.SUCCEEDED
            assert await asyncio.to_thread(arrived.wait, 30)
            await wait_for(lambda: _delivered(client, task.task_id), within=20.0)
    finally:
        await worker.stop(1.0)
        await notifier.stop()
        await submit.stop(0)
        receiver.shutdown()
        receiver.server_close()
    assert len(received) == 1
    event = received[0]
    assert event["type"] == "task.succeeded"
    assert event["data"]["task_id"] == task.task_id and event["data"]["status"] == "SUCCEEDED"
    assert event["data"]["metadata"] == {"order": "7"} and event["data"]["result"]["sha256"]


async def _delivered(client: AsyncTaskgateClient, task_id: str) -> bool:
    return (await client.get(task_id)).callback_status == "DELIVERED"
