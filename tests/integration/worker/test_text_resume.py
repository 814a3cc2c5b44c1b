"""Text resume (#37 for chat tasks, #34): an answer interrupted mid-generation — its worker process SIGKILLed or
drained by SIGTERM — goes on in the next attempt from the text the output stream holds, made of the tokens its chunks
name. The client's text is contiguous (nothing repeated, nothing lost, no restart), the final answer is the one an
uninterrupted run makes (greedy, and seeded sampling: a token's draw depends on its seed and index only), and each
output token is generated once and metered once. Real tiny LM, PostgreSQL, NATS, gRPC and worker processes."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from nats.js.errors import NotFoundError

from services.scheduler import service as scheduler_service
from services.worker.chatrun import ChatRunner
from services.worker.textgen import Sampling, Sequence
from taskgate import bus as busmod
from taskgate import output
from taskgate.config import ModelSpec, Settings
from taskgate.runtime import Backends
from taskgate.states import Status
from taskgate_api.v1 import gateway_pb2, task_pb2
from taskgate_client import Output, TextAssembler
from tests.support.factories import key_for
from tests.support.harness import WorkerFactory, wait_for, worker_process
from tests.support.output import chunks, text_of
from tests.support.queries import is_status, read_result, row, wait_task

MODEL = "llama-tiny"
QUESTION = "a long answer, please"


@pytest.fixture
def settings(settings: Settings, tiny_lm: Path) -> Settings:
    spec = ModelSpec(kind="transformers", path=tiny_lm, max_sequences=4, max_input_tokens=4096, max_output_tokens=6000)
    return settings.model_copy(
        update={
            "models": {**settings.models, MODEL: spec},
            "worker_models": [MODEL],
            "lease_seconds": 1.0,
            "heartbeat_seconds": 0.25,
            "scan_interval_seconds": 0.2,
        }
    )


def test_a_sequence_resumed_from_any_token_makes_the_uninterrupted_ones_tokens(tiny_lm: Path) -> None:
    """The decoding loop alone: prefilled with the prompt and the first k tokens, a sequence makes the rest exactly as
    the uninterrupted one did, greedy and sampled (its generator seeded per token from the seed and the index)."""
    runner = ChatRunner.load(MODEL, ModelSpec(kind="transformers", path=tiny_lm, max_sequences=4), "cpu")
    try:
        prompt = runner.prompt_ids([{"role": "user", "content": QUESTION}])

        def generate(sampling: Sampling, resumed: list[int]) -> list[int]:
            handed: list[int] = []

            def take(token: int) -> bool:
                handed.append(token)
                return True

            seq = Sequence(prompt, sampling, take, lambda: False, resumed=resumed)
            done = runner.batcher.submit(seq).result(timeout=120)
            assert done.tokens == resumed + handed  # the resumed tokens are not handed over again
            return done.tokens

        for sampling in (Sampling(160), Sampling(160, temperature=0.9, top_p=0.9, seed=7)):
            whole = generate(sampling, [])
            assert len(whole) > 40
            for k in (1, 17, len(whole) // 2, len(whole) - 1):
                assert generate(sampling, whole[:k]) == whole, (sampling, k)
        other = generate(Sampling(160, temperature=0.9, top_p=0.9, seed=8), [])
        assert other != generate(Sampling(160, temperature=0.9, top_p=0.9, seed=7), [])  # the seed matters
    finally:
        runner.close()


async def test_the_stream_says_what_to_resume_from_as_a_reader_assembles_it(backends: Backends) -> None:
    """resume_text: the newest attempt's text from its offset with the tokens that made it; an older attempt's late
    chunk dropped; nothing (start over) without chunks, or once a chunk names no tokens or leaves a gap."""
    bus, user = backends.bus, "tenant-r"

    async def say(
        task: int, attempt: int, text: str, offset: int, tokens: tuple[int, ...] | None, token_offset: int
    ) -> None:
        await output.publish(
            bus,
            user,
            output.Chunk(
                task, attempt, output.TEXT, text=text, offset=offset, tokens=tokens, token_offset=token_offset
            ),
        )

    assert await output.resume_text(bus, user, 1) is None
    await say(1, 1, "Hello ", 0, (5, 6), 0)
    await say(1, 1, "there", 6, (7,), 2)
    await say(1, 2, " again", 6, (8, 9), 2)  # attempt 2 resumed after "Hello " (2 tokens) and went on
    await say(1, 1, "late", 11, (10,), 3)  # the replaced attempt's last words
    assert await output.resume_text(bus, user, 1) == output.Resumable(2, "Hello  again", [5, 6, 8, 9])
    await say(2, 1, "Hi", 0, (1,), 0)
    await say(2, 1, "!", 2, None, 1)  # made by a server whose tokens are not known
    assert await output.resume_text(bus, user, 2) is None
    await say(3, 1, "Hi", 0, (1,), 0)
    await say(3, 1, "!", 5, (2,), 1)  # a gap
    assert await output.resume_text(bus, user, 3) is None


async def submit(stub: Any, md: Any, key: str, **chat: Any) -> task_pb2.Task:
    params = task_pb2.ChatParams(messages=[task_pb2.ChatMessage(role="user", content=QUESTION)], **chat)
    made = await stub.SubmitTask(
        gateway_pb2.SubmitTaskRequest(task_type="chat", model_id=MODEL, chat=params, idempotency_key=key),
        metadata=md,
        timeout=10,
    )
    task: task_pb2.Task = made.task
    return task


async def published_tokens(backends: Backends, user_id: str, task_id: str, attempt: int) -> int:
    """How many token ids the attempt's chunks name (their Taskgate-Tokens headers)."""
    subject = busmod.output_subject(user_id, int(task_id))
    count, seq = 0, 1
    while True:
        try:
            msg = await backends.bus.js.get_msg(busmod.OUTPUT_STREAM, seq=seq, subject=subject, next=True)
        except NotFoundError:
            return count
        chunk = output.decode(msg.data or b"", int(msg.seq or 0))
        assert chunk is not None
        if chunk.attempt == attempt:
            header = (msg.headers or {})[output.TOKENS_HEADER]
            count += len([t for t in header.partition(":")[2].split(",") if t])
        seq = int(msg.seq or 0) + 1


