"""The TaskGateway gRPC service: submit, follow, list, cancel and download tasks."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeAlias, cast

import asyncpg
import grpc
import nats.errors
from google.protobuf.duration_pb2 import Duration

from taskgate import auth, chat, clienttokens, errors, eta, ids, output, paging, store, telemetry, tracing
from taskgate.auth import DEFAULT_SECRET_OVERLAP, Authenticator, Caller, Principal
from taskgate.config import GatewaySettings
from taskgate.dispatcher import Dispatcher
from taskgate.model import TaskRow, timestamp
from taskgate.queueview import QueueView
from taskgate.results import ResultNotFound, add_link, result_store
from taskgate.runtime import Backends, connect, serve_until_signal, stop_tasks
from taskgate.sealing import Sealer
from taskgate.server import Health, Probes, mark_not_serving, start_server
from taskgate.states import Status
from taskgate.store import submissions, tenants
from taskgate.store.submissions import Admission, AdmitVerdict, Candidate, NewTask
from taskgate.throttle import Throttle
from taskgate.wire import cancel, ended
from taskgate_api import reasons
from taskgate_api.v1 import batches_pb2, gateway_pb2, gateway_pb2_grpc, task_pb2

from . import pipeline
from .batches import Batches, BatchSignals, file_proto
from .batching import MAX_BATCH, Submitter, deadline_exceeded
from .cache import FORGOTTEN_CHANNEL, TerminalCache
from .inputs import InputImages
from .ratelimit import TENANT, quota_exceeded, rate_limited, too_many_pending
from .validation import (
    Submission,
    check_priority,
    end_user_problem,
    key_problem,
    moment,
    regenerate_request,
    validate,
)

log = logging.getLogger("taskgate.submit")

ACTOR = "submit"
SERVICE_NAME = "taskgate.v1.TaskGateway"

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
# A result store or database that failed to keep an input image: the caller may retry.
_STORE_ERRORS = (OSError, TimeoutError, asyncpg.PostgresError, nats.errors.Error)


def poll_interval(created_at: datetime, now: datetime | None = None) -> float:
    """How long a client should wait before asking again: 2 s in a task's first 30 s, 5 s until 2 min, then 10 s."""
    age = ((now or datetime.now(UTC)) - created_at).total_seconds()
    if age < 30:
        return 2.0
    if age < 120:
        return 5.0
    return 10.0


def _margin(remaining: float) -> float:
    """What to keep of a caller's remaining time (a fifth, 50-500 ms) to roll back and answer before it gives up."""
    return min(max(remaining * 0.2, 0.05), 0.5)


class _Unhurried:
    """The deadline side of a call context for submissions the gateway makes itself (a batch's lines): none."""

    def time_remaining(self) -> float | None:
        return None


def _prompt_fingerprint(prompt: str) -> dict[str, object]:
    """What a log line may say about a prompt: its length and a hash prefix, never the text."""
    return {"prompt_chars": len(prompt), "prompt_sha256": hashlib.sha256(prompt.encode()).hexdigest()[:12]}


