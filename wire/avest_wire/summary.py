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

Besides shapes and finiteness, both paths refuse sums no round can produce
(:data:`SUM_BOUNDS`, the ECE and log-loss bounds in :func:`make_sketch` and
:func:`make_summary`): each bound follows from the sums' definitions and the
feature clamp, and holds up to :data:`BOUND_REL_SLACK` and
:data:`BOUND_ABS_SLACK`. The bound checks are computed once, by the same
functions, for both paths.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from avest_wire.bins import AUC_SLOTS, CELLS_PER_POSITION, ECE_BINS, FEATURE_BINS
from avest_wire.coefficients import check_k, slope_ok
from avest_wire.errors import InvalidInput
from avest_wire.limits import MAX_K, MAX_LOG_ODDS, MAX_STEP_REQUESTS, MAX_SUMMARY_STEPS

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

#: Relative slack of every bound a summary's sums must meet. The shim sums in float32
#: on the device (unit roundoff u = 2**-24, 6e-8): a draft's term is off by a few u, a
#: step's reduction over its requests by about log2(requests) u, and the round adds its
#: steps one by one, so a round of T steps is off by at most about (T + 20) u of the sum
#: of its terms' magnitudes: 7e-6 for vLLM's 100-step round, 6e-5 at 1,000 steps (and
#: by about sqrt(T) u in practice). The wire carries ``ece_sum_predicted`` in float32
#: (one more u). An honest round meets a bound with equality only in degenerate cases
#: (every p = 1/2; every x of a position equal, or a single draft; every draft at the
#: clamp and wrong), where its sums sit on the bound up to those errors. A forged
#: summary can pass a bound by at most this share of it.
BOUND_REL_SLACK = 1e-4
#: Absolute slack, in the sums' own units (drafts times p and x terms): a bound of 0 (a
#: position without drafts, ``c_k = 0``) holds exactly for honest sums up to float32
#: subnormals (below 1.2e-38 a term), which a millionth of a draft covers.
BOUND_ABS_SLACK = 1e-6
#: ``|eta|`` is capped here in the log-loss bound only so that ``counts_k x softplus``
#: stays finite for any claimed coefficients: far above any linear predictor a worker
#: computes (the shim's is float32, at most 3.4e38; larger claimed coefficients give it
#: an infinite eta and a non-finite log loss, refused as such).
LOG_LOSS_ETA_CAP = 1e250

#: Per position ``k``, over its ``n_k = counts_k`` labelled drafts, with ``p`` in
#: ``[0, 1]``, label ``y`` in ``{0, 1}``, ``|x| <= X = MAX_LOG_ODDS`` (the feature clamp),
#: ``w = p (1 - p)`` in ``[0, 1/4]`` and ``r = y - p`` in ``[-1, 1]``:
#:
#: - ``c_k = sum w <= n_k / 4``;
#: - ``a_k = sum w x^2 <= n_k X^2 / 4``;
#: - ``|b_k| = |sum w x| <= n_k X / 4``;
#: - ``|b_k| <= sqrt(a_k c_k)`` (Cauchy-Schwarz with weights ``w``: ``(sum w x)^2 <=
#:   sum w x^2 sum w``): with ``a_k, c_k >= 0`` exactly the information
#:   ``[[a_k, b_k], [b_k, c_k]]`` being positive semidefinite (compared as square roots,
#:   which cannot overflow; the relative slack on ``|b_k|`` is twice that on ``b_k^2``);
#: - ``|g0_k| = |sum r x| <= n_k X``;
#: - ``|g1_k| = |sum r| <= n_k``.
#:
#: Each entry: the field, and what its failure means (the rows of :func:`_sum_bounds`).
SUM_BOUNDS = (
    ("info", "c_k = sum p(1-p) exceeds counts_k / 4"),
    ("info", f"a_k = sum w x^2 exceeds counts_k * {MAX_LOG_ODDS:g}^2 / 4"),
    ("info", f"|b_k| = |sum w x| exceeds counts_k * {MAX_LOG_ODDS:g} / 4"),
    ("info", "[[a_k, b_k], [b_k, c_k]] is not positive semidefinite: |b_k| exceeds sqrt(a_k c_k)"),
    ("grad", f"|g0_k| = |sum r x| exceeds counts_k * {MAX_LOG_ODDS:g}"),
    ("grad", "|g1_k| = |sum r| exceeds counts_k"),
)
#: Each ECE bin's probability range: bin ``j`` holds the drafts with ``p`` in
#: ``[j / ECE_BINS, (j + 1) / ECE_BINS)`` (the last one with ``p = 1``).
_BIN_LOW = np.arange(ECE_BINS) / ECE_BINS
_BIN_HIGH = np.arange(1, ECE_BINS + 1) / ECE_BINS
#: A bin's centre, and how far from ``drafts x centre`` its predicted sum may lie per
#: draft: half the bin's width, and the relative slack of the bin's top.
_BIN_MIDDLE = (_BIN_LOW + _BIN_HIGH) / 2.0
_BIN_REACH = (_BIN_HIGH - _BIN_LOW) / 2.0 + BOUND_REL_SLACK * _BIN_HIGH


