"""GPU check: every family's tiny model on CUDA: seconds per step, peak GPU memory, determinism, abort, device-busy
fraction."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import io
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# Run from a checkout without installing the package (the device machine gets a bare copy of the tree).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from PIL import Image

from services.worker import runner as runmod
from services.worker.devices import Devices
from services.worker.encoding import decode_mp4_info
from services.worker.inference import pick_device
from taskgate import images
from taskgate.families import FAMILIES, IMAGE_TO_VIDEO
from taskgate_local import tinymodel


def fail(message: str, code: int = 1) -> int:
    """Print a failure line and return its exit code."""
    print(f"FAIL: {message}", flush=True)
    return code


def sync(device: str) -> None:
    """Wait for the device's queued work, so wall-clock stamps mean something."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def input_image(size: int) -> bytes:
    """An image-to-video model's input as the gateway stores it: a canonical PNG (a gradient, so frames differ)."""
    gradient = Image.linear_gradient("L").resize((size, size)).convert("RGB")
    out = io.BytesIO()
    gradient.save(out, format="PNG")
    return images.canonical(out.getvalue(), images.Limits()).png


def run_input(
    task_id: int, frames: int, size: int, steps: int, seed: int = 1234, *, pipeline: str = ""
) -> runmod.RunInput:
    """One task's inputs as the worker hands them to a runner (with an input image for an image-to-video class)."""
    params: dict[str, Any] = {"num_frames": frames, "width": size, "height": size, "num_inference_steps": steps,
                              "guidance_scale": 5.0, "fps": 8, "seed": seed, "negative_prompt": ""}
    image = input_image(size) if pipeline and FAMILIES[pipeline].task_type == IMAGE_TO_VIDEO else None
    return runmod.RunInput(task_id, 1, "a red car drives on a road at night", params, image=image)


async def saturate(
    runner: runmod.DiffusersRunner, device: str, inputs: list[runmod.RunInput], *, slots: int
) -> tuple[float, float]:
    """The worker's split with a saturated queue: `slots` of `inputs` at once, the device phase (denoise, VAE decode)
    one at a time on the device's lane, MP4 encoding on other threads meanwhile; (device-busy seconds, wall seconds)."""
    devices = Devices([device])
    encoders = concurrent.futures.ThreadPoolExecutor(slots, thread_name_prefix="encode")
    loop = asyncio.get_running_loop()
    slot = asyncio.Semaphore(slots)

    async def one(inp: runmod.RunInput) -> None:
        async with slot:
            async with devices.use({device}) as lane:
                rendered = await loop.run_in_executor(
                    lane.executor, runner.render, inp, lambda _d, _t: sync(device), lambda: False
                )
            await loop.run_in_executor(encoders, runner.encode, rendered)

    started = time.monotonic()
    try:
        await asyncio.gather(*(one(inp) for inp in inputs))
    finally:
        devices.close()
        encoders.shutdown(wait=True)
    return devices.busy_seconds, time.monotonic() - started


async def busy_fraction(
    runner: runmod.DiffusersRunner, device: str, *, tasks: int, slots: int, inp: runmod.RunInput
) -> float:
    """The share of wall time the device was busy with `tasks` copies of `inp` queued at once (saturate)."""
    busy, wall = await saturate(runner, device, [inp] * tasks, slots=slots)
    return busy / wall


