"""free_port: a port for a server started later, which no outgoing connection or port-0 listener can take meanwhile."""

from __future__ import annotations

import socket

from taskgate_local import embedded


def test_ports_lie_below_the_ephemeral_range_and_are_never_handed_out_twice() -> None:
    low = embedded._ephemeral_low()
    ports = [embedded.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(embedded._LOWEST <= port < low for port in ports)


def test_a_port_something_listens_on_is_not_chosen(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", embedded.free_port()))
        listener.listen()
        taken = listener.getsockname()[1]
        # only the taken port and one free one to choose from: the taken one is skipped
        monkeypatch.setattr(embedded, "_LOWEST", taken)
        monkeypatch.setattr(embedded, "_ephemeral_low", lambda: taken + 1000)
        monkeypatch.setattr(embedded, "_GIVEN", set(range(taken + 2, taken + 1000)))
        assert embedded.free_port() == taken + 1
