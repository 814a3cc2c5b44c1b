"""scripts/gpu_proof.py: without CUDA it skips at once; its configurations are the published ones; its CPU dry mode runs
every phase of every family with those configurations (one block per stack, the smallest valid video)."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.harness import ROOT

SCRIPT = ROOT / "scripts" / "gpu_proof.py"


def _proof() -> Any:
    """scripts/gpu_proof.py as a module (the scripts folder is not a package)."""
    spec = importlib.util.spec_from_file_location("gpu_proof", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_proof", module)  # its dataclasses look their module up while being made
    spec.loader.exec_module(sys.modules["gpu_proof"])
    return sys.modules["gpu_proof"]


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """The script in a fresh process that sees no GPU, whatever this machine has."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_without_cuda_it_says_why_writes_the_skip_and_exits_0(tmp_path: Path) -> None:
    out = tmp_path / "proof.json"
    started = time.monotonic()
    done = _run("--out", str(out), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("SKIP: no CUDA device is visible to torch"), done.stdout
    doc = json.loads(out.read_text())
    assert "no CUDA device" in doc["skipped"] and doc["torch"] == torch.__version__
    assert "diffusers" not in doc, "the skip builds nothing and imports no model code"
    assert time.monotonic() - started < 60
    table = _run("--report", str(out), timeout=60)
    assert table.returncode == 0 and table.stdout.startswith("skipped: no CUDA device")


def _same(value: Any, default: Any) -> bool:
    if isinstance(value, list | tuple) and isinstance(default, list | tuple):
        return list(value) == list(default)
    return bool(value == default)


def test_the_configurations_are_what_diffusers_converters_build_and_of_the_published_sizes() -> None:
    import diffusers

    proof = _proof()
    # What each dict changes from its class's defaults: diffusers' conversion scripts build these models from the
    # defaults except these (Wan 1.3B: its converter's own dict; CogVideoX-2B: layers and heads, the defaults' values).
    differs = {"WanTransformer3DModel": {"num_attention_heads", "ffn_dim", "num_layers"}}
    sizes = {"wan": (1.3e9, 1.5e9), "cogvideox": (1.6e9, 1.8e9), "ltx": (1.8e9, 2.1e9), "hunyuan": (12.5e9, 13.2e9)}
    for key, p in proof.PROOFS.items():
        for name, config in ((p.transformer_class, p.transformer), (p.vae_class, p.vae)):
            cls = getattr(diffusers, name)
            defaults = {k: v.default for k, v in inspect.signature(cls.__init__).parameters.items() if k != "self"}
            assert set(config) <= set(defaults), f"{name} takes no {set(config) - set(defaults)}"
            changed = {k for k, v in config.items() if not _same(v, defaults[k])}
            assert changed == differs.get(name, set()), f"{name}: {changed}"
        with torch.device("meta"):
            transformer = getattr(diffusers, p.transformer_class)(**p.transformer)
        count = sum(t.numel() for t in transformer.parameters())
        low, high = sizes[key]
        assert low <= count <= high, f"{p.model}: {count / 1e9:.2f}B parameters"


DRY = ("--device", "cpu", "--layers", "1", "--tiny")


@pytest.mark.slow
def test_the_cpu_dry_mode_runs_every_phase_of_every_family_and_the_device_split(tmp_path: Path) -> None:
    out = tmp_path / "dry.json"
    done = _run(
        *DRY,
        "--steps",
        "1",
        "--tiny-checks",
        "off",
        "--busy-tasks",
        "1",
        "--busy-steps",
        "1",
        "--out",
        str(out),
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and doc["dtype"] == "float32" and doc.get("failures", []) == []
    assert list(doc["families"]) == ["wan", "ltx", "cogvideox", "hunyuan"]
    for key, fam in doc["families"].items():
        eager = fam["runs"]["eager"]
        assert eager["seconds_per_step"] > 0 and eager["decode_s"] > 0 and eager["encode_s"] > 0, (key, eager)
        assert eager["progress_monotonic"] and eager["shape_ok"] and eager["mp4_bytes"] > 0, (key, eager)
        assert all(v == 1 for v in fam["layers"].values()) and fam["depth_fraction"] < 1, fam["layers"]
        assert fam["weights_mib"]["transformer"] > 0 and fam["weights_mib"]["vae"] > 0, fam["weights_mib"]
        compiled = next(v for k, v in fam["runs"].items() if k.startswith("compile:"))
        assert compiled["seconds_per_step"] > 0 and compiled["backend"] == "eager", (key, compiled)
        attention = [v for k, v in fam["runs"].items() if k.startswith("attention")]
        if key == "cogvideox":
            assert "does not honour" in attention[0]["skipped"]
        else:
            assert any(v.get("seconds_per_step", 0) > 0 for v in attention), (key, attention)
    assert doc["families"]["hunyuan"]["published_layers"] == {
        "num_layers": 20,
        "num_single_layers": 40,
        "num_refiner_layers": 2,
    }
    assert any("HunyuanVideo" in note and "blocks" in note for note in doc["notes"])
    busy = doc["busy"]
    assert busy["mode"] == "lanes" and [(s["worker_slots_per_device"], s["slots"]) for s in busy["settings"]] == [
        (1.0, 1),
        (1.5, 2),
    ]
    assert all(0 < s["busy_fraction"] <= 1 and s["tasks_per_minute"] > 0 for s in busy["settings"]), busy
    table = _run("--report", str(out), timeout=60)
    assert table.returncode == 0
    for model in ("Wan 2.1 T2V 1.3B", "CogVideoX-2B", "LTX-Video", "HunyuanVideo", "worker_slots_per_device 1.5"):
        assert model in table.stdout, table.stdout


@pytest.mark.slow
def test_the_cpu_dry_mode_checks_the_tiny_pipelines_and_serves_a_queue_through_the_whole_worker(tmp_path: Path) -> None:
    out = tmp_path / "worker.json"
    done = _run(
        *DRY,
        "--families",
        "",
        "--busy",
        "worker",
        "--busy-tasks",
        "2",
        "--busy-steps",
        "1",
        "--out",
        str(out),
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    doc = json.loads(out.read_text())
    tiny = doc["tiny"]
    assert sorted(r["pipeline"] for r in tiny.values()) == [
        "CogVideoXPipeline", "HunyuanVideoPipeline", "LTXImageToVideoPipeline", "LTXPipeline", "WanPipeline"
    ]  # the image-to-video one runs from a stored input image
    assert all(
        r["deterministic"] and r["same_after_abort"] and r["progress_monotonic"] and r["abort_within_one_step"]
        for r in tiny.values()
    ), tiny
    busy = doc["busy"]
    assert busy["mode"] == "worker" and [s["worker_slots_per_device"] for s in busy["settings"]] == [1.0, 1.5]
    assert all(0 < s["busy_fraction"] <= 1 and s["tasks"] == 2 for s in busy["settings"]), busy


def test_what_the_budget_leaves_no_time_for_is_skipped_with_a_note(tmp_path: Path) -> None:
    out = tmp_path / "budget.json"
    done = _run(*DRY, "--budget", "1", "--tiny-checks", "off", "--out", str(out), timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert all("time budget" in fam["skipped"] for fam in doc["families"].values()) and len(doc["families"]) == 4
    assert "time budget" in doc["busy"]["skipped"] and len(doc["notes"]) == 5
