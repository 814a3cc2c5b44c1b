"""LLM: chat tasks on the tiny causal LM (taskgate_local.tinylm, CPU), one worker holding one model instance.

- Output tokens per second at each level (1, 4, 16 tasks at once): the same tasks at every level, in rounds of N chat
  tasks submitted together through the SDK, each streamed to its end with `stream_text()`; the tokens are the tasks'
  own output_tokens, a round's window from its first task's start to its last one's finish as the worker recorded
  them. The same rounds (prompts, seeds, token limits) on the model loaded in this process, straight into its
  decoding loop: the ceiling the gateway is held to.
- Time to first token: one task at a time, submit -> the first delta `stream_text()` yields, against the same prompt
  and token limit on the model here (a sequence into its decoding loop -> the detokenizer's first delta); the
  difference is what the gateway adds (dispatch, claim, prompt tokenizing in the worker, JetStream, the notifier's
  WatchTask; the first delta is not held by the output coalescing window).
- Server-side CPU per streamed token over the gateway's rounds: every service process, PostgreSQL and NATS from
  /proc, the worker's model decoding apart — its decoding loop's thread and the intra-op threads torch started from it,
  which carry its OS name (textgen-<model>; sampling and detokenizing run there too).

Both sides decode with `threads` intra-op threads (OMP_NUM_THREADS for the worker, torch.set_num_threads here).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench import cpu
from bench.stack import LLM_MODEL, BenchStack
from bench.stats import Report, ms, percentile
from taskgate_client import connect_async
from taskgate_client.aio import AsyncTaskgateClient
from taskgate_client.types import Status

IDLE_SECONDS = 2.0  # the idle stack's CPU is measured this long before the gateway's rounds
WORKER = "worker-llm"  # "worker-…": cpu.snapshot counts it as a worker
DECODING_THREADS = "textgen-"  # the OS name of a decoding loop's thread and of the threads it started


@dataclass(frozen=True)
class LlmOptions:
    """The phase's size: `rounds` rounds of each level's tasks, `tokens` output tokens each at most; `ttft_tasks`
    tasks one at a time of `ttft_tokens` tokens for the first-token latency; `threads` intra-op threads."""

    levels: tuple[int, ...] = (1, 4, 16)
    rounds: int = 2
    tokens: int = 128
    ttft_tasks: int = 20
    ttft_tokens: int = 16
    threads: int = 1


@dataclass
class Round:
    """One round of a level: the output tokens its tasks made, the seconds they ran, and CPU seconds meanwhile."""

    tokens: int
    seconds: float
    cpu: dict[str, float] | None = None  # server-side parts (the worker without its decoding)
    decoding: float = 0.0  # CPU seconds of the model's decoding threads
    client: float = 0.0  # CPU seconds of this process (the SDK's calls and streams) meanwhile: not server-side
    mismatches: int = 0  # tasks whose streamed text is not their final answer, or that did not succeed


def prompt(i: int) -> list[dict[str, str]]:
    """Task i's conversation (its seed is i + 1)."""
    return [{"role": "user", "content": f"Write a long story about a fox and a river, number {i}."}]


def level_rounds(n: int, opts: LlmOptions) -> list[list[int]]:
    """The tasks of a level's rounds, n at once: every level runs the same tasks (`rounds` x the largest level), so
    each one generates the same tokens (a sequence's tokens depend on its seed, not its neighbours)."""
    total = opts.rounds * max(opts.levels)
    return [list(range(first, min(first + n, total))) for first in range(0, total, n)]


TTFT_BASE = 10_000  # the first-token tasks' prompts: TTFT_BASE + j


def rate(rounds: list[Round]) -> float:
    """Output tokens per second over a level's rounds (their tokens over their summed windows)."""
    seconds = sum(r.seconds for r in rounds)
    return sum(r.tokens for r in rounds) / seconds if seconds > 0 else float("nan")


