"""GPU smoke check: build the tiny Wan model, run it on CUDA a few times, report speed and determinism."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# Run from a checkout without installing the package (the device machine gets a bare copy of the tree).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from services.worker.inference import (
    GenerationRequest,
    InferenceAborted,
    VideoPipeline,
    decode_mp4_info,
    pick_device,
)
from taskgate_local import tinymodel

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def fail(message: str, code: int = 1) -> int:
    """Print a failure line and return its exit code."""
    print(f"FAIL: {message}", flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    """Run the check; 0 when every run produced the expected video."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--allow-cpu", action="store_true", help="run on CPU when CUDA is missing (for testing)")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="override the picked dtype")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--size", type=int, default=64, help="width and height")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--strict", action="store_true", help="also fail when the runs' sha256 differ")
    args = parser.parse_args(argv)

    print(f"torch {torch.__version__} (CUDA build {torch.version.cuda}), cuda available: {torch.cuda.is_available()}")
    device, dtype = pick_device()
    if device != "cuda":
        if not args.allow_cpu:
            return fail("CUDA is not available to torch; this check needs a GPU (or pass --allow-cpu)", 2)
        print("WARNING: no CUDA, running on CPU because of --allow-cpu")
    if args.dtype != "auto":
        dtype = DTYPES[args.dtype]
    if device == "cuda":
        print(f"gpu: {torch.cuda.get_device_name(0)}, bf16 supported: {torch.cuda.is_bf16_supported()}")
    print(f"device: {device}, dtype: {str(dtype).removeprefix('torch.')}", flush=True)

    request = GenerationRequest(
        prompt="a red car drives on a road at night",
        negative_prompt="blurry",
        num_frames=args.frames,
        width=args.size,
        height=args.size,
        num_inference_steps=args.steps,
        seed=1234,
    )
    with tempfile.TemporaryDirectory(prefix="taskgate-gpu-check-") as tmp:
        started = time.perf_counter()
        folder = tinymodel.build_tiny_pipeline(Path(tmp) / "wan-tiny")
        print(f"built tiny model in {time.perf_counter() - started:.2f}s")
        started = time.perf_counter()
        pipeline = VideoPipeline.load("wan-tiny", folder, device, dtype)
        print(f"loaded in {time.perf_counter() - started:.2f}s")
        print(f"warmup: {pipeline.warmup():.2f}s", flush=True)

        def sync() -> None:
            if device == "cuda":
                torch.cuda.synchronize()

        digests: list[str] = []
        per_step: list[float] = []
        for run in range(1, args.runs + 1):
            stamps: list[float] = []

            def on_step(done: int, total: int, stamps: list[float] = stamps) -> None:
                sync()
                stamps.append(time.perf_counter())

            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            sync()
            started = time.perf_counter()
            video = pipeline.generate(request, on_step, lambda: False)
            sync()
            elapsed = time.perf_counter() - started
            step_seconds = [b - a for a, b in zip([started, *stamps[:-1]], stamps, strict=True)]
            # The first interval also holds prompt encoding, so the mean leaves it out when there are others.
            mean_step = sum(step_seconds[1:]) / (len(step_seconds) - 1) if len(step_seconds) > 1 else step_seconds[0]
            per_step.append(mean_step)
            peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else 0.0
            print(
                f"run {run}: {elapsed:.3f}s total, {mean_step:.4f} s/step over {len(stamps)} steps, "
                f"peak {peak:.0f} MiB, {len(video.data)} bytes, sha256 {video.sha256}",
                flush=True,
            )
            if len(stamps) != args.steps:
                return fail(f"on_step ran {len(stamps)} times for {args.steps} steps")
            info = decode_mp4_info(video.data)
            if info != (video.num_frames, args.size, args.size) or video.num_frames < 1:
                return fail(f"decoded (frames, width, height) {info}, expected ({video.num_frames}, {args.size}, ...)")
            digests.append(video.sha256)

        abort_steps: list[int] = []
        try:
            pipeline.generate(request, lambda done, _total: abort_steps.append(done), lambda: len(abort_steps) >= 2)
            return fail("abort was requested after step 2 but the run finished")
        except InferenceAborted:
            print(f"abort: stopped after step {abort_steps[-1]}")
        after = pipeline.generate(request, lambda _d, _t: None, lambda: False)

    deterministic = len(set(digests)) == 1
    print(f"deterministic across runs: {deterministic}; after abort same bytes: {after.sha256 == digests[0]}")
    summary = {
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "frames": args.frames,
        "size": args.size,
        "steps": args.steps,
        "seconds_per_step": [round(s, 5) for s in per_step],
        "sha256": digests,
        "deterministic": deterministic,
    }
    print("SUMMARY " + json.dumps(summary), flush=True)
    if args.strict and not deterministic:
        return fail("runs with the same seed gave different bytes")
    if decode_mp4_info(after.data) != decode_mp4_info(video.data):
        return fail("the run after an abort gave a different video shape")
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
