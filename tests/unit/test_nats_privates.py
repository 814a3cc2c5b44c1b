"""The private fields of nats-py that the services reach into, pinned: each test here fails when the library changes
one of them, so the reach is revisited at the upgrade instead of failing quietly in production."""

from __future__ import annotations

import inspect
from typing import Any, cast

from nats.aio.subscription import Subscription
from nats.js.client import JetStreamContext


def test_an_ordered_consumer_is_recreated_from_the_start_sequence_the_event_feed_sets() -> None:
    """services/notifier/event_feed.py (the event feed's start) sets `subscription._sub._jsi._sseq`: nats-py recreates a
    lost ordered consumer from `_sseq + 1`, which is 0 before its first delivery (the whole stream), and offers no
    public way to set it (nats-py 2.16). Checked: the subscription keeps its core subscription as `_sub`, the consumer
    state starts at `_sseq` 0, and both recreation points read it."""
    jsi_class = cast("Any", JetStreamContext)._JSI
    jsi = jsi_class(js=None, conn=None, stream="EVENTS", ordered=True, psub=None, sub=None, ccreq=None)
    assert jsi._sseq == 0
    assert inspect.getsource(jsi_class).count("self.reset_ordered_consumer(self._sseq + 1)") == 2
    core = Subscription(cast("Any", None), 1, "_INBOX.x")
    subscription = JetStreamContext.PushSubscription(js=cast("Any", None), sub=core, stream="EVENTS", consumer="c")
    assert cast("Any", subscription)._sub is core
