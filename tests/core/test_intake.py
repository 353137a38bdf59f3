"""The one-pass summary check accepts exactly what the thorough checks accept, with equal arrays."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from avest.core.estimator import make_batch
from avest.core.model import Coefficients
from avest.core.summary import sketch_state, summarise, summary_coefficients, summary_stats
from avest_wire.bins import CELLS_PER_POSITION, ECE_BINS
from avest_wire.errors import InvalidInput
from avest_wire.limits import MAX_LOG_ODDS
from avest_wire.summary import (
    BOUND_REL_SLACK,
    RoundSummary,
    intake,
    make_sketch,
    make_summary,
)
from tests.support.steps import synthetic_steps


def _wire(k: int, seed: int = 0, steps: int = 6) -> dict[str, Any]:
    """A worker's summary as the wire carries it: plain lists, cell gaps, uint counts."""
    batches = [make_batch(x, d, a, k) for x, d, a in synthetic_steps(steps, k=k, seed=seed)]
    at = Coefficients.of(0.5 + 0.1 * seed, np.linspace(-0.3, 0.4, k))
    s = summarise([(b.features, b.observed, b.accepted) for b in batches], at, 3)
    sk = s.sketch
    assert sk is not None
    arrays = sketch_state(sk).to_arrays()
    stats = summary_stats(s)
    return {
        "version": s.version,
        "slope": s.slope,
        "intercepts": list(s.intercepts),
        "info": np.stack([stats.a, stats.b, stats.c], axis=1).ravel().tolist(),
        "grad": np.stack([stats.g0, stats.g1], axis=1).ravel().tolist(),
        "counts": stats.n.tolist(),
        "steps": s.steps,
        "drafts": s.drafts,
        "sketch": [
            np.diff(sk.cells, prepend=0).tolist(),
            sk.counts.astype(np.int64).tolist(),
            arrays["ece_rejected"].ravel().astype(np.int64).tolist(),
            arrays["ece_accepted"].ravel().astype(np.int64).tolist(),
            arrays["ece_sum_predicted"].ravel().astype(np.float32).tolist(),
            arrays["logloss_sum"].tolist(),
        ],
    }


def _thorough(k: int, w: dict[str, Any]) -> RoundSummary:
    """The checks one at a time, as the service's thorough path runs them."""
    calibration = None
    if w["sketch"] is not None:
        deltas, counts, rej, acc, psum, nll = w["sketch"]
        d = np.asarray(deltas, dtype=np.int64)
        if d.size > 1 and d[1:].min() < 1:
            raise InvalidInput("cell_deltas", "gaps after the first cell must be >= 1")
        calibration = make_sketch(k, d.cumsum(), counts, rej, acc, psum, nll)
    rest = {n: v for n, v in w.items() if n != "sketch"}
    return make_summary(k, **rest, sketch=calibration)


def _fast(k: int, w: dict[str, Any]) -> RoundSummary | None:
    sketch = None if w["sketch"] is None else tuple(w["sketch"])
    return intake(k, **{**w, "sketch": sketch})


def _same(a: RoundSummary, b: RoundSummary) -> None:
    assert (a.version, summary_coefficients(a), a.steps, a.drafts) == (
        b.version,
        summary_coefficients(b),
        b.steps,
        b.drafts,
    )
    for f in ("a", "b", "c", "g0", "g1", "n"):
        x, y = getattr(summary_stats(a), f), getattr(summary_stats(b), f)
        assert x.dtype == y.dtype and np.array_equal(x, y), f
    assert (a.sketch is None) == (b.sketch is None)
    if a.sketch is not None and b.sketch is not None:
        for f in ("cells", "counts", "ece", "psum", "nll"):
            x, y = getattr(a.sketch, f), getattr(b.sketch, f)
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), f
        assert np.array_equal(a.sketch.drafts_per_position(), b.sketch.drafts_per_position())


@pytest.mark.parametrize("k", [1, 3, 8, 64])
@pytest.mark.parametrize("with_sketch", [True, False])
def test_valid_summaries_give_what_the_thorough_checks_give(k, with_sketch):
    for seed in range(3):
        w = _wire(k, seed)
        if not with_sketch:
            w["sketch"] = None
        fast = _fast(k, w)
        assert fast is not None
        _same(fast, _thorough(k, w))


def _set(part: str, i: int, value: Any):
    def mutate(w: dict[str, Any]) -> None:
        w[part] = list(w[part])
        w[part][i] = value

    return mutate


def _sketch_set(j: int, i: int, value: Any):
    def mutate(w: dict[str, Any]) -> None:
        w["sketch"][j] = list(w["sketch"][j])
        w["sketch"][j][i] = value

    return mutate


