"""The TaskGateway calls that submit: SubmitTask, SubmitTasks and SubmitStream (one path, `_submit`), UploadInput,
RegenerateTask; a submission's rate slots, checks, stored images, admission and answer (`_resolve`)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator
from typing import Any, cast

import asyncpg
import nats.errors

from taskgate import chat, errors, ids, telemetry, tracing
from taskgate.auth import Principal
from taskgate.model import TaskRow
from taskgate.store import submissions
from taskgate.store.submissions import Admission, AdmitVerdict, Candidate, NewTask
from taskgate_api import reasons
from taskgate_api.v1 import gateway_pb2

from . import pipeline
from .batching import MAX_BATCH, deadline_exceeded
from .core import Context, GatewayCore
from .ratelimit import TENANT, quota_exceeded, rate_limited, too_many_pending
from .validation import Submission, check_priority, end_user_problem, key_problem, regenerate_request, validate

log = logging.getLogger("taskgate.submit")

# A result store or database that failed to keep an input image: the caller may retry.
_STORE_ERRORS = (OSError, TimeoutError, asyncpg.PostgresError, nats.errors.Error)


def _prompt_fingerprint(prompt: str) -> dict[str, object]:
    """What a log line may say about a prompt: its length and a hash prefix, never the text."""
    return {"prompt_chars": len(prompt), "prompt_sha256": hashlib.sha256(prompt.encode()).hexdigest()[:12]}


class SubmitCalls(GatewayCore):
    """The TaskGateway calls that submit tasks or their inputs (a mixin of Gateway)."""

    # SubmitTask and SubmitTasks: one path, SubmitTask is SubmitTasks of one

    async def SubmitTask(
        self, request: gateway_pb2.SubmitTaskRequest, context: Context
    ) -> gateway_pb2.SubmitTaskResponse:
        [answer] = await self._submit(await self._principal(context), [request], context)
        if isinstance(answer, errors.ApiError):
            raise answer
        return answer

    async def SubmitTasks(
        self, request: gateway_pb2.SubmitTasksRequest, context: Context
    ) -> gateway_pb2.SubmitTasksResponse:
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
            # as a unary call's own deadline would end it: nothing looked up, nothing admitted
            raise deadline_exceeded()
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
        to_check = [
            i
            for i, r in enumerate(items)
            if i in slotted or i in replays or not (r.callback_url or r.HasField("image"))
        ]
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
                answers[i] = gateway_pb2.SubmitTaskResponse(
                    task=task.to_proto(await self._queue_position(task, context))
                )
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

    def _resolve(
        self, candidate: Candidate, sub: Submission, admission: Admission | BaseException
    ) -> tuple[TaskRow, bool]:
        """The tenant's task for this submission and whether it is new, or the error its admission calls for."""
        if isinstance(admission, BaseException):
            raise admission
        verdict = admission.verdict
        if verdict is AdmitVerdict.RATE_LIMITED:
            assert candidate.per_minute is not None and admission.retry_after is not None
            raise rate_limited(
                admission.rate_limit or candidate.per_minute, admission.retry_after, admission.scope or TENANT
            )
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
            reasons.IDEMPOTENCY_KEY_REUSED,
            f"this idempotency key belongs to a different request{hint}",
            task_id=str(existing.id),
        )

    async def RegenerateTask(
        self, request: gateway_pb2.RegenerateTaskRequest, context: Context
    ) -> gateway_pb2.RegenerateTaskResponse:
        """A new task from a finished one's request (fresh key; HIGH when the tenant may use it), through SubmitTask."""
        who = await self._principal(context)
        source = await self._load(who.tenant_id, ids.require(request.task_id), context)
        if not source.status.terminal:
            raise errors.failed_precondition(
                reasons.TASK_NOT_FINISHED,
                f"the task is {source.status.value}; only a finished task can be regenerated",
                status=source.status.value,
            )
        again = regenerate_request(
            source,
            seed=request.seed if request.HasField("seed") else None,
            priority=who.max_priority,
            idempotency_key=request.idempotency_key,
        )
        submitted = await self.SubmitTask(again, context)
        return gateway_pb2.RegenerateTaskResponse(
            task=submitted.task, created=submitted.created, source_task_id=str(source.id)
        )
