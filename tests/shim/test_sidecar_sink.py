"""The production sink against the real sidecar on 127.0.0.1:0, driven by the chat trace.

What reaches the sidecar equals the trace (and the pair learns exactly what
the core estimator learns from it); pushed coefficients land in the stand-in's
tensors in place at a step boundary; a second worker starts from the trained
pair (warm start); the profiled cost curves reach the pair; the plugin's
production path builds the sink in the process that uses it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import numpy as np
import pytest

from avest.core.budget import decide
from avest.core.costs import CostTable
from avest_client import EstimatorClient
from avest_client.vllm import costs, plugin
from avest_client.vllm.config import ShimConfig
from avest_client.vllm.sidecar import sink as sidecar_sink
from avest_client.vllm.sidecar.sink import SidecarSink
from avest_wire.coefficients import Coefficients
from avest_wire.limits import MAX_COST_POINTS
from avest_wire.pair import PairKey
from tests.support.helpers import f32
from tests.support.sidecar import (
    CPU,
    DRAFT,
    DRAFT_CURVE,
    TARGET,
    VERIFY_CURVE,
    delivered,
    make_shim,
    sink_of,
    wait_until,
)
from tests.support.tracedrive import core_replay, run, trace_steps

# -- what reaches the sidecar ---------------------------------------------------


@pytest.mark.parametrize("rule", ["vllm", "recursive"])
def test_what_reaches_the_sidecar_equals_the_trace(start_sidecar, tmp_path, trace_slice, rule):
    srv = start_sidecar(tmp_path, refit_interval=10, default_rule=rule)
    trace = trace_steps(trace_slice("chat", 0, 300))
    est = make_shim(srv.grpc_address)
    sink = sink_of(est)
    assert sink.wait_connected(10)
    run(est, trace)
    delivered(est)
    with EstimatorClient(srv.grpc_address) as client:
        pair = client.pair(sink.pair_id)
    replay = core_replay(trace, 5, pair.rule, pair.refit_interval, srv.settings)
    assert (pair.rule, pair.refit_interval) == (rule, 10)
    assert pair.key.target == TARGET and pair.key.draft == DRAFT and pair.key.k == 5
    assert pair.key.labels == {"temperature": "1.0", "draft_sample_method": "probabilistic"}
    # exactly the trace's steps and drafts, nothing lost, nothing twice
    assert pair.steps_observed == len(trace) == 300
    assert (
        pair.drafts_observed
        == replay.drafts
        == sum(int(np.minimum(s.num_accepted + 1, s.num_verified).sum()) for s in trace)
    )
    # and the pair learnt exactly what the core estimator learns from the trace
    c = pair.coefficients
    assert (c.version, c.round) == (replay.version, replay.round) == (30, 30)
    assert c.slope == replay.coefficients.slope
    assert c.intercepts == tuple(replay.coefficients.intercepts)
    stats = est.avest_stats()
    assert stats["captured"] == stats["submitted"] == 300 and stats["dropped"] == 0
    s = stats["sink"]
    assert (s["received"], s["acked"], s["dropped"], s["refused"], s["invalid"]) == (
        300,
        300,
        0,
        0,
        0,
    )
    assert s["registrations"] == 1 and s["reconnects"] == 0
    # governed from the first step: every local round (ends at 99, 199, 299) ended unrefit
    assert stats["governed"] and stats["skipped_refits"] == 3 and est._refits == 0
    est.avest_close()


def test_pushed_coefficients_land_in_place_at_a_step_boundary(start_sidecar, tmp_path, trace_slice):
    srv = start_sidecar(tmp_path, refit_interval=10, default_rule="vllm")
    trace = trace_steps(trace_slice("chat", 0, 41))
    est = make_shim(srv.grpc_address)
    sink = sink_of(est)
    assert sink.wait_connected(10)
    ptrs = (est.slope.data_ptr(), est.intercepts.data_ptr())
    run(est, trace[:40])
    delivered(est)
    with EstimatorClient(srv.grpc_address) as client:
        c = client.coefficients(sink.pair_id)
    assert c.version == 4
    # the refit that step 40 caused is pushed to the sink ...
    wait_until(
        lambda: getattr(sink.latest_coefficients(), "version", 0) == 4, what="version 4 pushed"
    )
    assert sink.latest_coefficients() == Coefficients(c.slope, tuple(c.intercepts), version=4)
    # ... but nothing touches the tensors between steps
    assert est.avest_stats()["version"] != 4
    assert est.slope.item() != f32(c.slope)
    run(est, trace[40:41])  # the next step boundary applies it
    assert est.avest_stats()["version"] == 4
    assert est.slope.item() == f32(c.slope)
    assert est.intercepts.tolist() == [f32(b) for b in c.intercepts]
    assert (est.slope.data_ptr(), est.intercepts.data_ptr()) == ptrs  # same storage
    est.avest_close()


def test_a_new_worker_starts_from_the_trained_pair(start_sidecar, tmp_path, trace_slice):
    srv = start_sidecar(tmp_path, refit_interval=10)
    trace = trace_steps(trace_slice("chat", 0, 120))
    first = make_shim(srv.grpc_address)
    assert sink_of(first).wait_connected(10)
    run(first, trace[:100])
    delivered(first)
    first.avest_close()
    with EstimatorClient(srv.grpc_address) as client:
        trained = client.coefficients(sink_of(first).pair_id)
    # The default rule refits four short warm-up rounds, then every 10 steps.
    trained_version = 13
    assert trained.version == trained_version
    assert trained.slope != 0.5 and trained.intercepts != (-0.2,) * 5

    second = make_shim(srv.grpc_address)
    sink = sink_of(second)
    assert sink.wait_connected(10)
    # registration handed over the pair's coefficients before any step ...
    assert sink.latest_coefficients() == Coefficients(
        trained.slope, tuple(trained.intercepts), version=trained_version
    )
    assert second.slope.item() == 0.5  # (tensors change only at a step boundary)
    run(second, trace[100:101])
    # ... so the very first step boundary puts them in force, not 0.5 / -0.2
    assert second.slope.item() == f32(trained.slope)
    assert second.intercepts.tolist() == [f32(b) for b in trained.intercepts]
    st = second.avest_stats()
    assert st["governed"] and st["version"] == trained_version and st["updates"] == 1
    assert st["sink"]["registrations"] == 1
    second.avest_close()


# -- cost curves ----------------------------------------------------------------


def test_profiled_cost_curves_reach_the_pair(start_sidecar, tmp_path, trace_slice):
    srv = start_sidecar(tmp_path, refit_interval=10)
    rec = costs.CostCurveRecorder()
    est = make_shim(srv.grpc_address, recorder=rec, hardware="NVIDIA H200")
    sink = sink_of(est)
    assert sink.wait_connected(10)
    time.sleep(0.1)
    assert sink.cost_curves_sent == 0  # nothing profiled yet, nothing sent
    rec.record(DRAFT_CURVE, VERIFY_CURVE, cudagraph_limit=256)  # vLLM's set_cost_curves
    wait_until(lambda: sink.cost_curves_sent == 1, what="cost curves sent")
    client = EstimatorClient(srv.grpc_address)
    pair = client.pair(sink.pair_id)
    assert pair.cost_curve_hardware == ("NVIDIA H200",)
    # Budget works with them, as the core decides with the same tables
    run(est, trace_steps(trace_slice("chat", 0, 30)))
    delivered(est)
    rng = np.random.default_rng(0)
    conf = rng.uniform(0.05, 0.95, size=(16, 5)).astype(np.float32)
    scheduled = rng.integers(0, 6, size=16)
    got = client.budget(sink.pair_id, conf, scheduled, 16, 16, hardware="NVIDIA H200")
    table = CostTable.from_curves(DRAFT_CURVE, VERIFY_CURVE, cudagraph_limit=256)
    want = decide("lossless-walk", conf.astype(np.float64), scheduled, table, 16, 16)
    assert got.budget == want.budget and got.lossless
    assert got.verify_lengths.tolist() == want.verify_lengths.tolist()
    # re-profiled curves are sent again
    rec.record(DRAFT_CURVE, [(1, 4.0), (1024, 18.0)])
    wait_until(lambda: sink.cost_curves_sent == 2, what="new curves sent")
    client.close()
    est.avest_close()


def test_curves_profiled_at_more_sizes_than_the_service_takes_are_thinned(start_sidecar, tmp_path):
    """A profile at every size up to 2048 (vLLM's, or the CPU engine's) is refused whole
    by the service (at most MAX_COST_POINTS points): the sink sends it thinned, and
    inside the capture limit no size costs less than it was profiled at."""
    srv = start_sidecar(tmp_path, refit_interval=10)
    rec = costs.CostCurveRecorder()
    est = make_shim(srv.grpc_address, recorder=rec, hardware="cpu")
    sink = sink_of(est)
    assert sink.wait_connected(10)
    draft = [(n, 1.0 + 0.01 * n) for n in range(1, 2049)]
    verify = [(n, 5.0 + 0.002 * n + (3.0 if n > 512 else 0.0)) for n in range(1, 2049)]
    rec.record(draft, verify, cudagraph_limit=512)
    wait_until(lambda: sink.cost_curves_sent == 1, what="thinned cost curves sent")
    with EstimatorClient(srv.grpc_address) as client:
        assert client.pair(sink.pair_id).cost_curve_hardware == ("cpu",)
    thinned = costs.thin(verify, MAX_COST_POINTS, 512)
    assert len(thinned) <= MAX_COST_POINTS and thinned[0] == verify[0]
    assert thinned[-1] == verify[-1] and (512, verify[511][1]) in thinned
    full = CostTable.from_curves(draft, verify, cudagraph_limit=512)
    sent = CostTable.from_curves(draft, thinned, cudagraph_limit=512)
    sizes = np.arange(1, 513)
    assert (sent.verify_cost(sizes) >= full.verify_cost(sizes)).all()
    assert costs.thin(verify[:10], MAX_COST_POINTS) == verify[:10]  # short ones as they are
    est.avest_close()


# -- the production path: plugin -> make_sink, in the process that uses it ---------


@pytest.fixture
def fake_vllm(fake_vllm, monkeypatch):
    """vLLM's hooked modules as already-imported fakes, with a current config."""
    cfg_mod = types.ModuleType("vllm.config")
    vllm_config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(model="Qwen/Qwen3-8B"),
        speculative_config=types.SimpleNamespace(
            model="Qwen/Qwen3-0.6B", method="draft_model", draft_sample_method="probabilistic"
        ),
    )
    cfg_mod.get_current_vllm_config_or_none = lambda: vllm_config
    monkeypatch.setitem(sys.modules, cfg_mod.__name__, cfg_mod)
    return fake_vllm


