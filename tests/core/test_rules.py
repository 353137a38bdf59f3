"""The update rules against dense algebra, statsmodels and their guards."""

from __future__ import annotations

import numpy as np
import pytest
import statsmodels.api as sm

from avest.core.labels import labels
from avest.core.mle import fit_mle
from avest.core.model import Coefficients, linear_predictor
from avest.core.rules import (
    APPLIED,
    SLOPE_HELD,
    RecursiveRule,
    VllmRule,
    arrowhead_dense,
    arrowhead_matvec,
    intercept_steps,
    schur_slope_step,
    vllm_step,
)
from avest.core.stats import RoundStats, fold


def synthetic(rows: int, k: int, slope: float, intercepts, seed: int):
    """Features and labels drawn from the model itself (accepted prefix)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(1.0, 2.0, size=(rows, k)).clip(-40, 40)
    p = 1 / (1 + np.exp(-(slope * x + np.asarray(intercepts))))
    success = rng.random((rows, k)) < p
    accepted = np.where(success.all(axis=1), k, np.argmin(success, axis=1))
    verified = np.full(rows, k)
    observed, acc = labels(verified.astype(np.int64), accepted.astype(np.int64), k)
    return x, observed, acc


def dense_design(x, observed, accepted):
    rows, k = x.shape
    r_idx, k_idx = np.nonzero(observed)
    design = np.zeros((r_idx.size, k + 1))
    design[:, 0] = x[r_idx, k_idx]
    design[np.arange(r_idx.size), 1 + k_idx] = 1.0
    return design, accepted[r_idx, k_idx].astype(float)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_schur_step_equals_dense_solve(seed):
    k = 6
    x, obs, acc = synthetic(300, k, 0.6, np.linspace(0.5, -1.5, k), seed)
    coef = Coefficients.of(0.4, np.full(k, -0.1))
    stats = fold(x, linear_predictor(coef, x), obs, acc)
    l2, damping = 1e-3, 50.0
    h = arrowhead_dense(float(stats.a.sum()), stats.b, stats.c) + l2 * np.eye(k + 1)
    g = np.concatenate(([stats.g0.sum()], stats.g1))
    dense = np.linalg.solve(h, g)
    assert schur_slope_step(stats, l2) == pytest.approx(dense[0], rel=1e-10)
    # Without damping the intercept steps are the rest of the dense solution.
    np.testing.assert_allclose(intercept_steps(stats, l2, dense[0]), dense[1:], rtol=1e-9)
    # With damping: the slope step is the dense one times n/(n+c), and the
    # intercepts solve their block rows given that damped slope step.
    step_w, step_b, held = vllm_step(coef.slope, stats, l2, damping)
    n = stats.n.sum()
    assert not held
    assert step_w == pytest.approx(dense[0] * n / (n + damping), rel=1e-10)
    block = h[1:, 1:]
    expect_b = np.linalg.solve(block, g[1:] - h[1:, 0] * step_w) * stats.n / (stats.n + damping)
    np.testing.assert_allclose(step_b, expect_b, rtol=1e-9)


def test_newton_converges_to_statsmodels_glm():
    k = 5
    x, obs, acc = synthetic(4000, k, 0.55, [0.8, 0.3, -0.2, -0.6, -1.0], seed=7)
    coef, iterations = fit_mle(x, obs, acc)
    design, y = dense_design(x, obs, acc)
    glm = sm.GLM(y, design, family=sm.families.Binomial()).fit(tol=1e-12)
    np.testing.assert_allclose(coef.as_vector(), glm.params, atol=1e-6)
    assert iterations < 30


def test_vllm_rule_drops_a_negative_slope_step_but_moves_intercepts():
    k = 3
    # Labels anti-correlated with the feature push the slope below zero.
    x = np.array([[5.0, 5.0, 5.0], [-5.0, -5.0, -5.0]] * 50)
    acc = np.array([[False] * 3, [True] * 3] * 50)
    obs = np.ones_like(acc)
    coef = Coefficients.of(0.01, np.zeros(k))
    stats = fold(x, linear_predictor(coef, x), obs, acc)
    assert schur_slope_step(stats, 1e-3) < -0.01
    result = VllmRule().refit(coef, stats)
    assert result.outcome == SLOPE_HELD
    assert result.coefficients.slope == coef.slope
    # Intercepts are solved with the guarded (zero) slope step.
    expect = intercept_steps(stats, 1e-3, 0.0) * stats.n / (stats.n + 50.0)
    np.testing.assert_allclose(result.coefficients.intercept_array(), expect)


def test_empty_round_changes_nothing():
    coef = Coefficients.cold_start(4)
    result = VllmRule().refit(coef, RoundStats.zeros(4))
    assert result.coefficients == coef
    assert result.outcome == APPLIED
    # Undamped with no data: 0/0 is NaN and is dropped, as in vLLM.
    result = VllmRule(l2=0.0, damping=0.0).refit(coef, RoundStats.zeros(4))
    assert result.coefficients == coef


def test_arrowhead_matvec_matches_dense():
    rng = np.random.default_rng(3)
    b, c, theta = rng.normal(size=7), rng.random(7), rng.normal(size=8)
    np.testing.assert_allclose(
        arrowhead_matvec(2.5, b, c, theta), arrowhead_dense(2.5, b, c) @ theta, rtol=1e-12
    )


def test_recursive_rule_without_forgetting_reaches_the_pooled_fit():
    k = 8
    truth = np.array([1.2, 0.8, 0.4, 0.0, -0.4, -0.8, -1.2, -1.6])
    rounds = [synthetic(64 * 16, k, 0.5, truth, seed=100 + i) for i in range(40)]
    rule = RecursiveRule(forgetting=1.0, prior=1e-6)
    coef = Coefficients.cold_start(k)
    rule.reset(coef)
    for x, obs, acc in rounds:
        coef = rule.refit(coef, fold(x, linear_predictor(coef, x), obs, acc)).coefficients
    pooled = [np.concatenate(parts) for parts in zip(*rounds, strict=True)]
    mle, _ = fit_mle(*pooled)
    err_recursive = np.max(np.abs(coef.as_vector() - mle.as_vector()))
    # The vLLM rule on the same rounds keeps jumping toward each round's fit.
    vcoef = Coefficients.cold_start(k)
    vllm = VllmRule()
    for x, obs, acc in rounds:
        vcoef = vllm.refit(vcoef, fold(x, linear_predictor(vcoef, x), obs, acc)).coefficients
    err_vllm = np.max(np.abs(vcoef.as_vector() - mle.as_vector()))
    assert err_recursive < 0.02
    assert err_recursive < err_vllm


def test_recursive_state_round_trips():
    k = 4
    x, obs, acc = synthetic(500, k, 0.5, np.zeros(k), seed=5)
    a, b = RecursiveRule(), RecursiveRule()
    coef = Coefficients.cold_start(k)
    a.reset(coef)
    c1 = a.refit(coef, fold(x, linear_predictor(coef, x), obs, acc)).coefficients
    b.load_state(a.state())
    stats = fold(x, linear_predictor(c1, x), obs, acc)
    assert a.refit(c1, stats).coefficients == b.refit(c1, stats).coefficients


def falling_acceptance(rows: int, k: int, seed: int):
    """In-range features whose acceptance *falls* as the feature rises."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(-2.0, 4.0, size=(rows, k))
    p = 1 / (1 + np.exp(-(1.2 - 0.4 * x)))
    success = rng.random((rows, k)) < p
    accepted = np.where(success.all(axis=1), k, np.argmin(success, axis=1))
    observed, acc = labels(np.full(rows, k, dtype=np.int64), accepted.astype(np.int64), k)
    return x, observed, acc


