"""What every update rule the factory makes promises: finite steps on any input,
round sums that merge by addition, and a state that resumes exactly."""

from __future__ import annotations

import numpy as np
import pytest

from avest.core.estimator import OnlineEstimator
from avest.core.labels import labels
from avest.core.model import Coefficients, linear_predictor
from avest.core.rule_factory import RULE_NAMES, make_rule
from avest.core.rules import OUTCOMES, UpdateRule
from avest.core.stats import RoundStats, fold

K = 4
#: Every rule the factory can make, by name.
RULES = list(RULE_NAMES)


def _round(rng, rows, coef, *, x=None, accept=None, clamp=False):
    """One round's drafts scored at ``coef``: ``(stats, (x, observed, accepted))``."""
    if x is None:
        x = rng.normal(1.0, 2.5, size=(rows, K))
        if clamp:
            x = np.where(rng.random((rows, K)) < 0.5, 40.0, -40.0)
    if accept is None:
        p = 1 / (1 + np.exp(-(0.9 * x + np.linspace(1.0, -0.5, K))))
        ok = rng.random((rows, K)) < p
    else:
        ok = np.full((rows, K), accept)
    a = np.where(ok.all(axis=1), K, np.argmin(ok, axis=1))
    obs, acc = labels(np.full(rows, K), a.astype(np.int64), K)
    return fold(x, linear_predictor(coef, x), obs, acc), (x, obs, acc)


#: Rounds meant to break a step, each made at the coefficients in force.
HOSTILE = {
    "clamped": lambda rng, c: _round(rng, 64, c, clamp=True)[0],
    "piled-at-+40": lambda rng, c: _round(rng, 64, c, x=np.full((64, K), 40.0))[0],
    "all-accepted": lambda rng, c: _round(rng, 64, c, accept=True)[0],
    "all-rejected": lambda rng, c: _round(rng, 64, c, accept=False)[0],
    "no-labels": lambda rng, c: RoundStats.zeros(K),
    "one-draft": lambda rng, c: _round(rng, 1, c)[0],
    "huge": lambda rng, c: _round(rng, 256, c)[0].scale(1e9),
    "tiny": lambda rng, c: _round(rng, 256, c)[0].scale(1e-9),
    "-40-all-accepted": lambda rng, c: _round(rng, 64, c, x=np.full((64, K), -40.0), accept=True)[
        0
    ],
}


def _sane(coef: Coefficients) -> bool:
    v = coef.as_vector()
    return bool(np.all(np.isfinite(v)) and coef.slope >= 0.0)


@pytest.mark.parametrize("name", RULES)
def test_every_rule_is_an_update_rule_with_every_feature(name):
    rule = make_rule(name)
    assert isinstance(rule, UpdateRule) and rule.name == name
    assert rule.warmup_rounds >= 0
    assert 0.0 <= rule.carried_weight <= 1.0


@pytest.mark.parametrize("name", RULES)
@pytest.mark.parametrize("seed", range(3))
def test_hostile_rounds_leave_finite_coefficients(name, seed):
    rng = np.random.default_rng(seed)
    rule = make_rule(name)
    coef = Coefficients.cold_start(K)
    rule.reset(coef)
    for _ in range(3):
        for make in HOSTILE.values():
            result = rule.refit(coef, make(rng, coef))
            assert result.outcome in OUTCOMES
            assert _sane(result.coefficients), (name, result)
            coef = result.coefficients
            assert np.isfinite(rule.carried_weight)


@pytest.mark.parametrize("name", RULES)
def test_two_half_rounds_added_move_the_rule_as_the_whole_round(name):
    """Many workers' rounds pool by addition: the sums of two halves give the step
    of the whole, round after round (the rule's carried state included)."""
    rng = np.random.default_rng(11)
    whole, halves = make_rule(name), make_rule(name)
    coef_w = coef_h = Coefficients.cold_start(K)
    whole.reset(coef_w)
    halves.reset(coef_h)
    for _ in range(8):
        _, (x, obs, acc) = _round(rng, 400, coef_w)
        one = fold(x, linear_predictor(coef_w, x), obs, acc)
        two = fold(x[:150], linear_predictor(coef_h, x[:150]), obs[:150], acc[:150]) + fold(
            x[150:], linear_predictor(coef_h, x[150:]), obs[150:], acc[150:]
        )
        coef_w = whole.refit(coef_w, one).coefficients
        coef_h = halves.refit(coef_h, two).coefficients
        np.testing.assert_allclose(coef_h.as_vector(), coef_w.as_vector(), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", RULES)
def test_state_to_snapshot_and_back_gives_the_same_next_refit(name):
    rng = np.random.default_rng(12)
    rule = make_rule(name)
    coef = Coefficients.cold_start(K)
    rule.reset(coef)
    for i in range(6):
        coef = rule.refit(coef, _round(rng, 200, coef, clamp=i == 3)[0]).coefficients
    arrays = rule.state()
    assert all(v.dtype == np.float64 for v in arrays.values())
    again = make_rule(name)
    again.reset(Coefficients.cold_start(K))
    again.load_state({n: v.copy() for n, v in arrays.items()})
    for _ in range(3):
        stats = _round(rng, 200, coef)[0]
        a, b = rule.refit(coef, stats), again.refit(coef, stats)
        np.testing.assert_array_equal(a.coefficients.as_vector(), b.coefficients.as_vector())
        assert a.outcome == b.outcome
        assert rule.carried_weight == again.carried_weight
        coef = a.coefficients


@pytest.mark.parametrize("name", RULES)
def test_an_estimator_snapshot_resumes_every_rule_exactly(name):
    rng = np.random.default_rng(13)
    a = OnlineEstimator(K, make_rule(name), refit_interval=10, calibrate=True)
    b = OnlineEstimator(K, make_rule(name), refit_interval=10, calibrate=True)
    for _ in range(45):
        _, (x, _obs, _acc) = _round(rng, 8, a.coefficients)
        a.observe(x, np.full(8, K), rng.integers(0, K + 1, size=8))
    b.restore(a.snapshot())
    for _ in range(40):
        x = rng.normal(1.0, 2.5, size=(8, K))
        d, acc = np.full(8, K), rng.integers(0, K + 1, size=8)
        a.observe(x, d, acc)
        b.observe(x, d, acc)
    assert a.coefficients == b.coefficients
    assert a.round_length == b.round_length
