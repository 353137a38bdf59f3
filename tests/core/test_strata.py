"""Strata in the core: a coefficient set per stratum beside the pair's own."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression

from avest.core.estimator import Batch, OnlineEstimator, make_batch
from avest.core.model import Coefficients, linear_predictor
from avest.core.rule_factory import make_rule
from avest.core.rules import arrowhead_dense
from avest.core.strata import StrataConfig, StratifiedEstimator, shrink
from avest_wire.errors import InvalidInput
from tests.support.steps import draw_step

K = 4
#: Two kinds of request with the slopes of greedy and sampled requests apart.
TRUTH = {
    "greedy": Coefficients.of(1.2, [1.0, 0.6, 0.3, 0.0]),
    "t0.5-1": Coefficients.of(0.35, [0.2, -0.1, -0.4, -0.6]),
}


def mixed_steps(n: int, rows: dict[str, int], seed: int) -> list[tuple[Batch, list[str]]]:
    """``n`` steps, each ``rows[s]`` requests of stratum ``s`` drawn from its truth."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        parts, names = [], []
        for name, count in rows.items():
            if count:
                truth = TRUTH[name]
                parts.append(draw_step(rng, count, K, truth.slope, truth.intercept_array()))
                names += [name] * count
        x, d, a = (np.concatenate(p) for p in zip(*parts, strict=True))
        out.append((make_batch(x, d, a, K), names))
    return out


def run(
    steps: list[tuple[Batch, list[str]]], config: StrataConfig | None = None, interval: int = 20
) -> StratifiedEstimator:
    est = StratifiedEstimator(OnlineEstimator(K, make_rule("tracking"), interval), config)
    for batch, names in steps:
        est.apply(batch, names)
    return est


def sklearn_mle(steps: list[tuple[Batch, list[str]]], stratum: str) -> Coefficients:
    """The unpenalised MLE of one stratum's drafts on features ``[x, one-hot position]``."""
    xs, ys = [], []
    for batch, names in steps:
        rows = np.array(names) == stratum
        obs = batch.observed[rows]
        position = np.broadcast_to(np.arange(K), obs.shape)[obs]
        xs.append(np.column_stack([batch.features[rows][obs], np.eye(K)[position]]))
        ys.append(batch.accepted[rows][obs])
    fit = LogisticRegression(C=np.inf, fit_intercept=False, max_iter=10_000, tol=1e-10)
    fit.fit(np.concatenate(xs), np.concatenate(ys))
    return Coefficients.from_vector(fit.coef_[0])


def test_each_stratum_converges_to_its_own_mle_and_the_pair_keeps_one_set() -> None:
    """Plentiful evidence (6,400 requests' steps per stratum and round): each
    stratum serves its own maximum-likelihood fit, as sklearn finds it."""
    steps = mixed_steps(2000, {"greedy": 32, "t0.5-1": 32}, seed=1)
    est = run(steps, interval=200)
    for name in TRUTH:
        mle = sklearn_mle(steps, name)
        got = est.coefficients_for(name).as_vector()
        np.testing.assert_allclose(got, mle.as_vector(), atol=0.07, err_msg=name)
    # The two strata are far apart; the pair's one set sits between them.
    greedy, sampled = (est.coefficients_for(n).slope for n in TRUTH)
    assert greedy - sampled > 0.6
    assert sampled < est.pooled.coefficients.slope < greedy


def test_a_thin_stratum_stays_near_the_pair_and_moves_to_its_own_fit_as_it_grows() -> None:
    """The share of the way from the stratum's own MLE to the pair's set that its
    coefficients keep: large while thin, shrinking as its drafts grow."""
    shares = []
    for thin_rows in (1, 6, 48):
        steps = mixed_steps(400, {"greedy": 48, "t0.5-1": thin_rows}, seed=2)
        est = run(steps)
        mle = sklearn_mle(steps, "t0.5-1").slope
        pooled = est.pooled.coefficients.slope
        shares.append((est.coefficients_for("t0.5-1").slope - mle) / (pooled - mle))
        if thin_rows == 1:
            alone = run(steps, StrataConfig(prior_drafts=0.0))
            # Without the prior the thin stratum follows its few drafts further.
            free = (alone.coefficients_for("t0.5-1").slope - mle) / (pooled - mle)
            assert shares[0] > free + 0.1, (shares[0], free)
    assert shares[0] > 0.25, shares
    assert shares[0] > shares[1] > shares[2], shares
    assert abs(shares[2]) < 0.1, shares


def test_a_new_stratum_starts_from_the_pair_and_a_huge_prior_holds_it_there() -> None:
    steps = mixed_steps(200, {"greedy": 16, "t0.5-1": 16}, seed=3)
    est = run(steps[:100])
    assert "greedy" in est.strata
    fresh = StratifiedEstimator(est.pooled)
    assert fresh.coefficients_for("t0.5-1") == est.pooled.coefficients
    held = run(steps, StrataConfig(prior_drafts=1e9))
    for name in TRUTH:
        np.testing.assert_allclose(
            held.coefficients_for(name).as_vector(),
            held.pooled.coefficients.as_vector(),
            atol=1e-3,
        )


