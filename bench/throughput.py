"""SubmitTask and GetTask under load from a separate client process, and the raw ceiling beside the gateway."""

from __future__ import annotations

import asyncio
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import cpu, profile
from bench.load import LoadResult, LoadSpec, run_load
from bench.stack import BenchStack
from bench.stats import Report, ms

BULK_RAW_KEY = "bulk_enqueue"  # the JSON report's key for every system's bulk enqueue figures


@dataclass
class Options:
    """How long and how hard each load level runs."""

    seconds: float = 5.0
    warmup: float = 1.0
    channels: int = 8
    levels: tuple[int, ...] = (1, 16, 64, 256)
    # tasks per call in the bulk enqueue phases (SubmitTasks, Celery group, procrastinate batch defer)
    bulk_batch: int = 100
    bulk_inflight: int = 8  # calls in flight there
    profile_dir: Path | None = None  # py-spy profiles of the load phases go here (--profile)

    @property
    def bulk_figure(self) -> str:
        """The row every system's bulk enqueue figure shares."""
        return f"bulk enqueue, {self.bulk_batch} per call ({self.bulk_inflight} calls in flight)"


async def load(executor: ProcessPoolExecutor, spec: LoadSpec) -> LoadResult:
    return await asyncio.get_running_loop().run_in_executor(executor, run_load, spec)


SUBMIT_P50_MS = 2.0  # issue 38: SubmitTask, 1 in flight
GET_P50_MS = 1.5  # issue 38: a poll of a QUEUED task, 1 in flight
GET_RATE = 1500  # issue 38: GetTask at 16 in flight, reads a second


def summary(result: LoadResult) -> dict[str, Any]:
    p50, p99 = ms(result.latencies)
    return {"rate": round(result.rate, 1), "ok": result.ok, "p50_ms": round(p50, 2), "p99_ms": round(p99, 2),
            "errors": dict(result.errors)}


async def submit_levels(
    stack: BenchStack,
    executor: ProcessPoolExecutor,
    opts: Options,
    report: Report,
    section: str,
    levels: tuple[int, ...],
    raw_key: str,
    profiled: tuple[int, ...] = (64,),
) -> dict[int, LoadResult]:
    """SubmitTask at each concurrency; every level starts with an empty queue; the `profiled` levels are profiled
    when opts.profile_dir is set."""
    results: dict[int, LoadResult] = {}
    for level in levels:
        spec = LoadSpec(stack.submit_address, stack.api_key, "submit", level, opts.seconds, opts.warmup, opts.channels,
                        tag=f"{raw_key}-c{level}")
        before = cpu.snapshot(stack)
        async with profile.record(stack, opts.profile_dir if level in profiled else None, f"{raw_key}-c{level}"):
            result = await load(executor, spec)
        costs = cpu.per_task(before, cpu.snapshot(stack), result.total, result.cpu)
        results[level] = result
        report.raw.setdefault(raw_key, {})[str(level)] = summary(result) | {"cpu_ms_per_task": costs}
        p50, p99 = ms(result.latencies)
        report.add(section, f"CPU per submitted task, {level} in flight", sum(costs.values()), "ms",
                   note=", ".join(f"{k} {v:.2f}" for k, v in costs.items()))
        errors = f"{sum(result.errors.values())} errors {dict(result.errors)}" if result.errors else ""
        if level == 64:
            report.add(
                section, f"SubmitTask throughput, {level} in flight", result.rate, "tasks/s", at_least=1500, note=errors
            )
        else:
            report.add(section, f"SubmitTask throughput, {level} in flight", result.rate, "tasks/s", note=errors)
        report.add(section, f"SubmitTask p50 / p99, {level} in flight", p50, "ms", note=f"p99 {p99:.1f} ms",
                   at_most=SUBMIT_P50_MS if level == 1 else None)
        await stack.close_open_tasks()
    return results


