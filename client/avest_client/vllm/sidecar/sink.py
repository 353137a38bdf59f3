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
* The supervisor thread (``avest-sink``, :meth:`SidecarSink._tick`), every
  ``poll_s``: registers the pair
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
from dataclasses import asdict
from operator import attrgetter
from typing import Any

import numpy as np

from avest_client._stream import Backoff, StratumSummary
from avest_client.client import EstimatorClient
from avest_client.forwarder import Forwarder
from avest_client.ledger import Stats
from avest_client.types import Served
from avest_client.vllm import costs
from avest_client.vllm.config import ShimConfig
from avest_client.vllm.sidecar import fork, logger
from avest_client.vllm.sidecar.handoff import Handoff
from avest_client.vllm.sidecar.health import StreamHealth
from avest_client.vllm.sidecar.labels import default_hardware, pair_labels
from avest_client.vllm.sidecar.sync import CostSender, Registrar
from avest_wire.pair import PairKey
from avest_wire.summary import RoundSummary

#: How often the supervisor looks at the forwarder, the cost curves and the clock.
POLL_S = 0.02


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


class SidecarSink:
    """See the module docstring. Implements :class:`avest_client.vllm.sink.Sink`.

    Its parts each own their state: the :class:`.handoff.Handoff` of steps to
    the forwarder, the :class:`.sync.Registrar` and :class:`.sync.CostSender`,
    the :class:`.health.StreamHealth` of the stream. The sink itself holds the
    two values the step reads, written by its supervisor thread only.
    """

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
        self._backoff = backoff or Backoff(initial_s=0.05, max_s=5.0)
        self._poll_s = poll_s
        self._timeout = config.timeout_s
        self._pid = os.getpid()
        # Lazy: no channel until the supervisor's first call (after the fork).
        self._client = EstimatorClient(str(config.address), timeout=self._timeout)
        self._stop = threading.Event()
        self._closed = False
        self._forked = False
        self._failures_logged = 0
        # What the step reads (written by the supervisor only).
        self._connected = False
        self._coef: Served | None = None
        #: Each stratum's pushed set for the coefficients in ``_coef`` (same object
        #: until they change; empty: none pushed, or for other coefficients).
        self._strata: dict[str, Served] = {}
        self._handoff = Handoff(config.queue_size)
        self._registrar = Registrar(
            config, pair_key, self.labels, self._client, self._backoff, self._stop
        )
        self._costs = CostSender(
            costs.RECORDER if recorder is None else recorder,
            self._client,
            self.hardware,
            self._backoff,
        )
        self._health = StreamHealth(self._timeout)
        fork.LIVE.add(self)
        self._thread = threading.Thread(target=self._run, name="avest-sink", daemon=True)
        self._thread.start()

    # -- Sink protocol: the step's side ----------------------------------------

    @property
    def connected(self) -> bool:
        return self._connected

    def latest_coefficients(self) -> Served | None:
        return self._coef

    def latest_strata(self) -> dict[str, Served]:
        """Each stratum's set pushed with the coefficients :meth:`latest_coefficients`
        holds (docs/strata.md); the same object until it changes. Do not modify it."""
        return self._strata

    def latest_calibration(self) -> tuple[tuple[float, ...], tuple[float, ...], bool] | None:
        """The calibration table pushed with the stream's coefficients (None before any)."""
        fwd = self._handoff.forwarder
        return None if fwd is None else fwd.latest_calibration()

    def submit(
        self,
        features: np.ndarray,
        num_verified: np.ndarray,
        num_accepted: np.ndarray,
        exclude: np.ndarray | None = None,
        strata: list[str] | None = None,
    ) -> None:
        """``strata``: each row's stratum (docs/strata.md), None for pooled traffic."""
        if self._closed or self._forked:
            return
        fwd = self._handoff.offer((features, num_verified, num_accepted, exclude, strata))
        if fwd is not None:
            fwd.submit(features, num_verified, num_accepted, exclude, strata)

    def submit_summary(self, summary: RoundSummary, stratum: str | None = None) -> None:
        """Queue one round summary (summary mode; ``stratum``: the stratum whose drafts
        it sums, None for the worker's pooled round); non-blocking, like :meth:`submit`."""
        if self._closed or self._forked:
            return
        if stratum is None:
            fwd = self._handoff.offer(summary)
            if fwd is not None:
                fwd.submit_summary(summary)
            return
        fwd = self._handoff.offer(StratumSummary(summary, stratum))
        if fwd is not None:
            fwd.submit_summary(summary, stratum)

    def close(self, timeout: float | None = None) -> None:
        """Send what is queued and wait for its acknowledgements, for at most ``timeout`` s.

        Default ``AVEST_TIMEOUT_S``. Returns within about ``timeout + 3`` s
        whatever the sidecar does.
        """
        if self._closed:
            return
        self._closed = True
        self._handoff.shut()
        self._stop.set()
        t = self._timeout if timeout is None else max(0.0, timeout)
        deadline = time.monotonic() + t
        if self._forked or os.getpid() != self._pid:
            return  # the threads and channel belong to the parent
        fwd = self._handoff.drain()
        if fwd is not None:
            fwd.close(timeout=t)
        self._client.close()  # cancels a registration or cost-curve call in flight
        self._thread.join(max(0.1, deadline - time.monotonic()))
        self._connected = False
        fork.LIVE.discard(self)

    def disarm(self) -> None:
        """In a forked child: the parent's threads and channel do not exist here."""
        self._forked = True
        self._connected = False
        self._coef = None

    # -- the supervisor (the avest-sink thread) ----------------------------------

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
        reg = self._registrar
        if reg.error is not None:
            self._connected = False
            return
        fwd = self._handoff.forwarder
        if fwd is not None and self._health.needs_register(fwd, fwd.stats):
            reg.needed = True
        if reg.due(now):
            self._register(now)
        if reg.pair_id:
            self._costs.send(now, reg.pair_id)
            reg.repoll(now)
        fwd = self._handoff.forwarder
        if fwd is None:
            self._connected = False
            return
        serves = self._health.serves(fwd, fwd.stats, time.monotonic())
        best = reg.serve(fwd.latest_coefficients())
        # the strata first: a step that sees new coefficients sees their strata too
        strata = self._strata_for(fwd, best)
        if strata is not None:  # None: a push half read; both values next tick
            if strata != self._strata:
                self._strata = strata
            if best != self._coef:
                self._coef = best
        self._connected = serves and reg.registrations > 0

    @staticmethod
    def _strata_for(fwd: Forwarder, best: Served | None) -> dict[str, Served] | None:
        """The strata pushed with ``best``: none when it is not the pushed coefficients
        (the registration's warm start, a poll after a restart); None while the stream's
        latest push is half stored (its strata still an older push's)."""
        if best is None:
            return {}
        reader = getattr(fwd, "latest_strata", None)
        pushed: dict[str, Served] = reader() if reader is not None else {}
        latest = fwd.latest_coefficients()
        if latest is None:
            return {}
        if any(s.version != latest.version for s in pushed.values()):
            return None
        return pushed if latest.version == best.version else {}

    def _register(self, now: float) -> None:
        fwd = self._handoff.forwarder
        reg = self._registrar.register(now, fwd)
        if self._registrar.error is not None:
            self._connected = False
        if reg is None:
            return
        self._costs.again()
        if fwd is None:
            # The stream opens in a moment: connected meanwhile (the warm start
            # applies at once), for at most AVEST_TIMEOUT_S.
            self._health.opening(time.monotonic())
            self._start_forwarder(reg.pair_id)
            logger.info(
                "avest: registered pair %s (%s, refit every %d); coefficients version %d",
                reg.pair_id,
                reg.rule,
                reg.refit_interval,
                reg.coefficients.version,
            )

    def _start_forwarder(self, pair_id: str) -> None:
        fwd = self._client.forwarder(
            pair_id,
            queue_size=self.config.queue_size,
            k=self.pair_key.k,
            connect_timeout=self._timeout,
            backoff=self._backoff,
        )
        fwd.start()
        if not self._handoff.attach(fwd):  # closed meanwhile
            fwd.close(timeout=0.0)
            return
        self._health.attached(fwd)

    # -- observability -----------------------------------------------------------

    # What the parts know, read through the sink. ``error``: a refusal that made
    # the sink give up (local refits only), or None.
    pair_id = property(attrgetter("_registrar.pair_id"))
    rule = property(attrgetter("_registrar.rule"))
    refit_interval = property(attrgetter("_registrar.refit_interval"))
    registrations = property(attrgetter("_registrar.registrations"))
    error = property(attrgetter("_registrar.error"))
    cost_curves_sent = property(attrgetter("_costs.sent"))
    stalls = property(attrgetter("_health.stalls"))
    _recorder = property(attrgetter("_costs.recorder"))

    @property
    def dropped(self) -> int:
        """Steps discarded unsent: the pre-registration buffer's and the forwarder's drops."""
        fwd = self._handoff.forwarder
        return self._handoff.dropped + (fwd.stats.dropped if fwd is not None else 0)

    @property
    def stats(self) -> dict[str, Any]:
        """Counters: the client forwarder's (:class:`avest_client.Stats`) and the sink's own.

        ``received == buffered + dropped + invalid + acked + refused + pending``
        (+ ``unsent_at_close`` after :meth:`close`); ``dropped`` counts the
        pre-registration buffer's drops and the forwarder's.
        """
        handoff = self._handoff
        fwd = handoff.forwarder
        buffered = handoff.held()
        out: dict[str, Any] = asdict(fwd.stats if fwd is not None else Stats())
        fwd_dropped = out["dropped"]
        out.update(
            received=handoff.received,
            buffered=buffered,
            buffer_dropped=handoff.dropped,
            forwarder_dropped=fwd_dropped,
            dropped=handoff.dropped + fwd_dropped,
            unsent_at_close=handoff.unsent_at_close,
            connected=self._connected,
            pair_id=self.pair_id,
            registrations=self.registrations,
            stalls=self.stalls,
            cost_curves_sent=self.cost_curves_sent,
            hardware=self.hardware,
            coefficients_version=None if self._coef is None else self._coef.version,
            error=str(self.error) if self.error else "",
        )
        return out

    @property
    def forwarder(self) -> Forwarder | None:
        """The client forwarder, once the pair is registered."""
        return self._handoff.forwarder

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every step received so far is acknowledged (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        while True:
            fwd = self._handoff.forwarder
            if fwd is not None and self._handoff.empty:
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
