"""Faults with the real sink and the real sidecar: absent, killed mid-run, slow, state lost.

In every case the stand-in's step loop runs at full speed with vLLM's own
refits while the pooled coefficients are unavailable, and forwarding resumes
by itself; the drop counter is exact.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest
import torch

import avest.server
from avest.grpc.service import EstimatorService
from avest_client import EstimatorClient
from avest_wire.coefficients import Coefficients
from tests.support.helpers import f32, free_port
from tests.support.sidecar import (
    CPU,
    DRAFT_CURVE,
    VERIFY_CURVE,
    delivered,
    make_shim,
    sink_of,
    wait_until,
)
from tests.support.standin import StandinAcceptanceEstimator
from tests.support.tracedrive import (
    MAX_REQS,
    Step,
    core_replay,
    run,
    steps,
    synthetic_trace,
    trace_steps,
)

pytestmark = pytest.mark.slow

#: How much slower than vLLM's estimator alone the shim's median step may be here.
#: The benchmark measures the real figure (target <= 20 us); a shared CI box needs slack.
SLACK_US = 250.0


def timed(est, plain, trace: list[Step]) -> tuple[float, float]:  # noqa: ANN001
    """Median wall time of ``step`` (µs), shim and plain interleaved step by step."""
    shim_t, plain_t = [], []
    clock = time.perf_counter_ns
    for s in trace:
        for e, out in ((plain, plain_t), (est, shim_t)):
            e.load_features(s.idx_mapping, s.features)  # vLLM's propose: not timed
            t0 = clock()
            e.step(s.idx_mapping, s.num_sampled, s.num_rejected)
            out.append((clock() - t0) / 1e3)
    return statistics.median(shim_t), statistics.median(plain_t)


def same_state(a, b) -> bool:  # noqa: ANN001
    return all(
        torch.equal(getattr(a, n), getattr(b, n))
        for n in ("slope", "intercepts", "info", "grad", "counts")
    ) and (a._refits, a._steps_since_refit) == (b._refits, b._steps_since_refit)


def copy_of(est) -> StandinAcceptanceEstimator:  # noqa: ANN001
    """A plain estimator continuing from ``est``'s state."""
    ref = StandinAcceptanceEstimator(MAX_REQS, est.num_speculative_steps, CPU)
    for n in ("slope", "intercepts", "info", "grad", "counts", "features", "predictions"):
        setattr(ref, n, getattr(est, n).clone())
    ref._steps_since_refit, ref._refits = est._steps_since_refit, est._refits
    return ref


def test_sidecar_down_from_the_start_is_plain_vllm_at_full_speed(trace_slice):
    trace = trace_steps(trace_slice("chat", 0, 450))
    est = make_shim(f"127.0.0.1:{free_port()}", queue_size=64)
    plain = StandinAcceptanceEstimator(MAX_REQS, 5, CPU)
    shim_us, plain_us = timed(est, plain, trace)
    sink = sink_of(est)
    assert not sink.connected and sink.latest_coefficients() is None
    # vLLM's own refits, bit for bit
    assert est._refits == plain._refits == 4 and same_state(est, plain)
    st = est.avest_stats()
    assert not st["governed"] and st["updates"] == 0 and st["skipped_refits"] == 0
    assert shim_us < plain_us + SLACK_US, (shim_us, plain_us)
    # nothing was registered; the sink kept the newest 64 steps
    assert est._avest.transfer.flush(5)
    s = sink.stats
    assert s["registrations"] == 0 and s["received"] == 450
    assert s["buffered"] == 64 and s["dropped"] == 450 - 64
    t0 = time.perf_counter()
    est.avest_close()
    assert time.perf_counter() - t0 < 5.0 + 3.5


def test_drop_counter_is_exact_and_late_sidecar_gets_the_newest(
    start_sidecar, tmp_path, trace_slice
):
    port = free_port()
    q, n = 4, 50
    trace = trace_steps(trace_slice("chat", 0, n))
    est = make_shim(f"127.0.0.1:{port}", queue_size=q)
    sink = sink_of(est)
    for s in trace:
        run(est, [s])
        assert est._avest.transfer.flush(5)  # the shim's ring hands every step over
    st = est.avest_stats()
    assert st["captured"] == st["submitted"] == n and st["dropped"] == 0
    assert sink.stats["received"] == n
    assert sink.dropped == sink.stats["dropped"] == n - q  # exact: submitted - capacity
    assert sink.stats["buffered"] == q
    # the sidecar appears late: registration (retried with backoff) succeeds and
    # the q newest steps, kept in order, are delivered
    srv = start_sidecar(tmp_path, grpc_address=f"127.0.0.1:{port}", refit_interval=1000)
    assert sink.wait_connected(15)
    assert sink.flush(15), sink.stats
    with EstimatorClient(srv.grpc_address) as client:
        pair = client.pair(sink.pair_id)
    kept = trace[n - q :]
    assert pair.steps_observed == q
    assert pair.drafts_observed == core_replay(kept, 5, pair.rule, 1000, srv.settings).drafts
    s = sink.stats
    assert (s["received"], s["acked"], s["dropped"], s["pending"]) == (n, q, n - q, 0)
    est.avest_close()


