"""gRPC's wake-ups of the event loop, drained whole.

grpcio's asyncio stack (1.85 and before) hands completions to the loop through a
socket pair: its poller thread queues each completion and writes one byte; the
loop's reader handles every queued completion but reads one byte
(``PollerCompletionQueue._handle_events`` in ``grpc/_cython/_cygrpc/aio``). Under
load each wake-up finds several completions, so bytes pile up: after a few hundred
unread one-byte writes (each takes a whole socket buffer's slot) the poller blocks
in ``write``, and from then on each pass of the loop reads one byte and lets the
poller deliver one completion. The service is then bound by one gRPC completion
per loop iteration, however idle the loop: a read, an acknowledgement written or a
stream opened each waits its turn behind every other stream's. Measured
(``bench/bench_abuse.py overload``): the poller thread blocked in ``write`` in
1,297 of 1,299 samples, the loop's own lag 15 ms (p50) while a light worker's step
was read 200-400 ms after it was sent, and 577-948 of a thousand streams opened.

:func:`drain_wakeups` wraps that reader so each pass runs it once per pending byte
(the first run hands over every queued completion, the others find the queue
empty or nearly), so the poller is never blocked for long; the completions it
hands over, and the order, are unchanged.
It relies on asyncio's selector loop keeping its readers in ``_selector`` and on
grpcio's reader being that method: where either is not so, nothing is wrapped
and the service runs as before (``False``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import selectors
import socket
from collections.abc import Callable

log = logging.getLogger("avest.grpc")

#: Wake-ups handled per pass at most (each byte is one completion's).
CHUNK = 65536


def _grpc_reader(callback: object) -> bool:
    if isinstance(callback, functools.partial):  # grpcio 1.6x on: (the loop) bound
        callback = callback.func
    owner = getattr(callback, "__self__", None)
    return (
        getattr(callback, "__name__", "") == "_handle_events"
        and type(owner).__name__ == "PollerCompletionQueue"
    )


def drained(sock: socket.socket, handle_events: Callable[[], None]) -> Callable[[], None]:
    """``handle_events`` run once per byte pending on ``sock`` (up to :data:`CHUNK`).

    grpcio's reader reads one byte and then hands over every queued completion, so
    each byte is consumed by a reader that drains the queue after it: a completion
    queued after a drain keeps its own byte, and one that a reader could not hand
    over (grpcio raises for a completion of a loop already closed) keeps the bytes
    after it, which wake the loops again. Several loops of one process (in-process
    test servers) share grpcio's socket, and any loop's reader hands every queued
    completion to its loop: a byte another loop took first is left to that loop."""
    buf = bytearray(1)
    peek = socket.MSG_PEEK | socket.MSG_DONTWAIT

    def handle() -> None:
        for _ in range(CHUNK):
            try:
                handle_events()
                if sock.recv_into(buf, 1, peek) == 0:
                    return
            except (BlockingIOError, InterruptedError):
                return

    handle.drained = True  # type: ignore[attr-defined]
    return handle


def drain_wakeups(loop: asyncio.AbstractEventLoop) -> bool:
    """Wrap grpcio's completion reader on ``loop`` (see the module); whether it was."""
    selector = getattr(loop, "_selector", None)
    if not isinstance(selector, selectors.BaseSelector):
        return False
    for key in list(selector.get_map().values()):
        reader = key.data[0] if isinstance(key.data, tuple) and key.data else None
        callback = getattr(reader, "_callback", None)
        if getattr(callback, "drained", False):
            return True  # another server in this process wrapped it already
        if reader is None or not _grpc_reader(callback):
            continue
        if not isinstance(key.fileobj, socket.socket):
            continue
        loop.remove_reader(key.fileobj)
        args = getattr(reader, "_args", None) or ()
        loop.add_reader(key.fileobj, drained(key.fileobj, functools.partial(callback, *args)))
        return True
    log.info("gRPC's completion reader is not the one-byte socket reader: left as it is")
    return False
