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
import sys
import threading
from collections.abc import Callable
from typing import Any

#: The interpreter lock is handed between threads this often (Python's default is
#: 5 ms). The I/O loop needs it at least this often to read its completions while
#: the state thread folds; at 5 ms, 1,000 busy streams starved the I/O loop until
#: clients cancelled (bench/loop_latency.py --server aio-thread), at 0.5 ms every
#: stream's first ack came within 1.8 s and a unary call's p99 was 8-11 ms.
SWITCH_INTERVAL_S = 0.0005


def on_loop(loop: asyncio.AbstractEventLoop | None, fn: Callable[..., Any], *args: Any) -> None:
    """Call ``fn(*args)`` on ``loop``: now when that is the running loop (or ``None``:
    one loop for all), else as soon as ``loop`` turns."""
    if loop is None:
        fn(*args)
        return
    try:
        here = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    if here is loop:
        fn(*args)
    elif not loop.is_closed():
        loop.call_soon_threadsafe(fn, *args)


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
