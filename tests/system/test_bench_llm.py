"""`python -m bench --only llm` runs on a fresh stack and reports every figure of the phase (behaviour only: this
machine's speed is not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_llm_phase_runs_and_reports_each_level(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "--only",
            "llm",
            "--quick",
            "--no-peers",
            "--llm-tokens",
            "12",
            "--llm-ttft",
            "2",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    figures = report["figures"]
    assert not [f for f in figures if f["section"] == "failed phases"], done.stderr[-3000:]
    llm = {f["name"]: f for f in figures if f["section"].startswith("llm")}
    for n in (1, 4, 16):
        assert llm[f"output tokens/s, {n} at once, through the gateway"]["value"] > 0
        assert llm[f"server-side CPU per streamed token, {n} at once (model decoding excluded)"]["value"] > 0
        assert llm[f"model decoding CPU per token, {n} at once"]["value"] > 0
        assert report["raw"]["llm"]["direct_tokens_per_second"][str(n)] > 0
    assert llm["time to first token through the gateway, p50"]["value"] > 0
    assert llm["time to first token, the model called here, p50"]["value"] > 0
    assert llm["tasks not SUCCEEDED with their streamed text as the answer"]["value"] == 0
