"""A round summary and its calibration sketch: the one type each, and their one check.

In summary mode a worker sends, once per round, the IRLS sums vLLM's
estimator accumulates (``info`` [K, 3] = ``a, b, c``, ``grad`` [K, 2] =
``g0, g1``, ``counts`` [K]: per position ``a = sum w x^2``, ``b = sum w x``,
``c = sum w``, ``g0 = sum r x``, ``g1 = sum r`` with ``w = p (1 - p)`` and
``r = y - p`` over the labelled drafts), the coefficients (and their version)
the round's predictions were made with, its steps and labelled drafts, and a
calibration :class:`Sketch` in the contract's bins (:mod:`avest_wire.bins`).
Every part is a sum, so summaries from many workers add up.

The client builds these (on the host from raw steps, or from the shim's device
sums) and the service pools them; both construct them only through
:func:`make_summary` and :func:`make_sketch`, which check everything the
contract promises and name the offending field (:class:`InvalidInput`). The
service's ingest takes thousands a second, so :func:`intake` runs the same
checks in about half the numpy calls: a *sufficient* test whose result, when
it gives one, equals the thorough path's array for array; when anything is
off it returns ``None`` and the caller runs the thorough path for the
message. ``tests/core/test_intake.py`` checks both directions.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from avest_wire.bins import AUC_SLOTS, CELLS_PER_POSITION, ECE_BINS
from avest_wire.errors import InvalidInput
from avest_wire.limits import MAX_K, MAX_SUMMARY_STEPS

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

#: A bin's predicted probabilities may exceed its drafts by this much (float32
#: sums on the device round up to this far).
PSUM_SLACK = 1e-3


@dataclass(frozen=True)
class Sketch:
    """A round's calibration sums, the linear-predictor histogram kept sparse.

    ``cells``: ascending flat indices ``(position * 2 + label) * AUC_SLOTS +
    slot`` of the occupied histogram cells, ``counts`` their drafts; ``ece``
    ``[K, ECE_BINS, 2]`` (rejected, accepted) drafts per probability bin,
    ``psum`` ``[K, ECE_BINS]`` their predicted probabilities, ``nll`` ``[K]``
    log loss. Merging one costs O(occupied cells), not O(K x 2052).
    """

    k: int
    cells: IntArray
    counts: FloatArray
    ece: FloatArray
    psum: FloatArray
    nll: FloatArray

    def drafts_per_position(self) -> FloatArray:
        return self._per_position

    @functools.cached_property
    def _per_position(self) -> FloatArray:
        per = np.bincount(self.cells // CELLS_PER_POSITION, weights=self.counts, minlength=self.k)
        return np.asarray(per, dtype=np.float64)

    @classmethod
    def from_dense(
        cls,
        histogram: npt.ArrayLike,
        ece_rejected: npt.ArrayLike,
        ece_accepted: npt.ArrayLike,
        ece_sum_predicted: npt.ArrayLike,
        logloss_sum: npt.ArrayLike,
    ) -> Sketch:
        """Checked, from a dense histogram ``[K, 2, AUC_SLOTS]`` (or flat) and the ECE sums.

        Counts are rounded to whole drafts: a device accumulates them in float32.
        """
        h = np.rint(np.asarray(histogram, dtype=np.float64).reshape(-1))
        idx = np.flatnonzero(h)
        k = int(np.asarray(logloss_sum).size)
        return make_sketch(
            k,
            idx,
            h[idx],
            np.rint(np.asarray(ece_rejected, dtype=np.float64)),
            np.rint(np.asarray(ece_accepted, dtype=np.float64)),
            ece_sum_predicted,
            logloss_sum,
        )

    def dense_histogram(self) -> FloatArray:
        """The histogram ``[K, 2, AUC_SLOTS]``."""
        out = np.zeros(self.k * CELLS_PER_POSITION)
        out[self.cells] = self.counts
        return out.reshape(self.k, 2, AUC_SLOTS)


@dataclass(frozen=True)
class RoundSummary:
    """One worker's round: sums at ``(slope, intercepts)`` of ``version``, steps, drafts."""

    version: int
    slope: float
    intercepts: tuple[float, ...]
    info: FloatArray  # [K, 3]
    grad: FloatArray  # [K, 2]
    counts: FloatArray  # [K]
    steps: int
    drafts: int
    sketch: Sketch | None = None

    @property
    def k(self) -> int:
        return len(self.intercepts)


def _check_k(k: int) -> None:
    if not 1 <= k <= MAX_K:
        raise InvalidInput("k", f"K must be in [1, {MAX_K}], got {k}")


