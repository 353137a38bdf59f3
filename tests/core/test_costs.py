"""Cost tables: vLLM 0.33 semantics, validation, profile helpers, extension rates."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from avest.core.costs import (
    CostTable,
    affine_costs,
    bucket_costs,
    overhead_costs,
)
from avest_wire.errors import InvalidInput

DRAFT = [(1, 0.5)]


def verify_table(curve, limit, max_tokens=24):
    return CostTable.from_curves(DRAFT, curve, limit, max_requests=4, max_tokens=max_tokens)


def reference_cost(curve, limit, n):
    """The semantics spelled out one size at a time, in plain Python."""
    xs = [s for s, _ in curve]
    level, top = [], -np.inf
    for _, ms in curve:
        top = max(top, ms)
        level.append(top)
    if len(xs) > 1 and n > xs[-1]:
        return level[-1] + (level[-1] - level[-2]) / (xs[-1] - xs[-2]) * (n - xs[-1])
    if limit > 0 and n > limit:
        above = [(x, y) for x, y in zip(xs, level, strict=True) if x > limit]
        if above:
            if n <= above[0][0]:
                return above[0][1]
            for (x0, y0), (x1, y1) in zip(above, above[1:], strict=False):
                if x0 <= n <= x1:
                    return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
            return above[-1][1]
    for x, y in zip(xs, level, strict=True):
        if x >= n:
            return y
    return level[-1]


def test_step_function_at_or_below_the_capture_limit():
    t = verify_table([(2, 1.0), (4, 3.0), (8, 5.0)], limit=8)
    # Sizes pad up to the next profiled size: 0..2 -> 2, 3..4 -> 4, 5..8 -> 8.
    got = [t.verify_cost(n) for n in range(9)]
    assert got == [1.0, 1.0, 1.0, 3.0, 3.0, 5.0, 5.0, 5.0, 5.0]
    # Past the last point: slope of the last two points, (5 - 3) / (8 - 4).
    assert t.verify_cost(10) == pytest.approx(6.0)
    assert t.verify_cost(20) == pytest.approx(11.0)


def test_interpolation_only_between_points_above_the_limit():
    t = verify_table([(2, 1.0), (4, 2.0), (8, 4.0), (16, 6.0)], limit=4)
    assert [t.verify_cost(n) for n in range(5)] == [1.0, 1.0, 1.0, 2.0, 2.0]
    # 5..8 is not blended with the point at 4 (crossing the limit loses graphs).
    assert [t.verify_cost(n) for n in (5, 6, 7, 8)] == [4.0, 4.0, 4.0, 4.0]
    assert t.verify_cost(12) == pytest.approx(5.0)
    assert t.verify_cost(10) == pytest.approx(4.5)
    assert t.verify_cost(20) == pytest.approx(7.0)


def test_limit_zero_keeps_the_whole_profiled_range_a_step_function():
    t = verify_table([(2, 1.0), (8, 4.0)], limit=0)
    assert t.verify_cost(3) == 4.0
    assert t.verify_cost(10) == pytest.approx(5.0)


def test_running_max_and_extrapolation_from_the_flattened_points():
    t = verify_table([(1, 2.0), (2, 1.0), (3, 3.0), (4, 2.0)], limit=0)
    assert [t.verify_cost(n) for n in range(1, 5)] == [2.0, 2.0, 3.0, 3.0]
    assert t.verify_cost(9) == 3.0  # flattened last two points: slope 0
    assert np.all(np.diff(t.verify_table) >= 0)


def test_floors_and_scalar_vs_vector_lookups():
    t = CostTable.from_curves([(1, 0.0)], [(1, 0.0), (2, 0.0)], max_requests=3, max_tokens=4)
    assert t.draft_cost(2) == 0.0
    assert t.verify_cost(1) == 1e-6
    assert isinstance(t.verify_cost(3), float)
    v = t.verify_cost(np.array([[0, 1], [2, 3]]))
    assert v.shape == (2, 2) and np.all(v == 1e-6)
    assert t.draft_cost([0, 1, 2]).shape == (3,)


def test_sizes_beyond_the_tables_are_evaluated_from_the_curves():
    curve = [(2, 1.0), (4, 2.0), (8, 4.0), (16, 6.0)]
    small = verify_table(curve, 4, max_tokens=10)
    big = verify_table(curve, 4, max_tokens=100)
    n = np.arange(0, 101)
    assert np.allclose(small.verify_cost(n), big.verify_table)
    assert np.allclose(small.verify_range(5, 40), big.verify_table[5:41])
    assert small.draft_cost(50) == big.draft_cost(50)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 60), min_size=1, max_size=7, unique=True),
    st.lists(st.floats(0, 10), min_size=7, max_size=7),
    st.integers(0, 70),
)
def test_matches_a_one_size_at_a_time_reference(sizes, costs, limit):
    curve = list(zip(sorted(sizes), costs, strict=False))
    t = verify_table(curve, limit, max_tokens=90)
    expect = [max(reference_cost(curve, limit, n), 1e-6) for n in range(91)]
    assert np.allclose(t.verify_table, expect, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("curve", "problem"),
    [
        ([], "non-empty"),
        ([(1, float("nan"))], "finite"),
        ([(1, 1.0), (1, 2.0)], "increasing"),
        ([(2, 1.0), (1, 2.0)], "increasing"),
        ([(0, 1.0)], "positive"),
        ([(1.5, 1.0)], "integers"),
        ([(1, -1.0)], ">= 0"),
        ([(1, 2, 3)], "pairs"),
        ("abc", "pairs"),
    ],
)
def test_curve_validation_names_the_curve(curve, problem):
    with pytest.raises(InvalidInput) as err:
        CostTable.from_curves(DRAFT, curve)
    assert err.value.field == "verify_curve"
    assert problem in err.value.problem
    with pytest.raises(InvalidInput) as err:
        CostTable.from_curves(curve, DRAFT)
    assert err.value.field == "draft_curve"


@pytest.mark.parametrize("limit", [-1, 2.5, True])
def test_bad_cudagraph_limit(limit):
    with pytest.raises(InvalidInput) as err:
        CostTable.from_curves(DRAFT, DRAFT, limit)
    assert err.value.field == "cudagraph_limit"


def test_bad_lookup_sizes():
    t = verify_table([(1, 1.0)], 0)
    with pytest.raises(InvalidInput):
        t.verify_cost(-1)
    with pytest.raises(InvalidInput):
        t.draft_cost(np.array([0.5]))


def test_affine_profile():
    t = affine_costs(draft_base=0.5, draft_per_request=0.1, verify_base=1.0, verify_per_token=0.2)
    assert t.draft_cost(10) == pytest.approx(1.5)
    assert t.verify_cost(7) == pytest.approx(2.4)
    assert t.verify_cost(5000) == pytest.approx(1001.0)  # beyond the table


def test_overhead_profile():
    t = overhead_costs(draft_ms=0.3, verify_base=1.0, overhead=0.5, per_token=0.1, free_tokens=4)
    assert [t.verify_cost(n) for n in (0, 4)] == [1.0, 1.0]
    assert t.verify_cost(5) == pytest.approx(1.6)
    assert t.verify_cost(9) == pytest.approx(2.0)
    assert t.draft_cost(7) == 0.3
    with pytest.raises(InvalidInput):
        overhead_costs(draft_ms=0, verify_base=1, overhead=1, per_token=0, free_tokens=0)


def test_bucket_profile():
    t = bucket_costs(draft_ms=0.1, buckets=[(2, 1.0), (4, 1.5), (8, 2.5)])
    assert [t.verify_cost(n) for n in range(9)] == [1.0] * 3 + [1.5] * 2 + [2.5] * 4
    assert t.verify_cost(12) == pytest.approx(3.5)


def brute_rates(v):
    n = v.size - 1
    return np.array([min((v[b] - v[m]) / (b - m) for b in range(m + 1, n + 1)) for m in range(n)])


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(1, 80), min_size=1, max_size=8, unique=True),
    st.lists(st.floats(0, 10), min_size=8, max_size=8),
    st.integers(0, 80),
    st.integers(0, 20),
    st.integers(1, 60),
)
def test_extension_rates_match_brute_force(sizes, costs, limit, t0, n):
    curve = list(zip(sorted(sizes), costs, strict=False))
    t = verify_table(curve, limit, max_tokens=100)
    v = t.verify_range(t0, t0 + n)
    got = t.extension_rates(t0, n)
    assert got.shape == (n,)
    assert np.allclose(got, brute_rates(v), rtol=1e-9, atol=1e-12)
    assert t.extension_rates(t0, n) is got  # cached per (T0, N)


def test_extension_rates_on_curved_costs():
    # Convex and concave costs: every point is a kink of one kind or the other.
    for power in (2.0, 0.5):
        sizes = np.arange(1, 120)
        t = verify_table([(int(s), float(s**power)) for s in sizes], 200, max_tokens=130)
        assert np.allclose(t.extension_rates(3, 100), brute_rates(t.verify_range(3, 103)))