def test_killed_mid_run_local_refits_then_resume_and_resend(start_sidecar, tmp_path, trace_slice):
    trace = trace_steps(trace_slice("chat", 0, 451))
    # Acknowledgements come with refits (every 10 steps) or every 5 s: the steps
    # after the last refit are still unacknowledged when the sidecar dies.
    settings = dict(refit_interval=10, default_rule="vllm", flush_interval_ms=5000)
    srv = start_sidecar(tmp_path, **settings)
    port = srv.grpc_port
    est = make_shim(srv.grpc_address)
    sink = sink_of(est)
    assert sink.wait_connected(10)
    run(est, trace[:100])
    wait_until(lambda: sink.stats["acked"] == 100, what="acked")
    wait_until(lambda: getattr(sink.latest_coefficients(), "version", 0) == 10, what="version 10")
    run(est, trace[100:106])  # version 10 in force; no refit, so no acknowledgement
    assert est.avest_stats()["version"] == 10 and est.avest_stats()["governed"]
    pooled = (est.slope.item(), est.intercepts.tolist())
    assert est._avest.transfer.flush(5)
    wait_until(lambda: sink.stats["sent"] == 106, what="sent")

    srv.kill_streams()  # a crash: open streams end, acks in flight are lost
    srv.stop()
    wait_until(lambda: not sink.connected, what="loss noticed")
    unacked = sink.stats["pending"]
    assert unacked == 6  # steps 101..106 were never acknowledged

    # Lost: vLLM's own refits resume from the last pooled coefficients, exactly
    ref = copy_of(est)
    refits = est._refits
    shim_us, plain_us = timed(est, ref, trace[106:350])
    assert same_state(est, ref)
    assert est._refits == refits + 2  # rounds ending during the outage were refit locally
    assert (est.slope.item(), est.intercepts.tolist()) != pooled
    assert not est.avest_stats()["governed"]
    assert shim_us < plain_us + SLACK_US, (shim_us, plain_us)
    assert est._avest.transfer.flush(5)
    assert sink.stats["pending"] == unacked + 244 and sink.stats["dropped"] == 0

    # Back on the same data directory and port: forwarding resumes by itself,
    # the unacknowledged steps are resent, the pooled coefficients govern again.
    srv2 = start_sidecar(tmp_path, grpc_address=f"127.0.0.1:{port}", **settings)
    wait_until(lambda: sink.connected and sink.stats["registrations"] >= 2, what="re-registered")
    run(est, trace[350:450])
    delivered(est)
    s = sink.stats
    # the sidecar had applied and saved them before it died: the answer to the
    # stream's opening acknowledges them all at once, before or after some were
    # resent (on a stream that reached it before it stopped)
    assert s["reconnects"] >= 1 and 0 <= s["resent"] <= unacked
    assert (s["received"], s["acked"], s["dropped"], s["refused"]) == (450, 450, 0, 0)
    with EstimatorClient(srv2.grpc_address) as client:
        pair = client.pair(sink.pair_id)
        current = client.coefficients(sink.pair_id)
    # every step exactly once, in order: the pair is the core replay of the trace
    replay = core_replay(trace[:450], 5, "vllm", 10, srv2.settings)
    assert pair.steps_observed == 450 and pair.drafts_observed == replay.drafts
    assert pair.coefficients.slope == replay.coefficients.slope
    assert pair.coefficients.intercepts == tuple(replay.coefficients.intercepts)
    wait_until(lambda: sink.latest_coefficients().version == current.version, what="latest pushed")
    run(est, trace[450:451])
    assert est.avest_stats()["governed"] and est.avest_stats()["version"] == current.version
    assert est.slope.item() == f32(current.slope)
    est.avest_close()


class _SlowObserve(EstimatorService):
    """Handles each Observe message ``delay`` seconds after it arrives."""

    delay = 0.5

    async def Observe(self, request_iterator, context):  # noqa: ANN001, N802
        async def slow():  # noqa: ANN202
            async for req in request_iterator:
                await asyncio.sleep(self.delay)
                yield req

        async for resp in super().Observe(slow(), context):
            yield resp


def test_slow_sidecar_does_not_slow_the_step(start_sidecar, tmp_path, trace_slice, monkeypatch):
    monkeypatch.setattr(avest.server, "EstimatorService", _SlowObserve)
    srv = start_sidecar(tmp_path, refit_interval=10)
    trace = trace_steps(trace_slice("chat", 0, 300))
    est = make_shim(srv.grpc_address, queue_size=16, timeout_s=2.0)
    sink = sink_of(est)
    assert sink.wait_connected(10)
    plain = StandinAcceptanceEstimator(MAX_REQS, 5, CPU)
    t0 = time.perf_counter()
    shim_us, plain_us = timed(est, plain, trace)
    loop_s = time.perf_counter() - t0
    assert loop_s < 0.5 * 4, loop_s  # 300 steps take less than four slow answers
    assert shim_us < plain_us + SLACK_US, (shim_us, plain_us)
    assert sink.connected  # slow is not lost: pooled coefficients still govern
    assert sink.stats["stalls"] == 0
    assert est.avest_stats()["governed"] and est._refits == 0
    assert est._avest.transfer.flush(5)
    s, st = sink.stats, est.avest_stats()
    # every step is accounted for: dropped by the shim's ring (its consumer is a
    # thread polling every ms), or received by the sink and then acknowledged,
    # dropped (the slow sidecar lets the queue fill) or still pending
    assert st["captured"] == 300 == st["dropped"] + s["received"]
    assert s["dropped"] > 0
    assert s["received"] == s["acked"] + s["dropped"] + s["refused"] + s["pending"]
    # close flushes for at most AVEST_TIMEOUT_S (plus the join margins), then gives up
    t0 = time.perf_counter()
    est.avest_close()
    assert time.perf_counter() - t0 < 2.0 + 2.0 + 3.5