def test_plugin_wires_the_sidecar_sink(start_sidecar, tmp_path, fake_vllm, monkeypatch):
    srv = start_sidecar(tmp_path, refit_interval=10)
    monkeypatch.setenv("AVEST_ADDRESS", srv.grpc_address)
    monkeypatch.setenv("AVEST_LABELS", "temperature=0.7,domain=code")
    monkeypatch.setenv("AVEST_HARDWARE", "test-h200")
    monkeypatch.setenv("AVEST_QUEUE_SIZE", "128")
    monkeypatch.setenv("AVEST_TIMEOUT_S", "3")
    plugin.register()
    est = fake_vllm.spec.OnlineAcceptanceEstimator(16, 4, CPU)  # as vLLM's speculator does
    sink = sink_of(est)
    assert sink.config.queue_size == 128 and sink.config.timeout_s == 3.0
    assert sink.wait_connected(10)
    assert sink.forwarder._queue_size == 128 and sink._client.timeout == 3.0
    mgr = fake_vllm.av.AdaptiveVerificationManager()
    mgr._cudagraph_limit = 64
    mgr.set_cost_curves(DRAFT_CURVE, VERIFY_CURVE)  # start-up profiling, through the hook
    wait_until(lambda: sink.cost_curves_sent == 1, what="cost curves sent")
    assert costs.RECORDER.snapshot() == (1, DRAFT_CURVE, VERIFY_CURVE, 64)  # with the limit
    with EstimatorClient(srv.grpc_address) as client:
        pair = client.pair(sink.pair_id)
    assert (pair.key.target, pair.key.draft, pair.key.method, pair.key.k) == (
        "Qwen/Qwen3-8B",
        "Qwen/Qwen3-0.6B",
        "draft_model",
        4,
    )
    assert pair.key.labels == {
        "domain": "code",
        "draft_sample_method": "probabilistic",
        "temperature": "0.7",
    }
    assert pair.cost_curve_hardware == ("test-h200",)
    est.avest_close()


