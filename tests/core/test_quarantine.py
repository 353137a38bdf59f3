"""The statistics of robust pooling (avest.core.quarantine) against direct computation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from avest.core import quarantine as Q
from avest.core.model import Coefficients, linear_predictor
from avest.core.numeric import sigmoid
from avest.core.stats import RoundStats, fold

K = 4


def drafts(seed: int, rows: int = 64, accept: float | None = None):
    """Random drafts of K positions, labelled from the model (or at rate ``accept``)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(1.0, 2.0, size=(rows, K))
    p = sigmoid(linear_predictor(Coefficients.cold_start(K), x))
    truth = p if accept is None else np.full_like(p, accept)
    accepted = rng.random((rows, K)) < truth
    observed = rng.random((rows, K)) < 0.8
    return x, observed, accepted & observed


def stats_of(x, observed, accepted, at: Coefficients | None = None) -> RoundStats:
    at = Coefficients.cold_start(K) if at is None else at
    return fold(x, linear_predictor(at, x), observed, accepted)


def direct(x, observed, accepted, at: Coefficients | None = None) -> tuple[float, float, float]:
    """observed accepted - sum p, sum p(1 - p), drafts: straight from the drafts."""
    at = Coefficients.cold_start(K) if at is None else at
    p = sigmoid(linear_predictor(at, x))[observed]
    y = accepted[observed].astype(float)
    return float(y.sum() - p.sum()), float((p * (1 - p)).sum()), float(observed.sum())


def test_evidence_holds_observed_minus_predicted_its_variance_and_drafts():
    x, obs, acc = drafts(0)
    ev = Q.Evidence.of(stats_of(x, obs, acc))
    residual, variance, n = direct(x, obs, acc)
    assert ev.residual == pytest.approx(residual, rel=1e-12)
    assert ev.variance == pytest.approx(variance, rel=1e-12)
    assert ev.drafts == n


def test_evidence_decays_by_refits_and_adds_up():
    a, b = drafts(1), drafts(2)
    ev = Q.Evidence.of(stats_of(*a))
    ev.at(3).add(stats_of(*b))
    ra, va, na = direct(*a)
    rb, vb, nb = direct(*b)
    f = Q.DECAY**3
    assert ev.clock == 3
    assert ev.residual == pytest.approx(f * ra + rb, rel=1e-12)
    assert ev.variance == pytest.approx(f * va + vb, rel=1e-12)
    assert ev.drafts == pytest.approx(f * na + nb, rel=1e-12)
    ev.at(2)  # never back in time
    assert ev.clock == 3 and ev.drafts == pytest.approx(f * na + nb, rel=1e-12)


def test_score_is_the_standardized_gap_to_the_median_rate():
    rates = [0.01, -0.02, 0.03, 0.5]  # one far off: the median and its spread ignore it
    pooled = Q.Evidence(residual=10.0, variance=200.0, drafts=1000.0)
    ref = Q.reference(rates, pooled)
    median = float(np.median(rates))
    mad = 1.4826 * float(np.median(np.abs(np.array(rates) - median)))
    assert ref.rate == pytest.approx(median)
    assert ref.overdispersion == pytest.approx(max(Q.TAU, mad))
    assert ref.variance == pytest.approx(math.pi / 2 * 200.0 / 1000.0**2)
    assert ref.workers == 4 and ref.judges

    x, obs, acc = drafts(3, accept=1.0)
    own = Q.Evidence.of(stats_of(x, obs, acc))
    residual, variance, n = direct(x, obs, acc)
    want = (residual / n - median) / math.sqrt(
        (variance + Q.MIN_VARIANCE) / n**2 + ref.variance + ref.overdispersion**2
    )
    assert Q.score(own, ref) == pytest.approx(want, rel=1e-12)
    assert want > Q.QUARANTINE_Z  # all accepted where the model says ~0.6: far outside


def test_no_score_without_enough_workers_or_drafts():
    own = Q.Evidence(residual=-50.0, variance=0.0, drafts=50.0)
    two = Q.reference([0.0, 0.01], Q.Evidence(0.0, 10.0, 100.0))
    assert not two.judges and Q.score(own, two) == 0.0
    assert Q.reference([], Q.Evidence()) is Q.NO_REFERENCE
    three = Q.reference([0.0, 0.01, 0.02], Q.Evidence(0.0, 10.0, 100.0))
    assert Q.score(Q.Evidence(), three) == 0.0