def test_recursive_slope_guard_leaves_the_best_fit_with_the_slope_held():
    k = 3
    rule = RecursiveRule()
    coef = Coefficients.cold_start(k)
    rule.reset(coef)
    held = 0
    for seed in range(5):
        x, obs, acc = falling_acceptance(800, k, seed)
        result = rule.refit(coef, fold(x, linear_predictor(coef, x), obs, acc))
        held += result.outcome == SLOPE_HELD
        coef = result.coefficients
    assert held >= 1
    x, obs, acc = falling_acceptance(4000, k, 99)
    p = 1 / (1 + np.exp(-linear_predictor(coef, x)))
    # Calibrated per position under the constraint: mean predicted = observed.
    for j in range(k):
        assert abs(p[obs[:, j], j].mean() - acc[obs[:, j], j].mean()) < 0.05
    assert np.all(np.abs(coef.intercept_array()) < 10)


def test_recursive_rule_survives_hostile_labels():
    k = 4
    rule = RecursiveRule()
    coef = Coefficients.cold_start(k)
    rule.reset(coef)
    rng = np.random.default_rng(0)
    for _ in range(200):
        x = rng.uniform(0.0, 4.0, size=(64, k))
        # Accept exactly the low-confidence drafts: labels against the slope.
        acc = x < 2.0
        obs = np.ones_like(acc)
        coef = rule.refit(coef, fold(x, linear_predictor(coef, x), obs, acc)).coefficients
    assert coef.slope >= 0
    # Half the drafts are accepted; with the slope held the intercepts centre
    # the predictions on that rate instead of running off.
    assert np.all(np.abs(coef.intercept_array()) < 3)


