"""Which gRPC connections the warden closes at the cap (the live behaviour is in
``test_connections.py``)."""

from __future__ import annotations

from avest.grpc.warden import Accepted, most_idle


def test_the_warden_closes_silent_sockets_first_then_the_longest_idle() -> None:
    conns = [
        Accepted(fd=1, idle_ms=5_000, received=900),  # a client, idle 5 s
        Accepted(fd=2, idle_ms=1_500, received=0),  # silent for 1.5 s
        Accepted(fd=3, idle_ms=200, received=0),  # silent, but only just connected
        Accepted(fd=4, idle_ms=60_000, received=50),  # a client, idle a minute
        Accepted(fd=5, idle_ms=300, received=10_000),  # busy
    ]
    assert [c.fd for c in most_idle(conns, 10)] == [2, 4, 1]
    assert [c.fd for c in most_idle(conns, 2)] == [2, 4]