def test_make_sink_refuses_what_cannot_register():
    with pytest.raises(ValueError, match="AVEST_ADDRESS"):
        sidecar_sink.make_sink(ShimConfig(), PairKey("t", "d", "m", 3))
    with pytest.raises(ValueError, match="target or draft model unknown"):
        sidecar_sink.make_sink(ShimConfig("127.0.0.1:1"), PairKey("", "", "", 3))


def test_the_constructor_does_no_network_call():
    """Building the sink (on the decode path's thread) returns at once whatever the address.

    10.255.255.1 is a black hole: a connect there would hang until the timeout.
    """
    cfg = ShimConfig("10.255.255.1:50051", timeout_s=30.0)
    t0 = time.perf_counter()
    sink = SidecarSink(cfg, PairKey("t", "d", "m", 3))
    built = time.perf_counter() - t0
    assert built < 1.0, built  # a connect there would take the 30 s timeout
    assert not sink.connected and sink.latest_coefficients() is None
    sink.submit(np.zeros((2, 3), np.float32), np.zeros(2, np.int32), np.zeros(2, np.int32), None)
    t0 = time.perf_counter()
    sink.close(timeout=0.2)
    assert time.perf_counter() - t0 < 3.5
    assert sink.stats["unsent_at_close"] == 1