def test_one_stratum_is_todays_estimator_exactly(sample_trace) -> None:
    """All traffic in one stratum: every prediction and refit is the pooled estimator's,
    itself bit for bit what an estimator without strata does."""
    from avest.offline.evaluate import Steps

    steps = Steps.of(sample_trace)
    today = OnlineEstimator(sample_trace.k, make_rule("tracking"), 20)
    strat = StratifiedEstimator(OnlineEstimator(sample_trace.k, make_rule("tracking"), 20))
    refits = 0
    for lo, hi in steps.bounds:
        batch = Batch(steps.features[lo:hi], steps.observed[lo:hi], steps.accepted[lo:hi])
        names = ["greedy"] * batch.features.shape[0]
        want = linear_predictor(today.coefficients, batch.features)
        np.testing.assert_array_equal(strat.linear_predictor(batch.features, names), want)
        refit = today.apply(batch)
        refits += strat.apply(batch, names) is not None
        assert (refit is None) == (strat.pooled.steps_in_round != 0)
        assert strat.pooled.coefficients == today.coefficients
    assert refits >= 5
    assert strat.coefficients_for("greedy") == today.coefficients


def test_past_the_limit_a_stratum_falls_back_to_the_pair_and_is_counted() -> None:
    rng = np.random.default_rng(4)
    est = StratifiedEstimator(
        OnlineEstimator(K, make_rule("tracking"), 5), StrataConfig(max_strata=2)
    )
    names = ["a", "a", "b", "b", "c", "c", "c"]
    labelled = total = 0
    for _ in range(30):
        batch = make_batch(*draw_step(rng, len(names), K, 0.8, np.zeros(K)), K)
        labelled += int(batch.observed[4:].sum())
        total += batch.labelled
        est.apply(batch, names)
    assert set(est.strata) == {"a", "b"}
    assert est.fallback_rows == 30 * 3 and est.fallback_drafts == labelled
    assert est.last_fallback == "c"
    assert est.coefficients_for("c") == est.pooled.coefficients
    assert est.coefficients_for("a") != est.pooled.coefficients
    # The pair learned from every row, the fallen-back ones included.
    assert est.pooled.drafts == total


def test_an_idle_stratum_is_retired_and_its_place_freed() -> None:
    rng = np.random.default_rng(5)
    est = StratifiedEstimator(
        OnlineEstimator(K, make_rule("tracking"), 5), StrataConfig(max_strata=2, idle_rounds=3)
    )

    def rounds(count: int, names: list[str]) -> None:
        """Steps of ``names`` until the pair has refitted ``count`` times."""
        while count:
            batch = make_batch(*draw_step(rng, len(names), K, 0.8, np.zeros(K)), K)
            count -= est.apply(batch, names) is not None

    rounds(4, ["a", "b"])
    rounds(2, ["a", "a"])
    assert "b" in est.strata and est.strata["b"].idle == 2
    rounds(1, ["a", "a"])
    assert "b" not in est.strata and est.retired == 1
    rounds(1, ["a", "c"])
    assert "c" in est.strata and est.fallback_rows == 0


def test_bad_strata_are_refused_before_anything_changes() -> None:
    est = StratifiedEstimator(OnlineEstimator(K, make_rule("tracking"), 5))
    batch = make_batch(*draw_step(np.random.default_rng(6), 2, K, 0.8, np.zeros(K)), K)
    with pytest.raises(ValueError, match="2 rows"):
        est.apply(batch, ["a"])
    with pytest.raises(InvalidInput):
        est.apply(batch, ["a", ""])
    assert est.pooled.steps == 0


def test_shrink_is_the_posterior_mode_of_the_fit_and_the_prior() -> None:
    """The served set solves ``(I + P) theta = I fit + P centre``, with ``P`` the
    pseudo-drafts' information; more pseudo-drafts, nearer the centre."""
    information = (9.0, np.array([2.0, 0.0]), np.array([1.0, 0.0]))
    fit, centre = Coefficients.of(1.0, [0.5, 0.5]), Coefficients.of(0.5, [0.0, -1.0])
    got = shrink(fit, centre, information, drafts=4.0)
    # Four pseudo-drafts at weight 1/4: position 0 at its mean feature 2 with the
    # within-position spread (9 - 2^2/1) / 1 = 5 for each of the two positions;
    # position 1 has no information: its intercept alone.
    prior = arrowhead_dense(2.0**2 + 2 * 5.0, np.array([2.0, 0.0]), np.array([1.0, 1.0]))
    info = arrowhead_dense(*information)
    want = np.linalg.solve(info + prior, info @ fit.as_vector() + prior @ centre.as_vector())
    np.testing.assert_allclose(got.as_vector(), want, atol=1e-12)
    # Position 1 had no information of its own: it takes the centre's.
    assert got.intercepts[1] == pytest.approx(-1.0 - 2.0 * 0.0 + 0.0, abs=1e-12)
    near = shrink(fit, centre, information, drafts=400.0).as_vector()
    assert np.linalg.norm(near - centre.as_vector()) < np.linalg.norm(want - centre.as_vector())


def test_a_stratum_left_alone_serves_the_pairs_refits() -> None:
    """Once the other kind of request is gone, the remaining stratum is the whole
    pair: it takes the pair's refit, whatever its own history."""
    steps = mixed_steps(200, {"greedy": 16, "t0.5-1": 16}, seed=7)
    est = run(steps)
    assert est.coefficients_for("greedy") != est.pooled.coefficients
    refits = 0
    for batch, names in mixed_steps(60, {"greedy": 16, "t0.5-1": 0}, seed=8):
        refits += est.apply(batch, names) is not None
    assert refits >= 2
    assert est.coefficients_for("greedy") == est.pooled.coefficients
    assert est.coefficients_for("t0.5-1") != est.pooled.coefficients
