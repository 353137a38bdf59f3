"""The estimator's recent reached features: every draft that reached its position, verified
or trimmed, from raw steps and from round summaries alike, aged per refit like the recent
calibration, kept across a restart (the draft-length schedule reads them)."""

from __future__ import annotations

import numpy as np

from avest.core.estimator import OnlineEstimator
from avest.core.rules import VllmRule
from avest_client.summary import RoundAccumulator
from tests.support.steps import reached_by_brute_force, trimmed_steps

K = 4


def _estimator() -> OnlineEstimator:
    return OnlineEstimator(K, VllmRule(), refit_interval=10_000, recent_decay=0.5)


def test_raw_steps_and_summaries_of_the_same_steps_count_the_same_drafts() -> None:
    steps = trimmed_steps(20, 50, K, seed=4)
    raw, pooled = _estimator(), _estimator()
    acc = RoundAccumulator(K, reached=True)
    c = raw.coefficients
    for x, d, a in steps:
        raw.observe(x, d, a)
        acc.add(x, d, a, c.slope, c.intercept_array())
    summary = acc.take(raw.version, c.slope, c.intercept_array())
    assert summary is not None
    pooled.apply_summary(summary)
    want = reached_by_brute_force(steps, K)
    np.testing.assert_array_equal(raw.recent_reached.counts, want)
    np.testing.assert_array_equal(pooled.recent_reached.counts, want)
    # trimmed drafts are in: more drafts reached each position than were labelled
    labelled = raw.recent_calibration.histogram().totals()
    assert (want.sum(axis=1) > labelled).any()


def test_each_refit_ages_what_reached_and_a_restart_keeps_it() -> None:
    first, second = trimmed_steps(6, 30, K, seed=5), trimmed_steps(6, 30, K, seed=6)
    est = _estimator()
    for x, d, a in first:
        est.observe(x, d, a)
    est.refit()
    for x, d, a in second:
        est.observe(x, d, a)
    est.refit()  # the first round is now one refit older than the second
    want = 0.5 * reached_by_brute_force(first, K) + reached_by_brute_force(second, K)
    np.testing.assert_allclose(est.recent_reached.counts, want)
    back = _estimator()
    back.restore(est.snapshot())
    np.testing.assert_allclose(back.recent_reached.counts, want)
    older = {n: v for n, v in est.snapshot().items() if not n.startswith("reached.")}
    back.restore(older)
    assert back.recent_reached.counts.sum() == 0
