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

import logging
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import asdict
from typing import Any

import grpc
import numpy as np

from avest_client import Backoff, EstimatorClient, Stats
from avest_client.errors import AvestError
from avest_client.forwarder import Forwarder
from avest_client.vllm import costs
from avest_client.vllm.config import ShimConfig
from avest_client.vllm.pair import PairKey
from avest_client.vllm.sink import Coefficients

logger = logging.getLogger(__name__)

#: How often the supervisor looks at the forwarder, the cost curves and the clock.
POLL_S = 0.02
#: How often coefficients are fetched directly while the stream's view is stale.
REPOLL_S = 1.0
#: Registration answers that retrying cannot change: the sink gives up (local refits).
FATAL_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
    }
)
#: Label added to the pair key from vLLM's speculative config (AVEST_LABELS may override).
SAMPLE_METHOD_LABEL = "draft_sample_method"
DEFAULT_HARDWARE = "default"


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


def pair_labels(pair_key: PairKey) -> dict[str, str]:
    """The labels registered with the pair: AVEST_LABELS plus vLLM's draft sampling method."""
    labels = dict(pair_key.labels)
    if pair_key.draft_sample_method:
        labels.setdefault(SAMPLE_METHOD_LABEL, pair_key.draft_sample_method)
    return labels


def default_hardware() -> str:
    """The CUDA device name when CUDA is already initialised here, else ``"default"``.

    Never initialises CUDA itself (the sink may be built in a process that
    must not, and the label is not worth it).
    """
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            name = torch.cuda.get_device_name()
            return name.encode()[:128].decode(errors="ignore") or DEFAULT_HARDWARE
    except Exception:  # noqa: BLE001
        pass
    return DEFAULT_HARDWARE


