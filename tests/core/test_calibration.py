"""The calibration layer: a monotone map over the linear predictor, served only while it helps."""

from __future__ import annotations

import numpy as np

from avest.core.calibration import (
    DEFAULT_LAYER,
    SLOTS,
    Recalibrator,
    pool_adjacent_violators,
)
from avest.core.estimator import OnlineEstimator
from avest.core.labels import labels
from avest.core.metrics import CalibrationState
from avest.core.model import linear_predictor
from avest.core.rule_factory import make_rule
from avest.core.tracking import TrackingRule
from tests.support.steps import draw_step

MAX_LOGIT = DEFAULT_LAYER.max_logit
SHIFT_WEIGHT = DEFAULT_LAYER.shift_weight


def bent_steps(n, k, seed):
    """Acceptance that bends away from any logistic in the feature (0.95 where 0.8 is linear)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.normal(1.0, 2.5, size=(24, k))
        p = np.clip(0.15 + 0.8 / (1 + np.exp(-(2.0 * x - 1.0))), 0, 1) * np.linspace(1, 0.8, k)
        success = rng.random(x.shape) < p
        out.append((x, np.full(24, k), np.where(success.all(1), k, np.argmin(success, 1))))
    return out


def test_pool_adjacent_violators_is_monotone_and_weighted():
    fit = pool_adjacent_violators(np.array([0.1, 0.5, 0.3, 0.7]), np.array([1.0, 1.0, 3.0, 1.0]))
    np.testing.assert_allclose(fit, [0.1, 0.35, 0.35, 0.7])


def test_layer_lowers_ece_on_a_bent_workload_and_keeps_the_round_statistics():
    k = 4
    steps = bent_steps(600, k, 0)
    plain = OnlineEstimator(k, TrackingRule(), 50)
    layered = OnlineEstimator(k, TrackingRule(), 50, calibrate=True)
    scores = [CalibrationState.empty(k), CalibrationState.empty(k)]
    for i, (x, d, a) in enumerate(steps):
        obs, acc = labels(d, a.astype(np.int64), k)
        if i >= 300:
            scores[0].update(plain.served_eta(x), obs, acc)
            scores[1].update(layered.served_eta(x), obs, acc)
        plain.observe(x, d, a)
        layered.observe(x, d, a)
    # The layer never touches the IRLS statistics: the coefficients agree.
    assert plain.coefficients == layered.coefficients
    assert layered.recalibrator is not None and layered.recalibrator.active
    s0, s1 = scores[0].summary(), scores[1].summary()
    assert s1.ece < s0.ece - 0.005
    assert s1.logloss < s0.logloss
    assert s1.auc > s0.auc - 0.002


def test_inactive_layer_serves_the_logistic_and_exports_identity():
    r = Recalibrator()
    eta = np.linspace(-10, 10, 7)
    np.testing.assert_array_equal(r.apply(eta), eta)
    knots, table = r.export()
    assert knots.shape == table.shape == (SLOTS,)
    np.testing.assert_array_equal(knots, table)


def test_layer_state_round_trips():
    k = 3
    steps = bent_steps(200, k, 1)
    a = OnlineEstimator(k, TrackingRule(), 25, calibrate=True)
    for s in steps[:100]:
        a.observe(*s)
    b = OnlineEstimator(k, TrackingRule(), 25, calibrate=True)
    b.restore(a.snapshot())
    for s in steps[100:]:
        a.observe(*s)
        b.observe(*s)
    x = steps[0][0]
    np.testing.assert_array_equal(a.served_eta(x), b.served_eta(x))
    np.testing.assert_array_equal(
        linear_predictor(a.coefficients, x), linear_predictor(b.coefficients, x)
    )


def test_a_workload_switch_stops_serving_the_map_learned_before_it():
    """A bent workload until the layer is served, then another drafter: the
    rule's innovation test keeps almost none of its information at the first
    refit after the switch, and the layer's old evidence goes with it. Before,
    the old map stayed served for the next four rounds on its decayed gain."""
    k = 4
    est = OnlineEstimator(k, make_rule("tracking"), 50, calibrate=True)
    plain = OnlineEstimator(k, make_rule("tracking"), 50)
    for s in bent_steps(600, k, 3):
        est.observe(*s)
        plain.observe(*s)
    assert est.recalibrator is not None and est.recalibrator.active
    rng = np.random.default_rng(4)
    scores = [CalibrationState.empty(k), CalibrationState.empty(k)]
    refits = 0
    for _ in range(150):
        x, d, a = draw_step(rng, 24, k, 0.3, np.full(k, 1.5))
        obs, acc = labels(d, a.astype(np.int64), k)
        scores[0].update(plain.served_eta(x), obs, acc)
        scores[1].update(est.served_eta(x), obs, acc)
        plain.observe(x, d, a)
        if est.observe(x, d, a) is not None:
            refits += 1
            assert not est.recalibrator.active
            if refits == 1:
                assert est.rule.carried_weight < SHIFT_WEIGHT
    assert refits == 3
    # Served logistic after the switch, so no worse than the layer-free pair.
    assert scores[1].summary().logloss <= scores[0].summary().logloss + 1e-3