def test_a_few_surprising_drafts_do_not_decide():
    """Drafts the model calls certain, rejected: a handful stays inside the margin,
    the normal approximation alone would call one of them a z of about 10."""
    ref = Q.Reference(0.0, 0.0, Q.TAU, 8)
    for n in (1, 2, 3):
        p = 0.99
        own = Q.Evidence(residual=-p * n, variance=p * (1 - p) * n, drafts=float(n))
        assert abs(Q.score(own, ref)) < Q.QUARANTINE_Z
    assert 1.0 / math.sqrt(0.99 * 0.01) > 9.9


def test_an_honest_round_is_folded_untouched():
    x, obs, acc = drafts(4, rows=256)
    stats = stats_of(x, obs, acc)
    share = Q.RoundShare(K)
    assert share.bound(stats, "round 1", np.zeros((2, K))) is stats


def test_drafts_at_the_clamp_all_rejected_move_almost_nothing():
    """x = 40 at the cold start: p ~ 1 - 2e-9, gradient -1 each, no information."""
    rows = 200
    x = np.full((rows, K), 40.0)
    obs = np.zeros((rows, K), dtype=bool)
    obs[:, 0] = True
    acc = np.zeros_like(obs)
    stats = stats_of(x, obs, acc)
    share = Q.RoundShare(K)
    kept = share.bound(stats, 0, np.zeros((2, K)))
    limit1 = Q.MAX_STEP * (stats.c[0] + Q.INFO_FLOOR)
    limit0 = Q.MAX_STEP * (stats.a[0] + Q.INFO_FLOOR)
    assert stats.g1[0] == pytest.approx(-rows)
    assert abs(kept.g1[0]) <= limit1 * (1 + 1e-12) and abs(kept.g0[0]) <= limit0 * (1 + 1e-12)
    # g0 and g1 cut by one factor; the information kept as it is
    assert kept.g0[0] / stats.g0[0] == pytest.approx(kept.g1[0] / stats.g1[0])
    for f in ("a", "b", "c", "n"):
        assert np.array_equal(getattr(kept, f), getattr(stats, f))


def test_the_bound_holds_over_a_whole_round_and_restarts_with_the_next():
    """Many small messages cannot add up past it; a new round has a bound of its own."""
    x = np.full((1, K), 40.0)
    obs = np.zeros((1, K), dtype=bool)
    obs[:, 0] = True
    stats = stats_of(x, obs, np.zeros_like(obs))
    share = Q.RoundShare(K)
    none = np.zeros((2, K))
    kept = [share.bound(stats, "r1", none) for _ in range(100)]
    # the slope's gradient (-40 a draft) binds first; g1 is cut in proportion
    g0 = sum(s.g0[0] for s in kept)
    assert g0 == pytest.approx(-Q.MAX_STEP * (100 * stats.a[0] + Q.INFO_FLOOR), rel=1e-9)
    assert sum(s.g1[0] for s in kept) == pytest.approx(g0 / 40.0, rel=1e-9)
    assert share.bound(stats, "r2", none).g0[0] == pytest.approx(kept[0].g0[0], rel=1e-12)
    assert kept[0].g0[0] == pytest.approx(-Q.MAX_STEP * (stats.a[0] + Q.INFO_FLOOR), rel=1e-9)


def test_a_pooled_round_lets_a_worker_s_few_clamp_rejections_count_in_full():
    """Honest drafters pile features at the clamp: one rejected there inside a round
    the pair pooled much information into keeps its whole gradient."""
    x = np.full((3, K), 40.0)
    obs = np.zeros((3, K), dtype=bool)
    obs[:, 0] = True
    stats = stats_of(x, obs, np.zeros_like(obs))
    pooled = np.array([[400.0] * K, [60.0] * K])  # a, c of the pair's last round
    share = Q.RoundShare(K)
    assert share.bound(stats, 0, pooled) is stats
    assert share.bound(stats, 1, np.zeros((2, K))) is not stats