async def sdk_submits(
    stack: BenchStack, executor: ProcessPoolExecutor, opts: Options, report: Report, section: str, level: int = 64
) -> None:
    """The SDK's submit() from one client at `level` concurrent calls: over its SubmitStream, then unary SubmitTask."""
    for stream in (True, False):
        how = "SubmitStream" if stream else "unary SubmitTask"
        spec = LoadSpec(stack.submit_address, stack.api_key, "sdk", level, opts.seconds, opts.warmup, 1,
                        tag=f"sdk-{'stream' if stream else 'unary'}-c{level}", stream=stream)
        before = cpu.snapshot(stack)
        result = await load(executor, spec)
        costs = cpu.per_task(before, cpu.snapshot(stack), result.total, result.cpu)
        report.raw.setdefault("sdk_submit", {})[f"{'stream' if stream else 'unary'}-c{level}"] = summary(result) | {
            "cpu_ms_per_task": costs}
        p50, p99 = ms(result.latencies)
        errors = f"; {sum(result.errors.values())} errors {dict(result.errors)}" if result.errors else ""
        report.add(section, f"SDK submit(), {level} concurrent on one client, {how}", result.rate, "tasks/s",
                   note=f"p50 {p50:.1f} / p99 {p99:.1f} ms; CPU {sum(costs.values()):.2f} ms per task{errors}")
        await stack.close_open_tasks()


async def many_tenants(
    stack: BenchStack, executor: ProcessPoolExecutor, opts: Options, report: Report, section: str, tenants: int = 16
) -> None:
    """64 in flight spread over several tenants: shows what the per-tenant serialisation of submits costs."""
    keys = await stack.tenant_keys(tenants)
    spec = LoadSpec(stack.submit_address, keys[0], "submit", 64, opts.seconds, opts.warmup, opts.channels,
                    tag="tenants-c64", extra_keys=tuple(keys[1:]))
    result = await load(executor, spec)
    report.raw["submit_many_tenants"] = summary(result)
    p50, p99 = ms(result.latencies)
    report.add(section, f"SubmitTask throughput, 64 in flight over {tenants} tenants", result.rate, "tasks/s",
               note=f"p50 {p50:.1f} / p99 {p99:.1f} ms")
    await stack.close_open_tasks()


async def half_max_latency(
    stack: BenchStack, executor: ProcessPoolExecutor, opts: Options, report: Report, section: str, best: float
) -> None:
    """p99 at about half the best throughput: a paced open loop would be exact; a concurrency that lands there will
    do."""
    target_rate = best / 2
    # Little's law: in flight = rate x latency; start from the latency at 1 in flight and search a few levels.
    chosen: LoadResult | None = None
    for level in (2, 4, 8, 16, 32):
        spec = LoadSpec(stack.submit_address, stack.api_key, "submit", level, opts.seconds, opts.warmup, opts.channels,
                        tag=f"half-c{level}")
        result = await load(executor, spec)
        await stack.close_open_tasks()
        chosen = result
        if result.rate >= target_rate:
            break
    assert chosen is not None
    _, p99 = ms(chosen.latencies)
    report.add(section, "SubmitTask p99 at about half the best throughput", p99, "ms", at_most=20,
               note=f"{chosen.rate:.0f}/s ({chosen.rate / best:.0%} of {best:.0f}/s)")
    report.raw["submit_half_max"] = summary(chosen)


async def ceiling(
    stack: BenchStack,
    executor: ProcessPoolExecutor,
    opts: Options,
    report: Report,
    section: str,
    gateway: dict[int, LoadResult],
) -> None:
    """The bare INSERT + publish + UPDATE handler in as many processes as the gateway, at the same concurrencies."""
    names = [f"ceiling-{i}" for i in range(1, stack.submit_procs + 1)]
    await stack.cluster.start(*names)
    try:
        for level in sorted(gateway):
            if level < 16:
                continue
            spec = LoadSpec(stack.ceiling_address, "none", "submit", level, opts.seconds, opts.warmup, opts.channels,
                            tag=f"ceiling-c{level}")
            before = cpu.snapshot(stack)
            result = await load(executor, spec)
            costs = cpu.per_task(before, cpu.snapshot(stack), result.total, result.cpu)
            report.raw.setdefault("ceiling", {})[str(level)] = summary(result) | {"cpu_ms_per_task": costs}
            if level == 64:
                report.add(section, f"CPU per task, {level} in flight", sum(costs.values()), "ms",
                           note=", ".join(f"{k} {v:.2f}" for k, v in costs.items()))
            ratio = gateway[level].rate / result.rate if result.rate else float("nan")
            p50, p99 = ms(result.latencies)
            report.add(
                section,
                f"raw ceiling, {level} in flight",
                result.rate,
                "tasks/s",
                note=f"p50 {p50:.1f} / p99 {p99:.1f} ms",
            )
            report.add(section, f"gateway / ceiling, {level} in flight", ratio * 100, "%")
            await stack.close_open_tasks()
    finally:
        await stack.stop_group(names)


