"""Prometheus metrics of the avest service: the :class:`Metrics` facade.

The pieces live in their own modules, and their users import them from there:

- :mod:`avest.metrics.names`: every metric's name, type, labels and help
  (:data:`METRICS`, :data:`SPECS`, :func:`exposed_names`, the name constants),
  and what the labels and calibration gauges mean;
- :mod:`avest.metrics.collector`: the per-pair series, read from the registry
  on each scrape;
- :mod:`avest.grpc.interceptor` (the gRPC adapter's) times calls by method and code into
  :attr:`Metrics.rpc_duration`; the server attaches it.
"""

from __future__ import annotations

import asyncio
import gzip as _gzip
import logging
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_PLAIN_0_0_4,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics_core import Metric

from avest.core.metrics import CalibrationState, CalibrationSummary, Reliability
from avest.core.rules import Refit
from avest.metrics.buckets import LOOP_LAG_BUCKETS, REFIT_BUCKETS, RPC_BUCKETS
from avest.metrics.collector import PairCollector
from avest.metrics.names import (
    LOOP_LAG,
    REFIT_DURATION,
    REFUSAL_REASONS,
    REFUSED_BATCHES,
    RPC_DURATION,
    SPECS,
    STORE_WRITE_DURATION,
    family_name,
)
from avest.metrics.workers import WorkerCollector

log = logging.getLogger("avest.metrics")

#: What a cached calibration summary is valid for: (steps, version, round, drafts).
#: The estimator's calibration changes only when a step is applied (steps), a
#: round closes (round), or the pair is reset (version).
_Stamp = tuple[int, int, int, int]


