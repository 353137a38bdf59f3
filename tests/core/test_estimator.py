"""The online estimator: refusals change nothing, coefficients stay sane, state round-trips."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from avest.core.estimator import OnlineEstimator
from avest.core.features import logit_qmax_from_logits, logit_qmax_from_probs
from avest.core.labels import counts_from_vllm, labels
from avest.core.model import Coefficients
from avest.core.rule_factory import DEFAULT_RULE, make_rule
from avest.core.rules import RecursiveRule, VllmRule
from avest_wire.errors import InvalidInput


def state_of(est: OnlineEstimator) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in est.snapshot().items()}


def same_state(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


K = 4
finite_features = arrays(
    np.float64, st.tuples(st.integers(1, 12), st.just(K)), elements=st.floats(-40, 40)
)


@st.composite
def steps(draw):
    x = draw(finite_features)
    rows = x.shape[0]
    d = draw(arrays(np.int64, rows, elements=st.integers(0, K)))
    a = np.array([draw(st.integers(0, int(v))) for v in d], dtype=np.int64)
    return x, d, a


@pytest.mark.parametrize(
    "rule",
    [VllmRule(), RecursiveRule(), make_rule(DEFAULT_RULE)],
    ids=["vllm", "recursive", "tracking"],
)
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batches=st.lists(steps(), min_size=1, max_size=12))
def test_coefficients_stay_finite_and_slope_non_negative(rule, batches):
    est = OnlineEstimator(K, rule, refit_interval=2)
    for x, d, a in batches:
        est.observe(x, d, a)
        c = est.coefficients
        assert np.isfinite(c.slope) and c.slope >= 0.0
        assert np.all(np.isfinite(c.intercept_array()))


BAD = [
    (
        "features",
        lambda x, d, a: (np.where(np.arange(x.size).reshape(x.shape) == 0, np.nan, x), d, a),
    ),
    (
        "features",
        lambda x, d, a: (np.where(np.arange(x.size).reshape(x.shape) == 1, np.inf, x), d, a),
    ),
    ("features", lambda x, d, a: (x + 100.0, d, a)),
    ("features", lambda x, d, a: (x[:, :-1], d, a)),
    ("features", lambda x, d, a: (x.reshape(-1), d, a)),
    ("num_verified", lambda x, d, a: (x, d[:-1], a)),
    ("num_verified", lambda x, d, a: (x, d + K + 1, a)),
    ("num_accepted", lambda x, d, a: (x, d, d + 1)),
    ("num_accepted", lambda x, d, a: (x, d, a - 5)),
]


@pytest.mark.parametrize(("field", "corrupt"), BAD)
def test_bad_input_is_refused_and_changes_nothing(field, corrupt):
    rng = np.random.default_rng(0)
    est = OnlineEstimator(K, RecursiveRule(), refit_interval=3)
    for _ in range(4):
        x = rng.normal(size=(8, K))
        d = np.full(8, K)
        est.observe(x, d, rng.integers(0, K + 1, size=8))
    before = state_of(est)
    x = rng.normal(size=(8, K))
    d = np.full(8, K)
    a = np.full(8, 2)
    with pytest.raises(InvalidInput) as err:
        est.observe(*corrupt(x, d, a))
    assert err.value.field == field
    assert field in str(err.value)
    assert same_state(before, state_of(est))


def test_exclude_mask_drops_rows():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(6, K))
    d, a = np.full(6, K), np.array([0, 1, 2, 3, 4, 1])
    exclude = np.array([True, False, True, False, False, False])
    with_mask = OnlineEstimator(K)
    with_mask.observe(x, d, a, exclude)
    without_rows = OnlineEstimator(K)
    without_rows.observe(x[~exclude], d[~exclude], a[~exclude])
    assert with_mask.round_stats.equals(without_rows.round_stats)
    with pytest.raises(InvalidInput, match="exclude"):
        with_mask.observe(x, d, a, exclude[:3])


def test_refit_every_interval_steps_and_snapshot_restores_exactly():
    rng = np.random.default_rng(2)
    est = OnlineEstimator(K, RecursiveRule(forgetting=0.9), refit_interval=5)
    data = [
        (rng.normal(size=(16, K)), np.full(16, K), rng.integers(0, K + 1, size=16))
        for _ in range(23)
    ]
    for x, d, a in data[:13]:
        est.observe(x, d, a)
    assert (est.round, est.version, est.steps, est.steps_in_round) == (2, 2, 13, 3)
    clone = OnlineEstimator(K, RecursiveRule(forgetting=0.9), refit_interval=5)
    clone.restore(est.snapshot())
    for x, d, a in data[13:]:
        est.observe(x, d, a)
        clone.observe(x, d, a)
    assert est.coefficients == clone.coefficients
    assert same_state(state_of(est), state_of(clone))


def test_reset_returns_to_the_start():
    est = OnlineEstimator(K, start=Coefficients.of(0.7, [0.1] * K), refit_interval=1)
    assert est.version == 0
    est.observe(np.ones((4, K)), np.full(4, K), np.full(4, K))
    assert est.coefficients != est.start and est.version == 1
    est.reset()
    assert est.coefficients == Coefficients.of(0.7, [0.1] * K)
    # The version never goes back: a reset is a new set of coefficients.
    assert (est.version, est.round, est.drafts) == (2, 0, 0)


def test_feature_is_exact_where_the_naive_formula_overflows():
    assert logit_qmax_from_logits([20.0, 0.0]) == 20.0
    q = np.float32(1 / (1 + np.exp(np.float32(-20.0))))
    with np.errstate(divide="ignore"):
        assert np.isinf(np.log(q / (np.float32(1) - q)))
    # A one-hot distribution clamps to +40; temperature 0 leaves logits unscaled.
    assert logit_qmax_from_probs([1.0, 0.0, 0.0]) == 40.0
    z = np.array([[2.0, 1.0, 0.0]])
    np.testing.assert_allclose(logit_qmax_from_logits(z, [0.0]), logit_qmax_from_logits(z, [1.0]))
    p = np.exp(z / 0.5) / np.exp(z / 0.5).sum()
    np.testing.assert_allclose(
        logit_qmax_from_logits(z, [0.5]), np.log(p.max() / (1 - p.max())), rtol=1e-12
    )
    np.testing.assert_allclose(logit_qmax_from_probs(p), logit_qmax_from_logits(z, 0.5), rtol=1e-12)
    with pytest.raises(InvalidInput, match="logits"):
        logit_qmax_from_logits([np.nan, 1.0])


def test_vllm_counts_give_the_documented_labels():
    # num_sampled = accepted + 1 (bonus), 0 while prefilling.
    d, a = counts_from_vllm([0, 1, 3, 6], [0, 2, 1, 0])
    assert a.tolist() == [0, 0, 2, 5] and d.tolist() == [0, 2, 3, 5]
    observed, accepted = labels(d, a, 5)
    assert observed.sum(axis=1).tolist() == [0, 1, 3, 5]
    assert (observed & accepted).sum(axis=1).tolist() == [0, 0, 2, 5]
