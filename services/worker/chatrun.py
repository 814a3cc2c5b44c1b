"""Chat tasks on an in-process causal LM (model kind "transformers"): the loaded model with its tokenizer and its
decoding loop (textgen.Batcher), the text a sequence's tokens make as they come (stop strings cut it), and the deltas
published to the task's output stream, coalesced, off the decoding loop's path.

The answer is the text the deltas make: what a reader concatenates is, by construction, the final text.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.worker.textgen import Batcher, Finished, Sampling, Sequence
from taskgate import bus as busmod
from taskgate import output
from taskgate.config import ModelSpec

log = logging.getLogger("taskgate.worker.chat")

_PUBLISH_TRIES = 3  # a chunk that fails this often stays pending and goes with the next one
_BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")  # a SentencePiece byte-fallback piece


def _dtype(name: str, device: str) -> Any:
    import torch

    if name != "auto":
        return getattr(torch, name)
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


class ChatRunner:
    """One causal LM loaded on one device, serving chat tasks: up to its entry's `max_sequences` at once."""

    not_resumable: str | None = None  # an interrupted answer resumes from its published text (run.Attempts._generate)

    def __init__(self, model_id: str, spec: ModelSpec, model: Any, tokenizer: Any, batcher: Batcher) -> None:
        self.model_id = model_id
        self.spec = spec
        self.model = model
        self.tokenizer = tokenizer
        self.batcher = batcher
        # byte-fallback pieces: a run of them decodes as a whole (invalid UTF-8 becomes U+FFFD per byte), so the
        # detokenizer never ends a window inside one
        vocab = tokenizer.get_vocab()
        self.byte_ids = frozenset(i for piece, i in vocab.items() if _BYTE_PIECE.match(piece))

    @classmethod
    def load(cls, model_id: str, spec: ModelSpec, device: str) -> ChatRunner:
        """Loads the model and tokenizer from the entry's folder (safetensors unless allow_pickle_weights) onto
        `device`, starts its decoding loop and warms it with one short sequence (blocking; call in a thread)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        if spec.path is None:
            raise ValueError(f"model {model_id!r} has no path")
        folder = str(Path(spec.path))
        tokenizer = AutoTokenizer.from_pretrained(folder)
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            folder, dtype=_dtype(spec.dtype, device), use_safetensors=not spec.allow_pickle_weights
        )
        model = loaded.to(device).eval()
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos_ids = {int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None}
        if tokenizer.eos_token_id is not None:
            eos_ids.add(int(tokenizer.eos_token_id))
        runner = cls(model_id, spec, model, tokenizer, Batcher(model, eos_ids, spec.max_sequences, model_id))
        began = time.perf_counter()
        ids = runner.prompt_ids([{"role": "user", "content": "warm up"}])
        runner.batcher.submit(Sequence(ids, Sampling(2), lambda _: True, lambda: False)).result(timeout=300)
        log.info(
            "model loaded",
            extra={"model": model_id, "device": device, "warmup_seconds": round(time.perf_counter() - began, 3)},
        )
        return runner

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation through the model's chat template, as token ids (blocking: a long input takes a while)."""
        encoded: Any = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(encoded["input_ids"])

    def close(self) -> None:
        """Stops the decoding loop (a sequence still in it ends Stopped)."""
        self.batcher.close()


class Detokenizer:
    """A sequence's text as its tokens arrive, handed out as deltas (`emit`), held back where it may still change: a
    trailing partial character (byte-fallback pieces), and the last characters that could begin a stop string.

    Incremental decoding as vLLM does it: the text of a window of recent tokens, compared with the same window
    without the newest ones, so decoding a token costs the window, never the whole text."""

    def __init__(
        self, tokenizer: Any, stop: list[str], emit: Callable[[str], None], byte_ids: frozenset[int] = frozenset()
    ) -> None:
        self.tokenizer = tokenizer
        self.byte_ids = byte_ids
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.emit = emit
        self.tokens: list[int] = []
        self.text = ""  # decoded so far (cut at a stop string once one appeared)
        self.sent = 0  # characters of `text` handed out
        self._prefix = 0  # the window: tokens[_prefix:_read] are decoded into text already
        self._read = 0
        self.stopped = False

    def _window(self, final: bool) -> str:
        """The new text the window's tokens add ('' while it ends in a partial character or a byte piece, unless
        final)."""
        if not final and self.tokens and self.tokens[-1] in self.byte_ids:
            return ""
        before = self.tokenizer.decode(self.tokens[self._prefix:self._read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.tokens[self._prefix:], skip_special_tokens=True)
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self.tokens)
        # U+0000 (a <0x00> byte piece) is the one character PostgreSQL cannot store: the answer carries U+FFFD instead
        return after[len(before):].replace("\x00", "\ufffd")

    def add(self, token: int) -> bool:
        """Takes one token; False once a stop string ended the text (the decoding loop's thread calls it)."""
        self.tokens.append(token)
        self.text += self._window(final=False)
        return self._release(final=False)

    def replay(self, tokens: list[int], sent: str) -> bool:
        """Takes the tokens an interrupted attempt made, handing out nothing, as if their text `sent` had been handed
        out by this detokenizer; False when they do not make exactly that text (then this detokenizer is of no further
        use)."""
        emit, self.emit = self.emit, lambda _delta: None
        try:
            for token in tokens:
                self.add(token)
        finally:
            self.emit = emit
        return self.sent == len(sent) and self.text[: self.sent] == sent

    def finish(self) -> str:
        """After the last token: the rest of the text out, and the whole answer."""
        if not self.stopped:
            self.text += self._window(final=True)
            self._release(final=True)
        return self.text

    def _release(self, *, final: bool) -> bool:
        for stop in self.stop:
            at = self.text.find(stop, max(0, self.sent - len(stop) + 1))
            if at >= 0:
                self.text = self.text[:at]
                self.stopped = True
        upto = len(self.text) if final or self.stopped else len(self.text) - self.hold
        if upto > self.sent:
            self.emit(self.text[self.sent:upto])
            self.sent = upto
        return not self.stopped


