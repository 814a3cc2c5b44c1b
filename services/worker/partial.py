"""A running video's partial output besides its progress: preview images and the worker's log lines about it, on the
task's output stream (taskgate/output.py) next to a chat task's text.

A preview is made from the latents at a step end, on the device thread, by a linear latent-to-RGB projection of a few
frames (a matrix product of a few kilobytes, no VAE pass), copied to the host as uint8; resizing, tiling and encoding
the image, storing it in the result store (`previews/<task>-a<attempt>-s<step>.<ext>`) and publishing its chunk happen
on the event loop and a helper thread, one at a time, the newest waiting preview only (a slow store never holds the
device, and never builds a queue). Log lines (the model's load and warm-up, the run's start step, the wait for a
device, each phase's seconds) are published in order by the same writer. Both are best effort: a publish that fails
is logged here and dropped; the task's state and result stay the truth.
"""

from __future__ import annotations

import asyncio
import io
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import asyncpg

from taskgate import bus as busmod
from taskgate import output, results
from taskgate.config import ModelSpec
from taskgate.store import workers

log = logging.getLogger("taskgate.worker.partial")

# How each family's pipeline hands its latents to callback_on_step_end (batch first): Wan and HunyuanVideo
# (channels, frames, height, width), CogVideoX (frames, channels, ...), LTX-Video packed into tokens (frames x height x
# width tokens of `channels`, patch size 1).
LAYOUTS = {
    "CogVideoXPipeline": "BFCHW",
    "CogVideoXImageToVideoPipeline": "BFCHW",
    "LTXPipeline": "packed",
    "LTXImageToVideoPipeline": "packed",
}


def layout_of(pipeline: str) -> str:
    """The latents' layout of a pipeline class (BCFHW unless LAYOUTS says otherwise)."""
    return LAYOUTS.get(pipeline, "BCFHW")


@dataclass(frozen=True, slots=True)
class Projection:
    """A model's latent-to-RGB projection: `factors` (channels x 3) and `bias`, or None for the generic one."""

    layout: str
    frames: int
    factors: tuple[tuple[float, ...], ...] | None = None
    bias: tuple[float, float, float] = (0.0, 0.0, 0.0)


def project(latents: Any, projection: Projection, grid: tuple[int, int, int]) -> Any:
    """The first video's latents as `projection.frames` evenly spaced RGB frames (F x h x w x 3 uint8 numpy, latent
    resolution), computed on the latents' device; None when their shape is not what the layout says. `grid` is the
    latent (frames, height, width), which packed latents need."""
    import torch

    x = latents.detach()[0]
    if projection.layout == "packed":
        f, h, w = grid
        if x.ndim != 2 or x.shape[0] != f * h * w:
            return None
        x = x.reshape(f, h, w, x.shape[1]).permute(3, 0, 1, 2)
    elif projection.layout == "BFCHW":
        x = x.permute(1, 0, 2, 3) if x.ndim == 4 else x
    if x.ndim == 3:  # one image: a single frame
        x = x.unsqueeze(1)
    if x.ndim != 4:
        return None
    channels, count = x.shape[0], x.shape[1]
    picks = sorted(
        {round(i * (count - 1) / max(1, projection.frames - 1)) for i in range(min(projection.frames, count))}
    )
    x = x[:, picks].float()
    if projection.factors is not None and len(projection.factors) == channels:
        matrix = torch.tensor(projection.factors, dtype=torch.float32, device=x.device)
        bias = torch.tensor(projection.bias, dtype=torch.float32, device=x.device).view(1, 3, 1, 1)
        rgb = (torch.einsum("cfhw,cr->frhw", x, matrix) + bias).clamp(-1.0, 1.0).add(1.0).mul(127.5)
    else:
        groups = torch.tensor_split(x, 3, dim=0) if channels >= 3 else (x, x, x)
        rgb = torch.stack([g.mean(dim=0) for g in groups], dim=1)  # F x 3 x h x w
        low = rgb.amin(dim=(1, 2, 3), keepdim=True)
        high = rgb.amax(dim=(1, 2, 3), keepdim=True)
        rgb = (rgb - low).div((high - low).clamp_min(1e-6)).mul(255.0)
    return rgb.round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def frame_size(width: int, height: int, size: int) -> tuple[int, int]:
    """One preview frame's (width, height): the longer side `size`, the aspect of width x height kept."""
    if width >= height:
        return size, max(1, round(size * height / width))
    return max(1, round(size * width / height)), size


def encode_image(frames: Any, size: int, fmt: str, aspect: tuple[int, int]) -> tuple[bytes, int, int]:
    """Projected frames as one image (side by side, each of frame_size), encoded; (data, width, height). Blocking."""
    from PIL import Image

    fw, fh = frame_size(aspect[0], aspect[1], size)
    sheet = Image.new("RGB", (fw * len(frames), fh))
    for i, frame in enumerate(frames):
        sheet.paste(Image.fromarray(frame, "RGB").resize((fw, fh), Image.Resampling.BILINEAR), (i * fw, 0))
    buffer = io.BytesIO()
    if fmt == "webp":
        sheet.save(buffer, format="WEBP", quality=80, method=0)  # method 0: the fastest encoder
    else:
        sheet.save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue(), sheet.width, sheet.height


