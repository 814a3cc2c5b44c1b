"""Bulk enqueue, 100 per call: SubmitTasks beside Celery `group` and procrastinate's batch defer (same calls in flight).

`python -m bench.bulk` runs these phases alone on a fresh stack (taskgate, then both peers); `make bench` runs them
among the others. Every admitted taskgate task is checked at the end of the phase for its durable row and its
JetStream message, and every peer's job for its place in the peer's queue.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench import cpu, peers, profile
from bench.load import LoadSpec
from bench.stack import BenchStack, bench_settings
from bench.stats import Report, ms
from bench.throughput import BULK_RAW_KEY, Options, load, summary
from taskgate.store import bench as bench_store

DISPATCH_WITHIN = 15.0  # seconds the dispatch of the created tasks may take (the CreatedScan repairs after 10 s)


async def submit_tasks(
    stack: BenchStack, executor: ProcessPoolExecutor, opts: Options, report: Report, section: str
) -> None:
    """SubmitTasks with workers stopped, then every created task's row and message counted."""
    await stack.purge_tasks_stream()  # earlier phases' cancelled tasks leave their messages behind
    spec = LoadSpec(stack.submit_address, stack.api_key, "submit_many", opts.bulk_inflight, opts.seconds, opts.warmup,
                    opts.channels, tag="bulk", keep_ids=10**9, batch=opts.bulk_batch)
    before = cpu.snapshot(stack)
    async with profile.record(stack, opts.profile_dir, "submit-tasks"):
        result = await load(executor, spec)
    statuses, messages, dispatched_in = await _dispatched(stack, [int(i) for i in result.ids], result.created)
    # the dispatch of the last calls included
    costs = cpu.per_task(before, cpu.snapshot(stack), result.total, result.cpu)
    rows, queued = sum(statuses.values()), statuses.get("QUEUED", 0)
    report.raw.setdefault(BULK_RAW_KEY, {})["taskgate"] = summary(result) | {
        "cpu_ms_per_task": costs, "created": result.created, "rows": statuses, "messages": messages}
    p50, p99 = ms(result.latencies)
    errors = f"; {sum(result.errors.values())} item errors {dict(result.errors)}" if result.errors else ""
    report.add(section, f"SubmitTasks {opts.bulk_figure}", result.rate, "tasks/s", at_least=10_000,
               note=f"per call p50 {p50:.1f} / p99 {p99:.1f} ms{errors}")
    report.add(section, "SubmitTasks: created tasks without their row or their JetStream message",
               max(0, result.created - rows) + max(0, result.created - messages), "tasks", at_most=0,
               note=f"{result.created:,} created: {rows:,} rows ({queued:,} QUEUED), {messages:,} messages on TASKS"
                    f" ({dispatched_in:.2f} s after the last answer)")
    report.add(section, "CPU per task, SubmitTasks", sum(costs.values()), "ms", at_most=1.2,
               note=", ".join(f"{k} {v:.2f}" for k, v in costs.items()))
    await stack.close_open_tasks()


async def _dispatched(stack: BenchStack, ids: list[int], created: int) -> tuple[dict[str, int], int, float]:
    """The tasks' statuses and the TASKS stream's messages once every created task is QUEUED with its message, or after
    DISPATCH_WITHIN seconds (the answer follows the commit; the dispatcher publishes and queues after it); and how long
    that took."""
    began = time.monotonic()
    while True:
        statuses = await bench_store.count_by_status(stack.db, ids)
        messages = await stack.tasks_stream_messages()
        waited = time.monotonic() - began
        if (statuses.get("QUEUED", 0) >= created and messages >= created) or waited > DISPATCH_WITHIN:
            return statuses, messages, waited
        await asyncio.sleep(0.05)


def compare(report: Report) -> None:
    """SubmitTasks against the faster peer's bulk enqueue (issue 13's target: at least 3x), when all were measured."""
    rates = {k: v["rate"] for k, v in report.raw.get(BULK_RAW_KEY, {}).items()}
    faster = max((k for k in rates if k != "taskgate"), key=lambda k: rates[k], default=None)
    if "taskgate" not in rates or faster is None or not rates[faster]:
        report.skip("bulk enqueue", "SubmitTasks / the faster peer's bulk enqueue", "not every system was measured")
        return
    report.add("bulk enqueue", "SubmitTasks / the faster peer's bulk enqueue", rates["taskgate"] / rates[faster], "x",
               at_least=3, note=f"{rates['taskgate']:,.0f}/s against {faster}'s {rates[faster]:,.0f}/s")


async def run(args: argparse.Namespace, state_dir: Path) -> Report:
    report = Report()
    opts = Options(
        seconds=args.seconds,
        warmup=min(1.0, args.seconds / 2),
        bulk_batch=args.batch,
        bulk_inflight=args.inflight,
        profile_dir=profile.new_folder() if args.profile else None,
    )
    stack = BenchStack(state_dir, args.submit_procs, 2, bench_settings(state_dir))
    executor = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    try:
        await stack.start()
        await submit_tasks(
            stack, executor, opts, report, f"submit ({args.submit_procs} submit processes, workers stopped)"
        )
    finally:
        executor.shutdown(cancel_futures=True)
        await stack.stop()
    if not args.no_peers:
        await peers.run_all(report, state_dir, opts, bulk_only=True)
        compare(report)
    if opts.profile_dir is not None:
        print(f"profiles in {opts.profile_dir}", file=sys.stderr)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bulk", description=__doc__)
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per system")
    parser.add_argument("--submit-procs", type=int, default=2, help="submit processes sharing the port")
    parser.add_argument("--batch", type=int, default=100, help="tasks per call")
    parser.add_argument("--inflight", type=int, default=8, help="calls in flight")
    parser.add_argument("--no-peers", action="store_true", help="SubmitTasks only")
    parser.add_argument(
        "--profile", action="store_true", help="py-spy profiles of the service processes (.taskgate/bench/)"
    )
    args = parser.parse_args(argv)
    state_dir = Path(tempfile.mkdtemp(prefix="taskgate-bench-bulk-"))
    try:
        report = asyncio.run(run(args, state_dir))
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)
    print(report.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
