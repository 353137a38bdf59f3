"""uvicorn's HTTP/1.1 protocol with a connection cap and an idle timeout from the start.

uvicorn closes an idle keep-alive connection only after a first request; a
client that connects and sends nothing keeps its socket (and a file
descriptor) forever. :func:`guarded_protocol` returns a protocol class that
starts the idle timer when the connection is made and closes a connection
beyond ``max_connections`` at once, so idle sockets cost one descriptor each
for at most ``timeout_keep_alive`` seconds and can never fill the table.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from avest.policy.throttle import LogLimiter

_logs = LogLimiter("avest.http")


def guarded_protocol(max_connections: int) -> type[H11Protocol]:
    class GuardedH11(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self.opened_at = time.monotonic()
            no_delay(transport)
            super().connection_made(transport)
            if len(self.connections) > max_connections and not self._evict_idle():
                _logs.warning(
                    "full",
                    "HTTP connection refused: %d open, all busy (limit %d)",
                    len(self.connections) - 1,
                    max_connections,
                )
                self.connections.discard(self)
                transport.abort()
                return
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

        def _evict_idle(self) -> bool:
            """At the cap, a new connection takes the place of an idle one (no
            request in progress), so idle sockets cannot lock out probes."""
            for other in list(self.connections):
                if other is self or other.transport.is_closing():
                    continue
                cycle = other.cycle
                if cycle is None or cycle.response_complete:
                    _logs.warning(
                        "evict",
                        "HTTP connection limit %d reached: closing idle ones",
                        max_connections,
                    )
                    other.connections.discard(other)
                    other.transport.abort()
                    return True
            return False

        def data_received(self, data: bytes) -> None:
            if self.transport.is_closing():
                return
            super().data_received(data)

    return GuardedH11


def no_delay(transport: asyncio.BaseTransport) -> None:
    """Send small writes at once (TCP_NODELAY). uvicorn writes a response's head and
    body apart; with Nagle's algorithm the body waits for the client's delayed ACK of
    the head, 40 ms on Linux, on every response. asyncio turns Nagle off itself only
    for sockets made with ``IPPROTO_TCP``, and the listening socket the server binds
    (``socket.socket(family)``) hands its connections protocol 0."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def quiet_loop_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Route the loop's exception reports (accept errors at the descriptor limit)
    through a limiter instead of one log line each."""
    limiter = LogLimiter("asyncio")

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", "event loop error"))
        exc = context.get("exception")
        limiter.warning(message[:80], "%s: %r", message, exc)

    loop.set_exception_handler(handler)
