"""Mixed releases on one wire: the 0.1.0 client against this service, and this
release's vLLM shim against the 0.1.0 service (each run from its own environment,
real gRPC on loopback)."""

from __future__ import annotations

import logging
import textwrap
import time

import numpy as np
import pytest

from avest_client import EstimatorClient
from tests.support.server import launch

from .oldrelease import OldServer, run_old

pytestmark = pytest.mark.slow

OLD_CLIENT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import avest_client
    from avest_client import EstimatorClient

    rng = np.random.default_rng(7)
    with EstimatorClient(sys.argv[1], timeout=5.0) as client:
        reg = client.register("old-target", "old-draft", "draft_model", 4,
                              {"release": "0.1.0"}, "vllm", 10)
        fwd = client.forwarder(reg.pair_id, worker_id="old-worker")
        labelled = 0
        for _ in range(55):
            x = rng.normal(0.0, 2.0, size=(6, 4)).astype(np.float32)
            d = rng.integers(0, 5, size=6)
            a = np.minimum(rng.integers(0, 5, size=6), d)
            labelled += int(np.minimum(a + 1, d).sum())
            fwd.submit(x, d, a, None)
        assert fwd.flush(30), fwd.stats
        latest = fwd.latest_coefficients()
        stats = fwd.stats
        fwd.close()
        pair = client.pair(reg.pair_id)
    print(json.dumps({
        "version": avest_client.__version__ if hasattr(avest_client, "__version__") else "",
        "pair_id": reg.pair_id, "labelled": labelled, "steps": pair.steps_observed,
        "drafts": pair.drafts_observed, "acked": stats.acked, "refused": stats.refused,
        "pushed_version": latest[0] if latest else -1,
        "server_version": pair.coefficients.version,
    }))
    """
)


OLD_CLIENT_REFUSED = textwrap.dedent(
    """
    import json, sys
    import grpc
    from avest_client import EstimatorClient

    with EstimatorClient(sys.argv[1], timeout=5.0) as client:
        try:
            client.register("old-target", "old-draft", "draft_model", 4)
            out = {"code": "OK", "message": ""}
        except Exception as exc:
            out = {"code": getattr(getattr(exc, "code", None), "name", type(exc).__name__),
                   "message": str(exc)}
    print(json.dumps(out))
    """
)


def test_the_0_1_0_client_without_a_token_is_refused_where_tokens_are_required(tmp_path):
    srv = launch(tmp_path / "data", worker_token="worker-secret")
    try:
        out = run_old(OLD_CLIENT_REFUSED, srv.grpc_address)
        with EstimatorClient(srv.grpc_address, token="worker-secret") as client:
            assert client.pairs() == []  # refused before anything changed
    finally:
        srv.stop()
    assert out["code"] == "UNAUTHENTICATED", out
    assert "token" in out["message"], out


def test_the_0_1_0_client_is_served_on_loopback(tmp_path):
    srv = launch(tmp_path / "data", refit_interval=10)
    try:
        out = run_old(OLD_CLIENT, srv.grpc_address)
        with EstimatorClient(srv.grpc_address) as client:
            pair = client.pair(out["pair_id"])
    finally:
        srv.stop()
    # Every raw step the old client sent (no token, no summaries) was applied once and
    # acknowledged; the coefficient pushes reached it.
    assert (out["steps"], out["acked"], out["refused"]) == (55, 55, 0)
    assert out["drafts"] == out["labelled"] == pair.drafts_observed
    assert pair.steps_observed == 55 and pair.rule == "vllm" and pair.refit_interval == 10
    assert out["pushed_version"] == out["server_version"] == pair.coefficients.version >= 1


def test_this_shim_against_the_0_1_0_sidecar(tmp_path, trace_slice, caplog):
    pytest.importorskip("torch")  # the shim's stand-in estimator is torch
    from tests.support.sidecar import delivered, make_shim, sink_of
    from tests.support.tracedrive import core_replay, run, trace_steps

    caplog.set_level(logging.INFO)
    trace = trace_steps(trace_slice("chat", 0, 300))
    with OldServer(tmp_path / "old-data", "--refit-interval", "10") as old:
        est = make_shim(old.grpc_address)
        sink = sink_of(est)
        assert sink.wait_connected(20)
        run(est, trace)
        delivered(est)
        with EstimatorClient(old.grpc_address) as client:
            pair = client.pair(sink.pair_id)
        stats = est.avest_stats()
        est.avest_close()
    replay = core_replay(trace, 5, pair.rule, pair.refit_interval, _OldDefaults)
    # The old sidecar pooled exactly the trace, and the shim governed with its pushes.
    assert pair.steps_observed == 300
    assert pair.coefficients.slope == replay.coefficients.slope
    assert tuple(pair.coefficients.intercepts) == tuple(replay.coefficients.intercepts)
    assert stats["governed"] and stats["sink"]["acked"] == 300
    assert stats["sink"]["refused"] == 0
    assert np.isfinite(pair.coefficients.slope)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


class _OldDefaults:
    """0.1.0's defaults for the recursive rule (the pair takes the service default rule)."""

    forgetting = 0.95
    prior = 1.0


def test_this_shim_in_summary_mode_falls_back_against_the_0_1_0_sidecar(
    tmp_path, trace_slice, caplog
):
    """0.1.0 knows no round summaries: the shim sends it nothing and refits locally."""
    pytest.importorskip("torch")
    from tests.support.sidecar import make_shim, sink_of
    from tests.support.tracedrive import run, trace_steps

    caplog.set_level(logging.INFO)
    trace = trace_steps(trace_slice("chat", 0, 120))
    with OldServer(tmp_path / "old-data", "--refit-interval", "10") as old:
        est = make_shim(old.grpc_address, mode="summary")
        sink = sink_of(est)
        deadline = time.monotonic() + 20
        while sink.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sink.error is not None and "round summaries" in str(sink.error)
        assert not sink.wait_connected(0.5)
        run(est, trace)  # decoding goes on: vLLM's own estimator refits locally
        stats = est.avest_stats()
        with EstimatorClient(old.grpc_address) as client:
            pairs = client.pairs()
        est.avest_close()
    assert not stats["governed"]
    assert all(p.steps_observed == 0 for p in pairs)  # nothing was sent to it
    assert any("does not pool round summaries" in r.getMessage() for r in caplog.records)
    assert np.isfinite(float(est.slope)) and float(est.slope) >= 0.0
