"""Which drafts to verify once the budget is known: survival matrices checked,
and the top-``B`` scheduled slots by survival taken as per-request lengths.

Shared by the budget rules (:mod:`avest.core.budget`); pure numpy.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from avest_wire.errors import InvalidInput

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


def as_count(value: object, name: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidInput(name, f"must be an integer, got {value!r}")
    if value < low:
        raise InvalidInput(name, f"must be >= {low}, got {value}")
    return int(value)


def as_matrix(values: npt.ArrayLike, name: str) -> FloatArray:
    """A finite ``[R, K]`` matrix with entries in [0, 1]."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 2:
        raise InvalidInput(name, f"must be [requests, positions], got shape {x.shape}")
    if x.size and not bool(((x >= 0.0) & (x <= 1.0)).all()):  # NaN fails both
        raise InvalidInput(name, "must be finite and in [0, 1]")
    return x


def as_scheduled(scheduled: npt.ArrayLike | None, r: int, k: int) -> IntArray:
    if scheduled is None:
        return np.full(r, k, dtype=np.int64)
    raw = np.asarray(scheduled)
    if raw.shape != (r,) or (raw.size and raw.dtype.kind not in "iu"):
        raise InvalidInput("scheduled", f"must be {r} integers (one per request)")
    s = raw.astype(np.int64)
    if s.size and (s.min() < 0 or s.max() > k):
        raise InvalidInput("scheduled", f"drafts per request must be in [0, {k}]")
    return s


def check_survival(s: FloatArray, scheduled: IntArray) -> None:
    """Survival must not increase along a request's scheduled drafts."""
    inside = np.arange(1, s.shape[1])[None, :] < scheduled[:, None]
    if np.any((np.diff(s, axis=1) > 0) & inside):
        raise InvalidInput("survival", "must not increase along a request's drafts")


#: Scheduled, not forced, slots ``[R, K]``; ``None`` when that is every slot
#: (all K drafts scheduled and none forced: the common step, no mask needed).
Eligible = npt.NDArray[np.bool_] | None


def eligible_slots(s: FloatArray, sched: IntArray, forced: IntArray) -> Eligible:
    """Which slots are scheduled and not forced (``None``: all of them)."""
    k = s.shape[1]
    if not sched.size or (int(sched.min()) == k and not forced.any()):
        return None
    pos = np.arange(k)[None, :]
    return np.asarray((pos < sched[:, None]) & (pos >= forced[:, None]))


def best_first_values(survival: FloatArray, eligible: Eligible) -> FloatArray:
    """Survival of the eligible slots, sorted best first."""
    values = survival.reshape(-1) if eligible is None else survival[eligible]
    return np.sort(values)[::-1]


def allocate(
    survival: npt.ArrayLike,
    scheduled: npt.ArrayLike,
    budget: int,
    min_per_request: int = 0,
) -> IntArray:
    """Verify lengths ``[R]``: the top-``budget`` scheduled slots by survival.

    Each request keeps a prefix of its drafts. The first
    ``min(min_per_request, scheduled[r])`` drafts of every request are always
    kept and count toward ``budget``; when they alone exceed it they are
    verified anyway (the minimum wins). A budget above the number of
    scheduled slots verifies them all.

    Lossless whatever the budget, provided the budget itself does not depend
    on this step's drafted tokens: the rank of slot ``(r, i)`` against the
    slots above it reads no token drawn at ``i`` or later.
    """
    s = as_matrix(survival, "survival")
    sched = as_scheduled(scheduled, s.shape[0], s.shape[1])
    check_survival(s, sched)
    forced = np.minimum(sched, as_count(min_per_request, "min_per_request"))
    return fill(s, sched, forced, as_count(budget, "budget"))


def fill(
    s: FloatArray,
    sched: IntArray,
    forced: IntArray,
    budget: int,
    best_first: FloatArray | None = None,
) -> IntArray:
    """Forced drafts plus the top ``budget - Σ forced`` other slots, as lengths.

    Selects by threshold instead of a full ranking: every slot above the
    ``extra``-th best value, then the tied ones in request, position order,
    i.e. the first ``extra`` slots of the ranking. ``best_first`` is
    the eligible values already sorted descending, when the caller has them.
    """
    eligible = eligible_slots(s, sched, forced)
    size = s.size if eligible is None else int(np.count_nonzero(eligible))
    extra = min(max(budget - int(forced.sum()), 0), size)
    if extra == 0:
        return forced.copy()
    if best_first is None:
        values = s.reshape(-1) if eligible is None else s[eligible]
        best = np.partition(values, size - extra)[size - extra]
    else:
        best = best_first[extra - 1]
    threshold = float(best)
    take = s > threshold
    if eligible is not None:
        take &= eligible
    missing = extra - int(np.count_nonzero(take))
    if missing > 0:  # ties at the threshold: the first ones in request, position order
        tied = s == threshold
        if eligible is not None:
            tied &= eligible
        take.reshape(-1)[np.flatnonzero(tied)[:missing]] = True
    return np.asarray(forced + np.count_nonzero(take, axis=1), dtype=np.int64)