def check_family(name: str, pipeline: str, device: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """Build, load and warm one tiny model, then time its runs; raises AssertionError on a wrong result."""
    family = FAMILIES[pipeline]
    frames = 1 + max(1, (args.frames - 1) // family.frame_step) * family.frame_step
    size = max(1, args.size // family.size_multiple) * family.size_multiple
    started = time.perf_counter()
    tinymodel.build_tiny_pipeline(folder, pipeline=pipeline)
    spec = tinymodel.tiny_spec(pipeline, folder, default_frames=frames, default_width=size, default_height=size)
    loaded = time.perf_counter()
    runner = runmod.DiffusersRunner.load(name, spec, device)  # the worker's own load: options, checks, warm-up
    print(f"{name}: built in {loaded - started:.2f}s, loaded and warmed in {time.perf_counter() - loaded:.2f}s "
          f"({runner.pipeline.dtype}), {frames} frames at {size}x{size}, {args.steps} steps", flush=True)
    inp = run_input(1, frames, size, args.steps, pipeline=pipeline)
    per_step: list[float] = []
    digests: list[str] = []
    peak_mib = 0.0
    for run in range(1, args.runs + 1):
        stamps: list[float] = []

        def on_step(_done: int, _total: int, stamps: list[float] = stamps) -> None:
            sync(device)
            stamps.append(time.perf_counter())

        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        sync(device)
        began = time.perf_counter()
        output = runner.encode(runner.render(inp, on_step, lambda: False))
        elapsed = time.perf_counter() - began
        assert len(stamps) == args.steps, f"on_step ran {len(stamps)} times for {args.steps} steps"
        # The first interval also holds prompt encoding, so the mean leaves it out when there are others.
        gaps = [b - a for a, b in zip([began, *stamps[:-1]], stamps, strict=True)]
        mean = sum(gaps[1:]) / (len(gaps) - 1) if len(gaps) > 1 else gaps[0]
        peak = torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else 0.0
        per_step.append(mean)
        peak_mib = max(peak_mib, peak)
        digests.append(output.sha256)
        info = decode_mp4_info(output.data)
        assert info == (frames, size, size), f"decoded (frames, width, height) {info}, asked for {(frames, size, size)}"
        print(
            f"  run {run}: {elapsed:.3f}s, {mean:.4f} s/step, peak {peak:.0f} MiB, sha256 {output.sha256[:16]}",
            flush=True,
        )

    aborted_at: list[int] = []
    try:
        runner.render(inp, lambda done, _total: aborted_at.append(done), lambda: len(aborted_at) >= 2)
        raise AssertionError("abort was asked for after step 2 but the run finished")
    except runmod.RunAborted:
        assert aborted_at == [1, 2], f"the abort stopped after steps {aborted_at}"
    after = runner.encode(runner.render(inp, lambda _d, _t: None, lambda: False))
    busy = asyncio.run(busy_fraction(runner, device, tasks=args.busy_tasks, slots=args.slots, inp=inp))
    deterministic = len(set(digests)) == 1 and after.sha256 == digests[0]
    print(f"  {name}: {min(per_step):.4f} s/step (best run), peak {peak_mib:.0f} MiB, device busy {busy:.1%} "
          f"({args.busy_tasks} tasks, {args.slots} at once), deterministic {deterministic}", flush=True)
    return {
        "model": name,
        "pipeline": pipeline,
        "frames": frames,
        "size": size,
        "steps": args.steps,
        "seconds_per_step": [round(s, 5) for s in per_step],
        "peak_mib": round(peak_mib),
        "device_busy": round(busy, 4),
        "deterministic": deterministic,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the check; 0 when every family produced the expected videos (or when there is no GPU to check)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--allow-cpu", action="store_true", help="run on CPU when CUDA is missing (for testing)")
    parser.add_argument("--models", default=",".join(tinymodel.TINY_MODELS), help="comma-separated tiny models")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--frames", type=int, default=17, help="rounded down to each family's frame rule")
    parser.add_argument("--size", type=int, default=64, help="width and height, rounded down to each family's multiple")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--busy-tasks", type=int, default=8, help="tasks in the saturated queue of the busy measure")
    parser.add_argument("--slots", type=int, default=2, help="tasks at once per device (the worker's ceil(1 x 1.5))")
    parser.add_argument("--strict", action="store_true", help="also fail when runs with one seed differ")
    args = parser.parse_args(argv)

    print(f"torch {torch.__version__} (CUDA build {torch.version.cuda}), cuda available: {torch.cuda.is_available()}")
    device, _ = pick_device()
    if device != "cuda":
        if not args.allow_cpu:
            print("SKIP: no CUDA device is visible to torch; nothing measured (--allow-cpu runs it on the CPU)")
            return 0
        print("WARNING: no CUDA, running on CPU because of --allow-cpu")
    else:
        device = "cuda:0"
        print(f"gpu: {torch.cuda.get_device_name(0)}, bf16 supported: {torch.cuda.is_bf16_supported()}")
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in tinymodel.TINY_MODELS]
    if unknown:
        return fail(f"unknown tiny models {unknown}; known: {', '.join(tinymodel.TINY_MODELS)}", 2)
    results: list[dict[str, Any]] = []
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="taskgate-gpu-check-") as tmp:
        for name in names:
            try:
                results.append(check_family(name, tinymodel.TINY_MODELS[name], device, args, Path(tmp) / name))
            except Exception as exc:  # one family's failure must not hide the others' figures
                print(f"FAIL: {name}: {type(exc).__name__}: {exc}", flush=True)
                failed.append(name)
    print("SUMMARY " + json.dumps({"device": device, "families": results, "failed": failed}), flush=True)
    if failed:
        return 1
    if args.strict and not all(r["deterministic"] for r in results):
        return fail("runs with the same seed gave different bytes")
    worst = min((r["device_busy"] for r in results), default=math.nan)
    print(f"OK: {len(results)} families; lowest device-busy fraction {worst:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