class Every:
    """When a run's next preview is due: every `fraction` of its steps, or every `seconds` of its denoising (counted
    from its first step's end: a wait for a device or the prompt's encoding is no denoising)."""

    def __init__(
        self, fraction: float, seconds: float, start_step: int = 0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.fraction = fraction
        self.seconds = seconds
        self._clock = clock
        self._last_step = start_step
        self._since: float | None = None

    @property
    def enabled(self) -> bool:
        return self.fraction > 0 or self.seconds > 0

    def due(self, step: int, total: int) -> bool:
        if self._since is None:
            self._since = self._clock()
        if step >= total or step <= self._last_step:
            return False  # the last step's picture is the video itself
        by_steps = self.fraction > 0 and step - self._last_step >= max(1, math.floor(total * self.fraction))
        by_time = self.seconds > 0 and self._clock() - self._since >= self.seconds
        return by_steps or by_time

    def taken(self, step: int) -> None:
        self._last_step = step
        self._since = self._clock()


@dataclass(frozen=True, slots=True)
class Published:
    """A preview stored and on the task's stream (tests, logs)."""

    step: int
    uri: str
    width: int
    height: int
    size: int


class Partial:
    """One run's previews and log lines, published to its task's output stream by one writer, in order.

    The device thread calls `due` and `take` at step ends (cheap; `take` projects and hands the frames over); any
    thread calls `say`. `run` is the writer (a task on the event loop); `close` ends it once what is waiting is out.
    """

    def __init__(
        self,
        *,
        bus: busmod.Bus,
        pool: asyncpg.Pool,
        store: results.ResultStore,
        user_id: str,
        task_id: int,
        attempt: int,
        spec: ModelSpec,
        layout: str,
        start_step: int = 0,
        published: Callable[[Published], None] = lambda _p: None,
    ) -> None:
        self.bus = bus
        self.pool = pool
        self.store = store
        self.user_id = user_id
        self.task_id = task_id
        self.attempt = attempt
        self.spec = spec
        self.every = Every(spec.preview_every_fraction, spec.preview_every_seconds, start_step)
        factors = tuple(tuple(row) for row in spec.preview_rgb_factors) if spec.preview_rgb_factors else None
        bias = spec.preview_rgb_bias or [0.0, 0.0, 0.0]
        self.projection = Projection(layout, spec.preview_frames, factors, (bias[0], bias[1], bias[2]))
        self.previews = 0  # published
        self.lines = 0  # log lines handed out (a line's number is its position: its message id)
        self._published = published
        self._loop = asyncio.get_running_loop()
        self._lock = threading.Lock()
        self._lines: list[tuple[int, str]] = []
        self._frames: tuple[int, Any, tuple[int, int]] | None = None  # the newest preview waiting
        self._wake = asyncio.Event()
        self._closed = False

    # ---- the device thread's side ----

    def due(self, step: int, total: int) -> bool:
        return self.every.enabled and self.every.due(step, total)

    def take(self, step: int, latents: Any, grid: tuple[int, int, int], aspect: tuple[int, int]) -> None:
        """Projects the latents after `step` (on their device) and hands the frames to the writer."""
        self.every.taken(step)
        try:
            frames = project(latents, self.projection, grid)
        except Exception:  # a preview is never worth a run
            log.warning("preview not made", extra={"task_id": str(self.task_id), "step": step}, exc_info=True)
            return
        if frames is not None:
            self._loop.call_soon_threadsafe(self._offer, (step, frames, aspect))

    # ---- any thread ----

    def say(self, text: str) -> None:
        """One log line about the run (published in order)."""
        with self._lock:
            self.lines += 1
            self._lines.append((self.lines, text))
        self._loop.call_soon_threadsafe(self._wake.set)

    # ---- the loop's side ----

    def _offer(self, frames: tuple[int, Any, tuple[int, int]]) -> None:
        self._frames = frames  # an older one still waiting is dropped: only the newest picture matters
        self._wake.set()

    def close(self) -> None:
        """No more: the writer publishes the log lines waiting and ends (a waiting preview is dropped)."""
        self._closed = True
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._write_lines()
            if self._closed:
                return
            frames, self._frames = self._frames, None
            if frames is not None:
                await self._write_preview(*frames)

    async def _write_lines(self) -> None:
        with self._lock:
            lines, self._lines = self._lines, []
        for number, text in lines:
            chunk = output.Chunk(self.task_id, self.attempt, output.LOG, text=text, offset=number)
            try:
                await output.publish(self.bus, self.user_id, chunk)
            except Exception as exc:  # NATS errors of every kind: a log line is not worth more
                log.warning(
                    "log line not published",
                    extra={"task_id": str(self.task_id), "error": f"{type(exc).__name__}: {exc}"},
                )

    async def _write_preview(self, step: int, frames: Any, aspect: tuple[int, int]) -> None:
        spec = self.spec
        try:
            data, width, height = await asyncio.to_thread(
                encode_image, frames, spec.preview_size, spec.preview_format, aspect
            )
            name = output.preview_name(self.task_id, self.attempt, step, spec.preview_format)
            # named on the row before it is stored: retention deletes it with the task's output, and a worker killed
            # in between leaves nothing that no row names
            if not await workers.name_preview(
                self.pool, self.task_id, attempt=self.attempt, uri=self.store.uri_of(name)
            ):
                return  # fenced out: this attempt no longer runs the task
            stored = await self.store.put(name, data, output.PREVIEW_TYPES[spec.preview_format])
            chunk = output.Chunk(
                self.task_id, self.attempt, output.PREVIEW, uri=stored.uri, content_type=stored.content_type, step=step
            )
            await output.publish(self.bus, self.user_id, chunk)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a store or NATS outage: the run goes on without this preview
            error = f"{type(exc).__name__}: {exc}"
            log.warning("preview not published", extra={"task_id": str(self.task_id), "step": step, "error": error})
            return
        self.previews += 1
        self._published(Published(step, stored.uri, width, height, len(data)))