def cpu_per_token(rounds: list[Round]) -> tuple[dict[str, float], float]:
    """Milliseconds of CPU per output token: each server-side part's, and the model's decoding."""
    tokens = sum(r.tokens for r in rounds)
    parts: dict[str, float] = {}
    for r in rounds:
        for k, v in (r.cpu or {}).items():
            parts[k] = parts.get(k, 0.0) + v
    if not tokens:
        return {}, float("nan")
    per = {k: round(v * 1000 / tokens, 4) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])}
    return per, sum(r.decoding for r in rounds) * 1000 / tokens


async def measure(stack: BenchStack, report: Report, section: str, opts: LlmOptions) -> None:
    """Builds the model, starts one worker for it, measures the model here and through the gateway, stops the worker."""
    folder = stack.settings.models[LLM_MODEL].path
    assert folder is not None
    from taskgate_local import tinylm

    if not tinylm.is_lm_folder(folder):
        await asyncio.to_thread(tinylm.build_tiny_lm, folder)
    worker = stack.cluster.add(WORKER, "services.worker", worker_models=[LLM_MODEL])
    worker.env.update({"OMP_NUM_THREADS": str(opts.threads), "MKL_NUM_THREADS": str(opts.threads)})
    await stack.purge_tasks_stream()
    # the worker loads its copy while this process loads its own
    here = asyncio.create_task(asyncio.to_thread(_load_here, stack, opts.threads))
    try:
        await stack.cluster.start(WORKER, within=300)
        runner = await here
        try:
            direct_ttft = await asyncio.to_thread(_ttft_here, runner, opts)
            direct = {n: await asyncio.to_thread(_level_here, runner, n, opts) for n in opts.levels}
        finally:
            await asyncio.to_thread(runner.close)
        pid = cpu.service_pid(stack, WORKER)
        async with connect_async(
            stack.submit_address, stack.api_key, events_address=stack.notifier_address, call_timeout=60
        ) as client:
            # warm: the gateway's tokenizer, the worker's consumers
            await _gateway_task(client, TTFT_BASE - 1, opts.ttft_tokens)
            gateway_ttft = [
                await _gateway_task(client, TTFT_BASE + j, opts.ttft_tokens) for j in range(opts.ttft_tasks)
            ]
            began, before = time.monotonic(), cpu.snapshot(stack)
            await asyncio.sleep(IDLE_SECONDS)
            idle = {k: v / 1000 for k, v in cpu.per_unit(before, cpu.snapshot(stack), time.monotonic() - began).items()}
            gateway = {
                n: [await _gateway_round(stack, client, pid, tasks, opts.tokens) for tasks in level_rounds(n, opts)]
                for n in opts.levels
            }
    finally:
        if not here.done():
            here.cancel()
        await stack.close_open_tasks()
        await stack.stop_group([WORKER])
        await stack.purge_tasks_stream()
    _report(
        report,
        section,
        opts,
        direct_ttft,
        direct,
        [t for t, _ in gateway_ttft],
        gateway,
        idle,
        mismatches=sum(1 for _, ok in gateway_ttft if not ok),
    )


# ---- the model in this process (blocking: run in a thread) ----


def _load_here(stack: BenchStack, threads: int) -> Any:
    import torch

    from services.worker.chatrun import ChatRunner

    torch.set_num_threads(threads)
    return ChatRunner.load(LLM_MODEL, stack.settings.models[LLM_MODEL], "cpu")


def _sequence(runner: Any, i: int, tokens: int, on_text: Callable[[str], None]) -> concurrent.futures.Future[Any]:
    """Prompt i into the runner's decoding loop as the worker puts a task's (seed i + 1, temperature 1)."""
    from services.worker import chatrun
    from services.worker.textgen import Sampling

    ids = runner.prompt_ids(prompt(i))
    detok = chatrun.Detokenizer(runner.tokenizer, [], on_text, runner.byte_ids)
    _, done = chatrun.start(runner, ids, Sampling(tokens, temperature=1.0, seed=i + 1), detok, lambda: False)
    return done


