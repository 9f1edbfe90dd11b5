"""The port picker the launcher and the tests give services: never where outgoing connections
take their source ports (a service given one failed to bind, seconds later, in CI)."""
from __future__ import annotations

import socket

from services.launcher import _ephemeral_range, free_port


def test_ports_are_below_the_ephemeral_range_bindable_and_never_repeated():
    lo, hi = _ephemeral_range()
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < lo for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_a_port_in_use_or_handed_out_is_skipped(monkeypatch):
    from services import launcher

    lo, _ = _ephemeral_range()
    handed = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", _bindable_below(lo, avoid={handed})))
        busy.listen()
        busy_port = busy.getsockname()[1]
        other = _bindable_below(lo, avoid={handed, busy_port})
        candidates = iter([busy_port, handed, other])
        monkeypatch.setattr(launcher._random, "randrange", lambda a, b: next(candidates))
        assert free_port() == other


def _bindable_below(lo: int, avoid: set[int]) -> int:
    from services import launcher

    return next(port for port in range(lo - 1, 1024, -1)
                if port not in avoid and port not in launcher._handed_out and launcher.port_is_free(port))