def _move_a_draft(w: dict[str, Any]) -> None:
    """One accepted draft moved to the next position's cells (totals unchanged)."""
    deltas, counts = w["sketch"][0], list(w["sketch"][1])
    cells = np.cumsum(deltas)
    first_of_1 = int(np.searchsorted(cells, CELLS_PER_POSITION))
    counts[0] += 1
    counts[first_of_1] -= 1
    w["sketch"][1] = counts


def _extend(part: str, extra: float, cut: str | None = None):
    def mutate(w: dict[str, Any]) -> None:
        w[part] = [*w[part], extra]
        if cut is not None:
            w[cut] = w[cut][:-1]

    return mutate


def _at_position_0(part: str, col: int, value: Callable[[dict[str, Any]], float]):
    """Column ``col`` of position 0's row of ``part`` set to ``value(w)``."""

    def mutate(w: dict[str, Any]) -> None:
        w[part] = list(w[part])
        w[part][col] = value(w)

    return mutate


def _n0(w: dict[str, Any]) -> float:
    return float(w["counts"][0])


def _predict_below_a_busy_bin(w: dict[str, Any]) -> None:
    """0 predicted in a bin past the first of position 0 that holds drafts."""
    rej, acc = w["sketch"][2], w["sketch"][3]
    busy = next(j for j in range(1, ECE_BINS) if rej[j] + acc[j])
    w["sketch"][4] = list(w["sketch"][4])
    w["sketch"][4][busy] = 0.0