def _first_delta(runner: Any, i: int, tokens: int) -> float | None:
    """Seconds from the call to the detokenizer's first delta of prompt i (None: no text came)."""
    first: list[float] = []
    began = time.perf_counter()
    _sequence(runner, i, tokens, lambda _: first.append(time.perf_counter())).result(120)
    return first[0] - began if first else None


def _ttft_here(runner: Any, opts: LlmOptions) -> list[float]:
    _first_delta(runner, TTFT_BASE - 1, opts.ttft_tokens)  # warm
    return [
        t for j in range(opts.ttft_tasks) if (t := _first_delta(runner, TTFT_BASE + j, opts.ttft_tokens)) is not None
    ]


def _level_here(runner: Any, n: int, opts: LlmOptions) -> list[Round]:
    rounds = []
    for tasks in level_rounds(n, opts):
        began, decoding = time.perf_counter(), cpu.thread_seconds(os.getpid(), DECODING_THREADS)
        done = [_sequence(runner, i, opts.tokens, lambda _: None) for i in tasks]
        tokens = sum(len(d.result(600).tokens) for d in done)
        seconds, decoded = time.perf_counter() - began, cpu.thread_seconds(os.getpid(), DECODING_THREADS)
        rounds.append(Round(tokens, seconds, decoding=decoded - decoding))
    return rounds


# ---- through the gateway ----


async def _streamed(client: AsyncTaskgateClient, i: int, tokens: int) -> tuple[str, str, float | None]:
    """Submits prompt i as a chat task and streams it to its end: (task id, the streamed text, seconds from the
    submit to the first delta)."""
    began = time.perf_counter()
    handle = await client.chat(prompt(i), LLM_MODEL, max_output_tokens=tokens, temperature=1.0, seed=i + 1)
    first: float | None = None
    text = []
    async for delta in handle.stream_text():
        if first is None:
            first = time.perf_counter() - began
        text.append(str(delta))
    return handle.task_id, "".join(text), first


async def _gateway_task(client: AsyncTaskgateClient, i: int, tokens: int) -> tuple[float, bool]:
    """One task alone: its time to first token and whether it succeeded with the streamed text as its answer."""
    task_id, text, first = await _streamed(client, i, tokens)
    done = await client.get(task_id)
    ok = done.status is Status.SUCCEEDED and done.answer is not None and done.answer.text == text
    return (first if first is not None else float("nan")), ok


async def _gateway_round(
    stack: BenchStack, client: AsyncTaskgateClient, pid: int, indexes: list[int], tokens: int
) -> Round:
    before, decoding, mine = cpu.snapshot(stack), cpu.thread_seconds(pid, DECODING_THREADS), time.process_time()
    streamed = await asyncio.gather(*(_streamed(client, i, tokens) for i in indexes))
    after, decoded, mine = cpu.snapshot(stack), cpu.thread_seconds(pid, DECODING_THREADS), time.process_time() - mine
    tasks = await asyncio.gather(*(client.get(task_id) for task_id, _, _ in streamed))
    mismatches = sum(
        1
        for t, (_, text, _) in zip(tasks, streamed, strict=True)
        if t.status is not Status.SUCCEEDED or t.answer is None or t.answer.text != text
    )
    starts = [t.started_at.timestamp() for t in tasks if t.started_at is not None]
    ends = [t.finished_at.timestamp() for t in tasks if t.finished_at is not None]
    seconds = max(ends) - min(starts) if starts and ends else float("nan")
    parts = {k: after[k] - before[k] for k in after if k in before}
    parts["worker"] = parts.get("worker", 0.0) - (decoded - decoding)
    return Round(sum(t.output_tokens for t in tasks), seconds, parts, decoded - decoding, mine, mismatches)


