"""Keep the gRPC listener reachable at its connection cap: close the most idle.

gRPC refuses a connection beyond ``grpc.max_allowed_incoming_connections``, and
sockets that connect and send nothing hold their place until the handshake
timeout: at the cap a new client waits that long. The warden looks at the
listener's accepted sockets a few times a second (only while the process holds
nearly as many descriptors as the cap) and, when fewer than ``reserve`` places
are free, shuts down the most idle ones: first sockets that never sent a byte,
then those that received nothing for longest, never one that received data in
the last :data:`MIN_IDLE_S`. gRPC then sees the peer gone and frees the place,
as the HTTP side closes an idle connection for a new one.

Linux only (``/proc/self/fd`` and ``TCP_INFO``); elsewhere it does nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from dataclasses import dataclass

from avest.policy.throttle import LogLimiter

log = logging.getLogger("avest.grpc")

#: A connection that received data more recently than this is never closed.
MIN_IDLE_S = 1.0
#: How often the listener is looked at.
EVERY_S = 0.25
_FD_DIR = "/proc/self/fd"
# struct tcp_info (linux/tcp.h): tcpi_last_data_recv (u32, ms) at 52,
# tcpi_bytes_received (u64) at 128.
_TCP_INFO_BYTES = 232
_LAST_DATA_RECV = struct.Struct("=I")
_BYTES_RECEIVED = struct.Struct("=Q")


@dataclass(frozen=True)
class Accepted:
    fd: int
    idle_ms: int
    received: int


def accepted(port: int) -> list[Accepted]:
    """The connected sockets of this process whose local port is ``port``."""
    found: list[Accepted] = []
    for name in os.listdir(_FD_DIR):
        try:
            fd = int(name)
            if not os.readlink(f"{_FD_DIR}/{name}").startswith("socket:"):
                continue
            s = socket.socket(fileno=fd)
        except (ValueError, OSError):
            continue
        try:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            if s.getsockname()[1] != port:
                continue
            s.getpeername()  # the listener itself has no peer
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
            if len(info) < 136:
                continue
            found.append(
                Accepted(
                    fd,
                    _LAST_DATA_RECV.unpack_from(info, 52)[0],
                    _BYTES_RECEIVED.unpack_from(info, 128)[0],
                )
            )
        except OSError:
            continue
        finally:
            s.detach()  # the descriptor stays gRPC's
    return found


def most_idle(conns: list[Accepted], count: int) -> list[Accepted]:
    """Up to ``count`` connections to close: silent ones first, then longest idle."""
    idle = [c for c in conns if c.idle_ms >= MIN_IDLE_S * 1000]
    idle.sort(key=lambda c: (c.received > 0, -c.idle_ms))
    return idle[:count]


def shut(fd: int) -> None:
    """Shut the connection down without closing gRPC's descriptor."""
    s = socket.socket(fileno=fd)
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        s.detach()


class Warden:
    def __init__(self, port: int, cap: int, reserve: int | None = None) -> None:
        self.port = port
        self.cap = cap
        #: Places kept free for new clients.
        self.reserve = reserve if reserve is not None else max(2, cap // 32)
        self.closed = 0
        self._logs = LogLimiter("avest.grpc")

    def sweep(self) -> int:
        """One look: close idle connections beyond ``cap - reserve``; how many."""
        room = self.cap - self.reserve
        if len(os.listdir(_FD_DIR)) <= room:
            return 0  # cannot be near the cap: fewer descriptors than that in all
        conns = accepted(self.port)
        over = len(conns) - room
        if over <= 0:
            return 0
        victims = most_idle(conns, over)
        for c in victims:
            shut(c.fd)
        if victims:
            self.closed += len(victims)
            self._logs.warning(
                "warden",
                "gRPC connection limit %d nearly reached (%d open): closed %d idle connection(s)",
                self.cap,
                len(conns),
                len(victims),
            )
        return len(victims)

    async def run(self) -> None:
        if not os.path.isdir(_FD_DIR) or not hasattr(socket, "TCP_INFO"):
            log.debug("no /proc/self/fd or TCP_INFO: idle gRPC connections wait for timeouts")
            return
        while True:
            await asyncio.sleep(EVERY_S)
            with contextlib.suppress(OSError):
                # System calls only, a few per socket: off the event loop.
                await asyncio.to_thread(self.sweep)
