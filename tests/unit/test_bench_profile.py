"""`make bench PROFILE=1`'s summary: each process's busiest functions from py-spy's speedscope files."""

from __future__ import annotations

import json
from pathlib import Path

from bench import profile


def test_summary_counts_self_and_taskgate_totals(tmp_path: Path) -> None:
    frames = [
        {"name": "run_forever", "file": "/usr/lib/python3.11/asyncio/base_events.py", "line": 1},
        {"name": "SubmitTasks", "file": f"{profile.ROOT}/services/submit/service.py", "line": 120},
        {"name": "SubmitTasks", "file": f"{profile.ROOT}/services/submit/service.py", "line": 150},
        {"name": "iterencode", "file": "/usr/lib/python3.11/json/encoder.py", "line": 9},
        {
            "name": "execute",
            "file": f"{profile.ROOT}/.venv/lib/python3.11/site-packages/asyncpg/connection.py",
            "line": 3,
        },
    ]
    threads = [
        {"type": "sampled", "samples": [[0, 1, 3], [0, 2, 3], [0, 2, 4], [0]], "weights": [0.01] * 4},
        {"type": "sampled", "samples": [[]], "weights": [0.01]},  # an empty stack is not a busy sample
    ]
    (tmp_path / "submit-1.speedscope.json").write_text(json.dumps({"shared": {"frames": frames}, "profiles": threads}))

    text = profile.summary(tmp_path, ["submit-2: py-spy exited 1: no such process"])

    assert "submit-2: py-spy exited 1" in text
    assert "== submit-1: 4 samples" in text
    lines = text.splitlines()
    # a function's lines count together; self is the innermost frame, total any frame on the stack
    assert any(line.split() == ["50.0%", "50.0%", "json/encoder.py:", "iterencode"] for line in lines)
    assert any(line.split() == ["25.0%", "25.0%", "asyncpg/connection.py:", "execute"] for line in lines)
    own = lines[lines.index("  -- taskgate's own functions, by total:") + 1:]
    assert [line.split() for line in own if line] == [["0.0%", "75.0%", "services/submit/service.py:", "SubmitTasks"]]
