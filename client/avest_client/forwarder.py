"""Forwarders: stream a worker's decode steps to the service in the background.

A forwarder belongs to one ``(pair_id, worker_id)``. :meth:`submit` copies a
step out of the caller's buffers, gives it the next sequence number and
queues it — it never blocks and never raises (a malformed step is counted
in ``stats.invalid`` and logged, not queued). A background sender (a daemon
thread on the sync gRPC stack for :class:`Forwarder`, which survives vLLM's
fork; a task for :class:`AsyncForwarder`) writes the steps on
one Observe stream, releases them when the server's acknowledgement
watermark covers them, reconnects with backoff when the stream fails and
resends every unacknowledged step, in order, before new ones. Coefficient
updates pushed on the stream are available from :meth:`latest_coefficients`.

A worker id given explicitly may be one an earlier sender used (a restarted
worker): each stream first opens the worker, and the service answers with the
sequence it applied of that id. Before its first step goes out, a forwarder
whose steps start at or below it continues above it (``reused_worker_id=
"continue"``, the default: its steps are new, renumbered and counted in
``stats.renumbered``), takes them for its own earlier steps (``"resume"``: a
rerun replay), or stops (``"fail"``: an error logged, :attr:`error` set, its
steps dropped and :meth:`flush` raising :class:`WorkerIdReusedError`).

Bounds: ``queue_size`` steps waiting to be sent (the oldest is dropped when
a new one arrives and the queue is full) and ``max_unacked`` steps sent but
not yet acknowledged (default ``queue_size``). Every drop is counted in
:attr:`stats` (see :class:`~avest_client.ledger.Stats`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy.typing as npt

from avest_client._drivers import AsyncDriver, ThreadDriver
from avest_client._stream import (
    Backoff,
    ChannelOptions,
    Session,
    StepData,
    StratumSummary,
    encode_step,
)
from avest_client.credentials import Credentials
from avest_client.errors import WorkerIdReusedError
from avest_client.ledger import Ledger, Stats
from avest_client.types import Served
from avest_wire.strata import check_stratum
from avest_wire.summary import RoundSummary

log = logging.getLogger("avest_client.forwarder")

__all__ = ["AsyncForwarder", "Forwarder", "StepData", "default_worker_id", "encode_step"]


def default_worker_id() -> str:
    """``host:pid:random``: unique per sender incarnation, as the contract requires."""
    host = socket.gethostname()[:96] or "host"
    return f"{host}:{os.getpid()}:{secrets.token_hex(4)}"


class _Base:
    """What both forwarders share: validation, the ledger, the driver's state."""

    def __init__(
        self,
        address: str,
        pair_id: str,
        worker_id: str | None = None,
        queue_size: int = 1024,
        max_unacked: int | None = None,
        *,
        k: int | None = None,
        channel_options: ChannelOptions = (),
        connect_timeout: float = 5.0,
        rpc_timeout: float = 5.0,
        backoff: Backoff | None = None,
        fetch_coefficients: bool = True,
        token: str | None = None,
        tls_ca: str | None = None,
        credentials: Credentials | None = None,
        reused_worker_id: str = "continue",
    ) -> None:
        if not pair_id:
            raise ValueError("pair_id must not be empty")
        if worker_id is not None and not 1 <= len(worker_id.encode()) <= 128:
            raise ValueError("worker_id must be 1 to 128 bytes")
        self.address = address
        self.pair_id = pair_id
        self.k = k
        self._given_worker_id = worker_id
        self._queue_size = queue_size
        self._max_unacked = max_unacked
        self._backoff = backoff or Backoff()
        self._reused_worker_id = reused_worker_id
        self._driver_kwargs: dict[str, Any] = dict(
            channel_options=tuple(channel_options),
            connect_timeout=connect_timeout,
            rpc_timeout=rpc_timeout,
            fetch_coefficients=fetch_coefficients,
            credentials=credentials or Credentials.resolve(token, tls_ca),
        )
        self._closed = False
        self._invalid_logged = 0
        self.last_invalid = ""
        self._fresh_state()  # the session checks reused_worker_id

    def _fresh_state(self) -> None:
        self._pid = os.getpid()
        self.worker_id = self._given_worker_id or default_worker_id()
        self._ledger = Ledger(self._queue_size, self._max_unacked)
        self._session = Session(
            self.pair_id, self.worker_id, self._ledger, self._backoff, self._reused_worker_id
        )
        self._driver = self._make_driver()

    def _make_driver(self) -> Any:
        raise NotImplementedError

    # -- the interface the vLLM shim uses ---------------------------------------

    def submit(
        self,
        features: npt.ArrayLike,
        num_verified: npt.ArrayLike,
        num_accepted: npt.ArrayLike,
        exclude: npt.ArrayLike | None = None,
        strata: Sequence[str] | None = None,
    ) -> None:
        """Queue one decode step (features ``[R, K]``, counts ``[R]``; ``strata``: each
        row's stratum, docs/strata.md, None for the pair's pooled traffic); never blocks."""
        if not self._closed:
            self._put(self._queue, features, num_verified, num_accepted, exclude, strata)

    def submit_summary(self, summary: RoundSummary, stratum: str | None = None) -> None:
        """Queue one round summary (summary mode; ``stratum``: the stratum whose drafts
        alone it sums, None for the whole round); never blocks. Takes the next sequence."""
        if not self._closed:
            self._put(self._queue_summary, summary, stratum)

    def _put(self, queue: Callable[..., bool], *item: Any) -> None:
        """``queue(*item)`` with the sender started when its transport needs it; never raises."""
        raise NotImplementedError

    def _queue(
        self,
        features: npt.ArrayLike,
        num_verified: npt.ArrayLike,
        num_accepted: npt.ArrayLike,
        exclude: npt.ArrayLike | None,
        strata: Sequence[str] | None = None,
    ) -> bool:
        """Validate and queue; False (counted in ``stats.invalid``) for a bad step."""
        if self._session.failure is not None:
            return self._refuse("step", self._session.failure)
        try:
            data = encode_step(features, num_verified, num_accepted, exclude, self.k, strata)
        except (ValueError, TypeError) as exc:
            return self._refuse("step", exc)
        self._ledger.submit(data)
        return True

    def _queue_summary(self, summary: RoundSummary, stratum: str | None = None) -> bool:
        """Queue a round summary (checked when made); False (counted in ``stats.invalid``)
        if it is not one or its K is not the pair's."""
        if self._session.failure is not None:
            return self._refuse("summary", self._session.failure)
        if not isinstance(summary, RoundSummary):
            return self._refuse(
                "summary", TypeError(f"expected a RoundSummary, got {type(summary).__name__}")
            )
        if summary.k != self.k:
            return self._refuse(
                "summary", ValueError(f"summary has K={summary.k}, expected {self.k}")
            )
        if stratum is None:
            self._ledger.submit(summary)
            return True
        try:
            self._ledger.submit(StratumSummary(summary, check_stratum(stratum)))
        except ValueError as exc:
            return self._refuse("summary", exc)
        return True

    def _refuse(self, what: str, exc: Exception) -> bool:
        """Count a step or summary not queued, keep why, log the first ten; returns False."""
        self._ledger.count_invalid()
        self.last_invalid = str(exc)
        if self._invalid_logged < 10:
            self._invalid_logged += 1
            log.warning("avest forwarder: %s not queued: %s", what, exc)
        return False

    def latest_coefficients(self) -> Served | None:
        """The coefficients last received from the server, or None."""
        return self._session.latest

    def latest_strata(self) -> dict[str, Served]:
        """Each stratum's coefficients pushed with the latest coefficients (empty: none
        received, the pair has no strata, or the service keeps none); a stratum not
        listed is predicted with :meth:`latest_coefficients`."""
        return dict(self._session.strata)

    def latest_calibration(self) -> tuple[tuple[float, ...], tuple[float, ...], bool] | None:
        """``(knots, logits, served)`` of the calibration layer pushed with the latest
        coefficients, or None (none received, or the pair has no layer)."""
        return self._session.calibration

    @property
    def connected(self) -> bool:
        """Whether an Observe stream is open right now."""
        return self._session.connected

    @property
    def stats(self) -> Stats:
        """Exact counters (a consistent snapshot)."""
        return self._ledger.stats()

    @property
    def error(self) -> WorkerIdReusedError | None:
        """Why the forwarder stopped for good, or None: with ``reused_worker_id="fail"``,
        the service held steps of an earlier sender of its worker id at or above its
        first sequence. Its steps were dropped; later ones are not queued."""
        return self._session.failure

    @property
    def last_error(self) -> str:
        """How the last stream failed (empty if none did)."""
        return self._session.last_error

    def sequences(self) -> tuple[list[int], list[int]]:
        """``(in_flight, queued)`` sequence numbers held, oldest first."""
        return self._ledger.sequences()