def test_fit_mle_under_quasi_separation_matches_statsmodels_on_the_rest():
    k = 4
    truth = [0.8, 0.3, -0.2, -0.6]
    x, obs, acc = synthetic(3000, k, 0.8, truth, seed=11)
    # Position 0: every observed draft accepted (the intercept's MLE is +inf);
    # position 3 never verified (trimmed): nothing to fit there.
    obs = obs.copy()
    obs[:, 3] = False
    acc = acc & obs
    acc[:, 0] = True
    coef, _ = fit_mle(x, obs, acc)
    rest = obs.copy()
    rest[:, 0] = False
    design, y = dense_design(x, rest, acc)
    glm = sm.GLM(y, design[:, [0, 2, 3]], family=sm.families.Binomial()).fit(tol=1e-12)
    np.testing.assert_allclose(coef.slope, glm.params[0], atol=1e-6)
    np.testing.assert_allclose(coef.intercept_array()[1:3], glm.params[1:], atol=1e-6)
    assert coef.intercepts[3] == Coefficients.cold_start(k).intercepts[3]
    # The separated position predicts (numerically) certain acceptance.
    p0 = 1 / (1 + np.exp(-linear_predictor(coef, x)[obs[:, 0], 0]))
    assert p0.min() > 1 - 1e-9
    # statsmodels on the full design drives the same intercept off and agrees
    # on everything else.
    full_design, full_y = dense_design(x, obs, acc)
    full = sm.GLM(full_y, full_design[:, :4], family=sm.families.Binomial()).fit(
        tol=1e-12, maxiter=200
    )
    np.testing.assert_allclose(coef.slope, full.params[0], atol=1e-3)
    np.testing.assert_allclose(coef.intercept_array()[1:3], full.params[2:], atol=1e-3)


def test_fit_mle_all_rejected_position():
    k = 3
    x, obs, acc = synthetic(2000, k, 0.6, [0.5, 0.0, -0.5], seed=12)
    # Position 2: every observed draft rejected.
    acc = acc.copy()
    acc[:, 2] = False
    coef, _ = fit_mle(x, obs, acc)
    rest = obs.copy()
    rest[:, 2] = False
    design, y = dense_design(x, rest, acc)
    glm = sm.GLM(y, design[:, :3], family=sm.families.Binomial()).fit(tol=1e-12)
    np.testing.assert_allclose(coef.as_vector()[:3], glm.params, atol=1e-6)
    p2 = 1 / (1 + np.exp(-linear_predictor(coef, x)[obs[:, 2], 2]))
    assert p2.max() < 1e-9