class SidecarSink:
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
        self._buffer: deque[tuple[Any, Any, Any, Any]] = deque()
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

    # -- the supervisor ------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._tick(time.monotonic())
            except Exception:  # noqa: BLE001 - keep supervising whatever happens
                if self._failures_logged < 5:
                    self._failures_logged += 1
                    logger.exception("avest: sink supervisor step failed")
            self._stop.wait(self._poll_s)

    def _tick(self, now: float) -> None:
        if self.error is not None:
            self._connected = False
            return
        fwd = self._fwd
        if fwd is not None:
            self._watch_forwarder(fwd, fwd.stats)
        if self._need_register and now >= self._register_at:
            self._try_register(now)
        if self.pair_id:
            self._maybe_send_costs(now)
            if self._stale_above is not None and now >= self._repoll_at:
                self._repoll(now)
        fwd = self._fwd
        if fwd is None:
            self._connected = False
        else:
            self._refresh(fwd, fwd.stats, time.monotonic())

    def _watch_forwarder(self, fwd: Forwarder, st: Stats) -> None:
        reconnects = st.reconnects
        if reconnects != self._reconnects_seen:
            # A new stream: the sidecar may have restarted. Register again
            # (idempotent) so a sidecar without our pair learns it, resend curves.
            self._reconnects_seen = reconnects
            self._need_register = True
        err = fwd.last_error
        if err != self._error_seen:
            self._error_seen = err
            if err.startswith("NOT_FOUND"):
                self._need_register = True

    def _try_register(self, now: float) -> None:
        key = self.pair_key
        try:
            reg = self._client.register(
                key.target, key.draft, key.method, key.num_speculative_tokens, self.labels
            )
        except AvestError as exc:
            if self._stop.is_set():
                return
            if exc.code in FATAL_CODES:
                self.error = exc
                self._connected = False
                logger.error("avest: the sidecar refused the pair; local refits only: %s", exc)
                return
            delay = self._backoff.delay(self._attempt)
            if self._attempt == 0:
                logger.warning(
                    "avest: cannot register with the sidecar at %s (%s); retrying, "
                    "local refits meanwhile",
                    self.config.address,
                    exc,
                )
            self._attempt += 1
            self._register_at = now + delay
            return
        c = reg.coefficients
        known: Coefficients = (int(c.version), float(c.slope), [float(b) for b in c.intercepts])
        if self.pair_id and reg.pair_id != self.pair_id:
            logger.warning("avest: pair id changed %s -> %s", self.pair_id, reg.pair_id)
        self.rule, self.refit_interval = reg.rule, reg.refit_interval
        self._attempt = 0
        self._need_register = False
        self._known = known
        self._costs_due = True
        self._costs_attempt = 0
        self._costs_at = 0.0
        self.registrations += 1
        fwd = self._fwd
        if fwd is None:
            # The stream opens in a moment: connected meanwhile (the warm start
            # applies at once), for at most AVEST_TIMEOUT_S.
            self._registered_at, self._stream_seen = time.monotonic(), False
            self.pair_id = reg.pair_id
            self._start_forwarder(reg.pair_id)
            logger.info(
                "avest: registered pair %s (%s, refit every %d); coefficients version %d",
                reg.pair_id,
                reg.rule,
                reg.refit_interval,
                known[0],
            )
        else:
            live = fwd.latest_coefficients()
            if live is not None and known[0] < live[0]:
                # A sidecar that lost its state counts from the start again.
                logger.warning(
                    "avest: the sidecar's coefficients went back from version %d to %d",
                    live[0],
                    known[0],
                )
                self._stale_above = live[0]
                self._repoll_at = time.monotonic() + REPOLL_S

    def _start_forwarder(self, pair_id: str) -> None:
        fwd = self._client.forwarder(
            pair_id,
            queue_size=self._capacity,
            k=self.pair_key.num_speculative_tokens,
            connect_timeout=self._timeout,
            backoff=self._backoff,
        )
        fwd.start()
        with self._lock:
            if not self._closed:
                # In order, before anything submitted after this point.
                while self._buffer:
                    fwd.submit(*self._buffer.popleft())
                self._fwd = fwd
        if self._fwd is not fwd:  # closed meanwhile
            fwd.close(timeout=0.0)
            return
        self._reconnects_seen = fwd.stats.reconnects

    def _maybe_send_costs(self, now: float) -> None:
        snap = self._recorder.snapshot()
        if snap is None or now < self._costs_at:
            return
        version, draft, verify, limit = snap
        if version == self._costs_sent_version and not self._costs_due:
            return
        try:
            self._client.set_cost_curves(
                self.pair_id, draft, verify, cudagraph_limit=limit, hardware=self.hardware
            )
        except AvestError as exc:
            if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
                logger.error("avest: the sidecar refused the cost curves: %s", exc)
                self._costs_sent_version, self._costs_due = version, False
                return
            self._costs_at = now + self._backoff.delay(self._costs_attempt)
            self._costs_attempt += 1
            return
        self._costs_sent_version, self._costs_due = version, False
        self._costs_attempt = 0
        self.cost_curves_sent += 1
        logger.info("avest: cost curves for %r sent to pair %s", self.hardware, self.pair_id)

    def _repoll(self, now: float) -> None:
        self._repoll_at = now + REPOLL_S
        try:
            c = self._client.coefficients(self.pair_id)
        except AvestError:
            return
        self._known = (int(c.version), float(c.slope), [float(b) for b in c.intercepts])

    def _refresh(self, fwd: Forwarder, st: Stats, now: float) -> None:
        streaming = fwd.connected
        if streaming:
            self._stream_seen = True
        opening = not self._stream_seen and now - self._registered_at < self._timeout
        # A stream that stays open while nothing it carries is acknowledged for
        # AVEST_TIMEOUT_S (a hung sidecar) is as good as lost: local refits resume.
        if not streaming or not self._was_streaming or st.pending == 0:
            self._progress_at = now
        if st.acked_sequence != self._acked_seen:
            self._acked_seen, self._progress_at = st.acked_sequence, now
        self._was_streaming = streaming
        stalled = streaming and now - self._progress_at > self._timeout
        if stalled != self._stalled:
            self._stalled = stalled
            if stalled:
                self.stalls += 1
                logger.warning(
                    "avest: the sidecar acknowledged nothing for %.1fs; local refits meanwhile",
                    now - self._progress_at,
                )
        live = fwd.latest_coefficients()
        if self._stale_above is not None:
            if live is not None and live[0] > self._stale_above:
                self._stale_above = None  # the stream's view caught up
            else:
                live = None
        known = self._known
        best = known if live is None or (known is not None and known[0] > live[0]) else live
        if best != self._coef:
            self._coef = best
        self._connected = (streaming or opening) and not stalled and self.registrations > 0


#: Sinks of this process, so a forked child can disarm the copies it inherits.
_LIVE: weakref.WeakSet[SidecarSink] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # The parent's threads and channel do not exist here: an inherited sink
    # must neither claim a connection nor serve coefficients nobody updates.
    for sink in list(_LIVE):
        sink._forked = True
        sink._connected = False
        sink._coef = None
    _LIVE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
