"""Prometheus metrics of a real service on 127.0.0.1:0, fed through the gRPC API
and scraped over HTTP (parsed with prometheus_client's own parser)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from avest import __version__
from avest.core.estimator import OnlineEstimator
from avest.core.metrics import CalibrationState, CalibrationSummary
from avest.core.rules import OUTCOMES
from avest.grpc.interceptor import method_label
from avest.metrics import collector
from avest.metrics import names as N
from avest.metrics import registry as M
from avest.metrics.buckets import RPC_BUCKETS
from avest.state.admission import Admission
from avest.state.pairs import Pair
from avest_wire.pair import PairKey
from avest_wire.v1 import estimator_pb2 as pb
from tests.support.live import Live as _Live
from tests.support.live import messages, observe, register
from tests.support.live import register as shared_register
from tests.support.metrics import scrape, select, value

# -- helpers --------------------------------------------------------------------


def recent_calibration(live: _Live, pair_id: str) -> CalibrationSummary:
    """The pair's recent calibration summary, read on the server's event loop."""

    async def read() -> CalibrationSummary:
        pair = live.handle.server.app.registry.get(pair_id)
        summary: CalibrationSummary = pair.estimator.recent_calibration.summary()
        return summary

    result: CalibrationSummary = live.handle.call(read)
    return result


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


# -- the names --------------------------------------------------------------------


def _positions_are(samples: Any, pid: str, cal: Any, predicted: str, observed: str) -> None:
    """Each position's ``predicted`` and ``observed`` acceptance gauges are ``cal``'s
    (the service's summary, or the recent one), rates in [0, 1]."""
    for pos, p in enumerate(cal.by_position):
        got_p = value(samples, predicted, pair=pid, position=str(pos))
        got_o = value(samples, observed, pair=pid, position=str(pos))
        assert got_p == pytest.approx(p.mean_predicted, abs=1e-12)
        assert got_o == pytest.approx(p.observed, abs=1e-12)
        assert 0.0 < got_p < 1.0 and 0.0 <= got_o <= 1.0


def test_names_are_defined_once_prefixed_and_in_base_units() -> None:
    names = [m.name for m in N.METRICS]
    assert len(names) == len(set(names))
    for spec in N.METRICS:
        assert spec.name.startswith("avest_")
        assert spec.kind in ("gauge", "counter", "histogram")
        assert spec.name.endswith("_total") == (spec.kind == "counter"), spec.name
        assert not spec.name.endswith("_ms") and "millis" not in spec.name
        # Never unbounded labels.
        assert not {"request", "request_id", "worker", "worker_id"} & set(spec.labels)
    assert "avest_rpc_duration_seconds_bucket" in N.exposed_names()
    assert N.REFITS == "avest_refits_total" and N.SPECS[N.REFITS].labels == ("pair", "outcome")
    # The recent calibration gauges mirror the cumulative ones, labels included.
    for recent, cumulative in (
        (N.RECENT_AUC, N.AUC),
        (N.RECENT_ECE, N.ECE),
        (N.RECENT_LOG_LOSS, N.LOG_LOSS),
        (N.RECENT_PREDICTED_ACCEPTANCE, N.PREDICTED_ACCEPTANCE),
        (N.RECENT_OBSERVED_ACCEPTANCE, N.OBSERVED_ACCEPTANCE),
    ):
        assert recent == cumulative.replace("avest_", "avest_recent_", 1)
        assert N.SPECS[recent].labels == N.SPECS[cumulative].labels
        assert N.SPECS[recent].kind == "gauge"
        assert "0.95" in N.SPECS[recent].help and "20 rounds" in N.SPECS[recent].help


def test_every_metric_is_exposed_with_its_labels(live: _Live) -> None:
    register(live)
    # register() makes a recursive pair; one on the default rule too (no metric is
    # tracking-only now, so this is a second rule, not a gauge's precondition)
    shared_register(live, 5, 10, target="tracked-model", rule=pb.UPDATE_RULE_TRACKING)
    samples = scrape(live)
    for spec in N.METRICS:
        if spec.name in N.REPLICA_METRICS:  # on SQLite: one process, no replica series
            assert not set(spec.sample_names()) & set(samples), spec.name
            continue
        if spec.name in N.SCHEDULE_METRICS:  # none asked for (test_schedule_service.py)
            assert not set(spec.sample_names()) & set(samples), spec.name
            continue
        if spec.name in N.STRATUM_METRICS:  # no strata here (test_strata_service.py)
            assert not set(spec.sample_names()) & set(samples), spec.name
            continue
        for name in spec.sample_names():
            assert name in samples, f"{name} missing from /metrics"
            for s in samples[name]:
                labels = set(s.labels) - {"le"}
                assert labels == set(spec.labels), (name, s.labels)
    avest = {n for n in samples if n.startswith("avest_")}
    # Everything avest_ on the page is declared (prometheus_client's *_created aside).
    assert {n for n in avest if not n.endswith("_created")} <= N.exposed_names()
    assert value(samples, N.INFO, version=__version__) == 1.0


# -- per-pair series ----------------------------------------------------------------


def test_per_pair_series_exist_from_registration(live: _Live) -> None:
    pid = register(live, k=5, workload="chat")
    samples = scrape(live)
    assert value(samples, N.PAIRS) == 1.0
    info = select(samples, N.PAIR_INFO, pair=pid)
    assert len(info) == 1 and info[0].value == 1.0
    assert info[0].labels == {
        "pair": pid,
        "target": "target-model",
        "draft": "draft-model",
        "method": "eagle",
        "k": "5",
        "rule": "recursive",
        "labels": "workload=chat",
    }
    assert value(samples, N.SLOPE, pair=pid) == 0.5
    for pos in range(5):
        assert value(samples, N.INTERCEPT, pair=pid, position=str(pos)) == -0.2
        assert math.isnan(value(samples, N.PREDICTED_ACCEPTANCE, pair=pid, position=str(pos)))
        assert math.isnan(value(samples, N.OBSERVED_ACCEPTANCE, pair=pid, position=str(pos)))
    assert not select(samples, N.INTERCEPT, pair=pid, position="5")
    for pos in range(5):
        for name in (N.RECENT_PREDICTED_ACCEPTANCE, N.RECENT_OBSERVED_ACCEPTANCE):
            assert math.isnan(value(samples, name, pair=pid, position=str(pos))), name
    assert not select(samples, N.RECENT_OBSERVED_ACCEPTANCE, pair=pid, position="5")
    for name in (N.AUC, N.ECE, N.LOG_LOSS, N.RECENT_AUC, N.RECENT_ECE, N.RECENT_LOG_LOSS):
        assert math.isnan(value(samples, name, pair=pid)), name
    assert value(samples, N.CALIBRATION_DRAFTS, pair=pid) == 0.0
    assert value(samples, N.COEFFICIENTS_VERSION, pair=pid) == 0.0
    assert value(samples, N.ROUND, pair=pid) == 0.0
    assert value(samples, N.DRAFTS_OBSERVED, pair=pid) == 0.0
    assert value(samples, N.STEPS_OBSERVED, pair=pid) == 0.0
    for outcome in OUTCOMES:
        assert value(samples, N.REFITS, pair=pid, outcome=outcome) == 0.0
    assert value(samples, N.LAST_OBSERVED, pair=pid) == pytest.approx(time.time(), abs=60)
    assert value(samples, N.QUEUE_DEPTH) == 0.0


def test_gauges_follow_the_service_state(live: _Live, trace_slice: Any) -> None:
    trace = trace_slice("sample", 0, 120)
    pid = register(live, k=trace.k, refit_interval=10)
    assert observe(live, messages(trace, pid)) == 120
    coef = live.stub.GetCoefficients(pb.GetCoefficientsRequest(pair_id=pid)).coefficients
    pair = live.stub.GetPair(pb.GetPairRequest(pair_id=pid)).pair
    samples = scrape(live)

    # Coefficients: exactly those GetCoefficients returns (floats round-trip).
    assert coef.version > 0
    assert value(samples, N.SLOPE, pair=pid) == coef.slope
    for pos, b in enumerate(coef.intercepts):
        assert value(samples, N.INTERCEPT, pair=pid, position=str(pos)) == b
    assert value(samples, N.COEFFICIENTS_VERSION, pair=pid) == coef.version
    assert value(samples, N.ROUND, pair=pid) == coef.round == 12

    # Totals.
    assert value(samples, N.STEPS_OBSERVED, pair=pid) == pair.steps_observed == 120
    assert value(samples, N.DRAFTS_OBSERVED, pair=pid) == pair.drafts_observed
    assert pair.drafts_observed == int(trace.labels()[0].sum())
    refits = {o: value(samples, N.REFITS, pair=pid, outcome=o) for o in OUTCOMES}
    assert sum(refits.values()) == 12
    # Every version step is an applied or slope-held refit (rejected keeps the version).
    assert refits["applied"] + refits["slope_held"] == coef.version
    assert value(samples, N.REFIT_DURATION + "_count") == 12
    assert value(samples, N.REFIT_DURATION + "_sum") > 0

    # Calibration: the service's summary.
    cal = pair.calibration
    assert value(samples, N.AUC, pair=pid) == pytest.approx(cal.auc, abs=1e-12)
    assert value(samples, N.ECE, pair=pid) == pytest.approx(cal.ece, abs=1e-12)
    assert value(samples, N.LOG_LOSS, pair=pid) == pytest.approx(cal.logloss, abs=1e-12)
    assert value(samples, N.CALIBRATION_DRAFTS, pair=pid) == cal.count == pair.drafts_observed
    _positions_are(samples, pid, cal, N.PREDICTED_ACCEPTANCE, N.OBSERVED_ACCEPTANCE)
    assert value(samples, N.LAST_OBSERVED, pair=pid) == pytest.approx(time.time(), abs=60)
    assert value(samples, N.QUEUE_DEPTH) == 0.0  # the stream ended durable

    # Recent calibration: the estimator's decayed state, read on the server's loop.
    recent = recent_calibration(live, pid)
    assert 0 < recent.count < cal.count  # older rounds weigh less
    assert value(samples, N.RECENT_AUC, pair=pid) == pytest.approx(recent.auc, abs=1e-12)
    assert value(samples, N.RECENT_ECE, pair=pid) == pytest.approx(recent.ece, abs=1e-12)
    assert value(samples, N.RECENT_LOG_LOSS, pair=pid) == pytest.approx(recent.logloss, abs=1e-12)
    assert len(recent.by_position) == trace.k
    predicted, observed = N.RECENT_PREDICTED_ACCEPTANCE, N.RECENT_OBSERVED_ACCEPTANCE
    _positions_are(samples, pid, recent, predicted, observed)


def test_restored_pairs_are_exposed_before_any_call(
    open_server: Callable[..., _Live], trace_slice: Any
) -> None:
    trace = trace_slice("sample", 0, 40)
    first = open_server()
    pid = register(first, k=trace.k, refit_interval=10)
    observe(first, messages(trace, pid))
    before = scrape(first)
    first.stop()

    second = open_server()
    after = scrape(second)
    for name, labels in (
        (N.SLOPE, {"pair": pid}),
        (N.INTERCEPT, {"pair": pid, "position": "0"}),
        (N.COEFFICIENTS_VERSION, {"pair": pid}),
        (N.ROUND, {"pair": pid}),
        (N.STEPS_OBSERVED, {"pair": pid}),
        (N.DRAFTS_OBSERVED, {"pair": pid}),
        (N.AUC, {"pair": pid}),
    ):
        assert value(after, name, **labels) == value(before, name, **labels), name
    assert value(after, N.PAIRS) == 1.0
    # Refit counts are this process's: zero, but present.
    assert value(after, N.REFITS, pair=pid, outcome="applied") == 0.0


# -- refusals, RPC latency, streams, queue depth --------------------------------------


def test_refused_batches_are_counted_by_method_and_reason(live: _Live) -> None:
    pid = register(live, k=4)
    bad = pb.ObserveRequest(
        pair_id=pid,
        worker_id="w0",
        sequence=1,
        features=b"\0" * 8,  # rows*k*4 = 16 bytes expected
        rows=1,
        k=4,
        num_verified=[4],
        num_accepted=[1],
    )
    with pytest.raises(grpc.RpcError) as err:
        observe(live, [bad])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        live.stub.GetCoefficients(pb.GetCoefficientsRequest(pair_id="0" * 16), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    wrong_k = pb.ObserveRequest(
        pair_id=pid,
        worker_id="w0",
        sequence=1,
        features=b"\0" * 12,
        rows=1,
        k=3,
        num_verified=[3],
        num_accepted=[1],
    )
    with pytest.raises(grpc.RpcError):
        observe(live, [wrong_k])

    samples = scrape(live)
    assert value(samples, N.REFUSED_BATCHES, method="Observe", reason="invalid_argument") == 2
    assert value(samples, N.REFUSED_BATCHES, method="GetCoefficients", reason="not_found") == 1
    assert value(samples, N.REFUSED_BATCHES, method="Observe", reason="not_found") == 0
    # The state is untouched.
    assert value(samples, N.STEPS_OBSERVED, pair=pid) == 0.0
    # The aborted calls are timed under their status code.
    count = N.RPC_DURATION + "_count"
    assert value(samples, count, method="Observe", code="INVALID_ARGUMENT") == 2
    assert value(samples, count, method="GetCoefficients", code="NOT_FOUND") == 1


def test_rpc_duration_by_method_and_status(live: _Live, trace_slice: Any) -> None:
    trace = trace_slice("sample", 0, 12)
    pid = register(live, k=trace.k)
    observe(live, messages(trace, pid))
    live.stub.GetPair(pb.GetPairRequest(pair_id=pid), timeout=10)
    with pytest.raises(grpc.RpcError):
        live.stub.GetPair(pb.GetPairRequest(pair_id="nope"), timeout=10)
    # An unknown method is UNIMPLEMENTED and never becomes a label value.
    nope = live.channel.unary_unary("/avest.v1.EstimatorService/Nope")
    with pytest.raises(grpc.RpcError) as err:
        nope(b"", timeout=10)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED

    samples = scrape(live)
    count = N.RPC_DURATION + "_count"
    assert value(samples, count, method="RegisterPair", code="OK") == 1
    assert value(samples, count, method="Observe", code="OK") == 1
    assert value(samples, count, method="GetPair", code="OK") == 1
    assert value(samples, count, method="GetPair", code="NOT_FOUND") == 1
    assert not select(samples, count, method="Nope")
    buckets = select(samples, N.RPC_DURATION + "_bucket", method="Observe", code="OK")
    assert len(buckets) == len(RPC_BUCKETS) + 1
    assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == 1
    # Every declared method has a series from the start.
    methods = {s.labels["method"] for s in samples[count]}
    assert {"Score", "Budget", "WatchCoefficients", "ListPairs", "SetCostCurves"} <= methods


def test_streams_are_timed_whole_and_counted_while_open(live: _Live) -> None:
    pid = register(live, k=3)
    watch = live.stub.WatchCoefficients(pb.WatchCoefficientsRequest(pair_id=pid), timeout=30)
    assert next(watch).coefficients.version == 0
    assert value(scrape(live), N.OPEN_STREAMS) == 1.0
    time.sleep(0.3)
    watch.cancel()
    count = N.RPC_DURATION + "_count"

    def closed() -> bool:
        s = scrape(live)
        return value(s, N.OPEN_STREAMS) == 0.0 and bool(
            select(s, count, method="WatchCoefficients", code="CANCELLED")
        )

    wait_for(closed)
    samples = scrape(live)
    assert value(samples, count, method="WatchCoefficients", code="CANCELLED") == 1
    # The whole call: at least the time the stream stayed open.
    assert value(
        samples, N.RPC_DURATION + "_sum", method="WatchCoefficients", code="CANCELLED"
    ) >= (0.3)


def test_queue_depth_counts_applied_steps_until_durable(
    open_server: Callable[..., _Live], trace_slice: Any
) -> None:
    # No periodic flush and no refit: steps stay applied-not-durable while the stream is open.
    live = open_server(flush_interval_ms=600_000)
    trace = trace_slice("sample", 0, 5)
    pid = register(live, k=trace.k, refit_interval=1000)
    release = threading.Event()

    def requests() -> Iterator[Any]:
        yield from messages(trace, pid)
        release.wait(30)

    call = live.stub.Observe(requests(), timeout=60)
    try:
        wait_for(lambda: value(scrape(live), N.STEPS_OBSERVED, pair=pid) == 5.0)
        assert value(scrape(live), N.QUEUE_DEPTH) == 5.0
    finally:
        release.set()
    acks = [r.ack.acked_sequence for r in call if r.HasField("ack")]
    assert acks and max(acks) == 5
    assert value(scrape(live), N.QUEUE_DEPTH) == 0.0


# -- the Metrics object on its own ----------------------------------------------------


class _App:
    class _Hooks:
        def __init__(self) -> None:
            self.refit: list[Any] = []
            self.removed: list[Any] = []
            self.written: list[Any] = []

    class _Registry:
        pairs: dict[str, Any] = {}

    def __init__(self) -> None:
        self.hooks = self._Hooks()
        self.registry = self._Registry()
        self.admission = Admission()  # no pair's queue made: nothing waits


def test_injected_registries_are_independent() -> None:
    a, b = CollectorRegistry(), CollectorRegistry()
    ma, mb = M.Metrics(_App(), registry=a), M.Metrics(_App(), registry=b)
    ma.refused("Observe", "invalid_argument")
    mb.refused("Observe", "made-up reason")  # unknown reasons are bounded to "other"
    assert (
        a.get_sample_value(N.REFUSED_BATCHES, {"method": "Observe", "reason": "invalid_argument"})
        == 1
    )
    assert b.get_sample_value(N.REFUSED_BATCHES, {"method": "Observe", "reason": "other"}) == 1
    assert (
        b.get_sample_value(N.REFUSED_BATCHES, {"method": "Observe", "reason": "made-up reason"})
        is None
    )
    assert a.get_sample_value(N.PAIRS) == 0.0
    body, ctype = ma.exposition()
    assert b"avest_pairs 0.0" in body and ctype.startswith("text/plain")


def test_queue_depth_definition() -> None:
    assert collector.queue_depth({}, {}) == 0
    assert collector.queue_depth({"a": 7, "b": 3}, {"a": 5}) == 2 + 3
    assert collector.queue_depth({"a": 5}, {"a": 5}) == 0


def test_method_labels() -> None:
    assert method_label("/avest.v1.EstimatorService/Observe") == "Observe"
    assert method_label("/grpc.health.v1.Health/Check") == "grpc.health.v1.Health/Check"


class _CountingEstimator(OnlineEstimator):
    """An estimator that counts reads of its calibration properties (each of
    which merges the closed rounds and the open one into a fresh state)."""

    def __init__(self, k: int) -> None:
        self.reads = {"all": 0, "recent": 0}
        super().__init__(k, refit_interval=3)

    @property
    def calibration(self) -> CalibrationState:
        self.reads["all"] += 1
        return super().calibration

    @property
    def recent_calibration(self) -> CalibrationState:
        self.reads["recent"] += 1
        return super().recent_calibration


class _AppWith(_App):
    def __init__(self, *pairs: Pair) -> None:
        super().__init__()
        self.registry = SimpleNamespace(pairs={p.id: p for p in pairs})


def test_calibration_summaries_are_cached_until_the_state_changes() -> None:
    k = 3
    est = _CountingEstimator(k)
    pair = Pair(key=PairKey.of("t", "d", "eagle", k), rule_name="vllm", estimator=est)
    registry = CollectorRegistry()
    metrics = M.Metrics(_AppWith(pair), registry=registry)
    rng = np.random.default_rng(3)

    def step() -> None:
        est.observe(rng.uniform(-3, 5, size=(4, k)), [k] * 4, rng.integers(0, k + 1, size=4))

    def scrape_recent_ece() -> float | None:
        return registry.get_sample_value(N.RECENT_ECE, {"pair": pair.id})

    # Fresh objects per property read, so caching on their identity never hit:
    # one read per kind, however many scrapes and API calls ask.
    assert est.calibration is not est.calibration
    est.reads.update(all=0, recent=0)
    first = metrics.summary(pair)
    assert math.isnan(first.ece) and math.isnan(scrape_recent_ece())
    for _ in range(3):
        assert metrics.summary(pair) is first
        metrics.recent_summary(pair)
        metrics.exposition()
    assert est.reads == {"all": 1, "recent": 1}

    # A step (steps), a refit with no new step (round), a reset (version): each
    # invalidates both summaries, once.
    expected = {"all": 1, "recent": 1}
    for change in (step, est.refit, est.reset):
        change()
        before = metrics.summary(pair)
        recent = metrics.recent_summary(pair)
        metrics.exposition()
        expected = {kind: n + 1 for kind, n in expected.items()}
        assert est.reads == expected, change
        # (repr: NaN measures compare equal that way)
        assert repr(before) == repr(est.calibration.summary())
        assert repr(recent) == repr(est.recent_calibration.summary())
        est.reads.update(expected)
    # After steps and refits the recent window is a decayed (smaller) weight.
    est.reset()
    for _ in range(7):  # two refits and an open round of one step
        step()
    recent = metrics.recent_summary(pair)
    assert 0 < recent.count < metrics.summary(pair).count
    assert scrape_recent_ece() == pytest.approx(recent.ece, abs=1e-12)
    assert registry.get_sample_value(
        N.RECENT_OBSERVED_ACCEPTANCE, {"pair": pair.id, "position": "0"}
    ) == pytest.approx(recent.by_position[0].observed, abs=1e-12)
