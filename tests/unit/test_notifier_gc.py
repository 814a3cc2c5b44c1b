"""The notifier's full garbage collections follow its setting (an idle notifier with 10,000 streams spent most of its
CPU in them at Python's default)."""

from __future__ import annotations

import gc

from services.notifier.service import tune_gc
from taskgate.config import NotifierSettings


def test_the_full_collection_threshold_is_the_setting_and_the_younger_ones_stay() -> None:
    before = gc.get_threshold()
    try:
        tune_gc(NotifierSettings(notifier_gc_full_threshold=123))
        assert gc.get_threshold() == (before[0], before[1], 123)
        assert NotifierSettings().notifier_gc_full_threshold == 100
    finally:
        gc.set_threshold(*before)
