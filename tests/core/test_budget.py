"""Draft budget: size, allocation, rules, losslessness property, validation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from avest.core.budget import (
    DEFAULT_RULE,
    RULES,
    allocate,
    budget_size,
    decide,
    goodput_curve,
    lossless_walk_size,
)
from avest.core.costs import CostTable, bucket_costs, overhead_costs
from avest_wire.errors import InvalidInput


def random_costs(rng, step_shaped):
    """Random non-decreasing curves; step-shaped (all captured) or partly smooth."""
    sizes = np.sort(rng.choice(np.arange(1, 80), size=rng.integers(1, 7), replace=False))
    ms = np.cumsum(rng.uniform(0, 2, size=sizes.size)) + rng.uniform(0.1, 2)
    limit = int(sizes[-1]) if step_shaped else int(rng.integers(0, 80))
    draft = [(1, float(rng.uniform(0, 1)))]
    curve = list(zip(sizes.tolist(), ms.tolist(), strict=True))
    return CostTable.from_curves(draft, curve, limit, max_requests=16, max_tokens=128)


def random_step(rng, r_max=5, k_max=4):
    r, k = int(rng.integers(1, r_max + 1)), int(rng.integers(1, k_max + 1))
    conf = rng.uniform(0, 1, size=(r, k))
    conf[rng.random((r, k)) < 0.2] = 1.0  # exact ties in survival
    conf[rng.random((r, k)) < 0.1] = 0.0  # and slots worth nothing
    sched = rng.integers(0, k + 1, size=r)
    return conf, sched


def ranked_slots(survival, scheduled, skip=None):
    """Brute-force ranking: sort (−survival, request, position)."""
    slots = [
        (-survival[r, i], r, i)
        for r in range(survival.shape[0])
        for i in range(scheduled[r])
        if skip is None or i >= skip[r]
    ]
    return [(r, i) for _, r, i in sorted(slots)]


def brute_goodput(scores, s, r, t0, costs):
    total, out = float(s), []
    for b in range(len(scores) + 1):
        out.append(total / (costs.draft_cost(r) + costs.verify_cost(t0 + b)))
        if b < len(scores):
            total += scores[b]
    return out


def brute_argmax(scores, s, r, t0, costs):
    g = brute_goodput(scores, s, r, t0, costs)
    return min(b for b in range(len(g)) if g[b] == max(g))


def brute_walk(scores, s, r, t0, costs):
    """docs/design.md §3 rule 2, literally: optimistic extension vs stopping, per slot."""
    n = len(scores)
    cost = [costs.draft_cost(r) + costs.verify_cost(t0 + b) for b in range(n + 1)]
    for m in range(n):
        a = s + sum(scores[:m])
        best = max((a + (b - m) * scores[m]) / cost[b] for b in range(m + 1, n + 1))
        if not best > a / cost[m]:
            return m
    return n


def scores_of(survival, scheduled):
    return [survival[r, i] for r, i in ranked_slots(survival, scheduled)]


def random_cases(seed, step_shaped, n=300):
    """``n`` random decisions ``(costs, survival, scheduled, scores, s, r, t0)``: a step's
    survival matrix and its ranked slots' scores, ``s`` sampling requests of ``r`` and
    ``t0`` non-draft tokens in the verify pass."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        costs = random_costs(rng, step_shaped)
        conf, sched = random_step(rng)
        surv = np.cumprod(conf, axis=1)
        r = conf.shape[0]
        s, t0 = int(rng.integers(0, r + 1)), int(rng.integers(0, 10))
        yield costs, surv, sched, scores_of(surv, sched), s, r, t0


@pytest.mark.parametrize("step_shaped", [True, False])
def test_budget_size_is_the_global_argmax(step_shaped):
    for costs, surv, sched, scores, s, r, t0 in random_cases(1 if step_shaped else 2, step_shaped):
        want = brute_argmax(scores, s, r, t0, costs)
        assert budget_size(surv, s, r, t0, costs, scheduled=sched) == want
        assert budget_size(np.array(scores), s, r, t0, costs) == want


