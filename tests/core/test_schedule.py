"""The draft-length schedule: choices, hysteresis, range cap, vLLM format, goodput formula."""

from __future__ import annotations

import numpy as np
import pytest

from avest.core.budget import goodput_curve, lossless_walk_size
from avest.core.costs import CostTable, affine_costs, bucket_costs
from avest.core.draft_length import expected_tokens
from avest.core.histogram import EtaHistogram
from avest.core.model import Coefficients, linear_predictor, survival
from avest.core.numeric import sigmoid
from avest.core.schedule import (
    FEATURE_BINS,
    SWITCH_MARGIN,
    Choice,
    FeatureHistogram,
    compute_schedule,
    reached,
    survival_mass,
    vllm_lengths,
)
from avest_wire.bins import AUC_SLOTS, eta_slot
from avest_wire.errors import InvalidInput

K = 4
COEF = Coefficients(0.8, (0.4, 0.6, 0.7, 0.8))


def features(rows: int = 4000, k: int = K, seed: int = 0, shift: float = 0.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.gamma(1.5, 1.7, size=(rows, k)) - 2.5 + shift


def histogram(**kw: float) -> FeatureHistogram:
    return FeatureHistogram.of(features(**kw))  # type: ignore[arg-type]


def staircase(verify_per_token: float, draft_ms: float = 0.05, base: float = 5.0) -> CostTable:
    return affine_costs(
        draft_base=draft_ms,
        draft_per_request=0.0,
        verify_base=base,
        verify_per_token=verify_per_token,
        max_requests=256,
        max_tokens=256 * (K + 1),
    )


def test_speculation_off_when_verification_dominates() -> None:
    # no fixed cost to share: a draft costs as much as a sampled token, and is not surely accepted
    schedule = compute_schedule(
        COEF, histogram(), staircase(1.0, base=0.0), per_position=True, max_batch_size=64
    )
    assert schedule.to_vllm() == [(1, 64, 0)]
    assert not schedule.ranges[0].choice.adaptive


def test_full_length_without_av_when_verification_is_free() -> None:
    flat = bucket_costs(draft_ms=0.01, buckets=[(64 * (K + 1), 5.0)], max_tokens=4096)
    schedule = compute_schedule(COEF, histogram(), flat, per_position=True, max_batch_size=64)
    assert schedule.to_vllm() == [(1, 64, K)]
    # trimming saves nothing on a flat verify cost: AV is not worth keeping on
    assert schedule.ranges[0].choice == Choice(K, adaptive=False)


def test_shorter_lengths_as_the_batch_grows() -> None:
    schedule = compute_schedule(
        COEF, histogram(), staircase(0.02), per_position=True, max_batch_size=256, adaptive=False
    )
    lengths = [schedule.choice_at(c).length for c in range(1, 257)]
    assert lengths[0] == K and lengths[-1] < K
    assert all(a >= b for a, b in zip(lengths, lengths[1:], strict=False))


def test_fixed_goodput_is_the_closed_form() -> None:
    costs = staircase(0.02)
    schedule = compute_schedule(COEF, histogram(), costs, per_position=True, max_batch_size=32)
    tokens = expected_tokens(schedule.rates)
    for c in (1, 7, 32):
        for v in range(K + 1):
            ms = v * costs.draft_cost(c) / K + costs.verify_cost(c + c * v)
            assert schedule.expected_goodput(c, Choice(v)) == pytest.approx(
                1000.0 * c * tokens[v] / ms
            )


def sample(hist: FeatureHistogram, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` requests' features, each position drawn from its histogram (bin centres)."""
    edges = np.linspace(-40.0, 40.0, FEATURE_BINS + 1)
    centres = 0.5 * (edges[:-1] + edges[1:])
    w = hist.counts / hist.counts.sum(axis=1, keepdims=True)
    return np.stack([rng.choice(centres, size=n, p=w[i]) for i in range(hist.k)], axis=1)


def test_survival_mass_equals_a_monte_carlo_expectation() -> None:
    hist = histogram()
    rng = np.random.default_rng(1)
    s = survival(sigmoid(linear_predictor(COEF, sample(hist, 200_000, rng))))
    for d in (1, 3, K):
        mass, value = survival_mass(COEF, hist, d)
        assert mass.sum() == pytest.approx(d)
        # the expected survival mass is exact: Σ_i Π_j r_j
        assert value.sum() == pytest.approx(s[:, :d].mean(axis=0).sum(), rel=3e-3)
        # the best m slots per request: the top m·N survivals of N requests, over N
        ranked = np.sort(s[:, :d].ravel())[::-1]
        cum_m = np.concatenate(([0.0], np.cumsum(mass)))
        cum_v = np.concatenate(([0.0], np.cumsum(value)))
        for m in (0.25, 0.5, 1.0, d - 0.5):
            top = ranked[: int(m * s.shape[0])].sum() / s.shape[0]
            assert np.interp(m, cum_m, cum_v) == pytest.approx(top, rel=0.01)


@pytest.mark.parametrize("rule", ["argmax", "lossless-walk"])
def test_av_goodput_matches_brute_force_batches(rule: str) -> None:
    """The expected AV goodput against batches drawn and budgeted one by one."""
    hist, costs, c = histogram(), staircase(0.05), 64
    schedule = compute_schedule(
        COEF, hist, costs, per_position=True, max_batch_size=c, budget_rule=rule
    )
    rng = np.random.default_rng(2)
    tokens = time = 0.0
    draft = costs.draft_cost(c)  # K positions of a proposal of K: the whole curve
    for _ in range(300):
        s = survival(sigmoid(linear_predictor(COEF, sample(hist, c, rng))))
        scores = np.sort(s.ravel())[::-1]
        if rule == "argmax":
            b = int(np.argmax(goodput_curve(scores, c, c, c, costs)))
        else:
            b = lossless_walk_size(scores, c, c, c, costs)
        tokens += c + scores[:b].sum()
        time += draft + costs.verify_cost(c + b)
    brute = 1000.0 * tokens / time
    assert schedule.expected_goodput(c, Choice(K, True)) == pytest.approx(brute, rel=0.01)


def test_hysteresis_holds_against_noise_and_follows_a_real_change() -> None:
    costs = staircase(0.02)
    kw = {"per_position": True, "max_batch_size": 128, "max_ranges": 1000}
    base = compute_schedule(COEF, histogram(), costs, **kw)  # type: ignore[arg-type]
    rng = np.random.default_rng(3)
    flips_free = flips_held = 0
    for trial in range(12):
        noisy = Coefficients(COEF.slope, tuple(b + rng.normal(0, 0.1) for b in COEF.intercepts))
        hist = histogram(seed=10 + trial, rows=3000)
        free = compute_schedule(noisy, hist, costs, **kw)  # type: ignore[arg-type]
        held = compute_schedule(noisy, hist, costs, previous=base, **kw)  # type: ignore[arg-type]
        for c in range(1, 129):
            old, new, best = base.choice_at(c), held.choice_at(c), free.choice_at(c)
            flips_free += best != old
            flips_held += new != old
            if new != old:  # changed only for a gain beyond the margin, to the best
                assert new == best
                assert held.expected_goodput(c, new) > held.expected_goodput(c, old) * (
                    1 + SWITCH_MARGIN
                )
            else:
                assert held.expected_goodput(c, best) <= held.expected_goodput(c, old) * (
                    1 + SWITCH_MARGIN
                )
    assert flips_free > 0  # noise alone moves the argmax at some sizes
    assert flips_held < flips_free
    # a real change (acceptance collapses) is followed despite the schedule in force
    poor = Coefficients(COEF.slope, (-3.0,) * K)
    moved = compute_schedule(poor, histogram(), costs, previous=base, **kw)  # type: ignore[arg-type]
    assert moved.choice_at(1).length < base.choice_at(1).length


def test_ranges_are_capped_contiguous_and_cover_every_size() -> None:
    # pad buckets at powers of two: the best length changes inside every bucket
    buckets = [(2**i, 4.0 + 0.01 * 2**i) for i in range(13)]
    costs = bucket_costs(draft_ms=0.3, buckets=buckets, max_requests=256, max_tokens=4096)
    free = compute_schedule(
        COEF, histogram(), costs, per_position=True, max_batch_size=256, max_ranges=1000
    )
    assert len(free.ranges) > 3
    g = np.array(free.goodput)
    best = np.array([g[c - 1, free.options.index(free.choice_at(c))] for c in range(1, 257)])
    for cap in (1, 2, 3):
        capped = compute_schedule(
            COEF, histogram(), costs, per_position=True, max_batch_size=256, max_ranges=cap
        )
        assert len(capped.ranges) <= cap
        assert capped.ranges[0].start == 1 and capped.ranges[-1].end == 256
        for a, b in zip(capped.ranges, capped.ranges[1:], strict=False):
            assert b.start == a.end + 1 and a.choice != b.choice
        got = np.array([capped.expected_goodput(c) for c in range(1, 257)])
        assert np.all(got <= best * (1 + 1e-12))


def test_vllm_format_round_trip() -> None:
    buckets = [(2**i, 4.0 + 0.01 * 2**i) for i in range(13)]
    costs = bucket_costs(draft_ms=0.3, buckets=buckets, max_requests=256, max_tokens=4096)
    schedule = compute_schedule(COEF, histogram(), costs, per_position=True, max_batch_size=200)
    entries = schedule.to_vllm()
    assert entries[0][0] == 1 and entries[-1][1] == 200
    dense = vllm_lengths(entries, 300, K)
    assert dense[0] == 0
    assert dense[1:] == [schedule.choice_at(c).length for c in range(1, 301)]
    assert schedule.as_json()["num_speculative_tokens_per_batch_size"] == [list(e) for e in entries]


def test_vllm_lengths_fills_gaps_caps_and_runs_on() -> None:
    dense = vllm_lengths([(1, 2, 3), (5, 6, 9)], 8, 4)
    assert dense == [0, 3, 3, 3, 3, 4, 4, 4, 4]
    with pytest.raises(InvalidInput):
        vllm_lengths([(2, 4, 1)], 8, 4)
    with pytest.raises(InvalidInput):
        vllm_lengths([(1, 4, 1), (3, 6, 2)], 8, 4)


def test_reached_counts_the_next_draft_after_the_verified_ones() -> None:
    mask = reached([0, 2, 1, 3], [2, 2, 3, 3], 4)
    assert mask.tolist() == [
        [True, False, False, False],
        [True, True, True, False],
        [True, True, False, False],
        [True, True, True, True],
    ]


def test_histogram_from_a_sketch_matches_the_features() -> None:
    x = features(rows=20_000)
    eta = linear_predictor(COEF, x)
    counts = np.zeros((K, 2, AUC_SLOTS), dtype=np.float32)
    for i in range(K):
        np.add.at(counts[i, 0], eta_slot(eta[:, i]), 1.0)
    from_sketch = FeatureHistogram.empty(K)
    from_sketch.add_eta(EtaHistogram(counts), COEF)
    direct = FeatureHistogram.of(x)
    np.testing.assert_allclose(from_sketch.totals(), direct.totals())
    a = compute_schedule(COEF, from_sketch, staircase(0.02), per_position=True, max_batch_size=8)
    b = compute_schedule(COEF, direct, staircase(0.02), per_position=True, max_batch_size=8)
    np.testing.assert_allclose(a.rates, b.rates, atol=2e-3)


def test_histograms_merge_and_decay_keep_the_shape() -> None:
    a, b = histogram(seed=1), histogram(seed=2)
    both = a.copy()
    both.merge(b)
    np.testing.assert_allclose(both.totals(), a.totals() + b.totals())
    scaled = both.copy()
    scaled.scale(0.5)
    costs = staircase(0.02)
    r1 = compute_schedule(COEF, both, costs, per_position=True, max_batch_size=4).rates
    r2 = compute_schedule(COEF, scaled, costs, per_position=True, max_batch_size=4).rates
    np.testing.assert_allclose(r1, r2)


def test_an_unseen_position_borrows_its_nearest_and_an_empty_histogram_is_refused() -> None:
    x = features()
    mask = np.ones_like(x, dtype=bool)
    mask[:, 3] = False
    partial = FeatureHistogram.of(x, mask)
    costs = staircase(0.02)
    rates = compute_schedule(COEF, partial, costs, per_position=True, max_batch_size=2).rates
    shifted = Coefficients(COEF.slope, COEF.intercepts[:3] + (COEF.intercepts[2],))
    again = compute_schedule(shifted, partial, costs, per_position=True, max_batch_size=2).rates
    assert rates[3] != rates[2] and again[3] == pytest.approx(again[2])
    with pytest.raises(InvalidInput, match="features"):
        compute_schedule(COEF, FeatureHistogram.empty(K), costs, per_position=True)
    with pytest.raises(InvalidInput, match="budget_rule"):
        compute_schedule(COEF, partial, costs, per_position=True, budget_rule="full")
