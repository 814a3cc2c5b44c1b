"""Continuous batching for an in-process causal LM: several sequences share one loaded model on one device.

One thread per loaded model runs the loop: admit waiting sequences (each prefilled alone, its KV cache then joined to
the batch's), one decoding step over every active sequence (one forward of the whole batch), then each sequence's
next token sampled with its own generator, so a sequence's text depends on its seed and never on its neighbours. The
generator is seeded afresh for every token from (seed, the token's index), so a sequence's sampling state is nothing
but its length: a sequence resumed from the tokens an interrupted attempt made (`Sequence.resumed`, prefilled with
the prompt) draws the very numbers the uninterrupted one would have. A
sequence that finishes (end of text, its token limit, its consumer's say) or is stopped (checked before every step)
leaves between two steps; the others go on.

The batch's cache is left-padded to its longest sequence: each row has its own attention mask and positions (a
sequence's position ids are its own length), so padding changes nothing a sequence computes. When a sequence leaves,
its row is dropped and columns that only held padding are trimmed.

Why not transformers' own continuous batching (`model.init_continuous_batching()`): it gave the same tokens, but on
CPU it took 41 s for 3 x 40 tokens of the tiny model (paged cache and its loop), and it samples with one shared random
state (a seed per request is not possible).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger("taskgate.worker.textgen")

OnToken = Callable[[int], bool]  # called on the loop's thread with each new token; False: the sequence is done


class Stopped(Exception):
    """The sequence was stopped from outside (cancel, drain, a lost lease) before it finished."""


@dataclass(frozen=True, slots=True)
class Sampling:
    """How one sequence picks its tokens: greedy at temperature 0, else seeded nucleus sampling."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Finished:
    """Why a sequence ended ("stop": end of text or its consumer said so; "length": max_new_tokens) and its tokens."""

    reason: str
    tokens: list[int]


@dataclass(eq=False)
class Sequence:
    """One sequence to generate: its prompt, its sampling, and how the loop talks to its owner."""

    prompt: list[int]
    sampling: Sampling
    on_token: OnToken
    should_stop: Callable[[], bool]
    resumed: list[int] = field(default_factory=list)  # tokens an earlier attempt generated: prefilled, not handed over
    done: concurrent.futures.Future[Finished] = field(default_factory=concurrent.futures.Future)
    tokens: list[int] = field(default_factory=list)
    length: int = 0  # tokens in its cache (its next position)
    generator: torch.Generator | None = None
    device_seconds: float = 0.0  # its prefill, and its share of each step it was in (the step's time / its sequences)


