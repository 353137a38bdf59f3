"""Prometheus metrics of the avest service.

Every metric name, its type, labels and help text is defined once, here, in
:data:`METRICS` (the dashboards, alert rules and tests import the constants
below rather than spelling names). All names start with ``avest_``, use base
units (seconds, Unix time) and carry bounded labels only:

``pair``      the pair id (16 hex digits, at most ``max_pairs`` of them)
``position``  draft position, ``"0"`` .. ``"K-1"`` (0-based, as vLLM's
              ``vllm:spec_decode_num_accepted_tokens_per_pos_total``)
``method``    gRPC method: ``"Observe"`` etc. for ``avest.v1.EstimatorService``,
              ``"grpc.health.v1.Health/Check"`` style for the other services
``code``      gRPC status code name (``OK``, ``INVALID_ARGUMENT``, ...)
``outcome``   refit outcome, one of :data:`avest.core.rules.OUTCOMES`
``reason``    refusal reason, one of :data:`REFUSAL_REASONS`

Per-pair series come from a custom collector that reads the registry on every
scrape, so each exists from the pair's registration (or restoration from the
store) on, before any observation. Their values come from the pair's state:
``avest_drafts_observed_total`` and ``avest_steps_observed_total`` are the
estimator's persisted totals, so they continue across restarts and drop to 0
when the pair is reset through the admin API (Prometheus treats that as a
counter reset). ``avest_refits_total`` counts refits seen by this process.

Calibration gauges (AUC, ECE, log loss, predicted and observed acceptance) are
the pair's cumulative calibration state (every draft since registration or the
last reset, each scored with the coefficients in force when it was applied).
They are NaN while undefined (no drafts yet; AUC with only one class).
``avest_observed_acceptance{position=i}`` is the acceptance rate of drafts at
position ``i`` *given that position was verified* (the earlier drafts of the
row were accepted): a conditional rate. vLLM's
``rate(vllm:spec_decode_num_accepted_tokens_per_pos_total[5m]) /
rate(vllm:spec_decode_num_drafts_total[5m])`` is the unconditional rate,
comparable to the running product of avest's per-position rates.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from avest import __version__
from avest.core.metrics import CalibrationSummary
from avest.core.rules import OUTCOMES, Refit

log = logging.getLogger("avest.metrics")

PREFIX = "avest_"

# -- names ---------------------------------------------------------------------

INFO = "avest_info"
PAIRS = "avest_pairs"
PAIR_INFO = "avest_pair_info"
SLOPE = "avest_slope"
INTERCEPT = "avest_intercept"
COEFFICIENTS_VERSION = "avest_coefficients_version"
ROUND = "avest_round"
AUC = "avest_auc"
ECE = "avest_ece"
LOG_LOSS = "avest_log_loss"
CALIBRATION_DRAFTS = "avest_calibration_drafts"
PREDICTED_ACCEPTANCE = "avest_predicted_acceptance"
OBSERVED_ACCEPTANCE = "avest_observed_acceptance"
LAST_OBSERVED = "avest_last_observed_timestamp_seconds"
DRAFTS_OBSERVED = "avest_drafts_observed_total"
STEPS_OBSERVED = "avest_steps_observed_total"
REFITS = "avest_refits_total"
REFIT_DURATION = "avest_refit_duration_seconds"
RPC_DURATION = "avest_rpc_duration_seconds"
OPEN_STREAMS = "avest_open_streams"
QUEUE_DEPTH = "avest_queue_depth"
REFUSED_BATCHES = "avest_refused_batches_total"

#: Values of the ``reason`` label of :data:`REFUSED_BATCHES` (the gRPC adapter's
#: refusal reasons); anything else is counted as ``other``.
REFUSAL_REASONS = (
    "invalid_argument",
    "not_found",
    "resource_exhausted",
    "failed_precondition",
    "other",
)

#: Buckets of :data:`RPC_DURATION`: unary calls take 0.1 ms to tens of ms,
#: streams (Observe, WatchCoefficients) last seconds to hours.
RPC_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    900.0,
    3600.0,
)
#: Buckets of :data:`REFIT_DURATION` (one Newton step on K+1 parameters).
REFIT_BUCKETS = (
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)


@dataclass(frozen=True)
class MetricSpec:
    """One metric family as exposed: ``name`` is what PromQL uses (counters
    end in ``_total``; a histogram's samples add ``_bucket``, ``_sum`` and
    ``_count``)."""

    name: str
    kind: str  # "gauge" | "counter" | "histogram"
    labels: tuple[str, ...]
    help: str

    def sample_names(self) -> tuple[str, ...]:
        if self.kind == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


#: Every avest metric, in exposition order.
METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(INFO, "gauge", ("version",), "Always 1; the avest version serving."),
    MetricSpec(PAIRS, "gauge", (), "Model pairs registered (or restored)."),
    MetricSpec(
        PAIR_INFO,
        "gauge",
        ("pair", "target", "draft", "method", "k", "rule", "labels"),
        "Always 1; names of each pair (labels: its key labels as k=v,... sorted).",
    ),
    MetricSpec(SLOPE, "gauge", ("pair",), "Shared slope of the coefficients in force."),
    MetricSpec(
        INTERCEPT, "gauge", ("pair", "position"), "Per-position intercept of the coefficients."
    ),
    MetricSpec(
        COEFFICIENTS_VERSION,
        "gauge",
        ("pair",),
        "Version of the coefficients in force (+1 per applied refit and per reset).",
    ),
    MetricSpec(ROUND, "gauge", ("pair",), "Refit rounds closed (applied or not)."),
    MetricSpec(
        AUC, "gauge", ("pair",), "AUC of the predictions (NaN until both outcomes are seen)."
    ),
    MetricSpec(ECE, "gauge", ("pair",), "Expected calibration error over 15 probability bins."),
    MetricSpec(LOG_LOSS, "gauge", ("pair",), "Mean log loss (nats per draft) of the predictions."),
    MetricSpec(
        CALIBRATION_DRAFTS,
        "gauge",
        ("pair",),
        "Labelled drafts the calibration gauges are computed over.",
    ),
    MetricSpec(
        PREDICTED_ACCEPTANCE,
        "gauge",
        ("pair", "position"),
        "Mean predicted acceptance probability of verified drafts at the position.",
    ),
    MetricSpec(
        OBSERVED_ACCEPTANCE,
        "gauge",
        ("pair", "position"),
        "Observed acceptance rate of verified drafts at the position (conditional on reaching it).",
    ),
    MetricSpec(
        LAST_OBSERVED,
        "gauge",
        ("pair",),
        "Unix time of the last step applied to the pair (its registration before any).",
    ),
    MetricSpec(
        DRAFTS_OBSERVED,
        "counter",
        ("pair",),
        "Labelled (verified) drafts folded into the pair since registration or reset.",
    ),
    MetricSpec(
        STEPS_OBSERVED,
        "counter",
        ("pair",),
        "Observe steps applied to the pair since registration or reset (duplicates excluded).",
    ),
    MetricSpec(
        REFITS, "counter", ("pair", "outcome"), "Refits by outcome, counted by this process."
    ),
    MetricSpec(
        REFIT_DURATION,
        "histogram",
        (),
        "Seconds to apply the step that closes a round and refit.",
    ),
    MetricSpec(
        RPC_DURATION,
        "histogram",
        ("method", "code"),
        "gRPC call duration in seconds (streams: the whole call) by method and status code.",
    ),
    MetricSpec(OPEN_STREAMS, "gauge", (), "Open Observe and WatchCoefficients streams."),
    MetricSpec(
        QUEUE_DEPTH,
        "gauge",
        (),
        "Observe steps applied but not yet durable (so not yet acknowledged), summed over "
        "pairs and workers, counted in sequence numbers.",
    ),
    MetricSpec(
        REFUSED_BATCHES,
        "counter",
        ("method", "reason"),
        "Requests refused (state untouched) by method and reason.",
    ),
)
SPECS: dict[str, MetricSpec] = {m.name: m for m in METRICS}


def exposed_names() -> frozenset[str]:
    """Every sample name avest exposes (for checking dashboards and rules)."""
    return frozenset(n for m in METRICS for n in m.sample_names())


def _family_name(name: str) -> str:
    return name[: -len("_total")] if name.endswith("_total") else name


# -- the per-pair collector ----------------------------------------------------


class _PairCollector:
    """Reads the registry on each scrape: every pair's gauges and totals."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def _families(self) -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
        out: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for name in (
            INFO,
            PAIRS,
            PAIR_INFO,
            SLOPE,
            INTERCEPT,
            COEFFICIENTS_VERSION,
            ROUND,
            AUC,
            ECE,
            LOG_LOSS,
            CALIBRATION_DRAFTS,
            PREDICTED_ACCEPTANCE,
            OBSERVED_ACCEPTANCE,
            LAST_OBSERVED,
            DRAFTS_OBSERVED,
            STEPS_OBSERVED,
            REFITS,
            OPEN_STREAMS,
            QUEUE_DEPTH,
        ):
            spec = SPECS[name]
            if spec.kind == "counter":
                out[name] = CounterMetricFamily(
                    _family_name(name), spec.help, labels=list(spec.labels)
                )
            else:
                out[name] = GaugeMetricFamily(name, spec.help, labels=list(spec.labels))
        return out

    def describe(self) -> Iterable[Metric]:
        return list(self._families().values())

    def collect(self) -> Iterable[Metric]:
        m = self._metrics
        f = self._families()
        f[INFO].add_metric([__version__], 1.0)
        f[OPEN_STREAMS].add_metric([], float(m.open_streams()))
        pairs = list(m.app.registry.pairs.values())
        f[PAIRS].add_metric([], float(len(pairs)))
        depth = 0
        for pair in pairs:
            pid = pair.id
            est = pair.estimator
            key = pair.key
            f[PAIR_INFO].add_metric(
                [
                    pid,
                    key.target,
                    key.draft,
                    key.method,
                    str(key.k),
                    pair.rule_name,
                    ",".join(f"{k}={v}" for k, v in key.labels),
                ],
                1.0,
            )
            coef = est.coefficients
            f[SLOPE].add_metric([pid], coef.slope)
            for i, b in enumerate(coef.intercepts):
                f[INTERCEPT].add_metric([pid, str(i)], b)
            f[COEFFICIENTS_VERSION].add_metric([pid], float(est.version))
            f[ROUND].add_metric([pid], float(est.round))
            s = m.summary(pair)
            f[AUC].add_metric([pid], s.auc)
            f[ECE].add_metric([pid], s.ece)
            f[LOG_LOSS].add_metric([pid], s.logloss)
            f[CALIBRATION_DRAFTS].add_metric([pid], s.count)
            for i, p in enumerate(s.by_position):
                f[PREDICTED_ACCEPTANCE].add_metric([pid, str(i)], p.mean_predicted)
                f[OBSERVED_ACCEPTANCE].add_metric([pid, str(i)], p.observed)
            f[LAST_OBSERVED].add_metric([pid], float(pair.updated))
            f[DRAFTS_OBSERVED].add_metric([pid], float(est.drafts))
            f[STEPS_OBSERVED].add_metric([pid], float(est.steps))
            counts = m.refit_counts(pid)
            for outcome in OUTCOMES:
                f[REFITS].add_metric([pid, outcome], float(counts.get(outcome, 0)))
            depth += queue_depth(pair.applied, pair.durable)
        f[QUEUE_DEPTH].add_metric([], float(depth))
        return list(f.values())


