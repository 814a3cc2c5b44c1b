"""When a run's preview is due (services/worker/partial.Every), and the size of a preview frame: pure logic."""

from __future__ import annotations

from services.worker.partial import Every, frame_size


def previews_of(every: Every, first: int, total: int) -> list[int]:
    """The steps a run from `first` to `total` takes a preview after."""
    taken = []
    for step in range(first, total + 1):
        if every.due(step, total):
            every.taken(step)
            taken.append(step)
    return taken


def test_a_fraction_of_the_steps_makes_a_preview_each_that_many_steps_and_none_after_the_last() -> None:
    assert previews_of(Every(0.25, 0.0), 1, 12) == [3, 6, 9]
    assert previews_of(Every(0.25, 0.0, start_step=7), 8, 20) == [12, 17]  # a resumed run counts from its start step
    assert previews_of(Every(0.1, 0.0), 1, 3) == [1, 2]  # fewer steps than 1 / fraction: every step but the last


def test_seconds_count_from_the_first_steps_end_and_restart_at_each_preview() -> None:
    now = [100.0]
    every = Every(0.0, 2.0, clock=lambda: now[0])
    now[0] = 150.0  # the wait for a device and the prompt's encoding: no denoising yet
    assert not every.due(1, 50)  # the count starts here
    now[0] = 151.9
    assert not every.due(2, 50)
    now[0] = 152.0
    assert every.due(3, 50)
    every.taken(3)
    assert not every.due(4, 50)
    now[0] = 154.0
    assert every.due(5, 50) and not every.due(50, 50)
    assert not Every(0.0, 0.0).enabled and Every(0.0, 1.0).enabled


def test_a_preview_frame_keeps_the_videos_aspect_at_its_longer_side() -> None:
    assert frame_size(832, 480, 128) == (128, 74)
    assert frame_size(480, 832, 128) == (74, 128)
    assert frame_size(64, 64, 48) == (48, 48)
    assert frame_size(4000, 2, 16) == (16, 1)  # never a zero-pixel side