def test_budget_size_finds_a_later_peak_past_a_dip():
    # Padded buckets: 1 draft pays for a bucket of 4, so goodput dips, then peaks later.
    costs = bucket_costs(draft_ms=0.0, buckets=[(1, 1.0), (5, 2.0), (9, 2.05)])
    scores = np.array([0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9])
    g = goodput_curve(scores, 1, 1, 1, costs)
    assert g[1] < g[0] and np.argmax(g) == 8  # not unimodal
    assert budget_size(scores, 1, 1, 1, costs) == 8


def test_budget_size_ties_go_to_the_smallest_budget():
    costs = bucket_costs(draft_ms=0.0, buckets=[(4, 1.0)])
    # One bucket covers every size: goodput rises to B = 1, then stays flat.
    assert budget_size(np.array([0.5, 0.0, 0.0]), 1, 1, 0, costs) == 1


@pytest.mark.parametrize("step_shaped", [True, False])
def test_lossless_walk_matches_the_literal_rule(step_shaped):
    for costs, surv, sched, scores, s, r, t0 in random_cases(3 if step_shaped else 4, step_shaped):
        walk = lossless_walk_size(surv, s, r, t0, costs, scheduled=sched)
        assert walk == brute_walk(scores, s, r, t0, costs)
        # What can be proved: never fewer drafts than the argmax, and no larger
        # budget (verifying everything included) has better goodput.
        g = brute_goodput(scores, s, r, t0, costs)
        assert walk >= brute_argmax(scores, s, r, t0, costs)
        assert all(g[walk] >= g[b] - 1e-12 for b in range(walk, len(g)))


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.floats(0, 1), min_size=2, max_size=12),
    st.integers(0, 11),
    st.lists(st.floats(0, 1), min_size=12, max_size=12),
    st.integers(0, 3),
    st.sampled_from(["overhead", "buckets"]),
)
def test_walk_decision_for_a_slot_ignores_lower_ranked_slots(scores, m, others, s, profile):
    """Slots ranked at or above ``m`` are decided the same whatever lies below."""
    costs = {
        "overhead": overhead_costs(
            draft_ms=0.1, verify_base=1.0, overhead=0.9, per_token=0.05, free_tokens=3
        ),
        "buckets": bucket_costs(draft_ms=0.1, buckets=[(3, 1.0), (6, 1.6), (12, 2.1)]),
    }[profile]
    a = np.sort(np.array(scores))[::-1]
    m = min(m, a.size - 1)
    # Replace everything ranked below m by other values that stay below s_m.
    b = a.copy()
    b[m + 1 :] = np.sort(np.minimum(np.array(others[: a.size - m - 1]), a[m]))[::-1]
    wa = lossless_walk_size(a, s, 3, 3, costs)
    wb = lossless_walk_size(b, s, 3, 3, costs)
    assert min(wa, m + 1) == min(wb, m + 1)


LOSSLESS = [name for name, rule in RULES.items() if rule.lossless]


@pytest.mark.parametrize("rule", LOSSLESS)
def test_verifying_a_draft_never_depends_on_that_drafts_token(rule):
    """Changing a request's confidences after position i (what an autoregressive
    drafter does when the token at i changes) never changes whether i is verified."""
    rng = np.random.default_rng(5)
    costs = bucket_costs(draft_ms=0.2, buckets=[(4, 1.0), (8, 1.7), (16, 2.2), (32, 3.0)])
    for _ in range(400):
        conf, sched = random_step(rng, r_max=4, k_max=5)
        r, k = conf.shape
        stale = rng.uniform(0, 1, size=(r, k))
        minimum = int(rng.integers(0, 2))
        req, pos = int(rng.integers(r)), int(rng.integers(k))
        other = conf.copy()
        other[req, pos + 1 :] = rng.uniform(0, 1, size=k - pos - 1)
        one = decide(rule, conf, sched, costs, r, r, stale, minimum)
        two = decide(rule, other, sched, costs, r, r, stale, minimum)
        assert (one.verify_lengths[req] > pos) == (two.verify_lengths[req] > pos)


