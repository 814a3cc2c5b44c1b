"""`python -m bench --profile` (make bench PROFILE=1): py-spy records every service process during the load phases.

Each phase leaves one speedscope file per process (open it at speedscope.app) and a `summary.txt` with each process's
busiest functions, by self time and by time on the stack, under `.taskgate/bench/profile-<time>/<phase>/`. py-spy
samples without pausing its target (`--nonblocking`) at 100 Hz, but still takes CPU of its own: figures measured with
`--profile` are for reading the profile beside, not for comparing with a run without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

from bench.stack import BenchStack

ROOT = Path(__file__).resolve().parent.parent
PY_SPY = Path(sys.executable).parent / "py-spy"  # installed into the venv by `make bench` (bench/requirements.txt)
RATE = 100  # samples per second
TOP = 15  # functions per process in the summary
_STDLIB = re.compile(r"^.*/lib/python3\.\d+/(?!site-packages/)")
OWN = ("taskgate/", "services/")  # the files of the code under test, as _name shows them


def new_folder() -> Path:
    """A fresh folder for this run's profiles."""
    folder = ROOT / ".taskgate" / "bench" / time.strftime("profile-%Y%m%d-%H%M%S")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextlib.asynccontextmanager
async def record(stack: BenchStack, folder: Path | None, phase: str) -> AsyncIterator[None]:
    """Profiles every live service process of `stack` while the body runs; does nothing when `folder` is None."""
    if folder is None:
        yield
        return
    out = folder / phase
    out.mkdir(parents=True, exist_ok=True)
    spies: dict[str, asyncio.subprocess.Process] = {}
    for name, service in stack.cluster.services.items():
        if service.alive and service.proc is not None:
            spies[name] = await asyncio.create_subprocess_exec(
                str(PY_SPY), "record", "--pid", str(service.proc.pid), "--rate", str(RATE), "--nonblocking",
                "--format", "speedscope", "--output", str(out / f"{name}.speedscope.json"),
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            )
    try:
        yield
    finally:
        failures = []
        for name, spy in spies.items():
            if spy.returncode is None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C
            _, err = await spy.communicate()
            if spy.returncode:
                failures.append(
                    f"{name}: py-spy exited {spy.returncode}: {err.decode(errors='replace').strip()[-300:]}"
                )
        (out / "summary.txt").write_text(summary(out, failures))


def summary(folder: Path, failures: list[str]) -> str:
    """Each profiled process's top functions by self share of its samples, and taskgate's own by total (on-stack)
    share."""
    lines = [f"py-spy at {RATE} Hz; share of each process's busy samples (idle threads are not sampled)", *failures]
    for path in sorted(folder.glob("*.speedscope.json")):
        self_time, total_time, samples = _tally(json.loads(path.read_text()))
        lines += ["", f"== {path.name.removesuffix('.speedscope.json')}: {samples} samples"]
        if not samples:
            continue
        lines.append("  self    total   function")
        for name, weight in self_time.most_common(TOP):
            lines.append(f"  {weight / samples:5.1%}  {total_time[name] / samples:6.1%}   {name}")
        lines.append("  -- taskgate's own functions, by total:")
        own = Counter({name: weight for name, weight in total_time.items() if name.startswith(OWN)})
        for name, weight in own.most_common(TOP):
            lines.append(f"  {self_time[name] / samples:5.1%}  {weight / samples:6.1%}   {name}")
    return "\n".join(lines) + "\n"


def _tally(profile: dict[str, object]) -> tuple[Counter[str], Counter[str], int]:
    """Self and total sample counts by function over every thread of one speedscope file, and the sample count."""
    shared = profile["shared"]
    assert isinstance(shared, dict)
    names = [_name(f) for f in shared["frames"]]  # a function's lines together
    self_time: Counter[str] = Counter()
    total_time: Counter[str] = Counter()
    count = 0
    profiles = profile["profiles"]
    assert isinstance(profiles, list)
    for thread in profiles:
        for stack in thread["samples"]:
            if not stack:
                continue
            count += 1
            self_time[names[stack[-1]]] += 1
            for name in {names[i] for i in stack}:
                total_time[name] += 1
    return self_time, total_time, count


def _name(frame: dict[str, str]) -> str:
    """`function (file)`, the file relative to site-packages, the repository or the standard library."""
    file = _STDLIB.sub("", frame["file"])
    for marker in ("site-packages/", f"{ROOT}/"):
        if marker in file:
            file = file.split(marker, 1)[1]
            break
    return f"{file}: {frame['name']}"