class Metrics:
    """The service's Prometheus metrics on their own (injected) registry.

    Attaches to ``app.hooks`` (refits); reads ``app.registry`` on each scrape.
    """

    def __init__(self, app: Any, registry: CollectorRegistry | None = None) -> None:
        self.app = app
        self.registry = registry if registry is not None else CollectorRegistry()
        self.open_streams: Callable[[], int] = lambda: 0
        self._refits: dict[str, dict[str, int]] = {}
        #: (pair id, "all" | "recent") -> (stamp, summary)
        self._summaries: dict[tuple[str, str], tuple[_Stamp, CalibrationSummary]] = {}
        self._reliabilities: dict[str, Reliability] = {}
        self.refit_duration = self._metric(Histogram, REFIT_DURATION, buckets=REFIT_BUCKETS)
        self.rpc_duration = self._metric(Histogram, RPC_DURATION, buckets=RPC_BUCKETS)
        self.loop_lag = self._metric(Histogram, LOOP_LAG, buckets=LOOP_LAG_BUCKETS)
        self.store_write = self._metric(Histogram, STORE_WRITE_DURATION, buckets=LOOP_LAG_BUCKETS)
        self.refused_batches = self._metric(Counter, REFUSED_BATCHES)
        self._refused_children: dict[tuple[str, str], Any] = {}
        for method in _estimator_methods():
            self.rpc_duration.labels(method, "OK")
            for reason in REFUSAL_REASONS:
                self._refused_child(method, reason)
        self._workers = WorkerCollector(app)
        self.registry.register(self._workers)
        self._pairs = PairCollector(self)
        self.registry.register(self._pairs)
        #: One render on a thread at a time (a scrape storm queues, it does not pile up).
        self._render = ThreadPoolExecutor(max_workers=1, thread_name_prefix="avest-metrics")
        try:
            ProcessCollector(registry=self.registry)
        except Exception:  # pragma: no cover - platforms without /proc
            log.debug("process metrics unavailable", exc_info=True)
        app.hooks.refit.append(self._on_refit)
        app.hooks.removed.append(self._on_removed)
        app.hooks.written.append(lambda pairs, seconds: self.store_write.observe(seconds))

    def _metric(self, kind: Any, name: str, **options: Any) -> Any:
        """The prometheus_client metric ``name`` (a ``kind``) on this registry, with the
        help text and labels :data:`SPECS` gives it."""
        spec = SPECS[name]
        return kind(
            family_name(name), spec.help, labelnames=spec.labels, registry=self.registry, **options
        )

    # -- wiring used by the server ----------------------------------------

    def set_open_streams(self, fn: Callable[[], int]) -> None:
        self.open_streams = fn

    def refused(self, method: str, reason: str) -> None:
        """Count one refused request (``reason`` outside REFUSAL_REASONS -> ``other``)."""
        if reason not in REFUSAL_REASONS:
            reason = "other"
        self._refused_child(method, reason).inc()

    def exposition(self) -> tuple[bytes, str]:
        """The text exposition of every metric, and its content type, in one go.
        (``generate_latest`` writes the 0.0.4 text format; prometheus_client's
        ``CONTENT_TYPE_LATEST`` names 1.0.0, which Prometheus 2.x does not store.)"""
        return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4

    async def exposition_async(self, gzip: bool = False) -> tuple[bytes, str]:
        """The same exposition, its families collected on the event loop (a consistent
        picture of the state, samples copied) and rendered by prometheus_client, then
        gzipped when ``gzip``, on a thread of their own, off the loop."""
        collected = _Collected(list(self.registry.collect()))

        def render() -> bytes:
            text = generate_latest(collected)  # type: ignore[arg-type]
            return _gzip.compress(text, compresslevel=6) if gzip else text

        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._render, render), CONTENT_TYPE_PLAIN_0_0_4

    def close(self) -> None:
        """End the render thread (the server has stopped serving ``/metrics``)."""
        self._render.shutdown(wait=False, cancel_futures=True)

    # -- state shared with the HTTP API -------------------------------------

    def summary(self, pair: Any) -> CalibrationSummary:
        """The pair's cumulative calibration summary, recomputed only when it changed."""
        return self._summary(pair, "all", lambda est: est.calibration)

    def recent_summary(self, pair: Any) -> CalibrationSummary:
        """The pair's recent (decayed per round) calibration summary, cached likewise."""
        return self._summary(pair, "recent", lambda est: est.recent_calibration)

    def _summary(
        self, pair: Any, kind: str, state: Callable[[Any], CalibrationState]
    ) -> CalibrationSummary:
        # The estimator's calibration properties build a fresh merged state on
        # every access: read one only when the stamp says the cache is stale.
        est = pair.estimator
        stamp: _Stamp = (est.steps, est.version, est.round, est.drafts)
        cached = self._summaries.get((pair.id, kind))
        if cached is not None and cached[0] == stamp:
            return cached[1]
        calibration = state(est)
        s = calibration.summary()
        self._summaries[(pair.id, kind)] = (stamp, s)
        if kind == "all":  # the reliability bins, from the same read
            self._reliabilities[pair.id] = calibration.reliability()
        return s

    def reliability(self, pair: Any) -> Reliability:
        """The pair's cumulative reliability bins (all positions pooled), cached
        with its summary."""
        self.summary(pair)
        return self._reliabilities[pair.id]

    def refit_counts(self, pair_id: str) -> dict[str, int]:
        return self._refits.get(pair_id, {})

    # -- hooks --------------------------------------------------------------

    def _on_refit(self, pair: Any, refit: Refit, seconds: float) -> None:
        counts = self._refits.setdefault(pair.id, {})
        counts[refit.outcome] = counts.get(refit.outcome, 0) + 1
        self.refit_duration.observe(seconds)

    def _on_removed(self, pair: Any, why: str) -> None:
        """A deleted pair's series go with it (the collector reads the registry)."""
        self._refits.pop(pair.id, None)
        for kind in ("all", "recent"):
            self._summaries.pop((pair.id, kind), None)

    def _refused_child(self, method: str, reason: str) -> Any:
        child = self._refused_children.get((method, reason))
        if child is None:
            child = self._refused_children[(method, reason)] = self.refused_batches.labels(
                method, reason
            )
        return child


def _estimator_methods() -> Iterator[str]:
    from avest_wire.v1 import estimator_pb2 as pb

    yield from pb.DESCRIPTOR.services_by_name["EstimatorService"].methods_by_name


class _Collected:
    """Families collected once, as prometheus_client's exposition reads a registry."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def accepts_gzip(accept_encoding: str) -> bool:
    """Whether an ``Accept-Encoding`` header allows gzip (``gzip;q=0`` does not)."""
    for item in accept_encoding.split(","):
        name, _, params = item.strip().partition(";")
        if name.strip().lower() not in ("gzip", "*"):
            continue
        q = params.strip()
        if q.startswith("q="):
            try:
                return float(q[2:]) > 0.0
            except ValueError:
                return False
        return True
    return False