async def get_task(
    stack: BenchStack, executor: ProcessPoolExecutor, opts: Options, report: Report, section: str, raw_key: str,
    sample: int = 2000, close: bool = True,
) -> dict[int, LoadResult]:
    """GetTask of QUEUED tasks (so the submit service's cache of finished tasks does not answer): `sample` fresh
    tasks, cancelled at the end unless not `close`."""
    seed = LoadSpec(stack.submit_address, stack.api_key, "submit", 16, 60.0, 0.0, opts.channels, tag=f"{raw_key}-seed",
                    keep_ids=sample)
    ids = await _submit_exactly(stack, executor, seed, sample)
    results: dict[int, LoadResult] = {}
    for level in (1, 16):
        spec = LoadSpec(
            stack.submit_address, stack.api_key, "get", level, opts.seconds, opts.warmup, opts.channels, ids=tuple(ids)
        )
        result = await load(executor, spec)
        results[level] = result
        report.raw.setdefault(raw_key, {})[str(level)] = summary(result)
        p50, p99 = ms(result.latencies)
        report.add(
            section, f"GetTask p50 / p99, {level} in flight", p50, "ms", note=f"p99 {p99:.1f} ms, {result.rate:.0f}/s",
            at_most=GET_P50_MS if level == 1 else None,
        )
        if level > 1:
            report.add(section, f"GetTask throughput, {level} in flight", result.rate, "reads/s", at_least=GET_RATE)
    if close:
        await stack.close_open_tasks()
    return results


def compare_status_reads(report: Report) -> None:
    """GetTask at 16 in flight against the fastest peer's status read of a queued job at 16 (issue 38: at least as
    fast), when both were measured."""
    ours = report.raw.get("get", {}).get("16", {}).get("rate")
    peers = {section: levels["16"]["rate"] for section, levels in report.raw.get("status_read", {}).items()
             if "16" in levels}
    name = "GetTask / the fastest peer's status read, 16 in flight"
    if not ours or not peers:
        report.skip("GetTask", name, "not every system was measured")
        return
    fastest = max(peers, key=lambda k: peers[k])
    report.add("GetTask", name, ours / peers[fastest], "x",
               at_least=1, note=f"{ours:,.0f}/s against {peers[fastest]:,.0f}/s ({fastest})")


def compare_sdk(report: Report, level: int = 64) -> None:
    """The SDK's submit() at `level` concurrent calls (its better path) against the fastest peer's enqueue at as many
    in flight (issue 38: at least as fast), when both were measured."""
    sdk = report.raw.get("sdk_submit", {})
    ours = max((v["rate"] for k, v in sdk.items() if k.endswith(f"-c{level}")), default=None)
    peers = {section: levels[str(level)] for section, levels in report.raw.get("enqueue_rate", {}).items()
             if str(level) in levels}
    name = f"SDK submit() / the fastest peer's enqueue, {level} in flight"
    if not ours or not peers:
        report.skip("SDK", name, "not every system was measured")
        return
    fastest = max(peers, key=lambda k: peers[k])
    report.add("SDK", name, ours / peers[fastest], "x", at_least=1,
               note=f"{ours:,.0f}/s against {peers[fastest]:,.0f}/s ({fastest})")


async def _submit_exactly(stack: BenchStack, executor: ProcessPoolExecutor, spec: LoadSpec, count: int) -> list[str]:
    """Submits until `count` tasks exist (a load run stops at its time limit; short runs are repeated)."""
    ids: list[str] = []
    while len(ids) < count:
        short = LoadSpec(spec.address, spec.api_key, "submit", spec.concurrency, 2.0, 0.0, spec.channels,
                         tag=f"{spec.tag}-{len(ids)}", keep_ids=count - len(ids))
        ids += (await load(executor, short)).ids
    return ids[:count]
