"""The admin HTTP server on a thread of its own; the state's handlers stay on the event loop.

uvicorn accepts, parses and answers on its own thread and event loop
(:class:`HttpThread`), so a saturated service loop never delays a connection's
accept or a probe. :class:`LoopBridge`, the ASGI app uvicorn runs, answers
``GET /healthz`` there, from the service loop's :class:`Heartbeat`, and hands
every other request, whole, to the admin API on the service's event loop (the
thread that owns the registry), relaying its ``receive`` and ``send`` back:
the API's handlers run exactly where they always ran.

Liveness is then what a probe should ask: does the service loop still turn?
Under overload its turns grow to a few hundred milliseconds and ``/healthz``
still answers at once; a loop that has not run its heartbeat for
:data:`STALE_AFTER_S` is wedged, and ``/healthz`` answers 503 so that the
orchestrator restarts the process. ``/readyz`` and everything else still wait
for the loop: readiness depends on the state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any

import uvicorn

from avest import __version__
from avest.http.protocol import quiet_loop_errors

log = logging.getLogger("avest.http")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: The service loop runs its heartbeat this often.
BEAT_S = 0.5
#: A loop whose heartbeat is this late is wedged (no callback has run for ten seconds:
#: an overloaded loop's turns take at most a few hundred milliseconds).
STALE_AFTER_S = 10.0


class Heartbeat:
    """The service loop's last turn, as the HTTP thread reads it; ``late`` is told how
    late each beat ran (the loop's lag, ``avest_event_loop_lag_seconds``)."""

    def __init__(
        self,
        beat_s: float = BEAT_S,
        stale_after_s: float = STALE_AFTER_S,
        late: Callable[[float], None] | None = None,
    ) -> None:
        self.beat_s = beat_s
        self.stale_after_s = stale_after_s
        self.late = late
        self.last = time.monotonic()
        self._due = 0.0
        self._handle: asyncio.TimerHandle | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.last = time.monotonic()
        self._next(loop)

    def _next(self, loop: asyncio.AbstractEventLoop) -> None:
        self._due = loop.time() + self.beat_s
        self._handle = loop.call_at(self._due, self._beat, loop)

    def _beat(self, loop: asyncio.AbstractEventLoop) -> None:
        self.last = time.monotonic()  # one float store: read from the other thread as is
        if self.late is not None:
            self.late(max(0.0, loop.time() - self._due))
        self._next(loop)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def silent_s(self) -> float:
        """Seconds since the loop last ran its heartbeat."""
        return time.monotonic() - self.last


async def _json(send: Send, status: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body, separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


class LoopBridge:
    """ASGI app on the HTTP thread: ``/healthz`` here, everything else on ``loop``."""

    def __init__(self, api: ASGIApp, loop: asyncio.AbstractEventLoop, heartbeat: Heartbeat) -> None:
        self.api = api
        self.loop = loop
        self.heartbeat = heartbeat

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/healthz" and scope["method"] == "GET":
            await self.healthz(send)
            return
        here = asyncio.get_running_loop()

        def on_http_thread(call: Awaitable[Any]) -> Awaitable[Any]:
            return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call, here))  # type: ignore[arg-type]

        async def receive_there() -> Message:
            return await on_http_thread(receive())  # type: ignore[no-any-return]

        async def send_there(message: Message) -> None:
            await on_http_thread(send(message))

        running = asyncio.run_coroutine_threadsafe(
            self.api(scope, receive_there, send_there),  # type: ignore[arg-type]
            self.loop,
        )
        try:
            await asyncio.wrap_future(running)
        except asyncio.CancelledError:  # the client went away: so does the handler
            running.cancel()
            raise

    async def healthz(self, send: Send) -> None:
        silent = self.heartbeat.silent_s()
        if silent > self.heartbeat.stale_after_s:
            reason = f"the service's event loop has not turned for {silent:.1f} s"
            await _json(send, 503, {"status": "unresponsive", "reason": reason})
            return
        await _json(send, 200, {"status": "ok", "version": __version__})


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the service handles SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpThread:
    """uvicorn serving ``config`` on ``sock`` from a thread and event loop of its own."""

    def __init__(self, config: uvicorn.Config, sock: socket.socket) -> None:
        self.server = _EmbeddedUvicorn(config)
        self.sock = sock
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="avest-http", daemon=True)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        quiet_loop_errors(loop)
        try:
            loop.run_until_complete(self.server.serve(sockets=[self.sock]))
        except BaseException as exc:  # noqa: BLE001 - handed to start(), which raises it
            self.error = exc
        finally:
            loop.close()

    async def start(self) -> None:
        """Start serving; returns once uvicorn listens (raises what stopped it)."""
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise self.error or RuntimeError("the admin HTTP server stopped at start")
            await asyncio.sleep(0.01)

    async def stop(self, timeout_s: float) -> None:
        """Let uvicorn finish its requests (they may still need the service loop,
        which goes on turning while this waits) and close, within ``timeout_s``."""
        self.server.should_exit = True
        await asyncio.to_thread(self.thread.join, max(timeout_s, 0.1))
        if self.thread.is_alive():
            self.server.force_exit = True
            await asyncio.to_thread(self.thread.join, 1.0)