class TextOut:
    """Publishes a running task's text deltas to its output stream: the first at once, later ones gathered for
    `coalesce` seconds into one chunk, one publish at a time (so in order), each chunk saying where it starts in the
    attempt's text. `add` may be called from any thread; a publish that keeps failing keeps its text pending for the
    next chunk (a gap is never made).

    Given the attempt's token list (`tokens`, appended to by the decoding loop), each chunk carries the ids of the
    tokens that made its text, so a later attempt resumes from exactly what was published; a resumed attempt starts at
    the `offset` and `token_offset` it resumed from."""

    def __init__(self, bus: busmod.Bus, user_id: str, task_id: int, attempt: int, coalesce: float,
                 on_publish: Callable[[int], None] | None = None, tokens: list[int] | None = None,
                 offset: int = 0, token_offset: int = 0) -> None:
        self.bus = bus
        self.user_id = user_id
        self.task_id = task_id
        self.attempt = attempt
        self.coalesce = coalesce
        self.on_publish = on_publish  # told the characters published so far (progress)
        self.tokens = tokens
        self.offset = offset  # characters published
        self.token_offset = token_offset  # tokens whose text is published
        self.kept_seconds = 0.0  # the sequence's device seconds when the newest published text was made
        self.chunks = 0
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self._upto = token_offset  # tokens that made the pending text
        self._seconds = 0.0
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._closed = False

    def add(self, delta: str, upto: int = 0, seconds: float = 0.0) -> None:
        """Queues a delta; `upto`: the attempt's tokens that made the text so far, `seconds`: its device seconds
        then."""
        with self._lock:
            self._pending.append(delta)
            self._upto, self._seconds = max(self._upto, upto), seconds
        self._loop.call_soon_threadsafe(self._wake.set)

    def close(self) -> None:
        """No more text: the loop publishes what is pending and ends."""
        self._closed = True
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._closed and self.coalesce > 0 and self.chunks:
                # gather what arrives meanwhile into the same chunk; the first goes at once (the time to first token)
                await asyncio.sleep(self.coalesce)
            await self._flush()
            if self._closed:
                await self._flush()
                return

    async def _flush(self) -> None:
        with self._lock:
            text = "".join(self._pending)
            self._pending.clear()
            upto, seconds = self._upto, self._seconds
        if not text:
            return
        made = None if self.tokens is None else tuple(self.tokens[self.token_offset:upto])
        chunk = output.Chunk(self.task_id, self.attempt, output.TEXT, text=text, offset=self.offset, tokens=made,
                             token_offset=self.token_offset)
        for tries in range(1, _PUBLISH_TRIES + 1):
            try:
                await output.publish(self.bus, self.user_id, chunk)
                break
            except Exception as exc:  # NATS errors of every kind: the final result stays the truth
                if tries == _PUBLISH_TRIES:
                    log.warning("output chunk not published; kept for the next", extra={
                        "task_id": str(self.task_id), "error": f"{type(exc).__name__}: {exc}"})
                    with self._lock:
                        self._pending.insert(0, text)
                    return
        self.offset += len(text)
        self.token_offset = max(self.token_offset, upto)
        self.kept_seconds = seconds
        self.chunks += 1
        if self.on_publish is not None:
            self.on_publish(self.offset)


def sampling_of(payload: dict[str, Any], spec: ModelSpec) -> Sampling:
    """A chat task's stored generation parameters as the decoding loop takes them."""
    return Sampling(
        max_new_tokens=int(payload.get("max_output_tokens") or spec.default_max_output_tokens),
        temperature=float(payload.get("temperature", spec.default_temperature)),
        top_p=float(payload.get("top_p", spec.default_top_p)),
        seed=int(payload.get("seed") or 0),
    )


def start(runner: ChatRunner, prompt: list[int], sampling: Sampling, detok: Detokenizer,
          should_stop: Callable[[], bool]) -> tuple[Sequence, concurrent.futures.Future[Finished]]:
    """Puts a sequence into the runner's decoding loop; its tokens go through `detok` (the bench's direct calls)."""
    seq = Sequence(prompt, sampling, detok.add, should_stop)
    return seq, runner.batcher.submit(seq)
