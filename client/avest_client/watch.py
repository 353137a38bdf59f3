"""Watching a pair's coefficients: a blocking iterator, or a callback on a thread."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import grpc

from avest_client import codec
from avest_client._stream import Backoff
from avest_client.errors import AvestError, from_rpc_error
from avest_client.types import Coefficients


class Watchable(Protocol):
    """What a :class:`Watcher` needs of its client (an ``EstimatorClient``)."""

    def watch(self, pair_id: str) -> CoefficientsWatch: ...


log = logging.getLogger("avest_client")

#: Codes after which a watch gives up instead of reconnecting.
_FATAL_WATCH_CODES = frozenset(
    {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED}
)


def stream_error(
    exc: grpc.RpcError, end: type[Exception], method: str = "WatchCoefficients"
) -> Exception:
    """What a broken watch stream raises: ``end`` (iteration is over) if it was
    cancelled, else the :class:`AvestError` of its status."""
    if exc.code() == grpc.StatusCode.CANCELLED:
        return end()
    return from_rpc_error(exc, method)


class CoefficientsWatch(Iterator[Coefficients]):
    """Iterator over a pair's coefficient versions (first the current ones).

    Blocks until the next version; :meth:`cancel` (from any thread) ends it.
    """

    def __init__(self, call: Any, method: str = "WatchCoefficients") -> None:
        self._call = call
        self._method = method

    def __iter__(self) -> CoefficientsWatch:
        return self

    def __next__(self) -> Coefficients:
        try:
            msg = next(self._call)
        except grpc.RpcError as exc:
            raise stream_error(exc, StopIteration, self._method) from None
        return codec.coefficients(msg.coefficients)

    def cancel(self) -> None:
        self._call.cancel()

    def __enter__(self) -> CoefficientsWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


class Follow:
    """What a background watch keeps, on a thread or a task: the callback, the
    last version delivered, and the error it gave up on."""

    def __init__(
        self,
        client: Any,
        pair_id: str,
        callback: Callable[[Coefficients], Any],
        on_error: Callable[[AvestError], Any] | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        self._client = client
        self._pair_id = pair_id
        self._callback = callback
        self._on_error = on_error
        self._backoff = backoff or Backoff(initial_s=0.1, max_s=5.0)
        #: Last version delivered (-1: none yet).
        self.version = -1
        self.error: AvestError | None = None
        self._start()

    def _start(self) -> None:
        """Start following (a thread, a task)."""
        raise NotImplementedError

    def _fresh(self, c: Coefficients) -> bool:
        """Whether ``c`` is a version not delivered yet (and, if so, it is the last one now)."""
        if c.version <= self.version:
            return False
        self.version = c.version
        return True

    def _gives_up(self, exc: AvestError) -> bool:
        """Whether the watch ends on ``exc`` (calling ``on_error``) instead of reconnecting."""
        if exc.code not in _FATAL_WATCH_CODES:
            return False
        self.error = exc
        if self._on_error is not None:
            self._on_error(exc)
        return True


class Watcher(Follow):
    """A background watch: calls ``callback(coefficients)`` for each new version.

    Runs on a daemon thread, reconnects with backoff when the stream breaks,
    delivers each version at most once and in increasing order; gives up on
    NOT_FOUND / INVALID_ARGUMENT (calling ``on_error``). ``client`` is a
    :class:`Watchable` (an ``EstimatorClient``).
    """

    _client: Watchable

    def _start(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._current: CoefficientsWatch | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"avest-watch-{self._pair_id}", daemon=True
        )
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            try:
                watch = self._client.watch(self._pair_id)
                with self._lock:
                    self._current = watch
                if self._stop.is_set():
                    watch.cancel()
                for c in watch:
                    attempt = 0
                    if self._fresh(c):
                        try:
                            self._callback(c)
                        except Exception:
                            log.exception("avest watch callback failed")
                if self._stop.is_set():
                    return
            except AvestError as exc:
                if self._stop.is_set() or self._gives_up(exc):
                    return
                log.debug("avest watch of %s broke: %s", self._pair_id, exc)
            self._stop.wait(self._backoff.delay(attempt))
            attempt += 1

    def cancel(self, timeout: float = 5.0) -> None:
        """Stop watching and join the thread."""
        self._stop.set()
        with self._lock:
            if self._current is not None:
                self._current.cancel()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    close = cancel
