"""The production sink: a worker's steps to the avest sidecar, pooled coefficients back.

:func:`make_sink` (called by the shim on TP rank 0, inside the estimator's
constructor, so in the vLLM worker process after the fork) returns a
:class:`SidecarSink` built on :class:`avest_client.EstimatorClient` and its
background :class:`avest_client.Forwarder`. Nothing in the constructor
touches the network: the client's channel is created on first use, by the
sink's own thread.

Threads and what each does:

* vLLM's step (rank 0) reads :attr:`SidecarSink.connected` and
  :meth:`SidecarSink.latest_coefficients`: two attribute loads, values the
  supervisor prepared (the same tuple object until the coefficients change,
  so the shim's governor validates them once per change).
* The shim's forwarder thread (:mod:`.transfer`) calls :meth:`SidecarSink.submit`:
  the step goes to the client forwarder's bounded queue, or, until the pair
  is registered, to a buffer of the same capacity (``AVEST_QUEUE_SIZE``) that
  also drops the oldest. Never blocks on the network.
* The supervisor thread (``avest-sink``), every ``poll_s``: registers the pair
  (retrying with capped, jittered backoff while the sidecar is absent), then
  creates and starts the client forwarder with the pair id, moving the
  buffered steps into it in order; sends the cost curves vLLM profiled
  (:data:`.costs.RECORDER`) with ``SetCostCurves`` once they are known;
  registers again and resends the curves whenever the forwarder's stream
  reconnects (a restarted sidecar) or the sidecar answers NOT_FOUND (one
  that lost its state); and refreshes the two values the step reads.
* The client forwarder's thread runs the Observe stream: resend of
  unacknowledged steps after a reconnect, acknowledgements, pushed updates.

Coefficients: the registration's coefficients are the warm start (a worker
that joins a trained pair starts from them at its first step boundary), then
whatever the sidecar pushes on the stream. A sidecar that restarted without
its state counts versions from the start again; the client forwarder only
takes versions above the last one it saw, so until it catches up the sink
polls ``GetCoefficients`` itself (once a second) instead of serving stale
values.

``connected`` is True from a successful registration while the Observe
stream is up (and during the first ``AVEST_TIMEOUT_S`` after registration
while the stream is still opening); False while the sidecar is absent, lost,
refused the pair, or hung (its stream open but nothing acknowledged for
``AVEST_TIMEOUT_S`` while steps are outstanding). The shim's governor decides from it: pooled
coefficients govern while connected, vLLM's own refits otherwise.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import asdict
from typing import Any

import numpy as np

from avest_client import Backoff, EstimatorClient, Stats
from avest_client.errors import AvestError
from avest_client.forwarder import Forwarder
from avest_wire.summary import RoundSummary
from avest_client.vllm import costs
from avest_client.vllm.config import ShimConfig
from avest_client.vllm.pair import PairKey
from avest_client.vllm.sidecar.fork import LIVE as _LIVE
from avest_client.vllm.sidecar.fork import after_fork_in_child as _after_fork_in_child
from avest_client.vllm.sidecar.labels import (
    DEFAULT_HARDWARE,
    SAMPLE_METHOD_LABEL,
    default_hardware,
    pair_labels,
)
from avest_client.vllm.sidecar.supervisor import POLL_S, Supervisor, logger
from avest_client.vllm.sidecar.sync import FATAL_CODES, REPOLL_S, PairSync
from avest_client.vllm.sink import Coefficients

__all__ = [
    "DEFAULT_HARDWARE",
    "FATAL_CODES",
    "POLL_S",
    "REPOLL_S",
    "SAMPLE_METHOD_LABEL",
    "SidecarSink",
    "_LIVE",
    "_after_fork_in_child",
    "default_hardware",
    "logger",
    "make_sink",
    "pair_labels",
]


def make_sink(config: ShimConfig, pair_key: PairKey) -> SidecarSink:
    """The sink the plugin gives the shim; raises (the shim then runs vLLM's estimator alone)."""
    if not isinstance(config, ShimConfig) or not config.address:
        raise ValueError("AVEST_ADDRESS is not set")
    if not pair_key.target or not pair_key.draft:
        raise ValueError(
            "cannot name the pair: target or draft model unknown "
            f"(target={pair_key.target!r}, draft={pair_key.draft!r})"
        )
    return SidecarSink(config, pair_key)


class SidecarSink(Supervisor, PairSync):
    """See the module docstring. Implements :class:`avest_client.vllm.sink.Sink`."""

    def __init__(
        self,
        config: ShimConfig,
        pair_key: PairKey,
        *,
        hardware: str | None = None,
        recorder: costs.CostCurveRecorder | None = None,
        backoff: Backoff | None = None,
        poll_s: float = POLL_S,
    ) -> None:
        self.config = config
        self.pair_key = pair_key
        self.labels = pair_labels(pair_key)
        self.hardware = hardware or config.hardware or default_hardware()
        self._recorder = costs.RECORDER if recorder is None else recorder
        self._backoff = backoff or Backoff(initial_s=0.05, max_s=5.0)
        self._poll_s = poll_s
        self._timeout = config.timeout_s
        self._capacity = config.queue_size
        self._pid = os.getpid()
        # Lazy: no channel until the supervisor's first call (after the fork).
        self._client = EstimatorClient(str(config.address), timeout=self._timeout)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self._forked = False
        # What the step reads (written by the supervisor only).
        self._connected = False
        self._coef: Coefficients | None = None
        # Before registration: steps wait here (drop-oldest, same capacity).
        self._buffer: deque[Any] = deque()  # step tuples and round summaries
        self._fwd: Forwarder | None = None
        # Supervisor state.
        self.pair_id = ""
        self.rule = ""
        self.refit_interval = 0
        self.registrations = 0
        self.cost_curves_sent = 0
        self.error: AvestError | None = None  # a refusal that made the sink give up
        self._need_register = True
        self._register_at = 0.0
        self._attempt = 0
        self._registered_at = 0.0
        self._stream_seen = False
        self._known: Coefficients | None = None  # from RegisterPair / GetCoefficients
        self._stale_above: int | None = None  # the forwarder's view is stale up to this version
        self._repoll_at = 0.0
        self._reconnects_seen = 0
        self._error_seen = ""
        self._costs_sent_version = 0
        self._costs_due = False
        self._costs_at = 0.0
        self._costs_attempt = 0
        self._submitted = 0
        self._buffer_dropped = 0
        self._unsent_at_close = 0
        self._failures_logged = 0
        self._progress_at = 0.0
        self._acked_seen = 0
        self._was_streaming = False
        self._stalled = False
        self.stalls = 0
        _LIVE.add(self)
        self._thread = threading.Thread(target=self._run, name="avest-sink", daemon=True)
        self._thread.start()

    # -- Sink protocol: the step's side ----------------------------------------

    @property
    def connected(self) -> bool:
        return self._connected

    def latest_coefficients(self) -> Coefficients | None:
        return self._coef

    def latest_calibration(self) -> tuple[tuple[float, ...], tuple[float, ...], bool] | None:
        """The calibration table pushed with the stream's coefficients (None before any)."""
        fwd = self._fwd
        return None if fwd is None else fwd.latest_calibration()

    def submit(
        self,
        features: np.ndarray,
        num_verified: np.ndarray,
        num_accepted: np.ndarray,
        exclude: np.ndarray | None = None,
    ) -> None:
        if self._closed or self._forked:
            return
        self._submitted += 1  # one caller thread (the shim's forwarder)
        fwd = self._fwd
        if fwd is None:
            with self._lock:
                fwd = self._fwd
                if fwd is None:
                    if len(self._buffer) >= self._capacity:
                        self._buffer.popleft()
                        self._buffer_dropped += 1
                    self._buffer.append((features, num_verified, num_accepted, exclude))
                    return
        fwd.submit(features, num_verified, num_accepted, exclude)

    def submit_summary(self, summary: RoundSummary) -> None:
        """Queue one round summary (summary mode); non-blocking, like :meth:`submit`."""
        if self._closed or self._forked:
            return
        self._submitted += 1
        fwd = self._fwd
        if fwd is None:
            with self._lock:
                fwd = self._fwd
                if fwd is None:
                    if len(self._buffer) >= self._capacity:
                        self._buffer.popleft()
                        self._buffer_dropped += 1
                    self._buffer.append(summary)
                    return
        fwd.submit_summary(summary)

    def close(self, timeout: float | None = None) -> None:
        """Send what is queued and wait for its acknowledgements, for at most ``timeout`` s.

        Default ``AVEST_TIMEOUT_S``. Returns within about ``timeout + 3`` s
        whatever the sidecar does.
        """
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        t = self._timeout if timeout is None else max(0.0, timeout)
        deadline = time.monotonic() + t
        if self._forked or os.getpid() != self._pid:
            return  # the threads and channel belong to the parent
        with self._lock:
            fwd = self._fwd
            self._unsent_at_close = len(self._buffer)
            self._buffer.clear()
        if fwd is not None:
            fwd.close(timeout=t)
        self._client.close()  # cancels a registration or cost-curve call in flight
        self._thread.join(max(0.1, deadline - time.monotonic()))
        self._connected = False
        _LIVE.discard(self)

    # -- observability -----------------------------------------------------------

    @property
    def dropped(self) -> int:
        """Steps discarded unsent: the pre-registration buffer's and the forwarder's drops."""
        fwd = self._fwd
        return self._buffer_dropped + (fwd.stats.dropped if fwd is not None else 0)

    @property
    def stats(self) -> dict[str, Any]:
        """Counters: the client forwarder's (:class:`avest_client.Stats`) and the sink's own.

        ``received == buffered + dropped + invalid + acked + refused + pending``
        (+ ``unsent_at_close`` after :meth:`close`); ``dropped`` counts the
        pre-registration buffer's drops and the forwarder's.
        """
        fwd = self._fwd
        with self._lock:
            buffered = len(self._buffer)
        out: dict[str, Any] = asdict(fwd.stats if fwd is not None else Stats())
        fwd_dropped = out["dropped"]
        out.update(
            received=self._submitted,
            buffered=buffered,
            buffer_dropped=self._buffer_dropped,
            forwarder_dropped=fwd_dropped,
            dropped=self._buffer_dropped + fwd_dropped,
            unsent_at_close=self._unsent_at_close,
            connected=self._connected,
            pair_id=self.pair_id,
            registrations=self.registrations,
            stalls=self.stalls,
            cost_curves_sent=self.cost_curves_sent,
            hardware=self.hardware,
            coefficients_version=None if self._coef is None else self._coef[0],
            error=str(self.error) if self.error else "",
        )
        return out

    @property
    def forwarder(self) -> Forwarder | None:
        """The client forwarder, once the pair is registered."""
        return self._fwd

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every step received so far is acknowledged (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        while True:
            fwd = self._fwd
            if fwd is not None and not self._buffer:
                return fwd.flush(max(0.0, deadline - time.monotonic()))
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)

    def wait_connected(self, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while not self._connected:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True
