"""``allocate`` against a plain ranking: slots sorted by survival (descending), ties
by request then position, top ``budget`` after the forced minimum, with partial
schedules, forced drafts and many ties (the masks of the fast path and the slow
path must agree with the definition)."""

from __future__ import annotations

import numpy as np
import pytest

from avest.core.budget import allocate
from avest.core.model import survival


def _reference(s: np.ndarray, sched: np.ndarray, budget: int, minimum: int) -> np.ndarray:
    forced = np.minimum(sched, minimum)
    slots = [(-s[r, i], r, i) for r in range(s.shape[0]) for i in range(forced[r], sched[r])]
    slots.sort()
    lengths = forced.copy()
    for _, r, _ in slots[: max(budget - int(forced.sum()), 0)]:
        lengths[r] += 1
    return lengths


@pytest.mark.parametrize("seed", range(40))
def test_allocate_is_the_top_of_the_ranking(seed: int) -> None:
    rng = np.random.default_rng(seed)
    r, k = int(rng.integers(1, 12)), int(rng.integers(1, 7))
    # coarse confidences: many exact ties in survival
    conf = rng.choice([0.25, 0.5, 0.75, 1.0], size=(r, k))
    s = survival(conf)
    full = seed % 3 == 0  # every draft scheduled: the path without a mask
    sched = np.full(r, k) if full else rng.integers(0, k + 1, size=r)
    minimum = 0 if seed % 2 == 0 else int(rng.integers(0, k + 1))
    for budget in range(0, r * k + 2):
        got = allocate(s, sched, budget, minimum)
        np.testing.assert_array_equal(got, _reference(s, sched, budget, minimum))