K = 5
CORRUPTIONS = {
    "intercept NaN": _set("intercepts", 0, float("nan")),
    "info inf": _set("info", 4, float("inf")),
    "grad -inf": _set("grad", 1, float("-inf")),
    "count NaN": _set("counts", 2, float("nan")),
    "a_k negative": _set("info", 3, -1.0),
    "c_k negative": _set("info", 5, -0.5),
    "count fractional": _set("counts", 0, 0.5),
    "count negative": _set("counts", 1, -1.0),
    "drafts off by one": lambda w: w.update(drafts=w["drafts"] + 1),
    "no steps": lambda w: w.update(steps=0),
    "too many steps": lambda w: w.update(steps=10**9),
    "slope negative": lambda w: w.update(slope=-0.1),
    "slope NaN": lambda w: w.update(slope=float("nan")),
    "slope inf": lambda w: w.update(slope=float("inf")),
    "version negative": lambda w: w.update(version=-1),
    "an intercept too many": _extend("intercepts", 0.0),
    "sizes that compensate": _extend("intercepts", 0.0, cut="info"),
    "a gap of 0": _sketch_set(0, 3, 0),
    "a negative first cell": _sketch_set(0, 0, -1),
    "a cell past the grid": lambda w: w["sketch"][0].append(K * CELLS_PER_POSITION),
    "a cell count of 0": _sketch_set(1, 2, 0),
    "a cell count NaN": _sketch_set(1, 2, float("nan")),
    "a cell count inf": _sketch_set(1, 2, float("inf")),
    "a cell without a count": lambda w: w["sketch"][1].pop(),
    "an ECE bin too many": lambda w: w["sketch"][2].append(0),
    "ECE bins against cells": _sketch_set(3, 7, 10**6),
    "predictions above drafts": _sketch_set(4, 0, 1e6),
    "a prediction NaN": _sketch_set(4, 1, float("nan")),
    "a log loss inf": _sketch_set(5, 0, float("inf")),
    "a log loss negative": _sketch_set(5, 0, -1.0),
    "a log loss too many": lambda w: w["sketch"][5].append(0.0),
    "a draft at another position": _move_a_draft,
    "|g1_k| above counts_k": _at_position_0("grad", 1, lambda w: _n0(w) + 1.0),
    "|g0_k| above 40 counts_k": _at_position_0("grad", 0, lambda w: -41.0 * _n0(w)),
    "c_k = 1e300": _at_position_0("info", 2, lambda w: 1e300),
    "a_k above 40^2/4 counts_k": _at_position_0("info", 0, lambda w: 401.0 * _n0(w)),
    "|b_k| above 40/4 counts_k": _at_position_0("info", 1, lambda w: 11.0 * _n0(w)),
    "information not PSD": _at_position_0(
        "info", 1, lambda w: 2.0 * math.sqrt(w["info"][0] * w["info"][2]) + 1.0
    ),
    "a log loss of 1e308": _sketch_set(5, 0, 1e308),
    "predictions below a bin's range": _predict_below_a_busy_bin,
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_a_corrupted_summary_is_left_to_the_thorough_checks_which_refuse_it(name):
    w = _wire(K)
    w["sketch"] = [list(p) for p in w["sketch"]]
    CORRUPTIONS[name](w)
    assert _fast(K, w) is None
    with pytest.raises(InvalidInput):
        _thorough(K, w)


def test_random_corruptions_never_pass_the_fast_check_alone():
    """Whatever the one-pass check accepts, the thorough checks accept, equal."""
    rng = np.random.default_rng(7)
    base = _wire(K, 1)
    values = [0, -1, 1, 0.5, 2.0, 1e6, -1e-9, float("nan"), float("inf"), float("-inf")]
    accepted = refused = 0
    for _ in range(400):
        w = {n: v for n, v in base.items() if n != "sketch"}
        w["sketch"] = [list(p) for p in base["sketch"]]
        for _ in range(int(rng.integers(1, 3))):
            if rng.random() < 0.5:
                part = str(rng.choice(["intercepts", "info", "grad", "counts"]))
                w[part] = list(w[part])
                w[part][int(rng.integers(len(w[part])))] = values[int(rng.integers(len(values)))]
            else:
                j = int(rng.integers(6))
                p = w["sketch"][j]
                p[int(rng.integers(len(p)))] = values[int(rng.integers(len(values)))]
        try:
            fast = _fast(K, w)
        except (ValueError, OverflowError, TypeError):
            fast = None  # values the wire's types cannot carry (e.g. NaN as a cell gap)
        if fast is None:
            refused += 1
            continue
        accepted += 1
        _same(fast, _thorough(K, w))
    # both branches ran: most corruptions matter, some (e.g. 1 for 1) do not
    assert accepted > 20 and refused > 200


def _bounds_at_position(w: dict[str, Any], p: int) -> dict[str, tuple[str, int, float]]:
    """Each bound of position ``p``: ``(part, index, bound)`` of the value it bounds.

    Sketch parts are named ``sketch.<index>``; the ECE bound is the busiest bin's top.
    """
    n = float(w["counts"][p])
    a, c = w["info"][3 * p], w["info"][3 * p + 2]
    e = w["slope"] * MAX_LOG_ODDS + abs(w["intercepts"][p])
    rej, acc = w["sketch"][2], w["sketch"][3]
    row = range(p * ECE_BINS, (p + 1) * ECE_BINS)
    busy = max(row, key=lambda i: rej[i] + acc[i])
    drafts = rej[busy] + acc[busy]
    return {
        "c": ("info", 3 * p + 2, n / 4),
        "a": ("info", 3 * p, n * MAX_LOG_ODDS**2 / 4),
        "b": ("info", 3 * p + 1, min(n * MAX_LOG_ODDS / 4, math.sqrt(a * c))),
        "g0": ("grad", 2 * p, n * MAX_LOG_ODDS),
        "g1": ("grad", 2 * p + 1, n),
        "nll": ("sketch.5", p, n * (e + math.log1p(math.exp(-e)))),
        "psum": ("sketch.4", busy, drafts * (busy % ECE_BINS + 1) / ECE_BINS),
    }


def test_values_at_the_bounds_are_judged_alike_by_both_paths():
    """Sums set to their bounds times factors about the slack: the one-pass check
    accepts exactly what the thorough checks accept, with equal arrays."""
    rng = np.random.default_rng(11)
    base = _wire(K, 2, steps=12)
    rel = BOUND_REL_SLACK
    factors = [1 - 2 * rel, 1.0, 1 + rel / 2, 1 + 0.999 * rel, 1 + 1.001 * rel, 1 + 2 * rel, 10.0]
    accepted = refused = 0
    for _ in range(300):
        w = {n: v for n, v in base.items() if n != "sketch"}
        w["sketch"] = [list(p) for p in base["sketch"]]
        for _ in range(int(rng.integers(1, 3))):
            p = int(rng.integers(K))
            bounds = _bounds_at_position(w, p)
            name = str(rng.choice(sorted(bounds)))
            part, i, bound = bounds[name]
            # b_k, g0_k and g1_k are bounded in magnitude: either sign
            sign = -1.0 if name in ("b", "g0", "g1") and rng.random() < 0.5 else 1.0
            value = sign * bound * factors[int(rng.integers(len(factors)))]
            if part.startswith("sketch."):
                w["sketch"][int(part[-1])][i] = value
            else:
                w[part] = list(w[part])
                w[part][i] = value
        fast = _fast(K, w)
        try:
            thorough = _thorough(K, w)
        except InvalidInput:
            assert fast is None
            refused += 1
            continue
        assert fast is not None
        _same(fast, thorough)
        accepted += 1
    assert accepted > 30 and refused > 30
