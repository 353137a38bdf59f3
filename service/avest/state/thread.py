"""The state's event loop, on a thread of its own.

The server runs two event loops. The gRPC adapter's loop (the main thread) does
I/O only: it reads and checks each message, writes acknowledgements and pushes.
This one runs everything that touches the state: each pair's owner (folds,
refits), the group commit, the replicas' pending log, the admin API and the
metrics' collection. The state's code stays single-threaded, as it always was:
the adapters reach it through :meth:`avest.state.app.Avest.call` and
:meth:`~avest.state.app.Avest.run`, and it reaches them through the hooks, which
the gRPC adapter hands back to its loop with :func:`on_loop`.

Why two loops: grpc.aio hears of each completion (a message read, a write done)
through one byte that a poller thread writes to a socket pair, and the loop reads
one such byte per turn. A loop that also folds and refits turns slowly, the
socket pair fills, and every call waits behind every stream's pending reads and
writes (bench/loop_latency.py, bench/RESULTS.md): health checks and
GetCoefficients took 1-2 s beside 1,000 busy streams. A loop that does I/O only
turns often enough.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger("avest")

#: The interpreter lock is handed between threads this often (Python's default is
#: 5 ms). The I/O loop needs it at least this often to read its completions while
#: the state thread folds; at 5 ms, 1,000 busy streams starved the I/O loop until
#: clients cancelled (bench/loop_latency.py --server aio-thread), at 0.5 ms every
#: stream's first ack came within 1.8 s and a unary call's p99 was 8-11 ms.
SWITCH_INTERVAL_S = 0.0005


class Mailbox:
    """Calls posted from any thread, run on one loop in the order posted, with one
    wake-up of that loop per batch.

    ``call_soon_threadsafe`` writes a byte to the loop's self-pipe for every call:
    a system call, and a hand-over of the interpreter lock to wait for. One per
    Observe message each way cost more than the message's own checks
    (``BaseSelectorEventLoop._write_to_self``, 10 % of the server's samples), so
    calls wait here and the loop is woken once for all that came meanwhile.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._calls: deque[tuple[Callable[..., Any], tuple[Any, ...]]] = deque()
        self._lock = threading.Lock()
        self._woken = False

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        self._calls.append((fn, args))
        with self._lock:
            if self._woken:
                return
            self._woken = True
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._run)

    def _run(self) -> None:
        with self._lock:
            self._woken = False
        calls = self._calls
        while calls:
            fn, args = calls.popleft()
            try:
                fn(*args)
            except Exception:  # one call's fault is not the others'
                log.exception("a call handed between the service's loops failed")


_boxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox] = weakref.WeakKeyDictionary()
_boxes_lock = threading.Lock()


def mailbox(loop: asyncio.AbstractEventLoop) -> Mailbox:
    """The loop's one mailbox (one per loop, so calls to it keep their order)."""
    with _boxes_lock:
        box = _boxes.get(loop)
        if box is None:
            box = _boxes[loop] = Mailbox(loop)
        return box


def on_loop(loop: asyncio.AbstractEventLoop | None, fn: Callable[..., Any], *args: Any) -> None:
    """Call ``fn(*args)`` on ``loop``: now when that is the running loop (or ``None``:
    one loop for all), else in order with the other calls posted to it."""
    if loop is None:
        fn(*args)
        return
    try:
        here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    if here is loop:
        fn(*args)
    else:
        mailbox(loop).post(fn, *args)


class StateThread:
    """An event loop running on a thread of its own until :meth:`stop`."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="avest-state", daemon=True)

    def start(self) -> None:
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            with contextlib.suppress(Exception):
                tasks = asyncio.all_tasks(self.loop)
                for task in tasks:
                    task.cancel()
                self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
                self.loop.run_until_complete(self.loop.shutdown_default_executor())
            self.loop.close()

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop (what the state runs was closed before) and end the thread."""
        if not self._thread.is_alive():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        await asyncio.to_thread(self._thread.join, timeout_s)
