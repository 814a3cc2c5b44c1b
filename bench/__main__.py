"""`python -m bench` (make bench): runs every phase on a fresh embedded stack, prints the table, writes the JSON."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench import bulk, device_busy, fleet, history, latency, llm, peers, profile, recovery, streams, throughput, wasted
from bench.load import LoadResult
from bench.stack import LLM_SEQUENCES, BenchStack, bench_settings
from bench.stats import Report

DEFAULT_OUT = Path("bench-results/latest.json")
PHASES = (
    "submit",
    "sdk",
    "bulk",
    "get",
    "fleet",
    "streams",
    "latency",
    "recovery",
    "history",
    "llm",
    "device_busy",
    "wasted",
)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="short levels and a 100,000-row history (a smoke run)")
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per load level")
    parser.add_argument("--submit-procs", type=int, default=2, help="submit processes sharing the port")
    parser.add_argument(
        "--history", type=int, default=1_000_000, help="historical tasks for the large-table phase (0: skip)"
    )
    parser.add_argument("--latency-tasks", type=int, default=300, help="tasks sent one by one for the latency figures")
    parser.add_argument("--no-recovery", action="store_true", help="skip the dead-worker recovery phases")
    parser.add_argument("--no-peers", action="store_true", help="skip the peers (Celery, procrastinate, PgQueuer)")
    parser.add_argument("--peers-only", action="store_true", help="measure only the peers")
    parser.add_argument("--peer", default=",".join(peers.PEERS),
                        help=f"comma-separated peers to measure ({', '.join(peers.PEERS)}); default all")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the JSON report goes")
    parser.add_argument("--keep", action="store_true", help="keep the stack's folder (logs) after the run")
    parser.add_argument(
        "--bulk-inflight", type=int, default=8, help="calls in flight in the bulk enqueue phases (100 tasks each)"
    )
    parser.add_argument("--only", default="",
                        help=f"comma-separated phases to run ({', '.join(PHASES)}; history needs submit and get); "
                        f"default all")
    fleet_opts = parser.add_argument_group("fleet phase (sleep-only workers, every slot busy)")
    fleet_opts.add_argument("--fleet-workers", type=int, default=2, help="worker processes")
    fleet_opts.add_argument("--fleet-slots", type=int, default=100, help="slots per worker")
    fleet_opts.add_argument("--fleet-tasks", type=int, default=0, help="tasks (0: one per slot)")
    fleet_opts.add_argument("--fleet-seconds", type=float, default=20.0, help="how long each task runs")
    fleet_opts.add_argument(
        "--fleet-steps", type=int, default=20, help="steps per task (a progress report each, at most 100)"
    )
    streams_opts = parser.add_argument_group("streams phase (WatchTask streams on one notifier)")
    streams_opts.add_argument("--streams", type=int, default=10_000, help="WatchTask streams, one task each")
    streams_opts.add_argument(
        "--streams-channels", type=int, default=20, help="gRPC channels (HTTP/2 connections) they share"
    )
    streams_opts.add_argument("--streams-idle", type=float, default=0.0,
                              help="seconds of idle CPU measurement (0: one keep-alive period)")
    streams_opts.add_argument(
        "--streams-burst", type=int, default=1_000, help="watched tasks cancelled at once at the end"
    )
    llm_opts = parser.add_argument_group("llm phase (chat tasks on the tiny causal LM, one worker, one model instance)")
    llm_opts.add_argument("--llm-tokens", type=int, default=128, help="output tokens per task at most")
    llm_opts.add_argument("--llm-rounds", type=int, default=2, help="rounds of 1, 4 and 16 tasks at once")
    llm_opts.add_argument("--llm-ttft", type=int, default=20, help="tasks one at a time for the first-token latency")
    llm_opts.add_argument("--llm-threads", type=int, default=1,
                          help="torch intra-op threads, the worker's and this process's (docs/benchmarks.md: why 1)")
    parser.add_argument(
        "--busy-tasks", type=int, default=20, help="device_busy phase: 'sleep' tasks per queue (half as many tiny Wan)"
    )
    parser.add_argument("--wasted-tasks", type=int, default=6, help="wasted phase: tiny Wan tasks per queue")
    parser.add_argument("--wasted-kills", type=int, default=4, help="wasted phase: worker crashes per queue")
    parser.add_argument("--profile", action="store_true",
                        help="py-spy profiles of every service process at 64 in flight, in bulk and one at a "
                        "time (latency) (.taskgate/bench/)")
    args = parser.parse_args(argv)
    unknown = {name.strip() for name in args.only.split(",") if name.strip()} - set(PHASES)
    if unknown:
        parser.error(f"unknown phase(s) {', '.join(sorted(unknown))}; choose from {', '.join(PHASES)}")
    args.peer = {name.strip() for name in args.peer.split(",") if name.strip()}
    if args.peer - set(peers.PEERS):
        parser.error(
            f"unknown peer(s) {', '.join(sorted(args.peer - set(peers.PEERS)))}; choose from {', '.join(peers.PEERS)}"
        )
    if args.quick:
        args.busy_tasks = min(args.busy_tasks, 8)
        args.wasted_tasks, args.wasted_kills = min(args.wasted_tasks, 3), min(args.wasted_kills, 2)
        args.seconds = min(args.seconds, 2.0)
        args.history = min(args.history, 100_000)
        args.latency_tasks = min(args.latency_tasks, 100)
        args.llm_tokens = min(args.llm_tokens, 48)
        args.llm_rounds = min(args.llm_rounds, 1)
        args.llm_ttft = min(args.llm_ttft, 5)
    return args


async def run(args: argparse.Namespace, state_dir: Path) -> Report:
    report = Report()
    report.context = {"cpus": os.cpu_count(), "submit_processes": args.submit_procs, "seconds_per_level": args.seconds,
                      "load_average_at_start": os.getloadavg(),
                      # taskgate.runtime runs every service on uvloop when it is importable (pgqueuer's requirements
                      # bring it)
                      "services_on_uvloop": importlib.util.find_spec("uvloop") is not None}
    opts = throughput.Options(seconds=args.seconds, warmup=min(1.0, args.seconds / 2), bulk_inflight=args.bulk_inflight,
                              profile_dir=profile.new_folder() if args.profile else None)
    stack = BenchStack(state_dir, args.submit_procs, 2, bench_settings(state_dir, fleet_seconds=args.fleet_seconds))
    fleet_size = fleet.FleetOptions(
        args.fleet_workers, args.fleet_slots, args.fleet_tasks, args.fleet_seconds, args.fleet_steps
    )
    streams_size = streams.StreamsOptions(
        args.streams, args.streams_channels, idle=args.streams_idle, burst=args.streams_burst
    )
    executor = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    section = f"submit ({args.submit_procs} submit processes, workers stopped)"
    submit: dict[int, LoadResult] = {}
    get: dict[int, LoadResult] = {}

    async def phase(title: str, work: Callable[[], Awaitable[object]]) -> bool:
        """Runs one phase; a failure is reported as a skipped figure and the run goes on."""
        say(f"{title} …")
        try:
            await work()
        except Exception as exc:
            say(f"{title} failed: {type(exc).__name__}: {exc}")
            report.skip("failed phases", title, f"{type(exc).__name__}: {str(exc)[:200]}")
            return False
        return True

    async def submit_phase() -> None:
        submit.update(await throughput.submit_levels(stack, executor, opts, report, section, opts.levels, "submit"))

    async def get_phase() -> None:
        get.update(await throughput.get_task(stack, executor, opts, report, section, "get"))

    async def latency_phase() -> None:
        # what the phases before left open (their QUEUED tasks would be re-published after the queue timeout, during
        # this phase, and run by its workers): cancelled, their messages purged
        await stack.close_open_tasks()
        await stack.purge_tasks_stream()
        await stack.start_workers()
        async with profile.record(stack, opts.profile_dir, "latency"):
            await latency.measure(
                stack, report, "latency (2 idle workers, no-op tasks, one at a time)", args.latency_tasks
            )

    async def history_phase() -> None:
        await stack.stop_group(stack.worker_names())
        await stack.close_open_tasks()
        await history.compare(stack, executor, opts, report, args.history, submit, get)

    if args.peers_only:
        await peers.run_all(report, state_dir, opts, only=args.peer)
        report.context["load_average_at_end"] = os.getloadavg()
        return report
    only = {name.strip() for name in args.only.split(",") if name.strip()}

    def wanted(name: str) -> bool:
        return not only or name in only

    recovery_wanted = not args.no_recovery and wanted("recovery")

    try:
        await phase(f"starting the stack under {state_dir}", stack.start)
        if wanted("submit") and await phase("SubmitTask at 1, 16, 64, 256 in flight", submit_phase):
            best = max(r.rate for r in submit.values())
            await phase(
                "64 in flight over 16 tenants", lambda: throughput.many_tenants(stack, executor, opts, report, section)
            )
            await phase("p99 at about half the maximum throughput",
                        lambda: throughput.half_max_latency(stack, executor, opts, report, section, best))
            await phase("raw ceiling", lambda: throughput.ceiling(stack, executor, opts, report, "raw ceiling", submit))
        if wanted("sdk"):
            await phase("SDK submit(), 64 concurrent: SubmitStream and unary",
                        lambda: throughput.sdk_submits(stack, executor, opts, report, section))
        if wanted("bulk"):
            await phase(
                f"SubmitTasks, {opts.bulk_batch} per call",
                lambda: bulk.submit_tasks(stack, executor, opts, report, section),
            )
        if wanted("get"):
            await phase("GetTask", get_phase)
        if wanted("latency"):
            await phase("latencies with idle workers", latency_phase)
        if recovery_wanted:
            await phase("dead-worker recovery, shipped defaults", lambda: recovery.dead_worker(
                stack, report, "dead-worker recovery", "shipped defaults (lease 10 s)", 15.0))
        # after latency and recovery: a notifier that held 10,000 streams answers its next events slower
        # (docs/benchmarks.md)
        if wanted("fleet"):
            f = fleet_size
            await stack.stop_group(stack.worker_names())  # the latency phase's workers: the fleet alone runs
            await phase(
                f"fleet: {f.workers} x {f.slots} slots, {f.count} tasks of {f.seconds:g} s",
                lambda: fleet.measure(
                    stack,
                    report,
                    f"fleet ({f.workers} sleep workers x {f.slots} slots, {f.count} tasks of {f.seconds:g} s,"
                    f" {f.steps} steps each)",
                    f,
                ),
            )
        if wanted("streams"):
            m = streams_size
            await phase(f"{m.streams:,} WatchTask streams", lambda: streams.measure(
                stack, report, f"streams ({m.streams:,} WatchTask streams on one notifier, {m.channels} channels)", m))
        if args.history and submit and get and wanted("history"):
            await phase(f"{args.history:,} historical tasks", history_phase)
        if wanted("llm"):
            await stack.stop_group(stack.worker_names())  # the model's worker alone runs
            size = llm.LlmOptions(
                rounds=args.llm_rounds, tokens=args.llm_tokens, ttft_tasks=args.llm_ttft, threads=args.llm_threads
            )
            await phase(
                "chat tasks on the tiny language model",
                lambda: llm.measure(
                    stack,
                    report,
                    f"llm (tiny causal LM on CPU, one worker, one model instance of {LLM_SEQUENCES} sequences,"
                    f" {size.tokens} tokens per task)",
                    size,
                ),
            )
        if recovery_wanted:
            await phase(
                "dead-worker recovery, lease 5 s",
                lambda: recovery.with_lease(stack, report, "dead-worker recovery", 5.0),
            )
    finally:
        executor.shutdown(cancel_futures=True)
        await stack.stop()
    # each on an embedded stack of its own, with the tiny Wan pipeline on CPU
    if wanted("device_busy"):
        busy_section = (
            "device busy (one CPU device, a saturated queue; tiny Wan with step checkpoints off and on, previews)"
        )

        async def busy_phase() -> None:
            device_busy.add_figures(
                report, busy_section, await device_busy.measure(state_dir / "busy", args.busy_tasks)
            )
            previews = await device_busy.measure(
                state_dir / "previews", max(4, args.busy_tasks // 2), previews=True, rounds=2
            )
            device_busy.add_previews_figures(report, busy_section, previews)

        await phase("device busy, checkpoints off and on, previews off and on", busy_phase)
    if wanted("wasted"):
        wasted_section = (
            f"wasted GPU-seconds ({args.wasted_kills} worker crashes on a seeded schedule, tiny Wan, 20 steps)"
        )

        async def wasted_phase() -> None:
            found = await wasted.measure(state_dir / "wasted", args.wasted_tasks, args.wasted_kills, seed=37)
            wasted.add_figures(report, wasted_section, found)

        await phase("wasted GPU-seconds under worker crashes", wasted_phase)
    if not args.no_peers and not only:
        await peers.run_all(report, state_dir, opts, only=args.peer)
        bulk.compare(report)
        throughput.compare_status_reads(report)
        throughput.compare_sdk(report)
        latency.compare_with_celery(report)
    elif not args.no_peers and "get" in only:  # the GetTask rows' peers: each one's status read of a queued job
        await peers.run_all(report, state_dir, opts, only=args.peer, status_only=True)
        throughput.compare_status_reads(report)
    report.context["load_average_at_end"] = os.getloadavg()
    if opts.profile_dir is not None:
        report.context["profiles"] = str(opts.profile_dir)
        say(f"py-spy profiles in {opts.profile_dir} (summary.txt in each phase's folder)")
    return report


def say(text: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    state_dir = Path(tempfile.mkdtemp(prefix="taskgate-bench-"))
    try:
        report = asyncio.run(run(args, state_dir))
    finally:
        if not args.keep:
            shutil.rmtree(state_dir, ignore_errors=True)
        else:
            say(f"logs kept in {state_dir}/logs")
    print(report.table())
    print(
        f"load average (1, 5, 15 min) at start {report.context['load_average_at_start']}, at end "
        f"{report.context['load_average_at_end']}"
        " - other work on this machine skews every figure"
    )
    report.write(args.out)
    say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
