"""The notifier's young and full garbage collections follow its settings (an idle notifier with 10,000 streams spent
most of its CPU in full ones at Python's default, and a keep-alive tick's wake-ups ran young ones every few hundred)."""

from __future__ import annotations

import gc

from services.notifier.service import tune_gc
from taskgate.config import NotifierSettings


def test_the_young_and_full_collection_thresholds_are_the_settings_and_the_middle_one_stays() -> None:
    before = gc.get_threshold()
    try:
        tune_gc(NotifierSettings(notifier_gc_young_threshold=4567, notifier_gc_full_threshold=123))
        assert gc.get_threshold() == (4567, before[1], 123)
        assert NotifierSettings().notifier_gc_full_threshold == 100
        assert NotifierSettings().notifier_gc_young_threshold == 10_000
    finally:
        gc.set_threshold(*before)
