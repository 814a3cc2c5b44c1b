"""Token budgets at admission (#34): a chat task reserves its max_output_tokens plus its counted input in the admission
statement under the tenant lock, is refused QUOTA_EXCEEDED (budget 'tokens') when that does not fit the UTC day or
month, and its charge is trued up to the tokens its row records when it ends (a failed or cancelled one releases it)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2

from taskgate import auth, chat, ids, store
from taskgate.config import ModelSpec, Settings
from taskgate.runtime import Backends
from taskgate.states import Status
from taskgate.store import pool, submissions, tenants
from taskgate.store.submissions import Admission, AdmitVerdict, Candidate, History, NewTask
from taskgate_api.v1 import gateway_pb2, task_pb2
from tests.support.factories import claimed, key_for
from tests.support.harness import WorkerFactory, info_of, outcome
from tests.support.queries import is_status, wait_task

LATE = datetime(2026, 3, 10, 23, 0, tzinfo=UTC)  # an hour before the day's budget resets
NEXT_DAY = datetime(2026, 3, 11, 0, 0, 1, tzinfo=UTC)
VIDEO = {"num_frames": 9, "width": 32, "height": 32, "num_inference_steps": 2, "seed": 1}
MODEL = "llama-tiny"


def chat_candidate(tenant: str, key: str, *, input_tokens: int = 20, max_output_tokens: int = 100) -> Candidate:
    payload = {chat.MESSAGES: [{"role": "user", "content": key}], "max_output_tokens": max_output_tokens,
               "temperature": 0.0, "top_p": 1.0, "stop": [], "seed": 1, chat.INPUT_TOKENS: input_tokens}
    new = NewTask(
        id=ids.new_id(),
        user_id=tenant,
        idempotency_key=key,
        key_derived=False,
        request_hash=key,
        task_type=chat.TASK_TYPE,
        model_id=MODEL,
        prompt=key,
        payload=payload,
        metadata={},
        priority=5,
        max_retries=0,
        callback_url=None,
        callback_events=[],
    )
    return Candidate(new, None, 0.0, chat.reservation(payload))


def video_candidate(tenant: str, key: str) -> Candidate:
    new = NewTask(
        id=ids.new_id(),
        user_id=tenant,
        idempotency_key=key,
        key_derived=False,
        request_hash=key,
        task_type="text-to-video",
        model_id="wan-tiny",
        prompt=key,
        payload=VIDEO,
        metadata={},
        priority=5,
        max_retries=0,
        callback_url=None,
        callback_events=[],
    )
    return Candidate(new, None, 40.0)


async def admit(db: Any, *items: Candidate, now: datetime) -> list[Admission]:
    return await submissions.admit(db, items, default_max_pending=50, history=History(), now=now)


async def tokens_charged(backends: Backends, tenant: str) -> dict[str, int]:
    rows = await backends.pool.fetch("SELECT day, tokens FROM budget_charge WHERE tenant_id = $1 ORDER BY day", tenant)
    return {str(r["day"]): r["tokens"] for r in rows}


async def budget(backends: Backends, tenant: str, *, day: int | None = None, month: int | None = None,
                 gpu_day: float | None = None) -> None:
    if not await tenants.tenant_exists(backends.pool, tenant):
        await auth.create_key(backends.pool, backends.settings.api_key_pepper, tenant, max_pending=50)
    changed = await tenants.update_tenant(
        backends.pool, tenant, max_pending=None, submits_per_minute=None, max_priority=None, tokens_per_day=day,
        tokens_per_month=month, gpu_seconds_per_day=gpu_day,
    )
    assert changed is not None and (changed.tokens_per_day, changed.tokens_per_month) == (day or None, month or None)


async def test_the_day_token_budget_refuses_a_reservation_that_does_not_fit(backends: Backends) -> None:
    await budget(backends, "talker", day=300)
    got = await admit(
        backends.pool,
        chat_candidate("talker", "a"),
        chat_candidate("talker", "b"),
        chat_candidate("talker", "c"),
        chat_candidate("talker", "d", max_output_tokens=30),
        video_candidate("talker", "v"),
        chat_candidate("talker", "c"),
        now=LATE,
    )
    # one by one: 120 + 120 fit, the third 120 does not (60 left) and reserves nothing, so 50 after it fits; a video
    # task reserves no tokens and is never refused for them; a later copy shares its first copy's answer
    assert [a.verdict for a in got] == [AdmitVerdict.CREATED, AdmitVerdict.CREATED, AdmitVerdict.QUOTA_EXCEEDED,
                                        AdmitVerdict.CREATED, AdmitVerdict.CREATED, AdmitVerdict.QUOTA_EXCEEDED]
    refused = got[2]
    assert refused.budget is not None
    assert (refused.budget.unit, refused.budget.window, refused.budget.left, refused.budget.estimate) == (
        "tokens",
        "day",
        60,
        120,
    )
    assert refused.retry_after == pytest.approx(3600.0)
    assert got[5].budget == refused.budget
    assert [a.task.tokens_reserved for a in got if a.task] == [120, 120, 50, 0]
    assert await tokens_charged(backends, "talker") == {"2026-03-10": 290}
    assert await backends.pool.fetchval("SELECT sum(seconds) FROM budget_charge WHERE tenant_id = 'talker'") == 0
    # a retry of an accepted request gets its task over budget; the next day the refused one fits
    again = await admit(backends.pool, chat_candidate("talker", "a"), chat_candidate("talker", "e"), now=LATE)
    assert [a.verdict for a in again] == [AdmitVerdict.EXISTING, AdmitVerdict.QUOTA_EXCEEDED]
    [after] = await admit(backends.pool, chat_candidate("talker", "c"), now=NEXT_DAY)
    assert after.verdict is AdmitVerdict.CREATED
    assert await tokens_charged(backends, "talker") == {"2026-03-10": 290, "2026-03-11": 120}


async def test_the_month_token_budget_and_the_gpu_budget_both_apply(backends: Backends) -> None:
    await budget(backends, "both", day=1000, month=250, gpu_day=100.0)
    first = await admit(backends.pool, chat_candidate("both", "a"), video_candidate("both", "v1"), now=LATE)
    assert [a.verdict for a in first] == [AdmitVerdict.CREATED, AdmitVerdict.CREATED]
    [second, video, third] = await admit(
        backends.pool,
        chat_candidate("both", "b"),
        video_candidate("both", "v2"),
        chat_candidate("both", "c"),
        now=NEXT_DAY,
    )
    assert second.verdict is AdmitVerdict.CREATED  # 240 of 250 this month
    assert video.verdict is AdmitVerdict.CREATED  # GPU-seconds: a new day
    assert third.verdict is AdmitVerdict.QUOTA_EXCEEDED and third.budget is not None
    assert (third.budget.unit, third.budget.window, third.budget.left) == ("tokens", "month", 10)
    assert third.retry_after == pytest.approx((datetime(2026, 4, 1, tzinfo=UTC) - NEXT_DAY).total_seconds())
    # a GPU-second refusal still names its own budget
    [gpu] = (await admit(backends.pool, video_candidate("both", "v3"), video_candidate("both", "v4"), now=NEXT_DAY))[1:]
    assert gpu.verdict is AdmitVerdict.QUOTA_EXCEEDED and gpu.budget is not None and gpu.budget.unit == "gpu_seconds"


async def test_the_charge_is_trued_up_to_the_tokens_used_and_a_cancel_or_failure_releases_it(
    backends: Backends,
) -> None:
    await budget(backends, "settles", day=270)
    ran, failed = await admit(
        backends.pool, chat_candidate("settles", "ran"), chat_candidate("settles", "failed"), now=LATE
    )
    assert ran.task is not None and failed.task is not None
    [over] = await admit(backends.pool, chat_candidate("settles", "over"), now=LATE)
    assert over.verdict is AdmitVerdict.QUOTA_EXCEEDED  # 240 reserved of 270
    # the answer used 20 input and 7 output tokens of the 120 reserved: the charge becomes 27
    await claimed(backends.pool, ran.task.id, worker_id="w1", lease_seconds=30.0)
    result = store.ResultRef("mem://x", "text/plain", 3, "ab" * 32)
    done = await store.succeed(backends.pool, ran.task.id, attempt=1, result=result, actor="test",
                               text=store.TextOutcome("abc", 3, "stop", 20, 7))
    assert done.applied
    assert await tokens_charged(backends, "settles") == {"2026-03-10": 27 + 120}
    [fits] = await admit(backends.pool, chat_candidate("settles", "over"), now=LATE)
    assert fits.verdict is AdmitVerdict.CREATED and fits.task is not None  # 27 + 120 + 120 <= 270
    # a failed task and a cancelled one release their whole reservations
    await claimed(backends.pool, failed.task.id, worker_id="w1", lease_seconds=30.0)
    lost = await store.fail(
        backends.pool, failed.task.id, attempt=1, error=store.TaskError("X", "broken"), actor="test", reason="test"
    )
    assert lost.applied
    await store.cancel(backends.pool, fits.task.id, mode=store.CancelMode.SOFT, actor="test")
    assert await tokens_charged(backends, "settles") == {"2026-03-10": 27}


async def test_two_replicas_admitting_at_once_never_overdraw_the_budget(backends: Backends) -> None:
    await budget(backends, "racer", day=120 * 5)
    assert backends.settings.database_url is not None
    other = await pool.create_pool(backends.settings.database_url, size=2)  # a second replica's own connections
    try:
        batches = [[chat_candidate("racer", f"{r}-{i}") for i in range(4)] for r in range(4)]
        got = await asyncio.gather(
            *(admit(backends.pool if n % 2 else other, *b, now=LATE) for n, b in enumerate(batches))
        )
    finally:
        await other.close()
    verdicts = [a.verdict for batch in got for a in batch]
    assert verdicts.count(AdmitVerdict.CREATED) == 5 and verdicts.count(AdmitVerdict.QUOTA_EXCEEDED) == 11
    assert await tokens_charged(backends, "racer") == {"2026-03-10": 600}


@pytest.fixture
def settings(settings: Settings, tiny_lm: Path) -> Settings:
    spec = ModelSpec(kind="transformers", path=tiny_lm, max_sequences=2, max_input_tokens=4096, max_output_tokens=512)
    return settings.model_copy(update={"models": {**settings.models, MODEL: spec}, "worker_models": [MODEL]})


def chat_request(key: str) -> gateway_pb2.SubmitTaskRequest:
    # stop strings any second word meets: the answer ends well inside its 60 tokens, so the true-up frees room
    params = task_pb2.ChatParams(messages=[task_pb2.ChatMessage(role="user", content="Review this diff: return value")],
                                 max_output_tokens=60, temperature=0.0, stop=[" ", "\n", "e", "a"])
    return gateway_pb2.SubmitTaskRequest(task_type="chat", model_id=MODEL, chat=params, idempotency_key=key)


async def test_through_the_gateway_a_refused_task_fits_once_a_real_answer_trued_up_its_charge(
    settings: Settings, backends: Backends, stub: Any, workers: WorkerFactory
) -> None:
    md = await key_for(backends, "gateway-talker", max_pending=10)
    await budget(backends, "gateway-talker", day=10**6)
    first = await stub.SubmitTask(chat_request("first"), metadata=md, timeout=10)
    reserved = first.task.usage.input_tokens + 60
    assert first.created and first.task.usage.input_tokens > 0
    assert await tokens_charged(backends, "gateway-talker") == {str(datetime.now(UTC).date()): reserved}
    # the budget lowered to hold the first reservation and not a second one like it
    await budget(backends, "gateway-talker", day=2 * reserved - 1)
    code, details, _ = await outcome(stub.SubmitTask(chat_request("second"), metadata=md, timeout=10))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    info = info_of(details)
    assert info.reason == "QUOTA_EXCEEDED"
    assert dict(info.metadata) == {"budget": "tokens", "window": "day", "tokens_left": str(reserved - 1),
                                   "tokens_estimate": str(reserved)}
    retry = next(d for d in details if isinstance(d, error_details_pb2.RetryInfo))
    assert 0 < retry.retry_delay.ToTimedelta().total_seconds() <= 86400
    # the answer ends: the charge becomes the tokens its row records, and the second task fits
    await workers(settings)
    await wait_task(backends, int(first.task.id), is_status(Status.SUCCEEDED), within=60)
    row = await backends.pool.fetchrow(
        "SELECT input_tokens, output_tokens, tokens_reserved, token_budget_day FROM task WHERE id = $1",
        int(first.task.id),
    )
    used = row["input_tokens"] + row["output_tokens"]
    assert row["tokens_reserved"] == reserved and 0 < row["output_tokens"] < 60
    assert await tokens_charged(backends, "gateway-talker") == {str(row["token_budget_day"]): used}
    second = await stub.SubmitTask(chat_request("second"), metadata=md, timeout=10)
    assert second.created
    assert await tokens_charged(backends, "gateway-talker") == {str(row["token_budget_day"]): used + reserved}