async def streamed_as_a_client_reads_it(backends: Backends, user_id: str, task_id: str) -> str:
    """The text the SDK's assembler makes of every chunk, checking that no delta replaced text already shown."""
    assembler = TextAssembler()
    for chunk in await chunks(backends, user_id, task_id):
        delta = assembler.feed(Output.from_proto(chunk))
        assert delta is None or not delta.restarted, (delta.attempt, delta.offset)
    return assembler.text


async def interrupted_then_finished(
    settings: Settings, backends: Backends, stub: Any, workers: WorkerFactory, interrupt: signal.Signals, **chat: Any
) -> None:
    md = await key_for(backends, max_pending=10)
    task = await submit(stub, md, "interrupted", **chat)
    sched = await scheduler_service.start(settings, backends)
    try:
        async with worker_process(settings) as first:

            async def under_way() -> bool:
                return len(text_of(await chunks(backends, task.user_id, task.id), 1)) >= 100

            await wait_for(under_way, within=120, every=0.02)
            signalled = time.monotonic()
            first.send_signal(interrupt)
            if interrupt is signal.SIGTERM:  # drained: released at once, not after the answer's remaining tokens
                await wait_task(backends, int(task.id), lambda r: r.status is not Status.PROCESSING, within=30)
                released_seconds = time.monotonic() - signalled
            code = await asyncio.wait_for(first.wait(), 60)
        stopped = await row(backends.pool, int(task.id))
        assert stopped.status in (Status.PROCESSING, Status.QUEUED), "the answer ended before the interruption"
        if interrupt is signal.SIGTERM:
            # released to the queue with its progress, not failed, no retry spent; metered up to its newest published
            # text, at most a few tokens' time after it wasted
            assert code == 0 and released_seconds < 5, (code, released_seconds)
            assert stopped.status is Status.QUEUED and (stopped.retry_count, stopped.worker_losses) == (0, 0)
            assert stopped.device_seconds > 0 and stopped.wasted_seconds < 0.5, (
                stopped.device_seconds,
                stopped.wasted_seconds,
            )
        first_text = text_of(await chunks(backends, task.user_id, task.id), 1)  # all attempt 1 ever published
        first_tokens = await published_tokens(backends, task.user_id, task.id, 1)
        assert first_text and first_tokens > 0

        second = await workers(settings)
        [runner] = [r for r in second.worker.attempts.runners.values() if isinstance(r, ChatRunner)]
        steps_before = runner.batcher.steps  # its warm-up's
        done = await wait_task(backends, int(task.id), is_status(Status.SUCCEEDED), within=180)
        steps_resumed = runner.batcher.steps - steps_before
        assert done.attempt == 2 and done.result_uri is not None
        answer = (await read_result(settings, backends, done.result_uri)).decode()

        found = await chunks(backends, task.user_id, task.id)
        # attempt 2 went on where attempt 1's published text ended: its first chunk there, in order, no gap
        assert next(c.offset for c in found if c.attempt == 2) == len(first_text)
        assert first_text + text_of(found, 2, start=len(first_text)) == answer
        assert await streamed_as_a_client_reads_it(backends, task.user_id, task.id) == answer

        # the same request uninterrupted, as a new task on the same worker: the same answer, the same token count
        again = await submit(stub, md, "uninterrupted", **chat)
        whole = await wait_task(backends, int(again.id), is_status(Status.SUCCEEDED), within=180)
        assert whole.attempt == 1 and whole.result_uri is not None
        assert (await read_result(settings, backends, whole.result_uri)).decode() == answer
        # each token metered once: the resumed task's count is the uninterrupted one's, not that plus attempt 1's
        assert done.output_tokens == whole.output_tokens > first_tokens
        # and generated once: attempt 2 took one decoding step per token after attempt 1's published ones (its first
        # came out of the prefill; an end of text takes one step more)
        left = done.output_tokens - first_tokens
        assert left - 1 <= steps_resumed <= left, (steps_resumed, done.output_tokens, first_tokens)
    finally:
        await sched.stop()


async def test_a_killed_workers_answer_goes_on_in_the_next_attempt_from_its_published_text(
    settings: Settings, backends: Backends, stub: Any, workers: WorkerFactory
) -> None:
    await interrupted_then_finished(
        settings, backends, stub, workers, signal.SIGKILL, max_output_tokens=600, temperature=0.9, top_p=0.9, seed=7
    )


async def test_a_drained_workers_answer_is_released_with_its_progress_and_goes_on_elsewhere(
    settings: Settings, backends: Backends, stub: Any, workers: WorkerFactory
) -> None:
    await interrupted_then_finished(
        settings, backends, stub, workers, signal.SIGTERM, max_output_tokens=600, temperature=0.0
    )
