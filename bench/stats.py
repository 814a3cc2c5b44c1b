"""Figures: percentiles, the targets they are judged against, the printed table and the JSON report."""

from __future__ import annotations

import json
import math
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by nearest rank; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass
class Figure:
    """One measured number, its unit, and (when the issue sets one) the target it is judged against."""

    section: str
    name: str
    value: float | None
    unit: str
    target: str = ""
    met: bool | None = None  # None: no target, or not measured
    note: str = ""
    shown: str = ""  # printed instead of a value that could not be measured, e.g. "> 60 s"

    @property
    def verdict(self) -> str:
        if self.shown:
            return "MISSED" if self.met is False else ""
        if self.value is None:
            return "SKIPPED"
        if self.met is None:
            return ""
        return "ok" if self.met else "MISSED"


@dataclass
class Report:
    """Every figure of one run, plus what the run was and how long it took."""

    figures: list[Figure] = field(default_factory=list)
    context: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.time)

    def add(
        self,
        section: str,
        name: str,
        value: float | None,
        unit: str,
        *,
        at_most: float | None = None,
        at_least: float | None = None,
        target: str = "",
        note: str = "",
        shown: str = "",
    ) -> Figure:
        """Records a figure; `at_most`/`at_least` make a target of it (shown as text unless `target` says more)."""
        met: bool | None = None
        if value is not None and not math.isnan(value):
            if at_most is not None:
                met = value <= at_most
                target = target or f"<= {_fmt(at_most)} {unit}"
            elif at_least is not None:
                met = value >= at_least
                target = target or f">= {_fmt(at_least)} {unit}"
        elif value is not None and math.isnan(value):
            value = None
        if shown and at_most is not None:
            met, target = False, target or f"<= {_fmt(at_most)} {unit}"
        figure = Figure(section, name, value, unit, target, met, note, shown)
        self.figures.append(figure)
        return figure

    def skip(self, section: str, name: str, why: str) -> None:
        """A figure that was not measured, and why."""
        self.figures.append(Figure(section, name, None, "", note=why))

    def table(self) -> str:
        """The report as an aligned text table, grouped by section."""
        rows = [("figure", "value", "target", "", "note")]
        section = None
        for f in self.figures:
            if f.section != section:
                section = f.section
                rows.append((f"[{section}]", "", "", "", ""))
            value = f.shown or ("-" if f.value is None else f"{_fmt(f.value)} {f.unit}".strip())
            rows.append((f"  {f.name}", value, f.target, f.verdict, f.note))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = []
        for r in rows:
            cells = [r[i].ljust(widths[i]) for i in range(4)] + [r[4]]
            lines.append("  ".join(cells).rstrip())
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
            "seconds": round(time.time() - self.started, 1),
            "machine": {"python": platform.python_version(), "platform": platform.platform(), **self.context},
            "figures": [asdict(f) | {"verdict": f.verdict} for f in self.figures],
            "raw": self.raw,
        }

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2, default=str) + "\n")


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def ms(seconds: Sequence[float]) -> tuple[float, float]:
    """p50 and p99 of durations in seconds, as milliseconds."""
    return percentile(seconds, 50) * 1000, percentile(seconds, 99) * 1000
