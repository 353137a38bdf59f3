"""Pending sketches: folded when read, the same as folded on arrival."""

from __future__ import annotations

import numpy as np
import pytest

from avest.core import pooling
from avest.core.calibration import Recalibrator
from avest.core.estimator import OnlineEstimator
from avest.core.metrics import CalibrationState
from avest.core.model import Coefficients
from avest.core.rule_factory import make_rule
from avest.core.summary import add_sketch, observe_sketch, sketch_state, summarise
from tests.support.steps import K, batches, synthetic_steps


def _summaries(n: int, at: Coefficients, seed: int = 0):
    steps = batches(synthetic_steps(n * 4, rows=32, seed=seed))
    return [
        summarise([(b.features, b.observed, b.accepted) for b in steps[i : i + 4]], at, 1)
        for i in range(0, len(steps), 4)
    ]


def _eager(summaries, layer: Recalibrator) -> CalibrationState:
    """Each sketch folded on arrival (what the estimator did before pooling)."""
    state = CalibrationState.empty(K)
    for s in summaries:
        add_sketch(s.sketch, state)
        observe_sketch(layer, s.sketch)
    return state


def _assert_same_state(a: CalibrationState, b: CalibrationState) -> None:
    x, y = a.to_arrays(), b.to_arrays()
    for name in ("ece_rejected", "ece_accepted", "ece_sum_predicted", "logloss_sum"):
        np.testing.assert_allclose(x[name], y[name], rtol=1e-12, atol=1e-9, err_msg=name)
    np.testing.assert_array_equal(a._auc.dense(), b._auc.dense())


def _assert_same_layer(a: Recalibrator, b: Recalibrator) -> None:
    np.testing.assert_allclose(a.loss, b.loss, rtol=1e-12)
    np.testing.assert_allclose(a.round_total, b.round_total, rtol=1e-12)
    np.testing.assert_allclose(a.round_accepted, b.round_accepted, rtol=1e-12)


def test_pending_sketches_fold_as_if_each_was_folded_on_arrival():
    at = Coefficients.of(0.3, np.linspace(0.5, -0.5, K))
    summaries = _summaries(12, at)
    eager_layer = Recalibrator()
    eager = _eager(summaries, eager_layer)
    lazy_layer = Recalibrator()
    lazy = CalibrationState.empty(K)
    pending = pooling.PendingSketches(K)
    for s in summaries:
        pending.add(s.sketch)
    assert len(pending) == 12 and pending.cells == sum(s.sketch.cells.size for s in summaries)
    pending.settle(lazy, lazy_layer)
    assert len(pending) == 0 and pending.cells == 0
    _assert_same_state(lazy, eager)
    _assert_same_layer(lazy_layer, eager_layer)
    pending.settle(lazy, lazy_layer)  # nothing pending: nothing changes
    _assert_same_state(lazy, eager)


def test_one_pending_sketch_folds_the_same_way():
    at = Coefficients.of(0.5, [-0.2] * K)
    (one,) = _summaries(1, at, seed=3)
    eager_layer, lazy_layer = Recalibrator(), Recalibrator()
    eager = _eager([one], eager_layer)
    lazy = CalibrationState.empty(K)
    pending = pooling.PendingSketches(K)
    pending.add(one.sketch)
    pending.settle(lazy, lazy_layer)
    _assert_same_state(lazy, eager)
    _assert_same_layer(lazy_layer, eager_layer)


def test_a_sketch_of_another_k_is_refused():
    pending = pooling.PendingSketches(K + 1)
    (one,) = _summaries(1, Coefficients.of(0.5, [-0.2] * K))
    with pytest.raises(ValueError):
        pending.add(one.sketch)
    assert len(pending) == 0


def _estimator() -> OnlineEstimator:
    return OnlineEstimator(K, make_rule("tracking"), refit_interval=10_000, calibrate=True)


def test_every_reader_sees_the_pending_summaries():
    """Calibration, recent calibration, the layer, snapshots and raw steps each
    fold what is pending first: the estimator reads as if nothing were deferred."""
    at = Coefficients.of(0.5, [-0.2] * K)
    summaries = _summaries(6, at)
    eager_layer = Recalibrator()
    eager = _eager(summaries, eager_layer)

    est = _estimator()
    for s in summaries:
        est.apply_summary(s)
    assert len(est._pending) == 6
    assert est.calibration.count == eager.count
    assert len(est._pending) == 0
    _assert_same_state(est._calibration_round, eager)
    _assert_same_layer(est.recalibrator, eager_layer)

    for reader in (
        lambda e: e.recent_calibration,
        lambda e: e.recalibrator,
        lambda e: e.snapshot(),
        lambda e: e.apply(batches(synthetic_steps(1, seed=9))[0]),
    ):
        e = _estimator()
        e.apply_summary(summaries[0])
        assert len(e._pending) == 1
        reader(e)
        assert len(e._pending) == 0


def test_a_refit_folds_the_round_before_the_layer_moves():
    at = Coefficients.of(0.5, [-0.2] * K)
    summaries = _summaries(5, at)
    eager_layer = Recalibrator()
    _eager(summaries, eager_layer)
    eager_layer.refit()

    est = OnlineEstimator(K, make_rule("vllm"), refit_interval=20, calibrate=True)
    steps = 0
    for s in summaries:
        est.apply_summary(s)
        steps += s.steps
    assert est.round >= 1 and len(est._pending) == 0
    assert est._layer is not None
    np.testing.assert_allclose(est._layer.total, eager_layer.total, rtol=1e-12)
    np.testing.assert_allclose(est._layer.loss, eager_layer.loss, rtol=1e-12)


def test_pending_cells_are_bounded(monkeypatch):
    monkeypatch.setattr(pooling, "MAX_PENDING_CELLS", 1)
    est = _estimator()
    for s in _summaries(3, Coefficients.of(0.5, [-0.2] * K)):
        est.apply_summary(s)
        assert len(est._pending) == 0  # folded as soon as the bound is reached


def test_a_reset_or_restore_drops_what_is_pending():
    at = Coefficients.of(0.5, [-0.2] * K)
    s1, s2 = _summaries(2, at)
    est = _estimator()
    est.apply_summary(s1)
    saved = est.snapshot()
    est.apply_summary(s2)
    est.restore(saved)
    assert len(est._pending) == 0
    assert est.calibration.count == sketch_state(s1.sketch).count
    est.apply_summary(s2)
    est.reset()
    assert len(est._pending) == 0 and est.calibration.count == 0
