"""Declaring the streams against a real nats-server: an existing stream is updated, any other refusal is seen."""

from __future__ import annotations

from pathlib import Path

import pytest
from nats.js.api import StreamConfig
from nats.js.errors import BadRequestError

from taskgate import bus as busmod
from taskgate_local.embedded import EmbeddedNats


async def test_a_changed_stream_is_updated_and_another_refusal_is_raised_at_once(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path / "nats").start()
    bus = await busmod.connect(server.url, "declare-test")
    try:
        await busmod._ensure_stream(bus.js, StreamConfig(name="PROBE", subjects=["probe.>"], max_age=60.0))
        await busmod._ensure_stream(bus.js, StreamConfig(name="PROBE", subjects=["probe.>"], max_age=120.0))
        assert (await bus.js.stream_info("PROBE")).config.max_age == 120.0  # the name in use: updated, not refused
        # a stream whose subjects overlap another's is a refusal an update cannot mend: raised as itself (before, it
        # became the update's "stream not found", and a cluster still placing replicas looked like that too)
        with pytest.raises(BadRequestError) as refused:
            await busmod._ensure_stream(bus.js, StreamConfig(name="OTHER", subjects=["probe.x"]))
        assert refused.value.err_code not in (busmod.STREAM_NAME_IN_USE, busmod.NO_PEERS_FOR_PLACEMENT), refused.value
        assert "overlap" in (refused.value.description or "")
    finally:
        await bus.nc.close()
        server.stop()