def _over(value: FloatArray, bound: FloatArray) -> BoolArray:
    """Where ``value`` exceeds ``bound`` (>= 0) beyond the slack."""
    return np.asarray(value > bound * (1.0 + BOUND_REL_SLACK) + BOUND_ABS_SLACK)


def _sum_bounds(every: FloatArray, k: int) -> tuple[FloatArray, FloatArray]:
    """``(value, bound)``, each ``[len(SUM_BOUNDS), K]``, of :data:`SUM_BOUNDS`.

    ``every`` is a summary's ``[intercepts | info | grad | counts]`` with ``a_k, c_k
    >= 0``; gathered by index, in a handful of numpy calls for any K.
    """
    value = np.abs(every[_SUM_VALUES[k]])
    bound = every[_SUM_COUNTS[k]] * _SUM_SCALES[k]
    info = every[k : 4 * k]
    bound[3 * k : 4 * k] = np.sqrt(info[0::3]) * np.sqrt(info[2::3])
    return value.reshape(-1, k), bound.reshape(-1, k)


def _psum_off(drafts: FloatArray, psum: FloatArray) -> BoolArray:
    """``[K, ECE_BINS]``: bins whose predicted sum lies outside their drafts' range.

    A bin of ``m`` drafts, each with ``p`` in ``[lo, hi)``, predicts between ``m lo``
    and ``m hi`` in all: within ``m (hi - lo) / 2`` of ``m (lo + hi) / 2``.
    """
    return np.asarray(np.abs(psum - drafts * _BIN_MIDDLE) > drafts * _BIN_REACH + BOUND_ABS_SLACK)


def _log_loss_below(nll: FloatArray, n: FloatArray) -> BoolArray:
    """``[K]``: positions whose log loss lies below 0 beyond the slack.

    Each draft adds ``softplus(eta) - y eta >= 0``; on the device a draft with
    ``y = 1`` and ``eta`` up to torch's softplus threshold (20) can come out a few
    float32 ulps of 20 (2e-6) below 0, which the relative slack per draft covers.
    """
    return np.asarray(nll < -(n * BOUND_REL_SLACK + BOUND_ABS_SLACK))


