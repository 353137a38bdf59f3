"""The calibration table inside the shim's ``predict`` (CPU stand-in): in place,
only this call's tokens, served only while pooled coefficients govern; and end
to end from a live sidecar."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from avest_client import EstimatorClient
from avest_client.vllm.calibration import SLOTS, ConfidenceMap, validate_table
from avest_client.vllm.config import ShimConfig
from avest_client.vllm.estimator import make_sidecar_estimator
from tests.support.sidecar import delivered, make_shim, sink_of, wait_until
from tests.support.standin import StandinAcceptanceEstimator
from tests.support.tracedrive import MAX_REQS

from .fakes import FakeSink, FakeSinkFactory

CPU = torch.device("cpu")
K = 2
KNOTS = tuple(np.linspace(-8.25, 8.25, SLOTS).tolist())
#: A bent monotone map: flat low, steep in the middle.
LOGITS = tuple(np.clip(2.0 * np.asarray(KNOTS) + 1.0, -3.0, 5.0).tolist())


class TableSink(FakeSink):
    def __init__(self) -> None:
        super().__init__()
        self.table: tuple | None = None

    def latest_calibration(self):  # noqa: ANN201
        return self.table


def shim(sink: FakeSink):  # noqa: ANN201
    cls = make_sidecar_estimator(
        StandinAcceptanceEstimator, FakeSinkFactory(sink), config=ShimConfig()
    )
    return cls(MAX_REQS, K, CPU)


def boundary(est) -> None:  # noqa: ANN001
    """One step with no live request: the boundary reads the sink."""
    empty = torch.zeros(0, dtype=torch.int32)
    est.step(empty, empty, empty)


def expected(est, logits: torch.Tensor, table: bool) -> torch.Tensor:  # noqa: ANN001
    from tests.support.standin import logit_qmax

    eta = est.slope[0] * logit_qmax(logits) + est.intercepts[0]
    if table:
        eta = torch.tensor(np.interp(eta.numpy(), KNOTS, LOGITS), dtype=torch.float32)
    return torch.sigmoid(eta)


def test_the_served_table_maps_this_calls_confidences_only() -> None:
    sink = TableSink()
    sink.push(3, 0.7, [0.2, -0.4])
    sink.table = (KNOTS, LOGITS, True)
    est = shim(sink)
    boundary(est)
    assert est._avest.tables.map.loads == 1
    storage = (est._avest.tables.map.knots.data_ptr(), est._avest.tables.map.logits.data_ptr())

    logits = torch.randn(6, 50) * 3.0
    idx = torch.tensor([0, 1, 2, -1, 4, 5], dtype=torch.int32)
    conf = torch.full((8, K), -1.0)
    est.predict(logits, idx, torch.tensor(0), conf, torch.ones(MAX_REQS))
    want = expected(est, logits, table=True)
    live = idx >= 0
    torch.testing.assert_close(conf[:6, 0][live], want[live], rtol=1e-5, atol=1e-6)
    assert torch.all(conf[3, :] == -1.0) and torch.all(conf[:, 1] == -1.0)  # untouched
    # vLLM's own predictions (its IRLS statistics) stay the plain logistic's.
    torch.testing.assert_close(
        est.predictions[idx[live].long(), 0], expected(est, logits, table=False)[live]
    )
    # A new table is copied into the same storage (the captured graph reads it).
    sink.table = (KNOTS, KNOTS, True)
    boundary(est)
    assert (
        est._avest.tables.map.knots.data_ptr(),
        est._avest.tables.map.logits.data_ptr(),
    ) == storage


def test_a_table_not_served_or_not_governing_leaves_vllms_confidences() -> None:
    sink = TableSink()
    sink.push(1, 0.5, [0.0, 0.0])
    sink.table = (KNOTS, LOGITS, False)
    est = shim(sink)
    boundary(est)
    logits = torch.randn(4, 30) * 2.0
    idx = torch.arange(4, dtype=torch.int32)
    conf = torch.zeros(4, K)
    est.predict(logits, idx, torch.tensor(1), conf, torch.ones(MAX_REQS))
    torch.testing.assert_close(conf[:, 1], expected(est, logits, table=False))
    # Served, but the sidecar is lost: local refits govern, the map is off.
    sink.table = (KNOTS, LOGITS, True)
    sink.is_connected = False
    boundary(est)
    est.predict(logits, idx, torch.tensor(1), conf, torch.ones(MAX_REQS))
    torch.testing.assert_close(conf[:, 1], expected(est, logits, table=False))


def test_per_token_steps_map_each_requests_block() -> None:
    """A parallel drafter: K rows per request, a step per row."""
    m = ConfidenceMap(CPU)
    m.load((KNOTS, LOGITS, True), governed=True)
    est = StandinAcceptanceEstimator(MAX_REQS, K, CPU)
    logits = torch.randn(6, 40) * 2.0
    idx = torch.tensor([0, 0, 3, 3, -1, -1], dtype=torch.int32)
    step = torch.tensor([0, 1, 0, 1, 0, 1])
    conf = torch.zeros(3, K)
    est.predict(logits, idx, step, conf, torch.ones(MAX_REQS))
    plain = conf.clone()
    m.apply(est, 6, idx, step, conf)
    eta = torch.logit(plain[:2].double()).numpy()
    want = 1 / (1 + np.exp(-np.interp(eta, KNOTS, LOGITS)))
    np.testing.assert_allclose(conf[:2].numpy(), want, rtol=1e-4, atol=1e-5)
    assert torch.all(conf[2] == plain[2])  # the padded request's block is untouched


def test_bad_tables_are_refused() -> None:
    assert validate_table((KNOTS, LOGITS, True)) is not None
    assert validate_table((KNOTS[:-1], LOGITS[:-1], True)) is None
    assert validate_table((KNOTS[::-1], LOGITS, True)) is None
    assert validate_table((KNOTS, LOGITS[::-1], True)) is None
    assert validate_table((KNOTS, (float("nan"),) * SLOTS, True)) is None
    assert validate_table("nope") is None


def test_a_live_sidecars_served_table_reaches_predict(start_sidecar, tmp_path: Path) -> None:  # noqa: ANN001
    """Drafts the logistic cannot follow, forwarded by the shim: the sidecar serves its
    layer, pushes the table, and the shim's predict gives the sidecar's Score."""
    server = start_sidecar(tmp_path / "data", refit_interval=10, flush_interval_ms=10)
    est = make_shim(server.grpc_address, k=K)
    rng = np.random.default_rng(0)
    rows = 24
    idx = torch.arange(rows, dtype=torch.int32)
    # 295 steps: rounds end every 10 steps after the warm-up (at step 10), so the
    # boundary step below (the 296th, forwarded too) closes no round.
    for _ in range(295):
        x = rng.normal(0.0, 3.0, size=(rows, K))
        ok = rng.random((rows, K)) < np.where(x > 0.0, 0.95, 0.3)
        a = np.where(ok.all(axis=1), K, np.argmin(ok, axis=1))
        est.load_features(idx, torch.tensor(x, dtype=torch.float32))
        est.step(
            idx, torch.tensor(a + 1, dtype=torch.int32), torch.tensor(K - a, dtype=torch.int32)
        )
    delivered(est)
    sink = sink_of(est)
    wait_until(lambda: (sink.latest_calibration() or ((), (), False))[2], what="a served table")
    pair_id = sink.pair_id
    with EstimatorClient(server.grpc_address) as client:
        version = client.coefficients(pair_id).version
        wait_until(lambda: sink.latest_coefficients().version == version, what="the latest version")
        boundary(est)
        logits = torch.randn(rows, 64) * 3.0
        conf = torch.zeros(MAX_REQS, K)
        est.predict(logits, idx, torch.tensor(1), conf, torch.ones(MAX_REQS))
        confidences, _ = client.score(pair_id, est.features[:rows].numpy())
        assert client.coefficients(pair_id).version == version  # no refit in between
    np.testing.assert_allclose(conf[:rows, 1].numpy(), confidences[:, 1], rtol=1e-4, atol=1e-5)
    est.avest_close()
