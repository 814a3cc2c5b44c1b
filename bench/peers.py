"""Celery (Redis) and procrastinate (PostgreSQL) running the same no-op workload, when their packages are installed."""

from __future__ import annotations

from pathlib import Path

from bench.stats import Report
from bench.throughput import Options


async def run_all(report: Report, state_dir: Path, opts: Options) -> None:
    report.skip("peers", "Celery + Redis", "not implemented yet")
    report.skip("peers", "procrastinate", "not implemented yet")
