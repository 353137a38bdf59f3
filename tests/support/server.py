"""A real avest server on 127.0.0.1:0, in this process, on a thread with its own event loop.

:func:`launch` (``data_dir, **overrides``) gives a :class:`ServerHandle`:
``.grpc_address`` (``"127.0.0.1:PORT"``), ``.http_url`` (``"http://127.0.0.1:PORT"``),
``.settings``, ``.server`` (the :class:`avest.server.Server`), ``.call(coro_fn, *args)``
to run a coroutine on the server's loop and get its result, ``.stop()`` (idempotent)
and ``.kill_streams()`` (cancel every RPC at once, acks in flight lost, as a crash
would, while the state stays for the final snapshot). The ``server`` and
``start_server`` fixtures (:mod:`tests.support.fixtures`) stop theirs at teardown.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from avest.server import Server
from avest.settings import Settings

T = TypeVar("T")

#: Seconds allowed for starting and for stopping a server.
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0


class ServerHandle:
    """One :class:`~avest.server.Server` running on a background event loop."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._run_loop, name="avest-test-server", daemon=True
        )
        self._thread.start()
        # The loop runs once the thread gets to it (late on a loaded machine).
        started = time.monotonic()
        while not self.loop.is_running() and time.monotonic() - started < START_TIMEOUT_S:
            time.sleep(0.001)
        self._stopped = False
        self.server: Server = self.call(self._build, timeout=START_TIMEOUT_S)
        try:
            self.call(self.server.start, timeout=START_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise
        # Where it listens, ports 0 resolved to the ones it bound.
        self.grpc_address: str = self.server.grpc_address
        self.grpc_port: int = self.server.grpc_port
        self.http_url = f"http://{self.server.http_address}"

    async def _build(self) -> Server:
        # Built on the loop: asyncio primitives inside bind to it.
        return Server(self.settings)

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coro_fn: Callable[..., Awaitable[T]], *args: Any, timeout: float = 30.0) -> T:
        """Run ``coro_fn(*args)`` on the server loop; its result (or exception)."""
        if not self.loop.is_running():
            raise RuntimeError("the server loop is not running")

        async def run() -> T:
            return await coro_fn(*args)

        future = asyncio.run_coroutine_threadsafe(run(), self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            # Name what hung, and where every thread stood (a bare TimeoutError says
            # nothing in a CI summary, and a hang seen once may not come back).
            name = getattr(coro_fn, "__qualname__", repr(coro_fn))
            raise TimeoutError(
                f"{name} did not finish within {timeout:g} s; the threads:\n{thread_stacks()}"
            ) from None

    def kill_streams(self) -> None:
        """Cancel every RPC now (no grace): open streams end without their pending acks."""
        grpc_server = self.server._grpc
        if grpc_server is not None:
            self.call(grpc_server.stop, 0)

    def stop(self) -> None:
        """Drain and stop the server, then the loop and its thread (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        try:
            if self.loop.is_running() and getattr(self, "server", None) is not None:
                self.call(self.server.stop, timeout=STOP_TIMEOUT_S)
        finally:
            if self.loop.is_running():
                with contextlib.suppress(Exception):
                    asyncio.run_coroutine_threadsafe(_cancel_leftovers(), self.loop).result(10)
                self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(STOP_TIMEOUT_S)
            if not self._thread.is_alive():
                self.loop.close()

    @property
    def stopped(self) -> bool:
        return self._stopped

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def _cancel_leftovers() -> None:
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=5)


#: The admin token of test servers (admin actions are refused without one).
ADMIN_TOKEN = "test-admin-token"
#: gRPC metadata carrying it.
ADMIN = (("authorization", f"Bearer {ADMIN_TOKEN}"),)


def settings_for(data_dir: str | Path, **overrides: Any) -> Settings:
    """Settings of a test server: free loopback ports, a 20 ms flush (a test sees its
    steps saved at once), every full round refitted at once (a test compares the
    service with the core's replay refit by refit; ``test_admission`` checks the
    default interval), a 5 s drain and the admin token; ``overrides`` on top."""
    values: dict[str, Any] = dict(
        grpc_address="127.0.0.1:0",
        http_address="127.0.0.1:0",
        data_dir=str(data_dir),
        flush_interval_ms=20,
        min_refit_interval_ms=0,
        grace_s=5.0,
        admin_token=ADMIN_TOKEN,
    )
    values.update(overrides)
    return Settings(**values)


def launch(data_dir: str | Path, **overrides: Any) -> ServerHandle:
    """Start a server on ``data_dir`` (settings overridable); the caller stops it."""
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    return ServerHandle(settings_for(data_dir, **overrides))


def populate(data_dir: str | Path, pairs: int = 3, steps: int = 35, k: int = 64) -> dict[str, Any]:
    """A store with ``pairs`` trained pairs (label ``n`` = 0, 1, ...; worker ``w<n>``; each
    its own synthetic steps), made by a server started and stopped on ``data_dir``: each
    pair's ``avest.v1.Pair`` by id."""
    from avest_wire.v1 import estimator_pb2 as pb
    from tests.support.rpc import observe_all, register_k, stub_for, synthetic_steps

    srv = launch(data_dir)
    try:
        channel, stub = stub_for(srv.grpc_address)
        out = {}
        for n in range(pairs):
            reg = register_k(stub, k, n)
            observe_all(stub, synthetic_steps(reg.pair_id, f"w{n}", k, steps, seed=n))
            out[reg.pair_id] = stub.GetPair(pb.GetPairRequest(pair_id=reg.pair_id)).pair
        channel.close()
    finally:
        srv.stop()
    return out


def thread_stacks() -> str:
    """Every thread's stack, innermost call last (for a hang's report)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        out.append(f"--- {names.get(ident, ident)}")
        out.extend(line.rstrip() for line in traceback.format_stack(frame)[-8:])
    return "\n".join(out)