def test_argmax_does_depend_on_the_drafted_token():
    """The audit's toy: the next draft's confidence decides the first's fate."""
    costs = overhead_costs(
        draft_ms=0.1, verify_base=1.0, overhead=0.92, per_token=0.05, free_tokens=2
    )
    sure = np.array([[0.68, 0.99], [0.5, 0.5]])
    unsure = np.array([[0.68, 0.5], [0.5, 0.5]])
    assert decide("argmax", sure, [2, 2], costs, 2, 2).verify_lengths[0] > 0
    assert decide("argmax", unsure, [2, 2], costs, 2, 2).verify_lengths[0] == 0
    for rule in LOSSLESS:
        one = decide(rule, sure, [2, 2], costs, 2, 2, unsure)
        two = decide(rule, unsure, [2, 2], costs, 2, 2, unsure)
        assert (one.verify_lengths[0] > 0) == (two.verify_lengths[0] > 0)


def test_allocate_is_brute_force_top_b_and_a_prefix():
    rng = np.random.default_rng(6)
    for _ in range(400):
        conf, sched = random_step(rng)
        surv = np.cumprod(conf, axis=1)
        minimum = int(rng.integers(0, 3))
        budget = int(rng.integers(0, surv.size + 3))
        got = allocate(surv, sched, budget, minimum)
        forced = np.minimum(sched, minimum)
        want = forced.copy()
        for r, _ in ranked_slots(surv, sched, skip=forced)[: max(budget - forced.sum(), 0)]:
            want[r] += 1
        assert np.array_equal(got, want)
        assert np.all(got >= forced) and np.all(got <= sched)
        assert got.sum() == min(max(budget, forced.sum()), sched.sum())


def test_allocate_breaks_ties_by_request_then_position():
    surv = np.full((3, 2), 0.5)
    assert allocate(surv, [2, 2, 2], 3).tolist() == [2, 1, 0]
    # The minimum counts toward the budget...
    assert allocate(surv, [2, 2, 2], 3, min_per_request=1).tolist() == [1, 1, 1]
    assert allocate(surv, [2, 2, 2], 4, min_per_request=1).tolist() == [2, 1, 1]
    # ...and wins when it alone exceeds it.
    assert allocate(surv, [2, 0, 2], 1, min_per_request=1).tolist() == [1, 0, 1]


def test_allocate_rejects_survival_that_rises():
    with pytest.raises(InvalidInput) as err:
        allocate([[0.2, 0.5]], [2], 1)
    assert err.value.field == "survival"
    assert allocate([[0.2, 0.5]], [1], 1).tolist() == [1]  # unscheduled slot ignored


def test_rules_and_decision_bookkeeping():
    assert RULES[DEFAULT_RULE].lossless and DEFAULT_RULE == "lossless-walk"
    assert {n: r.lossless for n, r in RULES.items()} == {
        "lossless-walk": True,
        "stale": True,
        "argmax": False,
        "full": True,
    }
    costs = overhead_costs(
        draft_ms=0.3, verify_base=1.0, overhead=0.2, per_token=0.1, free_tokens=4
    )
    rng = np.random.default_rng(7)
    conf = rng.uniform(0.3, 1, size=(4, 3))
    surv = np.cumprod(conf, axis=1)
    for name in RULES:
        d = decide(name, conf, [3, 2, 3, 0], costs, 4, 3, rng.uniform(size=(4, 3)))
        assert d.rule == name and d.lossless == RULES[name].lossless
        assert d.budget == d.verify_lengths.sum()
        mask = np.arange(3)[None, :] < d.verify_lengths[:, None]
        assert d.expected_tokens == pytest.approx(3 + surv[mask].sum())
        assert d.cost_ms == pytest.approx(costs.draft_cost(4) + costs.verify_cost(4 + d.budget))
        assert d.goodput == pytest.approx(d.expected_tokens / d.cost_ms)
    assert decide("full", conf, [3, 2, 3, 0], costs, 4, 3).verify_lengths.tolist() == [3, 2, 3, 0]


def test_stale_rule_sizes_from_stale_and_picks_by_current():
    costs = overhead_costs(
        draft_ms=0.0, verify_base=1.0, overhead=0.5, per_token=0.2, free_tokens=2
    )
    conf = np.array([[0.1, 0.1], [0.9, 0.9]])
    stale = np.array([[0.9, 0.9], [0.9, 0.9]])
    d = decide("stale", conf, [2, 2], costs, 2, 2, stale)
    size = budget_size(np.cumprod(stale, axis=1), 2, 2, 2, costs)
    assert d.budget == size > 0
    assert d.verify_lengths.tolist() == allocate(np.cumprod(conf, axis=1), [2, 2], size).tolist()
    # No stale confidences: taken as 1 (vLLM's initial value).
    ones = decide("stale", conf, [2, 2], costs, 2, 2, np.ones((2, 2)))
    assert decide("stale", conf, [2, 2], costs, 2, 2).budget == ones.budget