class Forwarder(_Base):
    """Sync-client forwarder: a daemon thread runs the stream (sync gRPC stack).

    Safe to call from any thread. After ``os.fork()`` the child's first
    :meth:`submit` starts afresh (new worker id unless one was given, empty
    queue, new connection); the parent keeps sending its own steps.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._start_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        super().__init__(*args, **kwargs)

    def _make_driver(self) -> ThreadDriver:
        return ThreadDriver(self.address, self._session, **self._driver_kwargs)

    def _put(self, queue: Callable[..., bool], *item: Any) -> None:
        try:
            if self._pid != os.getpid() or self._thread is None:
                self._start()  # first, so that a forked child queues into its own ledger
            if queue(*item):
                self._driver.notify()
        except Exception:  # the hot path never raises
            log.exception("avest forwarder: submit failed")

    def start(self) -> Forwarder:
        """Start the sender now (otherwise the first :meth:`submit` does)."""
        self._start()
        return self

    def _start(self) -> None:
        with self._start_lock:
            if self._pid != os.getpid():
                # Forked: the parent's sender thread does not exist here.
                self._start_lock = threading.Lock()
                self._thread = None
                self._fresh_state()
            if self._thread is not None or self._closed:
                return
            self._thread = threading.Thread(
                target=self._main, name=f"avest-forwarder-{self.pair_id}", daemon=True
            )
            self._thread.start()

    def _main(self) -> None:
        try:
            self._driver.run()
        except Exception:
            log.exception("avest forwarder stopped on an error")

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every submitted step is acknowledged (or dropped); False on timeout.

        Raises :class:`WorkerIdReusedError` when the forwarder stopped for good (:attr:`error`).
        """
        deadline = time.monotonic() + timeout
        while self._ledger.pending and self._session.failure is None:
            if time.monotonic() >= deadline or self._thread is None:
                return False
            time.sleep(0.005)
        if self._session.failure is not None:
            raise self._session.failure
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued and wait for its acks, for at most ``timeout`` seconds."""
        self._closed = True
        thread = self._thread
        if thread is None or self._pid != os.getpid():
            return
        self._driver.request_close(timeout)
        thread.join(timeout)
        if thread.is_alive():  # the deadline passed with a stream open
            self._driver.cancel()
            thread.join(2.0)

    def __enter__(self) -> Forwarder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncForwarder(_Base):
    """asyncio forwarder: the stream runs as a task on the loop that first submits.

    :meth:`submit` is a plain (non-async) call, to be made on that loop's
    thread; :meth:`close` and :meth:`flush` are coroutines.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._task: asyncio.Task[None] | None = None
        super().__init__(*args, **kwargs)

    def _make_driver(self) -> AsyncDriver:
        return AsyncDriver(self.address, self._session, **self._driver_kwargs)

    def _put(self, queue: Callable[..., bool], *item: Any) -> None:
        try:
            if not queue(*item):
                return
            if self._task is None or self._task.done():
                self._start()  # needs the running loop: the first submit must come from it
            self._driver.notify()
        except Exception:
            log.exception("avest forwarder: submit failed")

    def start(self) -> AsyncForwarder:
        """Start the sender task on the running loop (otherwise the first submit does)."""
        self._start()
        return self

    def _start(self) -> None:
        if self._task is not None and not self._task.done():
            return
        if self._task is not None:  # ended on an error: report it, start again
            with contextlib.suppress(BaseException):
                self._task.result()
            self._driver = self._make_driver()
        self._task = asyncio.get_running_loop().create_task(
            self._driver.run(), name=f"avest-forwarder-{self.pair_id}"
        )

    async def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every submitted step is acknowledged (or dropped); False on timeout.

        Raises :class:`WorkerIdReusedError` when the forwarder stopped for good (:attr:`error`).
        """
        deadline = time.monotonic() + timeout
        while self._ledger.pending and self._session.failure is None:
            if time.monotonic() >= deadline or self._task is None:
                return False
            await asyncio.sleep(0.005)
        if self._session.failure is not None:
            raise self._session.failure
        return True

    async def close(self, timeout: float = 5.0) -> None:
        """Send what is queued and wait for its acks, for at most ``timeout`` seconds."""
        self._closed = True
        task = self._task
        if task is None or task.done():
            return
        self._driver.request_close(timeout)
        done, _ = await asyncio.wait({task}, timeout=timeout + 1.0)
        if not done:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def __aenter__(self) -> AsyncForwarder:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