def _log_loss_bound(n: FloatArray, slope: float, intercepts: FloatArray) -> FloatArray:
    """``[K]``: the most log loss a position's drafts can add at the claimed coefficients.

    A draft's term ``softplus(eta) - y eta`` is ``softplus(eta)`` or
    ``softplus(-eta)``, at most ``softplus(|eta|)``, and ``|eta| = |slope x +
    b_k| <= slope X + |b_k| = E_k`` with ``|x| <= X``: the position's sum is at most
    ``n_k softplus(E_k)`` (``softplus(E) = E + log1p(exp(-E))`` for ``E >= 0``).
    """
    e = np.minimum(np.abs(intercepts) + slope * MAX_LOG_ODDS, LOG_LOSS_ETA_CAP)
    return np.asarray(n * (e + np.log1p(np.exp(-e))))


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
class Reached:
    """The drafts that reached each position, verified or trimmed, by feature bin.

    Position ``i`` of a request is reached when its drafts ``0 .. i-1`` were all
    verified and accepted (vLLM drafts every position; adaptive verification may
    trim it): the drafts whose distribution a draft-length schedule needs, where
    the calibration sketch counts the verified ones only. ``cells``: ascending flat
    indices ``position * FEATURE_BINS + bin`` (:func:`~avest_wire.bins.feature_bin`),
    ``counts`` their drafts (whole, >= 1).
    """

    k: int
    cells: IntArray
    counts: FloatArray

    def per_position(self) -> FloatArray:
        per = np.bincount(self.cells // FEATURE_BINS, weights=self.counts, minlength=self.k)
        return np.asarray(per, dtype=np.float64)

    def dense(self) -> FloatArray:
        """The counts ``[K, FEATURE_BINS]``."""
        out = np.zeros(self.k * FEATURE_BINS)
        out[self.cells] = self.counts
        return out.reshape(self.k, FEATURE_BINS)

    @classmethod
    def from_dense(cls, counts: npt.ArrayLike, labelled: npt.ArrayLike, steps: int) -> Reached:
        """Checked (:func:`make_reached`), from dense counts ``[K, FEATURE_BINS]`` (or flat),
        rounded to whole drafts (a device adds them in float32)."""
        c = np.rint(np.asarray(counts, dtype=np.float64).reshape(-1))
        idx = np.flatnonzero(c)
        return make_reached(c.size // FEATURE_BINS, idx, c[idx], labelled=labelled, steps=steps)


def _sparse_cells(
    k: int, cells: npt.ArrayLike, counts: npt.ArrayLike, per_position: int
) -> tuple[IntArray, FloatArray]:
    """A sparse histogram's cells (ascending, in ``[0, k * per_position)``) and their
    counts (finite, >= 1), checked; :class:`InvalidInput` names the wire's field."""
    check_k(k)
    idx = np.asarray(cells, dtype=np.int64).reshape(-1)
    cnt = np.asarray(counts, dtype=np.float64).reshape(-1)
    if idx.shape != cnt.shape:
        raise InvalidInput("cell_counts", f"has {cnt.size} entries, cell_deltas {idx.size}")
    if idx.size and (idx[0] < 0 or idx[-1] >= k * per_position):
        raise InvalidInput("cell_deltas", f"cells must lie in [0, {k * per_position})")
    if idx.size > 1 and (idx[1:] <= idx[:-1]).any():
        raise InvalidInput("cell_deltas", "cells must ascend (gaps >= 1)")
    if idx.size and not (cnt.min() >= 1 and np.isfinite(cnt).all()):
        raise InvalidInput("cell_counts", "must be >= 1")
    return idx, cnt


def make_reached(
    k: int, cells: npt.ArrayLike, counts: npt.ArrayLike, *, labelled: npt.ArrayLike, steps: int
) -> Reached:
    """Check a round's reached counts (``cells``: absolute flat indices) into :class:`Reached`.

    Besides the cells' range and order and whole counts >= 1, what a round's
    ``labelled`` drafts per position (its summary's ``counts``) imply: each labelled
    draft reached its position (``reached_i >= n_i``); position ``i + 1`` is reached
    exactly by the drafts accepted at ``i``, at most those verified there
    (``reached_{i+1} <= n_i``); the first position by at most
    :data:`~avest_wire.limits.MAX_STEP_REQUESTS` a step of the round's ``steps``.
    So one worker's counts weigh no more than its labelled drafts, but at the first
    position (where the requests trimmed whole are counted too).
    """
    idx, cnt = _sparse_cells(k, cells, counts, FEATURE_BINS)
    if (cnt % 1.0).any():
        raise InvalidInput("cell_counts", "must be whole numbers >= 1")
    out = Reached(k, idx, cnt)
    per = out.per_position()
    n = np.asarray(labelled, dtype=np.float64).reshape(-1)
    short = per < n
    if short.any():
        i = int(np.argmax(short))
        raise InvalidInput(
            "cell_counts",
            f"position {i} is reached by {per[i]:g} drafts, fewer than the {n[i]:g} labelled there",
        )
    over = per[1:] > n[:-1]
    if over.any():
        i = int(np.argmax(over)) + 1
        raise InvalidInput(
            "cell_counts",
            f"position {i} is reached by {per[i]:g} drafts, more than the {n[i - 1]:g} "
            f"labelled at position {i - 1} (only its accepted drafts reach the next)",
        )
    if per[0] > steps * MAX_STEP_REQUESTS:
        raise InvalidInput(
            "cell_counts",
            f"position 0 is reached by {per[0]:g} drafts, more than {MAX_STEP_REQUESTS} "
            f"requests in each of the round's {steps} steps",
        )
    return out


def intake_reached(
    k: int, deltas: npt.ArrayLike, counts: npt.ArrayLike, labelled: FloatArray, steps: int
) -> Reached | None:
    """:func:`make_reached`'s checks in fewer numpy calls, on the wire's form (``deltas``:
    the first cell, then the gaps): the counts, or ``None`` when any check fails (then
    run :func:`make_reached`, which says which)."""
    gaps = np.asarray(deltas, dtype=np.int64)
    cnt = np.asarray(counts, dtype=np.float64)
    if gaps.ndim != 1 or gaps.shape != cnt.shape:
        return None
    if not gaps.size:
        return None if labelled.any() else Reached(k, gaps, cnt)
    if gaps[0] < 0 or (gaps.size > 1 and gaps[1:].min() < 1) or not cnt.min() >= 1:
        return None
    cells = gaps.cumsum()
    if cells[-1] >= k * FEATURE_BINS or (cnt % 1.0).any():
        return None
    per = np.bincount(cells // FEATURE_BINS, weights=cnt, minlength=k)
    if (per < labelled).any() or (per[1:] > labelled[:-1]).any():
        return None
    if per[0] > steps * MAX_STEP_REQUESTS:
        return None
    return Reached(k, cells, cnt)


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
    #: The round's drafts that reached each position (optional: the vLLM plugin sends
    #: them with one round in ten).
    reached: Reached | None = None

    @property
    def k(self) -> int:
        return len(self.intercepts)


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
    check_k(k)
    if version < 0:
        raise InvalidInput("coefficients_version", "must be >= 0")
    sizes = (("intercepts", k), ("info", 3 * k), ("grad", 2 * k), ("counts", k))
    given = (intercepts, info, grad, counts)
    parts = [np.asarray(v, dtype=np.float64).reshape(-1) for v in given]
    for (name, size), part in zip(sizes, parts, strict=True):
        if part.size != size:
            raise InvalidInput(name, f"must have {size} entries, got {part.size}")
    w = float(slope)
    if not slope_ok(w):
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
    value, bound = _sum_bounds(every, k)
    off = _over(value, bound)
    if off.any():
        row, pos = (int(i) for i in np.argwhere(off)[0])
        field, what = SUM_BOUNDS[row]
        raise InvalidInput(
            field,
            f"position {pos}: {what} ({value[row, pos]:.6g} > {bound[row, pos]:.6g}, "
            f"counts_k = {n[pos]:g})",
        )
    if sketch is not None:
        most = _log_loss_bound(n, w, every[:k])
        over = _over(sketch.nll, most)
        if over.any():
            pos = int(np.argmax(over))
            raise InvalidInput(
                "sketch.logloss_sum",
                f"position {pos}: {sketch.nll[pos]:.6g} exceeds {most[pos]:.6g}, the most "
                f"{n[pos]:g} drafts can lose at the summary's coefficients (counts_k x "
                f"softplus(slope x {MAX_LOG_ODDS:g} + |intercept_k|))",
            )
    return build_summary(k, version, w, every, steps, total, sketch)


def build_summary(
    k: int,
    version: int,
    slope: float,
    every: FloatArray,
    steps: int,
    drafts: int,
    sketch: Sketch | None,
) -> RoundSummary:
    """The summary over one buffer ``every = [intercepts | info | grad | counts]``, as
    given: the checks are the callers' (``intake``, ``make_summary``)."""
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
    idx, cnt = _sparse_cells(k, cells, cell_counts, CELLS_PER_POSITION)
    grid = k * ECE_BINS
    sizes = [("ece_rejected", grid), ("ece_accepted", grid), ("ece_sum_predicted", grid)]
    sizes.append(("logloss_sum", k))
    given = (ece_rejected, ece_accepted, ece_sum_predicted, logloss_sum)
    parts = [np.asarray(v, dtype=np.float64).reshape(-1) for v in given]
    for (field, size), part in zip(sizes, parts, strict=True):
        if part.size != size:
            raise InvalidInput(field, f"must have {size} entries, got {part.size}")
    for (field, _), part in zip(sizes, parts, strict=True):
        if not np.isfinite(part).all():
            raise InvalidInput(field, "must be finite")
    for (field, _), part in zip(sizes[:3], parts[:3], strict=True):
        if part.min() < 0:
            raise InvalidInput(field, "must be >= 0")
    every = np.concatenate(parts)
    rej = every[:grid].reshape(k, ECE_BINS)
    acc = every[grid : 2 * grid].reshape(k, ECE_BINS)
    psum = every[2 * grid : 3 * grid].reshape(k, ECE_BINS)
    nll = every[3 * grid :]
    both = rej + acc
    off = _psum_off(both, psum)
    if off.any():
        pos, b = (int(i) for i in np.argwhere(off)[0])
        m = both[pos, b]
        raise InvalidInput(
            "ece_sum_predicted",
            f"position {pos}, bin {b}: {psum[pos, b]:.6g} lies outside "
            f"[{m * _BIN_LOW[b]:.6g}, {m * _BIN_HIGH[b]:.6g}], what its {m:g} drafts with p "
            f"between {b}/{ECE_BINS} and {b + 1}/{ECE_BINS} can predict",
        )
    ece = np.stack([rej, acc], axis=2)
    sketch = Sketch(k, idx, cnt, ece, psum, nll)
    drafts = both.sum(axis=1)
    if not np.array_equal(sketch.drafts_per_position(), drafts):
        raise InvalidInput(
            "cell_counts", "the eta histogram and the ECE bins count different drafts"
        )
    below = _log_loss_below(nll, drafts)
    if below.any():
        pos = int(np.argmax(below))
        raise InvalidInput(
            "logloss_sum", f"position {pos}: {nll[pos]:.6g} is below 0 (a sum of losses >= 0)"
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
    if not slope_ok(w):
        return None
    # [intercepts | info | grad | counts] in one buffer (from one list: at most a few
    # hundred values, fewer numpy calls than a conversion each and a concatenation)
    every = np.array([*intercepts, *info, *grad, *counts], dtype=np.float64)
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
    if _over(*_sum_bounds(every, k)).any():
        return None
    if checked is not None and _over(checked.nll, _log_loss_bound(n, w, every[:k])).any():
        return None
    return build_summary(k, version, w, every, steps, total, checked)


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
    """The sketch, checked as ``make_sketch`` and ``make_summary`` check it, or ``None``.

    The wire's cells and counts are integers (``uint32``), summed here as such: whole
    counts of anything else (floats) are left to the thorough path.
    """
    deltas = np.asarray(cell_deltas)
    whole = np.asarray(cell_counts)
    if deltas.ndim != 1 or deltas.shape != whole.shape:
        return None
    if deltas.dtype.kind not in "iu" or whole.dtype.kind not in "iu":
        return None
    # wider than the wire's: keep the running sums below 2**63
    wide = deltas.size and max(deltas.itemsize, whole.itemsize) > 4
    if wide and (deltas.max() >= k * CELLS_PER_POSITION or whole.max() > 2**32):
        return None
    if deltas.size:
        # gaps >= 1 after a first cell >= 0: ascending cells inside the grid
        if deltas[0] < 0 or (deltas.size > 1 and deltas[1:].min() < 1):
            return None
        cells = deltas.cumsum(dtype=np.int64)
        if cells[-1] >= k * CELLS_PER_POSITION or whole.min() < 1:
            return None
    else:
        cells = deltas.astype(np.int64)
    grid = k * ECE_BINS
    parts = [
        np.asarray(v, dtype=np.float64)
        for v in (ece_rejected, ece_accepted, ece_sum_predicted, logloss_sum)
    ]
    if tuple(p.size for p in parts) != (grid, grid, grid, k):
        return None
    # [rejected | accepted | predicted | log loss]: min >= 0 of the first three
    # fails on NaN, the sum catches an infinity (and a NaN log loss)
    sums = np.concatenate(parts)
    if not (sums[: 3 * grid].min() >= 0 and math.isfinite(sums.sum())):
        return None
    ece = sums[: 2 * grid].reshape(2, k, ECE_BINS)
    both = ece[0] + ece[1]
    psum = sums[2 * grid : 3 * grid].reshape(k, ECE_BINS)
    if _psum_off(both, psum).any():
        return None
    # drafts per position: the cells ascend, so each position's cells are one
    # run, and a running sum (of integers, exact) read at the runs' ends gives them
    running = np.zeros(whole.size + 1, dtype=np.int64)
    whole.cumsum(dtype=np.int64, out=running[1:])
    at_ends = running[cells.searchsorted(_POSITION_ENDS[k])]
    per = at_ends.copy()
    per[1:] -= at_ends[:-1]
    if (per != both.sum(axis=1)).any() or (per != n).any():
        return None
    nll = sums[3 * grid :]
    if _log_loss_below(nll, per).any():
        return None
    cnt = whole.astype(np.float64)
    sketch = Sketch(k, cells, cnt, ece.transpose(1, 2, 0).copy(), psum, nll)
    # the drafts per position are known now: spare the sketch its own bincount
    sketch.__dict__["_per_position"] = per.astype(np.float64)
    return sketch


#: Per K, where ``a_k``, ``c_k`` and the counts lie in ``[intercepts | info | grad | counts]``.
_NON_NEGATIVE = [
    np.concatenate((k + 3 * np.arange(k), k + 3 * np.arange(k) + 2, 6 * k + np.arange(k)))
    for k in range(MAX_K + 1)
]


def _sum_values(k: int) -> npt.NDArray[np.intp]:
    """Where the values :data:`SUM_BOUNDS` bound lie in ``[intercepts | info | grad |
    counts]``, one row of K each: c, a, b, b (against sqrt(a c)), g0, g1."""
    i = np.arange(k)
    c, a, b = k + 3 * i + 2, k + 3 * i, k + 3 * i + 1
    g0, g1 = 4 * k + 2 * i, 4 * k + 2 * i + 1
    return np.concatenate((c, a, b, b, g0, g1)).astype(np.intp)


_SUM_VALUES = [_sum_values(k) for k in range(MAX_K + 1)]
#: Per K, the counts against each of those values, and the multiples of them each bound
#: is (``X = MAX_LOG_ODDS``; the row of sqrt(a c) is filled in apart).
_SUM_COUNTS = [np.tile(6 * k + np.arange(k), len(SUM_BOUNDS)) for k in range(MAX_K + 1)]
_SUM_SCALES = [
    np.repeat([0.25, MAX_LOG_ODDS**2 / 4.0, MAX_LOG_ODDS / 4.0, 0.0, MAX_LOG_ODDS, 1.0], k)
    for k in range(MAX_K + 1)
]
#: Per K, the first cell past each position: where each position's run of cells ends.
_POSITION_ENDS = [np.arange(1, k + 1) * CELLS_PER_POSITION for k in range(MAX_K + 1)]