def make_summary(
    k: int,
    *,
    version: int,
    slope: float,
    intercepts: npt.ArrayLike,
    info: npt.ArrayLike,
    grad: npt.ArrayLike,
    counts: npt.ArrayLike,
    steps: int,
    drafts: int | None = None,
    sketch: Sketch | None = None,
) -> RoundSummary:
    """Check one summary completely; ``drafts`` defaults to what the counts add up to.

    The parts are checked together, in one buffer, with a handful of numpy calls.
    """
    _check_k(k)
    if version < 0:
        raise InvalidInput("coefficients_version", "must be >= 0")
    sizes = (("intercepts", k), ("info", 3 * k), ("grad", 2 * k), ("counts", k))
    given = (intercepts, info, grad, counts)
    parts = [np.asarray(v, dtype=np.float64).reshape(-1) for v in given]
    for (name, size), part in zip(sizes, parts, strict=True):
        if part.size != size:
            raise InvalidInput(name, f"must have {size} entries, got {part.size}")
    w = float(slope)
    if not (math.isfinite(w) and w >= 0.0):
        raise InvalidInput("slope", f"must be finite and >= 0, got {w}")
    # one fresh buffer [intercepts | info | grad | counts]: the summary views it
    every = np.concatenate(parts)
    if not np.isfinite(every).all():
        bad = next(n for (n, _), v in zip(sizes, parts, strict=True) if not np.isfinite(v).all())
        raise InvalidInput(bad, "must be finite")
    inf = every[k : 4 * k].reshape(k, 3)
    n = every[6 * k :]
    if inf[:, 0::2].min() < 0:
        raise InvalidInput("info", "a_k and c_k must be >= 0")
    if n.min() < 0 or (n != np.rint(n)).any():
        raise InvalidInput("counts", "must be whole numbers >= 0")
    if not 1 <= steps <= MAX_SUMMARY_STEPS:
        raise InvalidInput("steps", f"must lie in [1, {MAX_SUMMARY_STEPS}], got {steps}")
    total = int(n.sum())
    if drafts is not None and drafts != total:
        raise InvalidInput("drafts", f"is {drafts}, the counts add up to {total}")
    if sketch is not None:
        if sketch.k != k:
            raise InvalidInput("sketch", f"has K={sketch.k}, expected {k}")
        if not np.array_equal(sketch.drafts_per_position(), n):
            raise InvalidInput("sketch", "its drafts per position differ from counts")
    return _summary(k, version, w, every, steps, total, sketch)


def _summary(
    k: int,
    version: int,
    slope: float,
    every: FloatArray,
    steps: int,
    drafts: int,
    sketch: Sketch | None,
) -> RoundSummary:
    return RoundSummary(
        int(version),
        slope,
        tuple(every[:k].tolist()),
        every[k : 4 * k].reshape(k, 3),
        every[4 * k : 6 * k].reshape(k, 2),
        every[6 * k :],
        int(steps),
        drafts,
        sketch,
    )


def make_sketch(
    k: int,
    cells: npt.ArrayLike,
    cell_counts: npt.ArrayLike,
    ece_rejected: npt.ArrayLike,
    ece_accepted: npt.ArrayLike,
    ece_sum_predicted: npt.ArrayLike,
    logloss_sum: npt.ArrayLike,
) -> Sketch:
    """Check a sketch's parts (``cells``: absolute flat indices) into a :class:`Sketch`."""
    _check_k(k)
    idx = np.asarray(cells, dtype=np.int64).reshape(-1)
    cnt = np.asarray(cell_counts, dtype=np.float64).reshape(-1)
    if idx.shape != cnt.shape:
        raise InvalidInput("cell_counts", f"has {cnt.size} entries, cell_deltas {idx.size}")
    if idx.size and (idx[0] < 0 or idx[-1] >= k * CELLS_PER_POSITION):
        raise InvalidInput("cell_deltas", f"cells must lie in [0, {k * CELLS_PER_POSITION})")
    if idx.size > 1 and (idx[1:] <= idx[:-1]).any():
        raise InvalidInput("cell_deltas", "cells must ascend (gaps >= 1)")
    if idx.size and not (cnt.min() >= 1 and np.isfinite(cnt).all()):
        raise InvalidInput("cell_counts", "must be >= 1")
    grid = k * ECE_BINS
    sizes = [("ece_rejected", grid), ("ece_accepted", grid), ("ece_sum_predicted", grid)]
    sizes.append(("logloss_sum", k))
    given = (ece_rejected, ece_accepted, ece_sum_predicted, logloss_sum)
    parts = [np.asarray(v, dtype=np.float64).reshape(-1) for v in given]
    for (field, size), part in zip(sizes, parts, strict=True):
        if part.size != size:
            raise InvalidInput(field, f"must have {size} entries, got {part.size}")
    every = np.concatenate(parts)
    if not (every.min(initial=0.0) >= 0 and np.isfinite(every).all()):
        raise InvalidInput("ece_rejected", "the ECE and log-loss sums must be finite and >= 0")
    rej = every[:grid].reshape(k, ECE_BINS)
    acc = every[grid : 2 * grid].reshape(k, ECE_BINS)
    psum = every[2 * grid : 3 * grid].reshape(k, ECE_BINS)
    nll = every[3 * grid :]
    both = rej + acc
    if (psum > both + PSUM_SLACK).any():
        raise InvalidInput("ece_sum_predicted", "a bin's predictions exceed its drafts")
    ece = np.stack([rej, acc], axis=2)
    sketch = Sketch(k, idx, cnt, ece, psum, nll)
    if not np.array_equal(sketch.drafts_per_position(), both.sum(axis=1)):
        raise InvalidInput(
            "cell_counts", "the eta histogram and the ECE bins count different drafts"
        )
    return sketch


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
    n = every[6 * k :]
    if every[_NON_NEGATIVE[k]].min() < 0 or (n % 1.0).any():
        return None
    total = int(n.sum())
    if drafts != total:
        return None
    checked = None if sketch is None else _sketch(k, n, *sketch)
    if sketch is not None and checked is None:
        return None
    return _summary(k, version, w, every, steps, total, checked)


def _sketch(
    k: int,
    n: FloatArray,
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
    if (psum > both + PSUM_SLACK).any():
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
