"""Fencing per claim: each run stores its output under a name of its own, so a fenced-out run's clean-up never deletes
what its replacement stored (the claim itself commits durably: tests/integration/worker/test_worker.py)."""

from __future__ import annotations

from services.worker.finish import output_name


def test_every_run_names_its_output_apart() -> None:
    names = {output_name(42, 1, "mp4") for _ in range(100)}
    assert len(names) == 100
    assert all(name.startswith("42-a1-") and name.endswith(".mp4") for name in names)
