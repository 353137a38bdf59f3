"""The slope's bound ``slope >= 0``: where acceptance does not rise with the feature
(inverted confidence), the default rule settles the slope at 0 and the intercepts
carry the per-position rates, which is the maximum-likelihood fit under the bound.

The reference is that constrained fit computed independently: scipy's L-BFGS-B on
the pooled drafts' log-likelihood with the slope bounded below by 0, and, when it
lands on the bound, the exact solution there (each intercept the log-odds of its
position's observed rate).
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import minimize

from avest.core.calibration import DEFAULT_LAYER
from avest.core.estimator import OnlineEstimator
from avest.core.labels import labels
from avest.core.model import Coefficients, linear_predictor
from avest.core.rule_factory import make_rule
from avest.core.stats import fold
from avest.core.tracking import TrackingConfig, TrackingRule
from avest.offline.evaluate import evaluate
from avest.offline.trace import Trace
from tests.support.steps import draw_step
from tests.support.traces import make_synthetic_trace

K = 5
#: Per-position intercepts of the synthetic truth: falling along the draft, as measured.
INTERCEPTS = np.linspace(1.0, -0.5, K)
#: Acceptance falling as the drafter grows confident: the log-odds drop by 0.5 per
#: unit of ``logit(q_max)``, so over the features' spread (sd ~2) the rate moves by
#: about 0.45 against the feature.
INVERTED_SLOPE = -0.5


def inverted_confidence_trace(seed: int, slope: float = INVERTED_SLOPE) -> Trace:
    """An avest-trace/1 trace whose acceptance falls (``slope < 0``) or stays flat
    (``slope = 0``) as the feature ``logit(q_max)`` rises: features skewed like the
    recorded traces' (mean ~0, long right tail), 400 decode steps of 16 requests,
    each position accepted with ``sigmoid(slope * x + INTERCEPTS[i])`` up to the
    first rejection."""
    return make_synthetic_trace(
        steps=400, requests=16, k=K, slope=slope, intercepts=INTERCEPTS, seed=seed
    )


def constrained_mle(x: np.ndarray, observed: np.ndarray, accepted: np.ndarray) -> np.ndarray:
    """``[slope, intercepts...]`` maximising the likelihood subject to ``slope >= 0``."""
    k = x.shape[1]
    position = np.nonzero(observed)[1]
    xs = x[observed]
    y = accepted[observed].astype(np.float64)

    def loss(theta: np.ndarray) -> tuple[float, np.ndarray]:
        eta = theta[0] * xs + theta[1:][position]
        r = 1.0 / (1.0 + np.exp(-eta)) - y
        grad = np.concatenate(([r @ xs], np.bincount(position, r, minlength=k)))
        return float(np.sum(np.logaddexp(0.0, eta) - y * eta)), grad

    fit = minimize(
        loss,
        np.zeros(k + 1),
        jac=True,
        method="L-BFGS-B",
        bounds=[(0.0, None)] + [(None, None)] * k,
        options={"gtol": 1e-10, "ftol": 1e-15, "maxiter": 10_000},
    )
    assert fit.success, fit.message
    theta = np.asarray(fit.x, dtype=np.float64)
    if theta[0] == 0.0:
        # On the bound the intercepts decouple: each is its position's observed log-odds.
        rate = accepted.sum(axis=0, where=observed) / observed.sum(axis=0)
        np.testing.assert_allclose(theta[1:], np.log(rate / (1.0 - rate)), atol=1e-5)
        theta[1:] = np.log(rate / (1.0 - rate))
        # And the bound binds: the likelihood would rise with a negative slope.
        assert loss(theta)[1][0] > 0.0
    return theta


@pytest.mark.parametrize(
    ("slope", "on_bound"), [(INVERTED_SLOPE, True), (0.8, False)], ids=["inverted", "rising"]
)
def test_refits_on_a_fixed_data_set_reach_the_constrained_mle(slope, on_bound):
    """Refitted again and again on the same drafts, the default rule's fixed point is
    the maximum-likelihood fit under ``slope >= 0``: exactly 0 where acceptance falls
    with the feature (the rule used to stop wherever its last step short of 0 left
    it, 0.024 here, with every intercept off by up to 0.026), and the free fit where
    it rises."""
    rng = np.random.default_rng(4)
    x, verified, accepted = draw_step(rng, 4000, K, slope, INTERCEPTS)
    observed, acc = labels(verified.astype(np.int64), accepted.astype(np.int64), K)
    reference = constrained_mle(x, observed, acc)
    assert bool(reference[0] == 0.0) is on_bound
    rule = TrackingRule()
    coef = Coefficients.cold_start(K)
    rule.reset(coef)
    for _ in range(100):
        coef = rule.refit(coef, fold(x, linear_predictor(coef, x), observed, acc)).coefficients
    if on_bound:
        assert coef.slope == 0.0
    np.testing.assert_allclose(coef.as_vector(), reference, atol=1e-4)


def test_stationary_inverted_rounds_reach_the_pooled_constrained_mle():
    """Fresh rounds of an inverted workload: the slope reaches 0 and stays there, and
    the intercepts are the pooled rates' log-odds within the rounds' noise (the
    tolerance of the free fit's test in test_tracking)."""
    rng = np.random.default_rng(4)
    rule = TrackingRule(TrackingConfig(forgetting=1.0, warmup_rounds=0))
    coef = Coefficients.cold_start(K)
    rule.reset(coef)
    pooled: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    slopes = []
    for _ in range(30):
        x, verified, accepted = draw_step(rng, 512, K, INVERTED_SLOPE, INTERCEPTS)
        observed, acc = labels(verified.astype(np.int64), accepted.astype(np.int64), K)
        coef = rule.refit(coef, fold(x, linear_predictor(coef, x), observed, acc)).coefficients
        pooled.append((x, observed, acc))
        slopes.append(coef.slope)
    reference = constrained_mle(*(np.concatenate(a) for a in zip(*pooled, strict=True)))
    assert reference[0] == 0.0
    assert slopes[-20:] == [0.0] * 20
    np.testing.assert_allclose(coef.as_vector(), reference, atol=0.1)


@pytest.mark.parametrize("slope", [INVERTED_SLOPE, 0.0], ids=["falling", "flat"])
def test_the_served_estimator_is_calibrated_on_an_inverted_trace(slope):
    """``avest evaluate --method tracking --method calibrated`` on a trace whose
    acceptance does not rise with the feature: ECE at most 0.05 for the rule alone and
    as served (with the calibration layer; 0.16 for the rule when a step below 0 was
    dropped), where vLLM's rule, its slope held at the cold start's 0.5, is 0.30 off."""
    trace = inverted_confidence_trace(seed=11, slope=slope)
    report = evaluate(trace, methods=["vllm", "tracking", "calibrated"])
    assert report.methods["vllm"].summary.ece > 0.1
    observed, accepted = trace.labels()
    rate = accepted.sum(axis=0, where=observed) / observed.sum(axis=0)
    for method in ("tracking", "calibrated"):
        result = report.methods[method]
        assert result.summary.ece <= 0.05, (method, result.summary.ece)
        assert result.coefficients is not None
        if slope < 0.0:
            assert result.coefficients.slope == 0.0  # the bound binds
        else:
            assert result.coefficients.slope < 0.02  # the free fit is 0 up to the noise
        # The intercepts carry the per-position rates (vLLM's rule: up to 0.17 off).
        np.testing.assert_allclose(
            result.coefficients.intercept_array(), np.log(rate / (1.0 - rate)), atol=0.1
        )


def test_at_the_bound_the_innovation_test_reads_the_intercepts_alone():
    """On a stationary inverted workload the slope's gradient at the bound never
    vanishes; read as innovation it made every refit look like a switch of workload
    (the rule kept under 1 % of its information and the calibration layer restarted
    each round). Once the slope is at 0 no refit reads as a shift."""
    trace = inverted_confidence_trace(seed=3)
    est = OnlineEstimator(K, make_rule("tracking"), 100, calibrate=True)
    kept = []
    for step in trace.steps():
        rounds = est.round
        est.observe(step.features, step.num_verified, step.num_accepted)
        if est.round != rounds and est.coefficients.slope == 0.0:
            kept.append(est.rule.carried_weight)
    assert len(kept) >= 5
    assert min(kept) >= DEFAULT_LAYER.shift_weight, kept


def test_the_floor_changes_nothing_where_acceptance_rises():
    """On a trace whose acceptance rises with the feature the bound never binds: the
    default rule with and without the floor gives the same coefficients at every refit."""
    trace = make_synthetic_trace(
        steps=300, requests=16, k=K, slope=0.5, intercepts=INTERCEPTS, seed=5
    )
    floor = OnlineEstimator(K, TrackingRule(), 50, calibrate=True)
    drop = OnlineEstimator(K, TrackingRule(TrackingConfig(slope_floor=False)), 50, calibrate=True)
    for step in trace.steps():
        for est in (floor, drop):
            est.observe(step.features, step.num_verified, step.num_accepted)
        assert floor.coefficients == drop.coefficients
    assert floor.coefficients.slope > 0.3