def _report(
    report: Report,
    section: str,
    opts: LlmOptions,
    direct_ttft: list[float],
    direct: dict[int, list[Round]],
    gateway_ttft: list[float],
    gateway: dict[int, list[Round]],
    idle: dict[str, float],
    *,
    mismatches: int,
) -> None:
    low, high = min(opts.levels), max(opts.levels)
    for n in opts.levels:
        tokens = sum(r.tokens for r in gateway[n])
        _, here = cpu_per_token(direct[n])
        report.add(
            section,
            f"output tokens/s, {n} at once, through the gateway",
            rate(gateway[n]),
            "tok/s",
            note=f"{tokens:,} tokens, {len(gateway[n])} round(s); the model alone here: {rate(direct[n]):,.0f} tok/s,"
            f" {here:.3f} ms CPU per token",
        )
    ratio = rate(gateway[high]) / rate(gateway[low])
    report.add(
        section,
        f"throughput {high} at once / {low} at once, through the gateway",
        ratio,
        "x",
        at_least=2.0,
        note=f"the model alone here: {rate(direct[high]) / rate(direct[low]):.2f} x (continuous batching)",
    )
    p50, p99 = ms(gateway_ttft)
    d50, d99 = ms(direct_ttft)
    report.add(
        section,
        "time to first token through the gateway, p50",
        p50,
        "ms",
        note=f"p99 {p99:.1f} ms, {len(gateway_ttft)} tasks one at a time, submit -> first delta of stream_text()",
    )
    report.add(
        section,
        "time to first token, the model called here, p50",
        d50,
        "ms",
        note=f"p99 {d99:.1f} ms, same prompt and max_output_tokens ({opts.ttft_tokens})",
    )
    report.add(
        section,
        "time the gateway adds to the first token, p50",
        p50 - d50,
        "ms",
        note="dispatch and claim, the worker's prompt tokenizing, JetStream, the notifier's WatchTask",
    )
    for n in opts.levels:
        parts, decoding = cpu_per_token(gateway[n])
        tokens = max(1, sum(r.tokens for r in gateway[n]))
        client = sum(r.client for r in gateway[n]) * 1000 / tokens
        at_rest = sum(idle.values()) * sum(r.seconds for r in gateway[n]) * 1000 / tokens  # the idle stack's share
        report.add(
            section,
            f"server-side CPU per streamed token, {n} at once (model decoding excluded)",
            sum(parts.values()),
            "ms",
            note=", ".join(f"{k} {v:.3f}" for k, v in parts.items())
            + f"; {at_rest:.3f} of it the idle stack's; the bench's SDK client {client:.3f} (not counted)",
        )
        report.add(
            section,
            f"model decoding CPU per token, {n} at once",
            decoding,
            "ms",
            note=f"the worker's {DECODING_THREADS}* threads (forward, sampling, detokenizing), {opts.threads} intra-op "
            f"thread(s)",
        )
    wrong = mismatches + sum(r.mismatches for rounds in gateway.values() for r in rounds)
    report.add(section, "tasks not SUCCEEDED with their streamed text as the answer", wrong, "tasks", at_most=0)
    report.raw["llm"] = {
        "threads": opts.threads,
        "tokens_per_task": opts.tokens,
        "rounds": opts.rounds,
        "gateway_tokens_per_second": {n: round(rate(gateway[n]), 1) for n in opts.levels},
        "direct_tokens_per_second": {n: round(rate(direct[n]), 1) for n in opts.levels},
        "ttft_ms": {
            "gateway_p50": round(p50, 2),
            "gateway_p99": round(p99, 2),
            "direct_p50": round(d50, 2),
            "direct_p99": round(d99, 2),
            "gateway_p90": round(percentile(gateway_ttft, 90) * 1000, 2),
        },
        "idle_cores": {k: round(v, 4) for k, v in idle.items()},
        "cpu_ms_per_token": {
            n: dict(zip(("parts", "decoding"), cpu_per_token(gateway[n]), strict=True)) for n in opts.levels
        },
    }