class Batcher:
    """The decoding loop of one loaded model: at most `max_sequences` sequences at once, the rest wait in order."""

    def __init__(self, model: Any, eos_ids: set[int], max_sequences: int, name: str) -> None:
        self.model = model
        self.eos_ids = eos_ids
        self.max_sequences = max_sequences
        self.device = next(model.parameters()).device
        self.steps = 0  # decoding steps taken (tests and the bench read it)
        self._waiting: deque[Sequence] = deque()
        self._active: list[Sequence] = []
        self._cache: Any = None  # the batch's DynamicCache, rows in _active's order
        self._mask: torch.Tensor | None = None  # [rows, columns]: 1 where a row's cache holds a token, 0 for padding
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"textgen-{name}", daemon=True)
        self._thread.start()

    def submit(self, seq: Sequence) -> concurrent.futures.Future[Finished]:
        """Queues a sequence; its future ends with Finished, Stopped, or the error that failed it."""
        if not seq.prompt:
            raise ValueError("a sequence needs at least one prompt token")
        with self._wake:
            if self._closed:
                raise RuntimeError("the model's decoding loop is closed")
            self._waiting.append(seq)
            self._wake.notify()
        return seq.done

    @property
    def active(self) -> int:
        """Sequences decoding now."""
        return len(self._active)

    def close(self) -> None:
        """Stops the loop; sequences still in it end with Stopped."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=30)

    # ---- the loop (its own thread) ----

    def _loop(self) -> None:
        _name_os_thread(self._thread.name)
        with torch.inference_mode():
            while True:
                with self._wake:
                    while not self._closed and not self._waiting and not self._active:
                        self._wake.wait()
                    if self._closed:
                        break
                    joining: list[Sequence] = []
                    while self._waiting and len(self._active) + len(joining) < self.max_sequences:
                        joining.append(self._waiting.popleft())
                try:
                    for seq in joining:
                        self._join(seq)
                    self._leave_stopped()
                    if self._active:
                        self._step()
                except Exception as exc:  # a failed forward fails every sequence in it; the loop goes on
                    log.exception("decoding step failed")
                    for seq in [*self._active, *joining]:
                        _end(seq, exc)
                    self._active, self._cache, self._mask = [], None, None
        for seq in [*self._active, *self._waiting]:
            _end(seq, Stopped("the decoding loop closed"))

    def _join(self, seq: Sequence) -> None:
        """Prefills a sequence alone, samples its first token, and adds its cache to the batch's."""
        if seq.should_stop() or seq.done.done():
            _end(seq, Stopped("stopped before it began"))
            return
        from transformers import DynamicCache

        seq.tokens = list(seq.resumed)
        if len(seq.tokens) >= seq.sampling.max_new_tokens:  # interrupted after its last token: nothing left to make
            _end(seq, Finished("length", list(seq.tokens)))
            return
        began = time.perf_counter()
        seq.generator = torch.Generator(device="cpu")
        cache = DynamicCache()
        ids = torch.tensor([seq.prompt + seq.tokens], device=self.device)
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
        seq.length = ids.shape[1]
        seq.device_seconds += time.perf_counter() - began
        if not self._take(seq, out.logits[0, -1]):
            return
        if self._cache is None:
            self._active, self._cache = [seq], cache
            self._mask = torch.ones((1, seq.length), dtype=torch.long, device=self.device)
            return
        assert self._mask is not None
        width, new = self._mask.shape[1], seq.length
        if new > width:  # the batch is padded on the left to the newcomer's length
            self._pad_batch(new - width)
            width = new
        for mine, theirs in zip(self._layers(self._cache), self._layers(cache), strict=True):
            for name in ("keys", "values"):
                grown = _left_pad(getattr(theirs, name), width - new)
                setattr(mine, name, torch.cat([getattr(mine, name), grown], dim=0))
        row = torch.cat([torch.zeros(width - new, dtype=torch.long), torch.ones(new, dtype=torch.long)]).to(self.device)
        self._mask = torch.cat([self._mask, row[None, :]], dim=0)
        self._active.append(seq)

    def _pad_batch(self, columns: int) -> None:
        assert self._mask is not None
        for layer in self._layers(self._cache):
            layer.keys = _left_pad(layer.keys, columns)
            layer.values = _left_pad(layer.values, columns)
        zeros = torch.zeros((self._mask.shape[0], columns), dtype=torch.long, device=self.device)
        self._mask = torch.cat([zeros, self._mask], dim=1)

    def _leave_stopped(self) -> None:
        stopped = [s for s in self._active if s.should_stop() or s.done.done()]
        for seq in stopped:
            _end(seq, Stopped("stopped"))
        self._leave({id(s) for s in stopped})

    def _leave(self, gone: set[int]) -> None:
        """Drops the rows of sequences that ended, then the columns only padding holds."""
        if not gone:
            return
        keep = [i for i, s in enumerate(self._active) if id(s) not in gone]
        self._active = [self._active[i] for i in keep]
        if not keep:
            self._cache, self._mask = None, None
            return
        assert self._mask is not None
        rows = torch.tensor(keep, device=self.device)
        mask = self._mask.index_select(0, rows)
        trim = int((mask.sum(dim=0) == 0).to(torch.long).cumprod(dim=0).sum().item())  # leading all-padding columns
        self._mask = mask[:, trim:]
        for layer in self._layers(self._cache):
            layer.keys = layer.keys.index_select(0, rows)[:, :, trim:, :]
            layer.values = layer.values.index_select(0, rows)[:, :, trim:, :]

    def _step(self) -> None:
        """One decoding step over every active sequence: each one's last token in, each one's next token out."""
        assert self._mask is not None
        began = time.perf_counter()
        seqs = self._active
        ids = torch.tensor([[s.tokens[-1]] for s in seqs], device=self.device)
        positions = torch.tensor([[s.length] for s in seqs], device=self.device)
        mask = torch.cat([self._mask, torch.ones((len(seqs), 1), dtype=torch.long, device=self.device)], dim=1)
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=self._cache, use_cache=True
        )
        self._mask = mask
        self.steps += 1
        share = (time.perf_counter() - began) / len(seqs)
        finished = set()
        for row, seq in enumerate(seqs):
            seq.length += 1
            seq.device_seconds += share
            if not self._take(seq, out.logits[row, -1]):
                finished.add(id(seq))
        self._leave(finished)

    def _take(self, seq: Sequence, logits: torch.Tensor) -> bool:
        """Samples the sequence's next token and hands it over; False (the future set) when the sequence ended."""
        if seq.generator is not None and seq.sampling.temperature > 0:
            seq.generator.manual_seed(token_seed(seq.sampling.seed, len(seq.tokens)))
        token = _sample(logits, seq.sampling, seq.generator)
        if token in self.eos_ids:
            _end(seq, Finished("stop", list(seq.tokens)))
            return False
        seq.tokens.append(token)
        try:
            wanted = seq.on_token(token)
        except Exception as exc:  # the consumer's failure is this sequence's alone
            _end(seq, exc)
            return False
        if not wanted:
            _end(seq, Finished("stop", list(seq.tokens)))
            return False
        if len(seq.tokens) >= seq.sampling.max_new_tokens:
            _end(seq, Finished("length", list(seq.tokens)))
            return False
        return True

    @staticmethod
    def _layers(cache: Any) -> list[Any]:
        return list(cache.layers)


