"""The bench's counting rules, without a stack: one measured window for every system, running task-seconds, the llm
phase's tokens per second and CPU per token."""

from __future__ import annotations

import math

import pytest

from bench.fleet import FleetOptions, running_seconds
from bench.llm import LlmOptions, Round, cpu_per_token, level_rounds, prompt, rate
from bench.load import Window
from bench.streams import Watch


def test_a_call_counts_by_when_it_ended_inside_the_window() -> None:
    window = Window(10.0, 20.0)
    assert window.seconds == 10.0
    assert window.counts(10.0) and window.counts(15.0) and window.counts(20.0)
    assert not window.counts(9.99) and not window.counts(20.01)
    # started in the warm-up, ended inside: counted (a long bulk call is not lost at the window's start)
    assert window.counts(10.5)
    # callers keep starting calls until the window closes, so the load is steady all through it
    assert window.open(19.99) and not window.open(20.0)


def test_window_after_opens_once_the_warm_up_is_over() -> None:
    window = Window.after(1.0, 5.0)
    assert window.seconds == pytest.approx(5.0)
    assert not window.counts(window.start - 0.5)


def test_running_seconds_counts_only_the_part_of_each_task_inside_the_window() -> None:
    spans: list[tuple[float, float | None]] = [
        (0.0, None),  # running all through
        (5.0, 8.0),  # inside
        (8.0, 30.0),  # finishes after the window
        (25.0, None),  # starts after it
        (0.0, 1.0),  # finished before it
    ]
    assert running_seconds(spans, 2.0, 12.0) == pytest.approx(10.0 + 3.0 + 4.0)


def test_fleet_defaults_fill_every_slot() -> None:
    assert FleetOptions().count == 200
    assert FleetOptions(workers=2, slots=20, tasks=7).count == 7


def test_a_stream_is_dropped_only_when_the_server_ended_it_without_a_terminal_event() -> None:
    assert not Watch("1").dropped  # still open
    assert not Watch("1", ended="client").dropped
    assert not Watch("1", ended="terminal").dropped
    assert Watch("1", ended="CANCELLED").dropped
    assert Watch("1", ended="OK (no terminal event)").dropped


def test_llm_throughput_is_the_rounds_tokens_over_their_summed_windows() -> None:
    rounds = [Round(tokens=300, seconds=2.0), Round(tokens=100, seconds=2.0)]
    assert rate(rounds) == pytest.approx(100.0)
    assert math.isnan(rate([]))


def test_llm_cpu_per_token_keeps_the_model_decoding_apart() -> None:
    rounds = [
        Round(200, 1.0, {"worker": 0.1, "notifier": 0.3}, decoding=0.4),
        Round(200, 1.0, {"worker": 0.1}, decoding=0.4),
    ]
    parts, decoding = cpu_per_token(rounds)
    assert parts == {"worker": pytest.approx(0.5), "notifier": pytest.approx(0.75)}
    assert list(parts) == ["notifier", "worker"]  # busiest first
    assert decoding == pytest.approx(2.0)


def test_every_llm_level_runs_the_same_tasks_n_at_once() -> None:
    opts = LlmOptions(levels=(1, 4, 16), rounds=2)
    for n in opts.levels:
        rounds = level_rounds(n, opts)
        assert [i for r in rounds for i in r] == list(range(32))
        assert {len(r) for r in rounds} == {n}
    assert level_rounds(5, LlmOptions(levels=(5, 16), rounds=1))[-1] == [15]  # the last round takes what is left
    assert prompt(1) != prompt(2)


def test_device_busy_figures_compare_each_variant_with_the_first() -> None:
    from bench import device_busy
    from bench.device_busy import VARIANTS, Figure
    from bench.stats import Report

    off, on = (v.label for v in VARIANTS)
    report = Report()
    device_busy.add_figures(
        report,
        "busy",
        [
            Figure("sleepy", 1, 20, 10.0, 7.0),
            Figure("wan-tiny", 1, 10, 10.0, 9.0, off),
            Figure("wan-tiny", 1, 10, 10.0, 8.1, on),
        ],
    )
    values = {f.name: f.value for f in report.figures}
    assert values["device busy: sleepy, 1 slot(s)"] == pytest.approx(70.0)
    assert values[f"busy with {on} / {off}, 1 slot(s)"] == pytest.approx(90.0)
    device_busy.add_previews_figures(
        report, "busy", [Figure("wan-tiny", 1, 8, 10.0, 8.0), Figure("wan-prev", 1, 8, 10.0, 7.6)]
    )
    [previews] = [f for f in report.figures if "previews" in f.name]
    assert previews.value == pytest.approx(95.0) and previews.met is False