FORK_SCRIPT = textwrap.dedent(
    """
    import os, sys, threading
    import torch
    sys.path.insert(0, sys.argv[2])
    from tests.support.standin import StandinAcceptanceEstimator
    from avest_client.vllm.sidecar import sink as sidecar_sink
    from avest_client.vllm.config import ShimConfig
    from avest_client.vllm.estimator import make_sidecar_estimator
    from avest_wire.pair import PairKey

    def ours():
        return [t.name for t in threading.enumerate() if t.name.startswith("avest")]

    config = ShimConfig(address=sys.argv[1], mode="raw")
    if sys.argv[3] == "worker":
        # The parent (vLLM's engine process) loads the plugin: the shim class
        # exists; no sink, no channel, no thread of ours.
        cls = make_sidecar_estimator(
            StandinAcceptanceEstimator, sidecar_sink.make_sink, config=config,
            pair_resolver=lambda k: PairKey("fork-target", "fork-draft", "m", k),
        )
        assert not ours()
        pid = os.fork()
        if pid == 0:  # the worker builds the estimator: the sink lives here
            status = 1
            try:
                est = cls(8, 3, torch.device("cpu"))
                sink = est._avest.sink
                assert sink.wait_connected(10), sink.stats
                idx = torch.tensor([0, 1])
                for _ in range(20):
                    est.load_features(idx, torch.ones(2, 3))
                    est.step(idx, torch.tensor([2, 4], dtype=torch.int32),
                             torch.tensor([1, 0], dtype=torch.int32))
                assert est._avest.transfer.flush(10) and sink.flush(10), sink.stats
                status = 0 if sink.stats["acked"] == 20 else 2
                est.avest_close()
            finally:
                os._exit(status)
        _, code = os.waitpid(pid, 0)
        assert not ours()
    else:
        # A sink built before a fork: the child inherits the object, not its
        # threads or channel. It must neither claim a connection nor forward.
        sink = sidecar_sink.SidecarSink(config, PairKey("inherit-t", "inherit-d", "m", 3))
        assert sink.wait_connected(10) and sink.latest_coefficients() is not None
        pid = os.fork()
        if pid == 0:
            ok = (not sink.connected and sink.latest_coefficients() is None)
            sink.submit(*[x for x in (torch.zeros(1, 3).numpy(),)], [0], [0], None)
            ok = ok and sink.stats["received"] == 0
            sink.close()
            os._exit(0 if ok else 3)
        _, code = os.waitpid(pid, 0)
        assert sink.connected  # the parent's sink is untouched
        sink.close()
    sys.exit(os.waitstatus_to_exitcode(code))
    """
)


def _fork_script(address: str, mode: str) -> subprocess.CompletedProcess:
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    if mode == "inherited":
        # The parent forks with its channel live. gRPC's own fork handlers
        # (GRPC_ENABLE_FORK_SUPPORT) are skipped when another thread is inside
        # gRPC at that moment, and the child then aborts in gRPC's poller
        # whatever avest does; the sink's own fork handling is what is tested.
        env["GRPC_ENABLE_FORK_SUPPORT"] = "false"
    return subprocess.run(
        [sys.executable, "-c", FORK_SCRIPT, address, root, mode],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_the_sink_is_created_in_the_forked_worker(start_sidecar, tmp_path):
    srv = start_sidecar(tmp_path)
    proc = _fork_script(srv.grpc_address, "worker")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with EstimatorClient(srv.grpc_address) as client:
        (pair,) = client.pairs()
    assert pair.key.target == "fork-target" and pair.steps_observed == 20


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_an_inherited_sink_is_inert_in_a_forked_child(start_sidecar, tmp_path):
    srv = start_sidecar(tmp_path)
    proc = _fork_script(srv.grpc_address, "inherited")
    assert proc.returncode == 0, proc.stderr[-3000:]