def test_minimum_per_request_is_always_verified():
    costs = bucket_costs(draft_ms=0.0, buckets=[(2, 1.0), (8, 50.0)])
    conf = np.full((2, 3), 0.05)
    for name in RULES:
        d = decide(name, conf, [3, 1], costs, 2, 2, conf, min_per_request=2)
        assert np.all(d.verify_lengths >= [2, 1])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"confidences": [[1.5]]}, "confidences"),
        ({"confidences": [[np.nan]]}, "confidences"),
        ({"confidences": [0.5]}, "confidences"),
        ({"scheduled": [2]}, "scheduled"),
        ({"scheduled": [-1]}, "scheduled"),
        ({"scheduled": [1, 1]}, "scheduled"),
        ({"scheduled": [0.5]}, "scheduled"),
        ({"stale_confidences": [[0.5, 0.5]]}, "stale_confidences"),
        ({"stale_confidences": [[-0.1]]}, "stale_confidences"),
        ({"num_sampling": 2}, "num_sampling"),
        ({"num_sampling": -1}, "num_sampling"),
        ({"num_non_draft_tokens": -1}, "num_non_draft_tokens"),
        ({"num_non_draft_tokens": 1.5}, "num_non_draft_tokens"),
        ({"min_per_request": -1}, "min_per_request"),
        ({"rule": "best"}, "rule"),
    ],
)
def test_decide_validation_names_the_field(kwargs, field):
    args = {
        "rule": DEFAULT_RULE,
        "confidences": [[0.5]],
        "scheduled": [1],
        "costs": bucket_costs(draft_ms=0.1, buckets=[(4, 1.0)]),
        "num_non_draft_tokens": 1,
        "num_sampling": 1,
    }
    args.update(kwargs)
    with pytest.raises(InvalidInput) as err:
        decide(**args)
    assert err.value.field == field


def test_budget_size_validation():
    costs = bucket_costs(draft_ms=0.1, buckets=[(4, 1.0)])
    with pytest.raises(InvalidInput, match="sorted"):
        budget_size(np.array([0.1, 0.5]), 1, 1, 0, costs)
    with pytest.raises(InvalidInput) as err:
        budget_size(np.ones((2, 2)), 1, 3, 0, costs)
    assert err.value.field == "num_requests"
    with pytest.raises(InvalidInput) as err:
        allocate(np.ones((1, 2)), [2], -1)
    assert err.value.field == "budget"


def test_empty_steps():
    costs = bucket_costs(draft_ms=0.1, buckets=[(4, 1.0)])
    for name in RULES:
        d = decide(name, np.zeros((0, 3)), np.zeros(0, dtype=int), costs, 0, 0)
        assert d.budget == 0 and d.verify_lengths.shape == (0,)
        d = decide(name, np.ones((2, 3)), [0, 0], costs, 2, 2)
        assert d.budget == 0


@pytest.mark.parametrize("step_shaped", [True, False])
def test_argmax_with_a_minimum_maximises_goodput_over_budgets_that_keep_it(step_shaped):
    """With a per-request minimum the argmax sizes what comes after the forced drafts."""
    rng = np.random.default_rng(11)
    for _ in range(200):
        conf, sched = random_step(rng)
        costs = random_costs(rng, step_shaped)
        r = conf.shape[0]
        surv = np.cumprod(conf, axis=1)
        forced = np.minimum(sched, 1)
        best = -1.0
        for b in range(int(forced.sum()), int(sched.sum()) + 1):
            kept = forced.copy()
            for req, pos in ranked_slots(surv, sched, skip=forced)[: b - int(forced.sum())]:
                kept[req] = max(kept[req], pos + 1)
            gain = r + sum(surv[q, : kept[q]].sum() for q in range(r))
            best = max(best, gain / (costs.draft_cost(r) + costs.verify_cost(r + int(kept.sum()))))
        got = decide("argmax", conf, sched, costs, r, r, min_per_request=1)
        assert got.goodput == pytest.approx(best, rel=1e-12)