class Gateway(gateway_pb2_grpc.TaskGatewayServicer):
    """The TaskGateway servicer over one pool and one bus."""

    def __init__(self, settings: GatewaySettings, backends: Backends, batch_signals: BatchSignals | None = None) -> None:
        self._settings = settings
        self._pool = backends.pool
        self._bus = backends.bus
        self._throttle = Throttle.of(settings)
        self._auth = Authenticator(
            backends.pool, settings.api_key_pepper, settings.api_key_cache_seconds, throttle=self._throttle,
            service="submit",
        )
        self.draining = asyncio.Event()  # set when the server stops: SubmitStream streams read no more and end
        self._cache = TerminalCache(settings.result_cache_size, settings.result_cache_seconds)
        # one connection hears revoked keys and forgotten tasks (deleted, or their output expired)
        self.revocations = self._auth.listener(backends.database_url, {FORGOTTEN_CHANNEL: self._cache.forget})
        self._pages = paging.Pager(settings.api_key_pepper)
        self._sealer = Sealer.of(settings)
        self._queue = QueueView(backends.pool, settings)
        self._results = result_store(settings, backends.bus)
        self.inputs = InputImages(backends.pool, self._results, settings)
        self.ids = ids.LeasedIds(backends.pool, lease_seconds=settings.id_node_lease_seconds, fixed_node=settings.id_node)
        self.dispatcher = Dispatcher(
            backends.pool, backends.bus, actor=ACTOR, ack_timeout=settings.submit_publish_timeout_seconds,
            db_timeout=settings.submit_db_timeout_seconds, max_batch=MAX_BATCH,
        )
        self._end_user_limits = submissions.EndUserLimits(
            settings.max_pending_per_end_user, settings.submits_per_minute_per_end_user
        )
        self._submitter = Submitter(
            backends.pool, self.dispatcher, default_max_pending=settings.max_pending_per_tenant,
            db_timeout=settings.submit_db_timeout_seconds,
            history=submissions.History(settings.eta_history_seconds, settings.eta_history_runs),
            end_users=self._end_user_limits,
        )
        self.batches = Batches(
            backends.pool, self._results, settings, self.ids.next,
            submit=lambda who, items: self._submit(who, items, _Unhurried()),
            cancel_task=self._hard_cancel, text_of=self._text_of, signals=batch_signals or BatchSignals(),
        )

    def _budget(self, context: Context, cap: float | None = None) -> float:
        """Seconds one backend call may take: the configured cap, shortened to fit the client's deadline."""
        cap = self._settings.submit_db_timeout_seconds if cap is None else cap
        remaining = context.time_remaining()
        if remaining is None:
            return cap
        return max(min(cap, remaining - _margin(remaining)), 0.001)

    async def _principal(self, context: Context) -> Principal:
        async with asyncio.timeout(self._budget(context)):  # no task per call, as wait_for would make
            return await self._auth.principal(context)

    # SubmitTask and SubmitTasks: one path, SubmitTask is SubmitTasks of one

    async def SubmitTask(self, request: gateway_pb2.SubmitTaskRequest, context: Context) -> gateway_pb2.SubmitTaskResponse:
        [answer] = await self._submit(await self._principal(context), [request], context)
        if isinstance(answer, errors.ApiError):
            raise answer
        return answer

    async def SubmitTasks(self, request: gateway_pb2.SubmitTasksRequest, context: Context) -> gateway_pb2.SubmitTasksResponse:
        who = await self._principal(context)
        items = list(request.requests)
        if not 1 <= len(items) <= MAX_BATCH:
            raise errors.invalid_argument([("requests", f"must hold 1 to {MAX_BATCH:,} submissions")])
        answers = await self._submit(who, items, context)
        return gateway_pb2.SubmitTasksResponse(results=[
            gateway_pb2.SubmitTaskResult(error=a.status_proto) if isinstance(a, errors.ApiError)
            else gateway_pb2.SubmitTaskResult(response=a)
            for a in answers
        ])

    async def SubmitStream(
        self, request_iterator: AsyncIterator[gateway_pb2.SubmitStreamRequest], context: Context
    ) -> AsyncIterator[gateway_pb2.SubmitStreamResponse]:
        """Submissions pipelined (services/submit/pipeline.py): each request admitted as SubmitTask admits it, its
        answer sent by its request id as soon as it is done."""
        async with self._auth.stream(context) as session:  # a revoked key ends the stream
            with self._throttle.stream(session.principal.tenant_id, "submit"):  # one of the tenant's stream places
                await context.send_initial_metadata(())  # accepted: the client writes its requests once it hears this
                answers = pipeline.serve(
                    request_iterator, context, self._submit_streamed, max_age=self._settings.stream_max_age_seconds,
                    draining=self.draining,
                )
                async for answer in session.guard(answers):
                    yield answer

    async def _submit_streamed(
        self, msg: gateway_pb2.SubmitStreamRequest, context: pipeline.ItemContext
    ) -> gateway_pb2.SubmitTaskResponse:
        """One streamed request, as SubmitTask: its key's tenant (one token of its call throttle), its deadline, its
        trace (the caller's context it carries)."""
        call = cast(Context, context)  # what the submit path reads of a call: its metadata and its time remaining
        left = context.time_remaining()
        if left is not None and left < self._settings.submit_min_time_left_seconds:
            raise deadline_exceeded()  # as a unary call's own deadline would end it: nothing looked up, nothing admitted
        with tracing.span("taskgate.v1.TaskGateway/SubmitStream.item", parent=dict(msg.trace_context) or None):
            try:
                [answer] = await self._submit(await self._principal(call), [msg.request], call)
            except TimeoutError:
                # a step cut short to fit the request's own deadline: what a unary caller hears from its deadline
                left = context.time_remaining()
                if left is not None and left < self._settings.submit_db_timeout_seconds:
                    raise deadline_exceeded(maybe_admitted=True) from None
                raise
        if isinstance(answer, errors.ApiError):
            raise answer
        return answer

    async def _submit(
        self, who: Principal, items: list[gateway_pb2.SubmitTaskRequest], context: Context
    ) -> list[gateway_pb2.SubmitTaskResponse | errors.ApiError]:
        """Each request's answer, in order: its task as the admission statement left it, or the error naming why not.

        The answer follows the one durable commit of the admission statement; the dispatcher publishes and queues the
        created tasks after it, off this path.
        """
        left = context.time_remaining()
        if left is not None and left < self._settings.submit_min_time_left_seconds:
            raise deadline_exceeded()  # too little time to be admitted: it does not join a batch
        per_minute = who.submits_per_minute or self._settings.submits_per_minute
        answers: list[gateway_pb2.SubmitTaskResponse | errors.ApiError | None] = [None] * len(items)

        replays: set[int] = set()  # items whose key already names a task

        async def take_slots(indices: list[int]) -> list[int]:
            """The items that got a rate slot; replays of a key take none, the others answer RATE_LIMITED."""
            # a key (or end user) validation will refuse is looked up as none (its item takes a slot, then answers
            # the field)
            sound = [i for i in indices if key_problem(items[i].idempotency_key, self._settings) is None
                     and end_user_problem(items[i].end_user) is None]
            keys = [items[i].idempotency_key if i in sound else "" for i in indices]
            end_users = [items[i].end_user if i in sound else "" for i in indices]
            taken = await submissions.take_rate_slots(
                self._pool, who.tenant_id, per_minute=per_minute, keys=keys, end_users=end_users,
                per_end_user=self._end_user_limits.per_minute, within=self._budget(context),
            )
            for i, slot in zip(indices, taken, strict=True):
                if slot.retry_after is not None:
                    answers[i] = rate_limited(slot.limit or per_minute, slot.retry_after, slot.scope or TENANT)
                elif slot.replay:
                    replays.add(i)
            return [i for i, slot in zip(indices, taken, strict=True) if slot.retry_after is None and not slot.replay]

        # checking a callback URL resolves its host, an input image is fetched and decoded: a rate-limited caller
        # must not get to make us do that, so those items take their slot first; an invalid item counts too, and a
        # rate-limited caller hears that first. A replay of an accepted key takes none: its answer is its task.
        costly = [i for i, r in enumerate(items) if r.callback_url or r.HasField("image")]
        slotted = set(await take_slots(costly)) if costly else set()
        to_check = [i for i, r in enumerate(items) if i in slotted or i in replays or not (r.callback_url or r.HasField("image"))]
        checked = await asyncio.gather(
            *(validate(who.tenant_id, items[i], self._settings, self.inputs, within=self._budget(context),
                       replay=i in replays) for i in to_check),
            return_exceptions=True,
        )
        subs: dict[int, Submission] = {}
        invalid: list[int] = []
        for i, sub in zip(to_check, checked, strict=True):
            if isinstance(sub, errors.ApiError):
                answers[i] = sub
                invalid.append(i)
            elif isinstance(sub, BaseException):
                raise sub
            else:
                subs[i] = sub
        unslotted_invalid = [i for i in invalid if i not in slotted]
        if unslotted_invalid:
            await take_slots(unslotted_invalid)
        telemetry.SUBMIT_REJECTIONS.labels("INVALID_ARGUMENT").inc(len(invalid))
        for i, sub in list(subs.items()):
            try:
                check_priority(sub.priority, who.max_priority)
            except errors.ApiError as exc:
                # an accepted request retried after the tenant's entitlement changed still gets its task: the
                # idempotent answer comes before any refusal
                existing = await submissions.task_by_key(
                    self._pool, who.tenant_id, sub.idempotency_key, end_user=sub.end_user, within=self._budget(context)
                )
                del subs[i]
                if existing is not None and sub.same_request(existing):
                    position = await self._queue_position(existing, context)
                    answers[i] = gateway_pb2.SubmitTaskResponse(task=existing.to_proto(position))
                    continue
                telemetry.SUBMIT_REJECTIONS.labels("PRIORITY_NOT_ALLOWED").inc()
                answers[i] = exc

        await self._keep_images(who, subs, answers, context)

        order = list(subs)
        candidates = [
            Candidate(self._new_task(who.tenant_id, subs[i]), None if i in slotted else per_minute,
                      self._settings.models[subs[i].model_id].gpu_seconds_estimate,
                      chat.reservation(subs[i].payload) if subs[i].task_type == chat.TASK_TYPE else None)
            for i in order
        ]
        admissions = await self._submitter.admit(candidates, self._caller_deadline(context))
        for i, candidate, admission in zip(order, candidates, admissions, strict=True):
            try:
                task, new = self._resolve(candidate, subs[i], admission)
            except errors.ApiError as exc:
                answers[i] = exc
                continue
            if new:
                answers[i] = gateway_pb2.SubmitTaskResponse(task=task.to_proto(), created=True)
            else:  # a replay (or a later copy of a key in this call) answers with that task as it now is
                answers[i] = gateway_pb2.SubmitTaskResponse(task=task.to_proto(await self._queue_position(task, context)))
        assert all(a is not None for a in answers)
        return [a for a in answers if a is not None]

    async def _keep_images(
        self, who: Principal, subs: dict[int, Submission], answers: list[Any], context: Context
    ) -> None:
        """Records and stores the checked input images of valid submissions before their admission (an image stored
        for a submission then refused is an unused input, which retention deletes); a store that fails answers that
        item UNAVAILABLE."""
        with_image = [i for i, sub in subs.items() if sub.image is not None]
        if not with_image:
            return
        kept = await asyncio.gather(
            *(self.inputs.keep(who.tenant_id, subs[i].image, within=self._budget(context)) for i in with_image),  # type: ignore[arg-type]
            return_exceptions=True,
        )
        for i, stored in zip(with_image, kept, strict=True):
            if isinstance(stored, _STORE_ERRORS):
                log.warning("input image not stored", extra={"error": f"{type(stored).__name__}: {stored}"})
                answers[i] = errors.unavailable("the input image could not be stored; retry")
                del subs[i]
            elif isinstance(stored, BaseException):
                raise stored
            else:
                subs[i] = subs[i].with_image(stored)

    async def UploadInput(
        self, request_iterator: AsyncIterator[gateway_pb2.UploadInputRequest], context: Context
    ) -> gateway_pb2.UploadInputResponse:
        """Stores an input image or a chat text attachment sent in parts; its sha256 names it in a later submission
        of this tenant."""
        who = await self._principal(context)
        per_minute = who.submits_per_minute or self._settings.submits_per_minute
        [slot] = await submissions.take_rate_slots(
            self._pool, who.tenant_id, per_minute=per_minute, keys=[""], within=self._budget(context)
        )
        if slot.retry_after is not None:  # an upload counts as a submission: storing images is not free either
            raise rate_limited(per_minute, slot.retry_after)
        stored = await self.inputs.upload(who.tenant_id, request_iterator, within=self._budget(context))
        what = stored.text if stored.HasField("text") else stored.image
        log.info("input uploaded", extra={"sha256": what.sha256, "bytes": what.size_bytes})
        return stored

    def _caller_deadline(self, context: Context) -> float | None:
        """The loop time by which this caller must hear back (None: it set no deadline), keeping the same margin as
        _budget; a batch the caller joins has its own statement timeout, never this."""
        remaining = context.time_remaining()
        if remaining is None:
            return None
        return asyncio.get_running_loop().time() + remaining - _margin(remaining)

    def _new_task(self, tenant: str, sub: Submission) -> NewTask:
        return NewTask(
            id=self.ids.next(),
            user_id=tenant,
            idempotency_key=sub.idempotency_key,
            key_derived=sub.key_derived,
            request_hash=sub.request_hash,
            task_type=sub.task_type,
            model_id=sub.model_id,
            prompt=sub.prompt,
            payload=sub.payload,
            metadata=sub.metadata,
            priority=sub.priority,
            max_retries=sub.max_retries,
            callback_url=sub.callback_url,
            callback_events=sub.callback_events,
            trace_context=tracing.carrier(),  # this call's span: the task's later spans continue its trace
            start_after=sub.start_after,
            max_queue_seconds=sub.max_queue_seconds,
            end_user=sub.end_user,
        )

    def _resolve(self, candidate: Candidate, sub: Submission, admission: Admission | BaseException) -> tuple[TaskRow, bool]:
        """The tenant's task for this submission and whether it is new, or the error its admission calls for."""
        if isinstance(admission, BaseException):
            raise admission
        verdict = admission.verdict
        if verdict is AdmitVerdict.RATE_LIMITED:
            assert candidate.per_minute is not None and admission.retry_after is not None
            raise rate_limited(admission.rate_limit or candidate.per_minute, admission.retry_after, admission.scope or TENANT)
        if verdict is AdmitVerdict.NO_TENANT:
            raise errors.unauthenticated("the key's tenant no longer exists")
        if verdict is AdmitVerdict.TOO_MANY_PENDING:
            assert admission.pending_limit is not None
            raise too_many_pending(admission.pending_limit, admission.scope or TENANT)
        if verdict is AdmitVerdict.QUOTA_EXCEEDED:
            assert admission.budget is not None and admission.retry_after is not None
            raise quota_exceeded(admission.budget, admission.retry_after)
        task = admission.task
        assert task is not None, verdict
        if verdict is AdmitVerdict.EXISTING:
            return self._replay(task, sub), False
        telemetry.TASKS_SUBMITTED.labels(task.model_id, task.task_type).inc()
        log.info(
            "task created",
            extra={"task_id": str(task.id), "state": task.status.value, "model": task.model_id,
                   "key_derived": sub.key_derived, **_prompt_fingerprint(sub.prompt)},
        )
        return task, True

    def _replay(self, existing: TaskRow, sub: Submission) -> TaskRow:
        """The existing task when the key was used for this same request; ALREADY_EXISTS otherwise."""
        if sub.same_request(existing):
            return existing
        telemetry.SUBMIT_REJECTIONS.labels("IDEMPOTENCY_KEY_REUSED").inc()
        hint = "; pass your own idempotency_key to submit it as a new task" if sub.key_derived else ""
        raise errors.already_exists(
            reasons.IDEMPOTENCY_KEY_REUSED, f"this idempotency key belongs to a different request{hint}", task_id=str(existing.id)
        )

    async def _queue_position(self, task: TaskRow, context: Context) -> int:
        return await submissions.queue_position(self._pool, task, within=self._budget(context))

    async def _estimate(self, task: TaskRow, context: Context) -> eta.Estimate | None:
        """A QUEUED or PROCESSING task's position and ETA from the process's queue snapshot; None for other states."""
        return await self._queue.estimate(task, within=self._budget(context))

    async def RegenerateTask(
        self, request: gateway_pb2.RegenerateTaskRequest, context: Context
    ) -> gateway_pb2.RegenerateTaskResponse:
        """A new task from a finished one's request (fresh key; HIGH when the tenant may use it), through SubmitTask."""
        who = await self._principal(context)
        source = await self._load(who.tenant_id, ids.require(request.task_id), context)
        if not source.status.terminal:
            raise errors.failed_precondition(
                reasons.TASK_NOT_FINISHED, f"the task is {source.status.value}; only a finished task can be regenerated",
                status=source.status.value,
            )
        again = regenerate_request(
            source,
            seed=request.seed if request.HasField("seed") else None,
            priority=who.max_priority,
            idempotency_key=request.idempotency_key,
        )
        submitted = await self.SubmitTask(again, context)
        return gateway_pb2.RegenerateTaskResponse(task=submitted.task, created=submitted.created, source_task_id=str(source.id))

    # Reads

    async def _load(self, tenant: str | Caller, task_id: int, context: Context) -> TaskRow:
        """The caller's task; NOT_FOUND for a missing id and for another tenant's task alike (and, for a client
        token, for another end user's task or one it does not list)."""
        task = self._cache.get(task_id)
        if task is None:
            async with asyncio.timeout(self._budget(context)):  # no task per call, as wait_for would make
                task = await store.get_task(self._pool, task_id)
            if task is not None:
                self._cache.put(task)
        who = tenant if isinstance(tenant, Caller) else Caller(Principal(tenant, None, None))
        if task is None or not who.may_see(task.user_id, task.end_user, task.id):
            raise errors.not_found()
        return task

    async def _caller(self, context: Context, scope: str) -> Caller:
        """The tenant by its API key, or a client token with `scope`."""
        async with asyncio.timeout(self._budget(context)):
            return await self._auth.caller(context, scope)

    async def GetTask(self, request: gateway_pb2.GetTaskRequest, context: Context) -> gateway_pb2.GetTaskResponse:
        who = await self._caller(context, clienttokens.READ)
        task = await self._load(who, ids.require(request.task_id), context)
        estimate = await self._estimate(task, context)
        position = estimate.queue_position if estimate is not None else await self._queue_position(task, context)
        interval = Duration()
        interval.FromMilliseconds(int(poll_interval(task.created_at) * 1000))
        msg = task.to_proto(position)
        if estimate is not None:
            estimate.stamp(msg)
        add_link(self._results, msg.result)
        return gateway_pb2.GetTaskResponse(task=msg, suggested_poll_interval=interval)

    async def ListTasks(self, request: gateway_pb2.ListTasksRequest, context: Context) -> gateway_pb2.ListTasksResponse:
        who = await self._principal(context)
        bad: list[tuple[str, str]] = []
        size = request.page_size or self._settings.list_default_page_size
        if size < 0:
            bad.append(("page_size", "must not be negative"))
        size = min(max(size, 1), self._settings.list_max_page_size)
        statuses: set[Status] = set()
        for value in request.statuses:
            if value == task_pb2.TASK_STATUS_UNSPECIFIED or value not in task_pb2.TaskStatus.values():
                bad.append(("statuses", "each must be a known status"))
                break
            statuses.add(Status.from_proto(value))
        after = moment(request, "created_after", bad)
        before = moment(request, "created_before", bad)
        fingerprint = paging.filter_key(sorted(s.value for s in statuses), after, before)
        cursor = None
        if request.page_token:
            try:
                cursor = self._pages.decode(request.page_token, fingerprint)
            except paging.BadToken as exc:
                bad.append(("page_token", str(exc)))
        if bad:
            raise errors.invalid_argument(bad)
        rows = await submissions.list_tasks(
            self._pool,
            who.tenant_id,
            statuses=statuses,
            created_after=after,
            created_before=before,
            after=cursor,
            limit=size + 1,
            within=self._budget(context),
        )
        tasks = rows[:size]
        token = ""
        if len(rows) > size:
            last = tasks[-1]
            token = self._pages.encode(paging.Cursor(last.created_at, last.id), fingerprint)
        listed = [t.to_proto() for t in tasks]
        for msg in listed:  # a page of chat answers could pass the message limit: GetTask has each one's
            if msg.HasField("text"):
                msg.text.text, msg.text.truncated = "", msg.text.chars > 0
        return gateway_pb2.ListTasksResponse(tasks=listed, next_page_token=token)

    async def RotateWebhookSecret(
        self, request: gateway_pb2.TaskGatewayRotateWebhookSecretRequest, context: Context
    ) -> gateway_pb2.TaskGatewayRotateWebhookSecretResponse:
        """A new webhook secret for the caller's tenant; the current ones keep signing until the overlap ends."""
        who = await self._principal(context)
        overlap = request.overlap.ToTimedelta().total_seconds() if request.HasField("overlap") else DEFAULT_SECRET_OVERLAP
        most = self._settings.webhook_secret_max_overlap_seconds
        if not 0 <= overlap <= most:
            raise errors.invalid_argument([("overlap", f"must be between 0 and {most:g} seconds")])
        rotated = await asyncio.wait_for(
            auth.rotate_webhook_secret(self._pool, who.tenant_id, overlap, self._sealer), self._budget(context)
        )
        log.info("webhook secret rotated", extra={"tenant": who.tenant_id, "overlap_seconds": overlap, "by": "tenant"})
        return gateway_pb2.TaskGatewayRotateWebhookSecretResponse(
            webhook_secret=rotated.secret, previous_valid_until=timestamp(rotated.previous_valid_until),
            valid_secrets=rotated.valid_secrets,
        )

    # Cancel and results

    async def CancelTask(self, request: gateway_pb2.CancelTaskRequest, context: Context) -> gateway_pb2.CancelTaskResponse:
        who = await self._caller(context, clienttokens.CANCEL)
        task = await self._load(who, ids.require(request.task_id), context)
        if task.status is Status.CANCELED:
            return gateway_pb2.CancelTaskResponse(task=task.to_proto())
        if task.status.terminal:
            raise _already_finished(task)
        mode = store.CancelMode.HARD if request.hard else store.CancelMode.SOFT
        out = await asyncio.wait_for(
            store.cancel(self._pool, task.id, mode=mode, actor=ACTOR, reason=f"{mode.value} cancel by client"),
            self._budget(context),
        )
        current = out.task
        if current is None:
            raise errors.not_found()
        if not out.applied:
            if current.status is Status.CANCELED:
                return gateway_pb2.CancelTaskResponse(task=current.to_proto())
            raise _already_finished(current)
        if out.from_status is Status.PROCESSING:
            await cancel.send(
                self._bus, current.id, hard=request.hard, reason="canceled by client", trace_context=current.trace_context
            )
        await ended.send(self._bus, current)  # the task's watchers hear it now, not after the relay's pass
        self._cache.put(current)
        return gateway_pb2.CancelTaskResponse(task=current.to_proto())

    async def _hard_cancel(self, task_id: int) -> None:
        """Stops one task of a batch being cancelled (its worker told when it runs), as a hard CancelTask would."""
        out = await store.cancel(self._pool, task_id, mode=store.CancelMode.HARD, actor=ACTOR, reason="batch cancelled")
        if out.task is None:
            return
        if out.applied and out.from_status is Status.PROCESSING:
            await cancel.send(self._bus, out.task.id, hard=True, reason="batch cancelled", trace_context=out.task.trace_context)
        self._cache.put(out.task)

    async def _text_of(self, task: TaskRow) -> str | None:
        """A SUCCEEDED chat task's whole answer (its stored result), for a batch's output file; None for others."""
        if task.task_type != "chat":
            return None
        if task.result_text is not None and len(task.result_text) == (task.result_chars or 0):
            return task.result_text  # kept whole inline
        if task.result_uri is None:
            return task.result_text
        got = bytearray()
        try:
            async for data in self._results.read(task.result_uri):
                got += data
        except ResultNotFound:
            return None
        return got.decode(errors="replace")

    # Files and batches (services/submit/batches.py)

    async def UploadFile(
        self, request_iterator: AsyncIterator[batches_pb2.UploadFileRequest], context: Context
    ) -> batches_pb2.StoredFile:
        who = await self._principal(context)
        return await self.batches.upload(who.tenant_id, request_iterator)

    async def GetFile(self, request: batches_pb2.GetFileRequest, context: Context) -> batches_pb2.StoredFile:
        who = await self._principal(context)
        return file_proto(await self.batches.file(who.tenant_id, request.file_id))

    async def ListFiles(self, request: batches_pb2.ListFilesRequest, context: Context) -> batches_pb2.ListFilesResponse:
        who = await self._principal(context)
        return await self.batches.files(who.tenant_id, request)

    async def GetFileContent(
        self, request: batches_pb2.GetFileRequest, context: Context
    ) -> AsyncIterator[batches_pb2.FileChunk]:
        who = await self._principal(context)
        async for chunk in self.batches.content(who.tenant_id, request.file_id):
            yield chunk

    async def CreateBatch(self, request: batches_pb2.CreateBatchRequest, context: Context) -> batches_pb2.Batch:
        return await self.batches.create(await self._principal(context), request)

    async def GetBatch(self, request: batches_pb2.GetBatchRequest, context: Context) -> batches_pb2.Batch:
        return await self.batches.get(await self._principal(context), request.batch_id)

    async def ListBatches(self, request: batches_pb2.ListBatchesRequest, context: Context) -> batches_pb2.ListBatchesResponse:
        return await self.batches.listing(await self._principal(context), request)

    async def CancelBatch(self, request: batches_pb2.CancelBatchRequest, context: Context) -> batches_pb2.Batch:
        return await self.batches.cancel(await self._principal(context), request.batch_id)

    # Client tokens: what a backend gives a browser or an app for one end user's tasks

    async def _client_token_kid(self, tenant: str, context: Context) -> str:
        return await asyncio.wait_for(
            tenants.current_client_token_key(self._pool, tenant, secrets.token_hex(8)), self._budget(context)
        )

    async def CreateClientToken(
        self, request: gateway_pb2.CreateClientTokenRequest, context: Context
    ) -> gateway_pb2.CreateClientTokenResponse:
        """A token for one end user's tasks, signed with the tenant's current client-token key (API key only)."""
        who = await self._principal(context)
        bad: list[tuple[str, str]] = []
        if (why := end_user_problem(request.end_user)) is not None:
            bad.append(("end_user", why))
        scopes = set(request.scopes) or {clienttokens.READ, clienttokens.WATCH}
        if not scopes <= clienttokens.SCOPES:
            bad.append(("scopes", f"each must be one of {', '.join(sorted(clienttokens.SCOPES))}"))
        ttl = request.ttl.ToTimedelta().total_seconds() if request.HasField("ttl") else clienttokens.DEFAULT_TTL_SECONDS
        if not 0 < ttl <= clienttokens.MAX_TTL_SECONDS:
            bad.append(("ttl", f"must be above 0 and at most {clienttokens.MAX_TTL_SECONDS:g} seconds"))
        task_ids: list[int] = []
        for value in request.task_ids:
            try:
                task_ids.append(ids.require(value))
            except errors.ApiError:
                bad.append(("task_ids", "each must be a task id"))
                break
        if bad:
            raise errors.invalid_argument(bad)
        kid = await self._client_token_kid(who.tenant_id, context)
        key = clienttokens.signing_key(self._settings.api_key_pepper, who.tenant_id, kid)
        now = time.time()
        token = clienttokens.mint(
            key, kid, who.tenant_id, request.end_user, scopes=scopes, task_ids=task_ids or None, ttl_seconds=ttl, now=now
        )
        return gateway_pb2.CreateClientTokenResponse(
            token=token, expires_at=timestamp(datetime.fromtimestamp(int(now) + int(ttl), UTC))
        )

    async def GetClientTokenSecret(
        self, request: gateway_pb2.GetClientTokenSecretRequest, context: Context
    ) -> gateway_pb2.GetClientTokenSecretResponse:
        """The tenant's client-token secret (the SDK mints offline with it), a new one with `rotate`."""
        who = await self._principal(context)
        pepper = self._settings.api_key_pepper
        if not request.rotate:
            kid = await self._client_token_kid(who.tenant_id, context)
            return gateway_pb2.GetClientTokenSecretResponse(
                secret=clienttokens.shared_secret(pepper, who.tenant_id, kid), key_id=kid
            )
        overlap = request.overlap.ToTimedelta().total_seconds() if request.HasField("overlap") else 3600.0
        most = self._settings.client_token_max_overlap_seconds
        if not 0 <= overlap <= most:
            raise errors.invalid_argument([("overlap", f"must be between 0 and {most:g} seconds")])
        rotated = await asyncio.wait_for(
            tenants.rotate_client_token_key(self._pool, who.tenant_id, secrets.token_hex(8), overlap),
            self._budget(context),
        )
        if rotated is None:
            raise errors.unauthenticated("the key's tenant no longer exists")
        kid, previous_until = rotated
        log.info("client-token secret rotated", extra={"tenant": who.tenant_id, "overlap_seconds": overlap})
        return gateway_pb2.GetClientTokenSecretResponse(
            secret=clienttokens.shared_secret(pepper, who.tenant_id, kid), key_id=kid,
            previous_valid_until=timestamp(previous_until),
        )

    async def GetTaskResult(
        self, request: gateway_pb2.GetTaskResultRequest, context: Context
    ) -> AsyncIterator[gateway_pb2.ResultChunk]:
        who = await self._caller(context, clienttokens.READ)
        task = await self._load(who, ids.require(request.task_id), context)
        if request.preview_uri:
            async for chunk in self._preview(task, request.preview_uri):
                yield chunk
            return
        if task.status is not Status.SUCCEEDED or task.result_uri is None:
            raise errors.failed_precondition(
                reasons.TASK_NOT_SUCCEEDED, f"the task is {task.status.value}; only SUCCEEDED tasks have a result",
                status=task.status.value,
            )
        if task.result_expired_at is not None:
            raise errors.not_found("result")  # deleted by retention
        info = task_pb2.TaskResult(
            uri=task.result_uri,
            content_type=task.result_content_type or "",
            size_bytes=task.result_size or 0,
            sha256=task.result_sha256 or "",
        )
        offset = 0
        try:
            async for data in self._results.read(task.result_uri):
                chunk = gateway_pb2.ResultChunk(data=data, offset=offset)
                if offset == 0:
                    chunk.info.CopyFrom(info)
                yield chunk
                offset += len(data)
        except ResultNotFound:
            log.warning("result missing from the store", extra={"task_id": str(task.id)})
            raise errors.not_found("result") from None
        if offset == 0:
            yield gateway_pb2.ResultChunk(info=info, data=b"", offset=0)


    async def _preview(self, task: TaskRow, uri: str) -> AsyncIterator[gateway_pb2.ResultChunk]:
        """One of the task's preview images (services/worker/partial.py names them), in chunks."""
        if not output.is_preview_of(self._results, task.id, uri):
            raise errors.not_found("preview")
        info = task_pb2.TaskResult(uri=uri, content_type=output.preview_type(uri))
        try:
            data = b"".join([part async for part in self._results.read(uri)])
        except ResultNotFound:
            raise errors.not_found("preview") from None
        info.size_bytes = len(data)
        info.sha256 = hashlib.sha256(data).hexdigest()
        for offset in range(0, max(1, len(data)), _PREVIEW_CHUNK):
            chunk = gateway_pb2.ResultChunk(data=data[offset : offset + _PREVIEW_CHUNK], offset=offset)
            if offset == 0:
                chunk.info.CopyFrom(info)
            yield chunk


