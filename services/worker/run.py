"""One claimed attempt running here: the model in its slot's thread, its progress to write, and a look at its row
(the attempt's own state is runstate.Run)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import hashlib
import logging
import time
from collections.abc import Callable

import asyncpg

from services.worker import chatrun, checkpoint, partial, resume, retry, settle, textgen, upstream
from services.worker import runner as runmod
from services.worker.devices import Devices
from services.worker.runstate import Run
from services.worker.settle import MessageAction
from services.worker.steps import StepInbox
from taskgate import bus as busmod
from taskgate import chat, output, results, store, telemetry, tracing
from taskgate.config import WorkerSettings
from taskgate.model import TaskRow
from taskgate.server import BACKEND_ERRORS

log = logging.getLogger("taskgate.worker")

ACTOR = "worker"


class Attempts:
    """Runs claimed attempts (the input image read, the device phase on a device, then the CPU phase), tells `stepped`
    of each step (sent live) and `progressed` when one has new progress to write, and stops one whose row says it
    should."""

    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        settings: WorkerSettings,
        runners: dict[tuple[str, str], runmod.ModelRunner | chatrun.ChatRunner | upstream.Upstream],
        devices: Devices,
        encoders: concurrent.futures.Executor,
        progressed: Callable[[], None],
        inputs: results.ResultStore,
        stepped: Callable[[Run], None] = lambda _run: None,
        bus: busmod.Bus | None = None,
        kept: Callable[[resume.Kept], None] = lambda _kept: None,
    ) -> None:
        self.bus = bus  # a chat task's text deltas go out on it
        self.pool = pool
        self.settings = settings
        self.inputs = inputs  # the result store, where image-to-video inputs live beside the outputs
        self.runners = runners
        self.devices = devices
        self.encoders = encoders
        self._progressed = progressed  # the heartbeat writes it, coalesced, batched with the other runs' (lease.py)
        self._stepped = stepped  # each step goes out live, coalesced to the newest (live.py)
        # the device threads' steps reach the loop coalesced, at most once per tick for all the slots
        self.steps: StepInbox[Run] = StepInbox(settings.live_progress_tick_seconds, self._on_step)
        self._kept = kept  # each checkpoint recorded (TestSignals.checkpointed)

    def checkpoints(self, run: Run) -> checkpoint.Policy | None:
        """The run's checkpoint policy, or None: its model's runs cannot resume, or its checkpoints are off."""
        task = run.task
        model_runner = next((r for (m, _), r in self.runners.items() if m == task.model_id), None)
        spec = self.settings.models.get(task.model_id)
        if (
            model_runner is None
            or spec is None
            or getattr(model_runner, "not_resumable", "no steps to resume") is not None
        ):
            return None
        policy = checkpoint.Policy(spec.checkpoint_every_seconds, spec.checkpoint_every_steps)
        return policy if policy.enabled else None

    async def perform(self, run: Run) -> runmod.RunOutput:
        """The run's output; raises RunAborted once it was stopped, RunError (classified) when it failed."""
        task = run.task
        loop = asyncio.get_running_loop()

        def on_step(step: int, total: int) -> None:
            run.reached = step
            self.steps.report(loop, run, step, total)

        # the threads run in a copy of this context: the phase spans they open are children of the attempt's
        policy = self.checkpoints(run)
        said: partial.Partial | None = None
        writer: asyncio.Task[None] | None = None
        try:
            forwarded = self.runners.get((task.model_id, runmod.UPSTREAM_DEVICE))
            if isinstance(forwarded, upstream.Upstream):
                output = await self._forward(run, forwarded)
                telemetry.RUN_TIME.labels(task.model_id).observe(time.monotonic() - run.started)
                return output
            chat_runners = [
                r for (m, _), r in self.runners.items() if m == task.model_id and isinstance(r, chatrun.ChatRunner)
            ]
            if chat_runners:
                output = await self._generate(run, min(chat_runners, key=lambda r: r.batcher.active))
                telemetry.RUN_TIME.labels(task.model_id).observe(time.monotonic() - run.started)
                return output
            # read before a device is taken: a slow store holds this slot only, never a device
            image = await self._input_image(run)
            snapshot = (
                await run.unless_stopped(resume.load(self.inputs, task, self.settings.lease_seconds))
                if policy is not None
                else None
            )
            if policy is not None:
                start_step = snapshot.step if snapshot is not None else 0
                log.info(
                    "run starts", extra={"task_id": str(task.id), "attempt": task.attempt, "from_step": start_step}
                )
                run.keeper = resume.Keeper(
                    pool=self.pool, store=self.inputs, task=task, policy=policy, device_seconds=run.device_seconds_now,
                    kept=self._kept, loop=loop, start_step=start_step,
                )
            said = self._partial(run, snapshot.step if snapshot is not None else 0)
            if said is not None:
                writer = asyncio.create_task(said.run(), name=f"partial-{task.id}")
                said.say(f"attempt {task.attempt} starts at step {snapshot.step if snapshot is not None else 0}"
                         + (" (from its checkpoint)" if snapshot is not None else ""))
            inp = runmod.RunInput(
                task.id,
                task.attempt,
                task.prompt,
                dict(task.request_payload),
                image,
                resume=snapshot,
                capture=run.keeper,
                previews=said,
            )
            devices = {d for m, d in self.runners if m == task.model_id}
            lane = self.devices.take(devices)
            if lane is None:  # all busy: wait in line, unless the run is stopped meanwhile
                waiting = time.monotonic()
                lane = await run.unless_stopped(self.devices.acquire(devices))
                if said is not None:
                    said.say(f"waited {time.monotonic() - waiting:.2f} s for a device")
            try:
                model_runner = self.runners[(task.model_id, lane.device)]
                assert not isinstance(model_runner, chatrun.ChatRunner | upstream.Upstream)
                if said is not None:
                    said.say(_loaded_line(model_runner, lane.device))
                held = run.held_since = time.monotonic()
                try:
                    rendered = await loop.run_in_executor(
                        lane.executor,
                        contextvars.copy_context().run,
                        model_runner.render,
                        inp,
                        on_step,
                        run.abort.is_set,
                    )
                finally:  # a failed or aborted device phase held the device too
                    run.device_seconds += time.monotonic() - held
                    run.held_since = None
                    self.steps.flush(run)  # its last steps are the run's before what it does next
            finally:
                self.devices.release(lane)
            if said is not None:
                said.say(_phases_line(rendered, time.monotonic() - held, said))
            encoding = time.monotonic()
            output = await loop.run_in_executor(
                self.encoders, contextvars.copy_context().run, model_runner.encode, rendered
            )
            if said is not None:
                said.say(
                    f"encoded {len(output.data)} bytes ({output.content_type}) in {time.monotonic() - encoding:.2f} s"
                )
        except runmod.RunAborted as exc:
            if said is not None:
                said.say(f"stopped: {exc}")
            await self._flush(run)  # a drained run's last snapshot is recorded before its task is released
            raise
        except Exception as exc:
            if said is not None:
                said.say(f"failed: {type(exc).__name__}: {exc}")
            await self._flush(run)
            if run.stopped_by is not None:
                raise runmod.RunAborted(str(exc)) from exc
            failure = retry.failure_of(exc, task=task, settings=self.settings)
            log.warning(
                "run failed",
                extra={
                    "task_id": str(task.id),
                    "attempt": task.attempt,
                    "error_code": failure.code,
                    "retryable": isinstance(failure, retry.RetryableError) or failure.dead_letter,
                },
                exc_info=not isinstance(exc, runmod.RunFailure),  # a failure the runner itself named needs no traceback
            )
            raise failure from exc
        finally:
            if run.keeper is not None:
                await run.keeper.close()
            if said is not None and writer is not None:
                said.close()
                await writer  # its lines are on the stream before the final write: a reader has them all by then
        telemetry.RUN_TIME.labels(task.model_id).observe(time.monotonic() - run.started)
        return output

    def _partial(self, run: Run, start_step: int) -> partial.Partial | None:
        """The run's previews and log lines (a diffusers model's only: its runs are long enough to be worth them)."""
        task = run.task
        spec = self.settings.models.get(task.model_id)
        model_runner = next((r for (m, _), r in self.runners.items() if m == task.model_id), None)
        pipeline = getattr(model_runner, "pipeline", None)
        if self.bus is None or spec is None or pipeline is None:
            return None
        return partial.Partial(
            bus=self.bus,
            pool=self.pool,
            store=self.inputs,
            user_id=task.user_id,
            task_id=task.id,
            attempt=task.attempt,
            spec=spec,
            layout=getattr(pipeline, "preview_layout", "BCFHW"),
            start_step=start_step,
        )

    async def _generate(self, run: Run, runner: chatrun.ChatRunner) -> runmod.RunOutput:
        """A chat task: its sequence joins the model's decoding loop (no device lane: the loop shares the device), its
        deltas go out coalesced; a stop ends its sequence before the loop's next step, the others going on. An attempt
        after an interrupted one (where resumes are on) continues from the text the output stream holds, made of the
        tokens its chunks name: the client's text goes on where it stopped, and each token is generated and metered
        once (only what was made after the last published chunk is made again, and metered as wasted)."""
        task = run.task
        payload = task.request_payload
        prompt = await asyncio.to_thread(runner.prompt_ids, chat.messages_of(payload))
        if len(prompt) > runner.spec.max_input_tokens:  # the gateway counted with the same tokenizer: a changed model
            raise ValueError(
                f"the input is {len(prompt)} tokens; model {task.model_id} takes {runner.spec.max_input_tokens}"
            )
        sampling = chatrun.sampling_of(payload, runner.spec)
        assert self.bus is not None, "a worker serving chat models publishes their output"

        def published(chars: int) -> None:
            run.kept_seconds = out.kept_seconds
            run.steps_done, run.total_steps = len(detok.tokens), sampling.max_new_tokens
            self._stepped(run)
            if run.progress_pending():
                self._progressed()

        def emit(delta: str) -> None:  # on the decoding loop's thread, within the token's turn
            out.add(delta, len(detok.tokens), seq.device_seconds)

        def detokenizer() -> chatrun.Detokenizer:
            return chatrun.Detokenizer(
                runner.tokenizer, [str(s) for s in payload.get("stop", [])], emit, runner.byte_ids
            )

        resuming = self.checkpoints(run) is not None
        earlier, detok = await self._earlier_text(run, detokenizer) if resuming else (None, detokenizer())
        resumed = earlier.tokens if earlier is not None else []
        out = chatrun.TextOut(
            self.bus,
            task.user_id,
            task.id,
            task.attempt,
            self.settings.output_coalesce_seconds,
            published,
            tokens=detok.tokens,
            offset=len(earlier.text) if earlier is not None else 0,
            token_offset=len(resumed),
        )
        publisher = asyncio.create_task(out.run(), name=f"output-{task.id}")
        seq = textgen.Sequence(prompt, sampling, detok.add, run.abort.is_set, resumed=resumed)
        try:
            if detok.stopped:  # the interrupted attempt had reached a stop string: its text is the answer
                finished = textgen.Finished("stop", resumed)
            else:
                done = runner.batcher.submit(seq)
                with tracing.span(
                    "generate",
                    attributes={"taskgate.input_tokens": len(prompt), "taskgate.resumed_tokens": len(resumed)},
                ):
                    finished = await run.unless_stopped(asyncio.wrap_future(done))
            text = detok.finish()
        finally:
            out.close()
            await publisher
            run.device_seconds += seq.device_seconds
        data = text.encode()
        inline = text[: self.settings.result_inline_chars]
        answer = store.TextOutcome(
            inline, len(text), "stop" if detok.stopped else finished.reason, len(prompt), len(finished.tokens)
        )
        return runmod.RunOutput(data, "text/plain; charset=utf-8", "txt", hashlib.sha256(data).hexdigest(), answer)

    async def _earlier_text(
        self, run: Run, detokenizer: Callable[[], chatrun.Detokenizer]
    ) -> tuple[output.Resumable | None, chatrun.Detokenizer]:
        """What an earlier attempt of the task published, and a detokenizer that has taken its tokens; None (the run
        starts from the first token) on a first attempt, when the stream cannot say which tokens made its text or
        they do not make it (another tokenizer), or the stream cannot be read."""
        task = run.task
        if task.attempt <= 1:
            return None, detokenizer()
        assert self.bus is not None
        try:
            earlier = await run.unless_stopped(
                asyncio.wait_for(output.resume_text(self.bus, task.user_id, task.id), self.settings.lease_seconds)
            )
        except runmod.RunAborted:
            raise
        except Exception as exc:  # NATS errors of every kind: a resume is an optimisation
            log.warning("output stream unreadable; the answer starts over", extra={
                "task_id": str(task.id), "error": f"{type(exc).__name__}: {exc}"})
            return None, detokenizer()
        if earlier is None:
            return None, detokenizer()
        detok = detokenizer()
        if not await asyncio.to_thread(detok.replay, earlier.tokens, earlier.text):
            log.warning(
                "published text is not what its tokens make; the answer starts over", extra={"task_id": str(task.id)}
            )
            return None, detokenizer()
        log.info(
            "resuming an answer",
            extra={
                "task_id": str(task.id),
                "attempt": task.attempt,
                "from_attempt": earlier.attempt,
                "tokens": len(earlier.tokens),
                "chars": len(earlier.text),
            },
        )
        return earlier, detok

    async def _forward(self, run: Run, server: upstream.Upstream) -> runmod.RunOutput:
        """A chat task on an upstream model: streamed from the OpenAI-compatible server, its deltas published as the
        in-process model's are (chatrun.TextOut); a stop cancels the request, which closes the stream upstream."""
        task = run.task
        payload = task.request_payload
        assert self.bus is not None, "a worker serving chat models publishes their output"
        deltas = 0
        limit = int(payload.get("max_output_tokens") or server.spec.default_max_output_tokens)

        def published(chars: int) -> None:
            run.steps_done, run.total_steps = min(deltas, limit), limit
            self._stepped(run)
            if run.progress_pending():
                self._progressed()

        out = chatrun.TextOut(
            self.bus, task.user_id, task.id, task.attempt, self.settings.output_coalesce_seconds, published
        )

        def relay(text: str) -> None:
            nonlocal deltas
            deltas += 1
            out.add(text)

        publisher = asyncio.create_task(out.run(), name=f"output-{task.id}")
        try:
            with tracing.span("upstream", attributes={"taskgate.upstream_model": server.upstream_model}):
                done = await run.unless_stopped(server.chat(chat.messages_of(payload), payload, relay))
        finally:
            out.close()
            await publisher
        # the server's own count when it sends one; else the gateway's count of the input at admission
        input_tokens = done.input_tokens if done.reported else int(payload.get(chat.INPUT_TOKENS) or 0)
        data = done.text.encode()
        inline = done.text[: self.settings.result_inline_chars]
        answer = store.TextOutcome(inline, len(done.text), done.finish_reason, input_tokens, done.output_tokens)
        return runmod.RunOutput(data, "text/plain; charset=utf-8", "txt", hashlib.sha256(data).hexdigest(), answer)

    @staticmethod
    async def _flush(run: Run) -> None:
        if run.keeper is not None:
            await run.keeper.flush()

    async def _input_image(self, run: Run) -> bytes | None:
        """The canonical PNG the task's params name under "image", read whole from the result store; None without one.
        Riding out a store outage of up to a lease, it then raises ResultStoreUnavailable (retryable); a missing
        object, or one whose bytes are not its sha256's, raises InputMissing (final); a stopped run stops reading."""
        task = run.task
        ref = task.request_payload.get("image")
        if ref is None:
            return None
        if not isinstance(ref, dict) or not isinstance(ref.get("uri"), str) or not isinstance(ref.get("sha256"), str):
            raise ValueError("the request's image reference has no uri and sha256")
        uri, sha256 = ref["uri"], ref["sha256"]

        async def read() -> bytes:
            return b"".join([chunk async for chunk in self.inputs.read(uri)])

        with tracing.span("input", attributes={"taskgate.input_sha256": sha256}):
            try:
                data = await run.unless_stopped(retry.persist(self.settings.lease_seconds, "input", task.id, read))
            except results.ResultNotFound as exc:
                raise runmod.InputMissing(f"input image {sha256} is no longer in the result store") from exc
            except BACKEND_ERRORS as exc:  # a NATS error is no OSError: made one, so it classifies as retryable
                raise results.ResultStoreUnavailable(f"input image {sha256}: {type(exc).__name__}: {exc}") from exc
        if hashlib.sha256(data).hexdigest() != sha256:
            raise runmod.InputMissing(f"the stored input image {sha256} holds other bytes ({len(data)})")
        return data

    async def check(self, run: Run, why: str, row: TaskRow | None = None) -> None:
        """Reads the row (unless given) after a refused write or a cancel signal; stops the run if it is not ours to
        finish."""
        if run.finishing or run.stopped_by is not None:
            return
        if row is None:
            row = await store.get_task(self.pool, run.task.id)
        step = settle.decide(row, attempt=run.attempt, run=settle.Running())
        if step.fate is None:
            run.soft_canceled = run.soft_canceled or step.action is MessageAction.KEEP_REUSABLE
            return
        if step.fate is settle.Fate.LOST:
            log.warning("lease lost", extra={"task_id": str(run.task.id), "attempt": run.attempt, "why": why})
        run.stop(step)

    def _on_step(self, run: Run, step: int, total: int) -> None:
        run.steps_done, run.total_steps = step, total
        self._stepped(run)
        if run.progress_pending():
            self._progressed()


def _loaded_line(model_runner: object, device: str) -> str:
    """The log line that says where the run's model sits and what loading it cost."""
    load = getattr(model_runner, "load_seconds", 0.0)
    warmup = getattr(getattr(model_runner, "pipeline", None), "warmup_seconds", None) or 0.0
    return f"model {getattr(model_runner, 'model_id', '?')} on {device}: loaded in {load:.2f} s, warm-up {warmup:.2f} s"


def _phases_line(rendered: runmod.Rendered, seconds: float, said: partial.Partial) -> str:
    """The log line of a device phase's seconds, phase by phase as the pipeline marked them."""
    phases: dict[str, float] = getattr(rendered.payload, "phases", None) or {}
    parts = [f"{name} {value:.2f} s" for name, value in phases.items()]
    line = f"device phase {seconds:.2f} s" + (f" ({', '.join(parts)})" if parts else "")
    return line + (f"; {said.previews} previews so far" if said.every.enabled else "")