def queue_depth(applied: dict[str, int], durable: dict[str, int]) -> int:
    """Sequence numbers applied but not yet durable, summed over workers.

    Exact when a worker numbers its steps consecutively (the client does);
    a gap in a worker's sequence counts as that many steps.
    """
    return sum(max(0, seq - durable.get(worker, 0)) for worker, seq in applied.items())


# -- the interceptor -----------------------------------------------------------

_ESTIMATOR_PREFIX = "/avest.v1.EstimatorService/"


def method_label(full_method: str) -> str:
    """``"/avest.v1.EstimatorService/Observe"`` -> ``"Observe"``; other services
    keep ``"package.Service/Method"``."""
    if full_method.startswith(_ESTIMATOR_PREFIX):
        return full_method[len(_ESTIMATOR_PREFIX) :]
    return full_method.lstrip("/")


def _status(context: Any, exc: BaseException | None) -> str:
    """The status code name a call ended with."""
    code = None
    try:
        code = context.code()
    except Exception:  # not every context implements code()
        code = None
    if isinstance(code, grpc.StatusCode):
        if exc is None or code != grpc.StatusCode.OK:
            return str(code.name)
    elif isinstance(code, int) and exc is None:
        # Some grpc versions report the raw integer.
        for sc in grpc.StatusCode:
            if sc.value[0] == code:
                return str(sc.name)
    if exc is None:
        return "OK"
    if isinstance(exc, (GeneratorExit, StopAsyncIteration)):
        return "CANCELLED"
    if isinstance(exc, asyncio.CancelledError):
        try:
            remaining = context.time_remaining()
        except Exception:
            remaining = None
        if remaining is not None and remaining <= 0:
            return "DEADLINE_EXCEEDED"
        return "CANCELLED"
    return "UNKNOWN"


