"""One round summary checked in one pass: the fast path of summary ingest.

A sidecar takes thousands of summaries a second, and each numpy call costs
microseconds on a loaded host, so :func:`intake` checks a summary and its
sketch with as few calls as it can (about 35, against about 70 for
:func:`~avest.core.summary.make_summary` and
:func:`~avest.core.summary.make_sketch` with the deltas decoded first). It is
a *sufficient* test: whatever it returns, those two would return too, equal
array for array (``tests/core/test_intake.py`` checks both directions on valid
and corrupted summaries). When anything is off it returns ``None`` and the
caller runs the thorough path, which names the offending field; bad input
pays for the slow path, good input never does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from avest.core.metrics import ECE_BINS
from avest.core.model import MAX_K, Coefficients
from avest.core.stats import RoundStats
from avest.core.summary import CELLS_PER_POSITION, MAX_SUMMARY_STEPS, RoundSummary, Sketch

#: The sketch's parts as they come off the wire: cell gaps, cell counts, rejected and
#: accepted drafts per ECE bin, predicted sums per bin, log-loss sums.
SketchParts = tuple[
    npt.ArrayLike, npt.ArrayLike, npt.ArrayLike, npt.ArrayLike, npt.ArrayLike, npt.ArrayLike
]


def intake(
    k: int,
    *,
    version: int,
    slope: float,
    intercepts: Sequence[float],
    info: Sequence[float],
    grad: Sequence[float],
    counts: Sequence[float],
    steps: int,
    drafts: int,
    sketch: SketchParts | None,
) -> RoundSummary | None:
    """The summary, or ``None`` when any check fails (then run the thorough path).

    ``sketch`` is ``(cell_deltas, cell_counts, ece_rejected, ece_accepted,
    ece_sum_predicted, logloss_sum)`` as the wire carries them, or ``None``
    for a summary without one.
    """
    if not (1 <= k <= MAX_K and version >= 0 and 1 <= steps <= MAX_SUMMARY_STEPS):
        return None
    if (len(intercepts), len(info), len(grad), len(counts)) != (k, 3 * k, 2 * k, k):
        return None
    w = float(slope)
    if not (math.isfinite(w) and w >= 0.0):
        return None
    # [intercepts | info | grad | counts] in one buffer
    every = np.concatenate(
        [np.asarray(v, dtype=np.float64) for v in (intercepts, info, grad, counts)]
    )
    if not np.isfinite(every).all():
        return None
    inf = every[k : 4 * k].reshape(k, 3)
    g = every[4 * k : 6 * k].reshape(k, 2)
    n = every[6 * k :]
    if every[_NON_NEGATIVE[k]].min() < 0 or (n % 1.0).any():
        return None
    total = int(n.sum())
    if drafts != total:
        return None
    calibration = None if sketch is None else _sketch(k, n, *sketch)
    if sketch is not None and calibration is None:
        return None
    stats = RoundStats(a=inf[:, 0], b=inf[:, 1], c=inf[:, 2], g0=g[:, 0], g1=g[:, 1], n=n)
    at = Coefficients(w, tuple(every[:k].tolist()))
    return RoundSummary(int(version), at, stats, int(steps), total, calibration)


def _sketch(
    k: int,
    n: npt.NDArray[np.float64],
    cell_deltas: npt.ArrayLike,
    cell_counts: npt.ArrayLike,
    ece_rejected: npt.ArrayLike,
    ece_accepted: npt.ArrayLike,
    ece_sum_predicted: npt.ArrayLike,
    logloss_sum: npt.ArrayLike,
) -> Sketch | None:
    """The sketch, checked as ``make_sketch`` and ``make_summary`` check it, or ``None``."""
    deltas = np.asarray(cell_deltas, dtype=np.int64)
    cnt = np.asarray(cell_counts, dtype=np.float64)
    if deltas.ndim != 1 or deltas.shape != cnt.shape:
        return None
    if deltas.size:
        # gaps >= 1 after a first cell >= 0: ascending cells inside the grid
        if deltas[0] < 0 or (deltas.size > 1 and deltas[1:].min() < 1):
            return None
        cells = deltas.cumsum()
        if cells[-1] >= k * CELLS_PER_POSITION or not cnt.min() >= 1:
            return None
    else:
        cells = deltas
    grid = k * ECE_BINS
    parts = [
        np.asarray(v, dtype=np.float64)
        for v in (ece_rejected, ece_accepted, ece_sum_predicted, logloss_sum)
    ]
    if tuple(p.size for p in parts) != (grid, grid, grid, k):
        return None
    # [rejected | accepted | predicted | log loss]: min >= 0 fails on NaN, the
    # sum catches an infinity
    sums = np.concatenate(parts)
    if not (sums.min() >= 0 and math.isfinite(sums.sum())):
        return None
    ece = sums[: 2 * grid].reshape(2, k, ECE_BINS)
    both = ece[0] + ece[1]
    psum = sums[2 * grid : 3 * grid].reshape(k, ECE_BINS)
    if (psum > both + 1e-3).any():
        return None
    # drafts per position: the cells ascend, so each position's cells are one
    # run, and a running sum read at the runs' ends gives them
    running = np.empty(cnt.size + 1)
    running[0] = 0.0
    cnt.cumsum(out=running[1:])
    if not math.isfinite(running[-1]):  # counts are >= 1 here: an infinite one shows
        return None
    at_ends = running[cells.searchsorted(_POSITION_ENDS[k])]
    per = at_ends.copy()
    per[1:] -= at_ends[:-1]
    if (per != both.sum(axis=1)).any() or (per != n).any():
        return None
    sketch = Sketch(k, cells, cnt, ece.transpose(1, 2, 0).copy(), psum, sums[3 * grid :])
    # the drafts per position are known now: spare the sketch its own bincount
    sketch.__dict__["_per_position"] = per
    return sketch


#: Per K, where ``a_k``, ``c_k`` and the counts lie in ``[intercepts | info | grad | counts]``.
_NON_NEGATIVE = [
    np.concatenate((k + 3 * np.arange(k), k + 3 * np.arange(k) + 2, 6 * k + np.arange(k)))
    for k in range(MAX_K + 1)
]
#: Per K, the first cell past each position: where each position's run of cells ends.
_POSITION_ENDS = [np.arange(1, k + 1) * CELLS_PER_POSITION for k in range(MAX_K + 1)]
