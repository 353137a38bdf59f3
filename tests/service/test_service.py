"""The real service on 127.0.0.1:0 through its gRPC API: exact learning, pooling,
persistence, refusals, health and reflection."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from avest.core.budget import decide
from avest.core.costs import CostTable
from avest.core.estimator import OnlineEstimator
from avest.core.model import Coefficients, linear_predictor, predict, survival
from avest.core.rule_factory import make_rule
from avest.core.rules import VllmRule
from avest.core.stats import fold
from avest.offline.replay import pair_key, replay, step_bounds
from avest_wire import matrix as wire
from avest_wire.rules import UPDATE_RULES
from avest_wire.v1 import estimator_pb2 as pb
from tests.support.rpc import messages_for, observe_all, register, stub_for
from tests.support.serve import spawn
from tests.support.server import ADMIN

pytestmark = pytest.mark.slow


def core_replay(trace, rule, refit_interval, steps=None):
    est = OnlineEstimator(trace.k, make_rule(rule), refit_interval, calibrate=True)
    for lo, hi in step_bounds(trace)[:steps]:
        est.observe(trace.features[lo:hi], trace.num_verified[lo:hi], trace.num_accepted[lo:hi])
    return est


@pytest.mark.parametrize("rule", ["vllm", "recursive", "tracking"])
def test_a_trace_through_the_service_gives_the_core_replay_exactly(server, trace_slice, rule):
    trace = trace_slice("chat", 0, 120)
    channel, stub = stub_for(server.grpc_address)
    with channel:
        reg = register(stub, trace, rule)
        assert reg.created and reg.refit_interval == 10 and reg.update_rule == UPDATE_RULES[rule]
        acked, updates = observe_all(stub, messages_for(trace, reg.pair_id, 0, 1, "w0", 1))
        est = core_replay(trace, rule, 10)
        got = stub.GetCoefficients(pb.GetCoefficientsRequest(pair_id=reg.pair_id)).coefficients
        pair = stub.GetPair(pb.GetPairRequest(pair_id=reg.pair_id)).pair
    rounds = est.round
    assert rounds == (12 if rule != "tracking" else 15)  # tracking: 4 short rounds first
    assert acked == 120
    assert updates == list(range(1, rounds + 1))
    assert got.slope == est.coefficients.slope
    assert tuple(got.intercepts) == est.coefficients.intercepts
    assert (got.version, got.round) == (est.version, est.round) == (rounds, rounds)
    assert pair.drafts_observed == est.drafts == int(trace.labels()[0].sum())
    assert pair.calibration.auc == pytest.approx(est.calibration.summary().auc, abs=1e-12)


def test_workers_pool_into_one_round(server, trace_slice):
    """Round statistics are sums: W concurrent workers give one pooled round."""
    trace = trace_slice("chat", 0, 60)
    messages = sum(len(messages_for(trace, "x", w, 3, "x", 1)) for w in range(3))
    # One refit, when the last of the pooled messages arrives.
    result = asyncio.run(
        replay(server.grpc_address, trace, workers=3, rule="vllm", refit_interval=messages)
    )
    observed, accepted = trace.labels()
    x = trace.features.astype(np.float64)
    start = Coefficients.cold_start(trace.k)
    stats = fold(x, linear_predictor(start, x), observed, accepted)
    expect = VllmRule().refit(start, stats).coefficients
    c = result.pair.coefficients
    assert (c.version, c.round, result.pair.steps_observed) == (1, 1, messages)
    assert c.slope == pytest.approx(expect.slope, abs=1e-12)
    np.testing.assert_allclose(c.intercepts, expect.intercepts, atol=1e-12)
    assert result.pair.drafts_observed == int(observed.sum())


def test_watch_pushes_every_refit(server, trace_slice):
    trace = trace_slice("chat", 0, 50)
    channel, stub = stub_for(server.grpc_address)
    with channel:
        reg = register(stub, trace, "vllm", refit_interval=5)
        watch = stub.WatchCoefficients(pb.WatchCoefficientsRequest(pair_id=reg.pair_id), timeout=30)
        first = next(watch).coefficients
        assert first.version == 0
        observe_all(stub, messages_for(trace, reg.pair_id, 0, 1, "w0", 1))
        versions = [next(watch).coefficients.version for _ in range(10)]
        watch.cancel()
    assert versions == list(range(1, 11))


def test_score_and_budget_equal_the_core(server, trace_slice):
    trace = trace_slice("chat", 0, 40)
    rng = np.random.default_rng(0)
    channel, stub = stub_for(server.grpc_address)
    with channel:
        reg = register(stub, trace, "recursive", refit_interval=10)
        observe_all(stub, messages_for(trace, reg.pair_id, 0, 1, "w0", 1))
        coef_pb = stub.GetCoefficients(pb.GetCoefficientsRequest(pair_id=reg.pair_id)).coefficients
        coef = Coefficients.of(coef_pb.slope, coef_pb.intercepts)
        x = rng.normal(1, 2, size=(32, trace.k)).astype(np.float32)
        data, rows, k = wire.encode(x)
        score = stub.Score(pb.ScoreRequest(pair_id=reg.pair_id, features=data, rows=rows, k=k))
        p = predict(coef, x.astype(np.float64))
        np.testing.assert_allclose(wire.decode(score.confidences, rows, k), p, rtol=1e-6)
        np.testing.assert_allclose(wire.decode(score.survival, rows, k), survival(p), rtol=1e-6)

        draft = [(1, 1.0), (64, 1.5), (256, 3.0)]
        verify = [(1, 5.0), (64, 6.0), (256, 9.0), (1024, 20.0)]
        stub.SetCostCurves(
            pb.SetCostCurvesRequest(
                pair_id=reg.pair_id,
                hardware="h200",
                draft_curve=[pb.CostPoint(size=s, ms=m) for s, m in draft],
                verify_curve=[pb.CostPoint(size=s, ms=m) for s, m in verify],
                cudagraph_capture_limit=256,
            ),
            metadata=ADMIN,
        )
        conf = wire.decode(score.confidences, rows, k)
        scheduled = rng.integers(0, k + 1, size=rows)
        table = CostTable.from_curves(draft, verify, cudagraph_limit=256)
        request = dict(
            pair_id=reg.pair_id,
            confidences=score.confidences,
            rows=rows,
            k=k,
            scheduled_drafts=scheduled.tolist(),
            num_non_draft_tokens=rows,
            num_sampling_requests=rows,
            hardware="h200",
        )
        for rule_pb, name in [
            (pb.BUDGET_RULE_UNSPECIFIED, "lossless-walk"),
            (pb.BUDGET_RULE_ARGMAX, "argmax"),
            (pb.BUDGET_RULE_FULL, "full"),
        ]:
            got = stub.Budget(pb.BudgetRequest(**request, rule=rule_pb))
            want = decide(name, conf.astype(np.float64), scheduled, table, rows, rows)
            assert got.budget == want.budget
            assert list(got.verify_lengths) == want.verify_lengths.tolist()
            assert got.expected_tokens == pytest.approx(want.expected_tokens)
            assert got.lossless == want.lossless
        stale = stub.Budget(pb.BudgetRequest(**request, stale_confidences=score.confidences))
        assert stale.rule == pb.BUDGET_RULE_STALE and stale.lossless


def test_restart_resumes_the_same_coefficients(start_server, tmp_path, trace_slice):
    trace = trace_slice("chat", 0, 60)
    srv = start_server(tmp_path)
    channel, stub = stub_for(srv.grpc_address)
    with channel:
        reg = register(stub, trace, "recursive", refit_interval=7)
        observe_all(stub, messages_for(trace, reg.pair_id, 0, 1, "w0", 1))
        before = stub.GetPair(pb.GetPairRequest(pair_id=reg.pair_id)).pair
    srv.stop()
    srv = start_server(tmp_path)
    channel, stub = stub_for(srv.grpc_address)
    with channel:
        after = stub.GetPair(pb.GetPairRequest(pair_id=reg.pair_id)).pair
        again = register(stub, trace, "recursive", refit_interval=7)
        # The same worker resending the whole trace applies nothing twice ...
        acked, _ = observe_all(stub, messages_for(trace, reg.pair_id, 0, 1, "w0", 1))
        dup = stub.GetPair(pb.GetPairRequest(pair_id=reg.pair_id)).pair
    srv.stop()
    assert after.coefficients.slope == before.coefficients.slope
    assert list(after.coefficients.intercepts) == list(before.coefficients.intercepts)
    assert (after.coefficients.version, after.coefficients.round) == (
        before.coefficients.version,
        before.coefficients.round,
    )
    assert after.drafts_observed == before.drafts_observed
    assert after.calibration.auc == before.calibration.auc
    assert again.pair_id == reg.pair_id and not again.created
    assert again.coefficients.version == before.coefficients.version
    # ... and acknowledges it all.
    assert acked == 60 and dup.steps_observed == before.steps_observed


@contextlib.contextmanager
def _spawned(data_dir, kill=False):
    """``avest serve`` over ``data_dir`` flushing every 10 ms (each full round refitted
    at once), and a stub: ``(process,
    stub)``. At the end the process is killed, or (``kill=False``) stopped with SIGTERM
    and given 20 s to exit."""
    proc, address = spawn(data_dir, "--flush-interval-ms", "10", "--min-refit-interval-ms", "0")
    channel, stub = stub_for(address)
    try:
        yield proc, stub
    finally:
        channel.close()
        if kill:
            proc.kill()
            proc.wait()
        else:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=20)


def test_sigkill_mid_stream_loses_nothing_acknowledged(tmp_path, trace_slice):
    trace = trace_slice("chat", 0, 300)
    with _spawned(tmp_path, kill=True) as (proc, stub):
        reg = register(stub, trace, "recursive", refit_interval=25)
        msgs = messages_for(trace, reg.pair_id, 0, 1, "w0", 1)
        acked = 0

        def slow():
            for i, m in enumerate(msgs):
                yield m
                if i % 20 == 0:
                    time.sleep(0.02)

        with pytest.raises(grpc.RpcError):
            for resp in stub.Observe(slow(), timeout=60):
                if resp.HasField("ack"):
                    acked = resp.ack.acked_sequence
                    if acked >= 120:
                        os.kill(proc.pid, signal.SIGKILL)
    assert 120 <= acked < 300
    with _spawned(tmp_path) as (_, stub):
        restored = stub.GetPair(pb.GetPairRequest(pair_id=reg.pair_id)).pair
        # Everything acknowledged survived, and the last refit is restored.
        assert restored.steps_observed >= acked
        assert restored.coefficients.round == restored.steps_observed // 25
        partial = core_replay(trace, "recursive", 25, restored.steps_observed)
        assert restored.coefficients.slope == partial.coefficients.slope
        # The worker resends what was not acknowledged; duplicates are ignored.
        resent, _ = observe_all(stub, msgs[acked:])
        final = stub.GetPair(pb.GetPairRequest(pair_id=reg.pair_id)).pair
    full = core_replay(trace, "recursive", 25)
    assert resent == 300
    assert final.steps_observed == 300
    assert final.coefficients.slope == full.coefficients.slope
    assert tuple(final.coefficients.intercepts) == full.coefficients.intercepts


def test_health_and_reflection(server):
    channel = grpc.insecure_channel(server.grpc_address)
    with channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "avest.v1.EstimatorService"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        resp = next(
            refl.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            )
        )
        names = {s.name for s in resp.list_services_response.service}
    assert {"avest.v1.EstimatorService", "grpc.health.v1.Health"} <= names


def _step(pair_id, x, d, a, k=None, rows=None, seq=1, worker="w", exclude=()):
    data = np.asarray(x, dtype="<f4").tobytes()
    x = np.asarray(x)
    return pb.ObserveRequest(
        pair_id=pair_id,
        worker_id=worker,
        sequence=seq,
        features=data,
        rows=x.shape[0] if rows is None else rows,
        k=x.shape[1] if k is None else k,
        num_verified=list(d),
        num_accepted=list(a),
        exclude=list(exclude),
    )


def _bad_steps(pid, K):
    good = np.zeros((2, K), dtype=np.float32)
    nan = good.copy()
    nan[0, 1] = np.nan
    inf = good.copy()
    inf[1, 0] = np.inf
    big = good + 41
    return [
        ("features", grpc.StatusCode.INVALID_ARGUMENT, _step(pid, nan, [K, K], [1, 1])),
        ("features", grpc.StatusCode.INVALID_ARGUMENT, _step(pid, inf, [K, K], [1, 1])),
        ("features", grpc.StatusCode.INVALID_ARGUMENT, _step(pid, big, [K, K], [1, 1])),
        ("features", grpc.StatusCode.INVALID_ARGUMENT, _step(pid, good, [K, K], [1, 1], rows=3)),
        ("k", grpc.StatusCode.INVALID_ARGUMENT, _step(pid, np.zeros((2, K + 1)), [K, K], [1, 1])),
        ("num_verified", grpc.StatusCode.INVALID_ARGUMENT, _step(pid, good, [K], [1, 1])),
        ("num_verified", grpc.StatusCode.INVALID_ARGUMENT, _step(pid, good, [K + 1, K], [1, 1])),
        ("num_accepted", grpc.StatusCode.INVALID_ARGUMENT, _step(pid, good, [2, K], [3, 1])),
        (
            "exclude",
            grpc.StatusCode.INVALID_ARGUMENT,
            _step(pid, good, [K, K], [1, 1], exclude=[True]),
        ),
        (
            "worker_id",
            grpc.StatusCode.INVALID_ARGUMENT,
            _step(pid, good, [K, K], [1, 1], worker=""),
        ),
        ("sequence", grpc.StatusCode.INVALID_ARGUMENT, _step(pid, good, [K, K], [1, 1], seq=0)),
        (
            "rows",
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            _step(pid, np.zeros((9, K)), [K] * 9, [1] * 9),
        ),
        ("pair_id", grpc.StatusCode.NOT_FOUND, _step("feedfacefeedface", good, [K, K], [1, 1])),
    ]


def test_every_refusal_names_the_field_and_changes_nothing(start_server, tmp_path, trace_slice):
    trace = trace_slice("chat", 0, 20)
    srv = start_server(tmp_path, max_rows=8, max_message_bytes=64 * 1024, max_pairs=2)
    channel, stub = stub_for(srv.grpc_address)
    with channel:
        reg = register(stub, trace, "vllm", refit_interval=3)
        observe_all(
            stub, [m for m in messages_for(trace, reg.pair_id, 0, 1, "w0", 1) if m.rows <= 8]
        )
        K = trace.k

        def state():
            p = stub.GetPair(pb.GetPairRequest(pair_id=reg.pair_id)).pair
            return p.SerializeToString(deterministic=True)

        before = state()
        for field, code, msg in _bad_steps(reg.pair_id, K):
            with pytest.raises(grpc.RpcError) as err:
                observe_all(stub, [msg])
            assert err.value.code() == code, field
            assert field in err.value.details(), (field, err.value.details())
            assert state() == before, field
        # An oversized message is refused by the transport limit.
        huge = _step(reg.pair_id, np.zeros((8, K)), [K] * 8, [1] * 8)
        huge.worker_id = "w" * 100
        huge.features = b"\0" * (128 * 1024)
        with pytest.raises(grpc.RpcError) as err:
            observe_all(stub, [huge])
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        # Unary refusals.
        def code_of(call, request):
            with pytest.raises(grpc.RpcError) as e:
                call(request, timeout=5, metadata=ADMIN)
            return e.value.code(), e.value.details()

        bad_key = pb.PairKey(
            target_model="t", draft_model="d", method="m", num_speculative_tokens=65
        )
        code, details = code_of(stub.RegisterPair, pb.RegisterPairRequest(key=bad_key))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "num_speculative_tokens" in details
        code, details = code_of(
            stub.RegisterPair,
            pb.RegisterPairRequest(key=pair_key(trace), update_rule=pb.UPDATE_RULE_RECURSIVE),
        )
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "update_rule" in details
        register(stub, trace, "vllm", refit_interval=3, labels={"workload": "b"})
        code, details = code_of(
            stub.RegisterPair,
            pb.RegisterPairRequest(
                key=pb.PairKey(
                    target_model="t", draft_model="d", method="m", num_speculative_tokens=4
                )
            ),
        )
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "pairs" in details
        code, details = code_of(stub.GetCoefficients, pb.GetCoefficientsRequest(pair_id="nope"))
        assert code == grpc.StatusCode.NOT_FOUND and "nope" in details
        x = np.zeros((2, K + 1), dtype="<f4")
        code, details = code_of(
            stub.Score, pb.ScoreRequest(pair_id=reg.pair_id, features=x.tobytes(), rows=2, k=K + 1)
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "k" in details
        conf = np.full((2, K), 0.5, dtype="<f4").tobytes()
        code, details = code_of(
            stub.Budget,
            pb.BudgetRequest(
                pair_id=reg.pair_id,
                confidences=conf,
                rows=2,
                k=K,
                scheduled_drafts=[K, K],
                hardware="none",
            ),
        )
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "hardware" in details
        code, details = code_of(
            stub.SetCostCurves,
            pb.SetCostCurvesRequest(
                pair_id=reg.pair_id,
                draft_curve=[pb.CostPoint(size=1, ms=float("nan"))],
                verify_curve=[pb.CostPoint(size=1, ms=1.0)],
            ),
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "draft_curve" in details
        assert state() == before
    srv.stop()


def test_sigterm_drains_acknowledges_and_snapshots(tmp_path, trace_slice):
    trace = trace_slice("chat", 0, 400)
    with _spawned(tmp_path, kill=True) as (proc, stub):
        reg = register(stub, trace, "recursive", refit_interval=30)
        msgs = messages_for(trace, reg.pair_id, 0, 1, "w0", 1)
        acked = 0
        sent = 0

        def slow():
            nonlocal sent
            for m in msgs:
                sent = m.sequence
                yield m
                time.sleep(0.002)

        stream = stub.Observe(slow(), timeout=60)
        for resp in stream:
            if resp.HasField("ack"):
                acked = resp.ack.acked_sequence
                if acked >= 60 and proc.poll() is None:
                    t0 = time.monotonic()
                    proc.send_signal(signal.SIGTERM)
        # The stream ended cleanly: health went NOT_SERVING, a final snapshot
        # was written and its acknowledgement delivered before the close.
        assert stream.code() == grpc.StatusCode.OK
        assert proc.wait(timeout=15) == 0
        assert time.monotonic() - t0 < 10
    assert 60 <= acked < 400
    with _spawned(tmp_path) as (_, stub):
        restored = stub.GetPair(pb.GetPairRequest(pair_id=reg.pair_id)).pair
    # Nothing applied went unacknowledged or unsaved.
    assert restored.steps_observed == acked
    partial = core_replay(trace, "recursive", 30, acked)
    assert restored.coefficients.slope == partial.coefficients.slope
