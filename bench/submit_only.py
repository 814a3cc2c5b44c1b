"""SubmitTask alone at 1 and 64 in flight on a fresh bench stack: the quick before/after check for submit-path work."""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import shutil
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench import profile, throughput
from bench.stack import BenchStack, bench_settings
from bench.stats import Report


async def run(args: argparse.Namespace, state_dir: Path) -> Report:
    report = Report()
    opts = throughput.Options(seconds=args.seconds, warmup=min(1.0, args.seconds / 2),
                              profile_dir=profile.new_folder() if args.profile else None)
    stack = BenchStack(state_dir, args.submit_procs, 2, bench_settings(state_dir))
    executor = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    try:
        await stack.start()
        section = f"submit ({args.submit_procs} submit processes, workers stopped)"
        await throughput.submit_levels(stack, executor, opts, report, section, tuple(args.levels), "submit",
                                      profiled=tuple(args.levels))
    finally:
        executor.shutdown(cancel_futures=True)
        await stack.stop()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.submit_only", description=__doc__)
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per load level")
    parser.add_argument("--submit-procs", type=int, default=2, help="submit processes sharing the port")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 64], help="requests in flight, one run each")
    parser.add_argument("--profile", action="store_true",
                        help="py-spy every service process at each level (bench/profile.py; the figures then carry its "
                        "cost)")
    args = parser.parse_args(argv)
    state_dir = Path(tempfile.mkdtemp(prefix="taskgate-bench-submit-"))
    try:
        report = asyncio.run(run(args, state_dir))
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)
    print(report.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