def _name_os_thread(name: str) -> None:
    """Gives the calling thread its name at the OS level (Linux keeps 15 bytes): `top -H`, py-spy and
    /proc/<pid>/task/*/comm show the decoding loop, and the intra-op threads torch starts from it inherit the name, so
    the model's own CPU can be told apart from the worker's (make bench's llm phase does)."""
    if sys.platform != "linux":
        return
    with contextlib.suppress(OSError, AttributeError):  # no libc symbol: the name is a nicety
        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME


def _end(seq: Sequence, result: Finished | BaseException) -> None:
    """Ends a sequence's future, unless its owner already gave up on it (a cancelled future)."""
    if seq.done.done():
        return
    if isinstance(result, BaseException):
        seq.done.set_exception(result)
    else:
        seq.done.set_result(result)


def token_seed(seed: int, index: int) -> int:
    """The generator's seed for a sequence's token number `index` (splitmix64 of the two): restorable from the count
    of tokens alone, and unrelated between neighbouring seeds and indices."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def _left_pad(t: torch.Tensor, columns: int) -> torch.Tensor:
    """A [batch, heads, length, dim] cache tensor with `columns` zero positions in front."""
    if columns <= 0:
        return t
    pad = torch.zeros((t.shape[0], t.shape[1], columns, t.shape[3]), dtype=t.dtype, device=t.device)
    return torch.cat([pad, t], dim=2)


def _sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """Greedy at temperature 0; otherwise temperature, nucleus (top_p) and a draw from the sequence's own generator."""
    logits = logits.float()
    if sampling.temperature <= 0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits / sampling.temperature, dim=-1).cpu()
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(probs, descending=True)
        before = torch.cumsum(ordered, dim=-1) - ordered  # mass above each token: keep while under top_p
        ordered[before >= sampling.top_p] = 0.0
        probs = torch.zeros_like(probs).scatter(0, order, ordered)
    return int(torch.multinomial(probs, 1, generator=generator).item())