_PREVIEW_CHUNK = 256 * 1024


def _already_finished(task: TaskRow) -> errors.ApiError:
    return errors.failed_precondition(
        reasons.TASK_FINISHED, f"the task already finished as {task.status.value}", status=task.status.value
    )


@dataclass
class SubmitHandle:
    """A running submit service: its port, and how to stop it in stages."""

    port: int
    server: grpc.aio.Server
    health: Health
    gateway: Gateway
    backends: Backends
    owns_backends: bool
    settings: GatewaySettings
    listening: asyncio.Task[None]

    async def stop(self, grace: float | None = None) -> None:
        """Readiness off, stop accepting, let in-flight calls finish within `grace`, then close the backends."""
        try:
            await mark_not_serving(self.health)
            self.gateway.draining.set()  # SubmitStream streams answer what they read and end, so clients go elsewhere
            grace = self.settings.submit_shutdown_grace_seconds if grace is None else grace
            await self.server.stop(grace)
            await self.gateway.batches.close()  # an ingest stopped here is resumed by the next read of its batch
            await self.gateway.dispatcher.close(grace)  # what it could not dispatch stays CREATED for the scan
        finally:
            await stop_tasks([self.listening])
            await self.gateway.inputs.close()
            await self.gateway.ids.close()
            if self.owns_backends:
                await self.backends.close()


async def start(
    settings: GatewaySettings, backends: Backends | None = None, *, batch_signals: BatchSignals | None = None
) -> SubmitHandle:
    """Starts the gateway on settings.submit_port (0 = ephemeral), connecting its own backends unless given."""
    owns = backends is None
    if backends is None:
        backends = await connect(settings, "submit")
    gateway = Gateway(settings, backends, batch_signals)

    def register(server: grpc.aio.Server) -> Iterable[str]:
        gateway_pb2_grpc.add_TaskGatewayServicer_to_server(gateway, server)
        return [SERVICE_NAME]

    try:
        await gateway.ids.start()
        server, port, health_servicer = await start_server(
            settings, settings.submit_port, register, Probes(pool=backends.pool, bus=backends.bus))
    except BaseException:
        await gateway.ids.close()
        if owns:
            await backends.close()
        raise
    listening = asyncio.create_task(gateway.revocations.run(), name="submit-revocations")
    return SubmitHandle(port, server, health_servicer, gateway, backends, owns, settings, listening)


async def main(settings: GatewaySettings) -> None:
    """Runs the gateway until SIGTERM or SIGINT, then shuts down in stages."""
    await serve_until_signal(lambda: start(settings), grace_seconds=settings.submit_shutdown_grace_seconds)
