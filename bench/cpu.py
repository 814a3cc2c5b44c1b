"""CPU seconds (and resident memory) of each part of the stack, from /proc: where a submitted task's cost goes."""

from __future__ import annotations

import os
from pathlib import Path

from bench.stack import BenchStack

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of a live process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process so far."""
    found = _stat(pid)
    return None if found is None else found[1]


def thread_seconds(pid: int, prefix: str) -> float:
    """User + system CPU seconds so far of a live process's threads whose OS name begins with `prefix`."""
    total = 0.0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return 0.0
    for task in tasks:
        try:
            if not (task / "comm").read_text().startswith(prefix):
                continue
            text = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        fields = text[text.rindex(")") + 2 :].split()
        total += (int(fields[11]) + int(fields[12])) / _TICK
    return total


def rss_bytes(pid: int) -> int | None:
    """Resident set size of a live process."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def service_pid(stack: BenchStack, name: str) -> int:
    """The pid of one running service process of the stack."""
    proc = stack.cluster[name].proc
    if proc is None or proc.poll() is not None:
        raise RuntimeError(f"{name} is not running")
    return proc.pid


def _postgres_pids(data_dir: Path) -> list[int]:
    """The postmaster of `data_dir` and its children (backends and background workers)."""
    try:
        master = int((data_dir / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return []
    pids = [master]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            found = _stat(int(entry.name))
            if found is not None and found[0] == master:
                pids.append(int(entry.name))
    return pids


def snapshot(stack: BenchStack) -> dict[str, float]:
    """CPU seconds so far of: each service kind, PostgreSQL (all its processes), nats-server."""
    out: dict[str, float] = {}
    for name, service in stack.cluster.services.items():
        if service.proc is None:
            continue
        found = _stat(service.proc.pid)
        if found is not None:
            kind = name.split("-")[0]
            out[kind] = out.get(kind, 0.0) + found[1]
    out["postgres"] = sum(s[1] for p in _postgres_pids(stack.cluster.postgres.data_dir) if (s := _stat(p)) is not None)
    nats = stack.cluster.nats.proc
    if nats is not None and (found := _stat(nats.pid)) is not None:
        out["nats"] = found[1]
    return out


def per_unit(before: dict[str, float], after: dict[str, float], units: float) -> dict[str, float]:
    """Milliseconds of CPU per unit (a task, a running task-second) for each server-side part alive at both snapshots,
    busiest first."""
    parts = {k: (after[k] - before[k]) * 1000 / units for k in after if k in before and units}
    return {k: round(v, 3) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])}


def per_task(before: dict[str, float], after: dict[str, float], tasks: int, client_cpu: float) -> dict[str, float]:
    """Milliseconds of CPU per task for each part (only processes alive at both snapshots count)."""
    parts = {k: (after[k] - before[k]) * 1000 / tasks for k in after if k in before and tasks}
    parts["client"] = client_cpu * 1000 / tasks if tasks else 0.0
    return {k: round(v, 3) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])}