class _HungObserve(_SlowObserve):
    delay = 3600.0


def test_hung_sidecar_counts_as_lost(start_sidecar, tmp_path, monkeypatch):
    """Its stream stays open but acknowledges nothing: after AVEST_TIMEOUT_S local refits run."""
    monkeypatch.setattr(avest.server, "EstimatorService", _HungObserve)
    srv = start_sidecar(tmp_path, refit_interval=10)
    trace = list(steps(synthetic_trace(steps=260, batch=8, k=5, seed=7), MAX_REQS))
    est = make_shim(srv.grpc_address, timeout_s=0.5)
    sink = sink_of(est)
    assert sink.wait_connected(10)
    run(est, trace[:5])
    assert est.avest_stats()["governed"]  # registered, stream open: pooled (version 0)
    wait_until(lambda: not sink.connected, timeout=5, what="stall noticed")
    assert sink.stats["stalls"] == 1 and sink.stats["pending"] == 5
    run(est, trace[5:260])
    st = est.avest_stats()
    assert not st["governed"] and est._refits == 2  # vLLM's rounds ending at steps 99 and 199


def test_sidecar_that_lost_its_state(start_sidecar, tmp_path):
    """A sidecar restarted on an empty data directory: the pair is registered again,
    the cost curves resent, and its (lower-numbered) coefficients govern."""
    trace = list(steps(synthetic_trace(steps=400, batch=12, k=5, seed=3), MAX_REQS))
    settings = dict(refit_interval=10, default_rule="vllm")
    srv = start_sidecar(tmp_path / "a", **settings)
    port = srv.grpc_port
    est = make_shim(srv.grpc_address, hardware="hw-1")
    sink = sink_of(est)
    sink._recorder.record(DRAFT_CURVE, VERIFY_CURVE, 256)
    assert sink.wait_connected(10)
    run(est, trace[:200])
    delivered(est)
    wait_until(lambda: getattr(sink.latest_coefficients(), "version", 0) == 20, what="version 20")
    assert sink.cost_curves_sent == 1
    srv.stop()
    wait_until(lambda: not sink.connected, what="loss noticed")

    srv2 = start_sidecar(tmp_path / "b", grpc_address=f"127.0.0.1:{port}", **settings)
    wait_until(lambda: sink.stats["registrations"] >= 2, what="registered again")
    wait_until(lambda: sink.cost_curves_sent == 2, what="curves resent")
    client = EstimatorClient(srv2.grpc_address)
    assert client.pair(sink.pair_id).cost_curve_hardware == ("hw-1",)
    # the new sidecar counts from version 0 again; the sink follows it down
    wait_until(lambda: sink.connected and sink.latest_coefficients().version < 20, what="follow")
    run(est, trace[200:260])
    assert est._avest.transfer.flush(5) and sink.flush(15), sink.stats
    fresh = client.coefficients(sink.pair_id)
    assert 1 <= fresh.version < 20
    wait_until(
        lambda: (
            sink.latest_coefficients()
            == Coefficients(fresh.slope, tuple(fresh.intercepts), version=fresh.version)
        ),
        timeout=10,
        what="fresh coefficients",
    )
    run(est, trace[260:261])
    assert est.avest_stats()["version"] == fresh.version
    assert est.slope.item() == f32(fresh.slope)
    pair = client.pair(sink.pair_id)
    assert pair.steps_observed > 0
    # steps the new sidecar refused before it knew the pair are counted, not resent forever
    s = sink.stats
    assert s["received"] == 261 and s["pending"] <= 1
    assert s["acked"] + s["dropped"] + s["refused"] + s["pending"] == 261
    client.close()
    est.avest_close()


def test_close_is_bounded_when_the_sidecar_vanished(start_sidecar, tmp_path):
    srv = start_sidecar(tmp_path)
    est = make_shim(srv.grpc_address, timeout_s=0.5)
    sink = sink_of(est)
    assert sink.wait_connected(10)
    srv.stop()
    wait_until(lambda: not sink.connected, what="loss noticed")
    run(est, list(steps(synthetic_trace(steps=5, batch=4, k=5), MAX_REQS)))
    t0 = time.perf_counter()
    est.avest_close()
    assert time.perf_counter() - t0 < 0.5 + 2.0 + 3.5
    assert sink.stats["pending"] == 5