class _Interceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Times every call (streams: start to end) by method and final status."""

    def __init__(self, histogram: Histogram) -> None:
        self._histogram = histogram
        self._children: dict[tuple[str, str], Any] = {}

    def _observe(self, method: str, code: str, seconds: float) -> None:
        child = self._children.get((method, code))
        if child is None:
            child = self._children[(method, code)] = self._histogram.labels(method, code)
        child.observe(seconds)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: UNIMPLEMENTED, never labelled
            return handler
        method = method_label(handler_call_details.method)
        kw = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(method, handler.unary_unary), **kw
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._wrap_unary(method, handler.stream_unary), **kw
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(method, handler.unary_stream), **kw
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._wrap_stream(method, handler.stream_stream), **kw
            )
        return handler

    def _wrap_unary(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def timed(request: Any, context: Any) -> Any:
            t0 = time.perf_counter()
            exc: BaseException | None = None
            try:
                result = behavior(request, context)
                if hasattr(result, "__await__"):
                    result = await result
                return result
            except BaseException as e:
                exc = e
                raise
            finally:
                self._observe(method, _status(context, exc), time.perf_counter() - t0)

        return timed

    def _wrap_stream(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(behavior):
            # A handler that writes with context.write() and returns nothing.
            return self._wrap_unary(method, behavior)

        async def timed(request: Any, context: Any) -> AsyncIterator[Any]:
            t0 = time.perf_counter()
            exc: BaseException | None = None
            result: Any = None
            try:
                result = behavior(request, context)
                if hasattr(result, "__aiter__"):
                    async for item in result:
                        yield item
                elif hasattr(result, "__await__"):
                    await result
                elif result is not None:
                    for item in result:
                        yield item
            except BaseException as e:
                exc = e
                raise
            finally:
                aclose = getattr(result, "aclose", None)
                if exc is not None and aclose is not None:
                    # Already failing: keep the first error.
                    with contextlib.suppress(BaseException):
                        await aclose()
                self._observe(method, _status(context, exc), time.perf_counter() - t0)

        return timed


# -- the facade ----------------------------------------------------------------


class Metrics:
    """The service's Prometheus metrics on their own (injected) registry.

    Attaches to ``app.hooks`` (refits); reads ``app.registry`` on each scrape.
    """

    def __init__(self, app: Any, registry: CollectorRegistry | None = None) -> None:
        self.app = app
        self.registry = registry if registry is not None else CollectorRegistry()
        self.open_streams: Callable[[], int] = lambda: 0
        self._refits: dict[str, dict[str, int]] = {}
        self._summaries: dict[str, tuple[tuple[int, ...], CalibrationSummary]] = {}
        self.refit_duration = Histogram(
            _family_name(REFIT_DURATION),
            SPECS[REFIT_DURATION].help,
            buckets=REFIT_BUCKETS,
            registry=self.registry,
        )
        self.rpc_duration = Histogram(
            RPC_DURATION,
            SPECS[RPC_DURATION].help,
            labelnames=SPECS[RPC_DURATION].labels,
            buckets=RPC_BUCKETS,
            registry=self.registry,
        )
        self.refused_batches = Counter(
            REFUSED_BATCHES,
            SPECS[REFUSED_BATCHES].help,
            labelnames=SPECS[REFUSED_BATCHES].labels,
            registry=self.registry,
        )
        self._refused_children: dict[tuple[str, str], Any] = {}
        for method in _estimator_methods():
            self.rpc_duration.labels(method, "OK")
            for reason in REFUSAL_REASONS:
                self._refused_child(method, reason)
        self.registry.register(_PairCollector(self))
        try:
            ProcessCollector(registry=self.registry)
        except Exception:  # pragma: no cover - platforms without /proc
            log.debug("process metrics unavailable", exc_info=True)
        app.hooks.refit.append(self._on_refit)

    # -- wiring used by the server ----------------------------------------

    def set_open_streams(self, fn: Callable[[], int]) -> None:
        self.open_streams = fn

    def refused(self, method: str, reason: str) -> None:
        """Count one refused request (``reason`` outside REFUSAL_REASONS -> ``other``)."""
        if reason not in REFUSAL_REASONS:
            reason = "other"
        self._refused_child(method, reason).inc()

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        return _Interceptor(self.rpc_duration)

    def exposition(self) -> tuple[bytes, str]:
        """The text exposition of every metric, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    # -- state shared with the HTTP API -------------------------------------

    def summary(self, pair: Any) -> CalibrationSummary:
        """The pair's calibration summary, recomputed only when it changed."""
        est = pair.estimator
        stamp = (id(est.calibration), est.steps, est.version, est.round)
        cached = self._summaries.get(pair.id)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        s: CalibrationSummary = est.calibration.summary()
        self._summaries[pair.id] = (stamp, s)
        return s

    def refit_counts(self, pair_id: str) -> dict[str, int]:
        return self._refits.get(pair_id, {})

    # -- hooks --------------------------------------------------------------

    def _on_refit(self, pair: Any, refit: Refit, seconds: float) -> None:
        counts = self._refits.setdefault(pair.id, {})
        counts[refit.outcome] = counts.get(refit.outcome, 0) + 1
        self.refit_duration.observe(seconds)

    def _refused_child(self, method: str, reason: str) -> Any:
        child = self._refused_children.get((method, reason))
        if child is None:
            child = self._refused_children[(method, reason)] = self.refused_batches.labels(
                method, reason
            )
        return child


def _estimator_methods() -> Iterator[str]:
    from avest.v1 import estimator_pb2 as pb

    yield from pb.DESCRIPTOR.services_by_name["EstimatorService"].methods_by_name
