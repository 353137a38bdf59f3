"""Round summaries: one worker's round as sums, merged into a pair's round.

In summary mode a worker sends, once per round, the IRLS sums vLLM's
estimator accumulates on the device (``info`` [K, 3] = ``a, b, c``, ``grad``
[K, 2] = ``g0, g1``, ``counts`` [K]), the coefficients they were computed at,
the number of steps and labelled drafts, and a calibration sketch (the
:class:`~avest.core.metrics.CalibrationState` sums of the round: the AUC
histograms of the linear predictor by label in the service's 1026 slots, the
15 ECE bins and the log-loss sums). Everything is a sum, so summaries from W
workers add up to the round the pair would have pooled from their raw steps.

**Statistics at the current coefficients merge exactly**: they are the same
sums the service would have folded from the raw steps.

**Statistics at older coefficients** ``theta_v`` (a worker that had not yet
applied the last refit when its round ended) are moved to the current point
``theta`` before they join the round (:func:`rebase`): per position,
``g_k <- g_k - H_k (theta - theta_v)`` with ``H_k = [[a_k, b_k], [b_k, c_k]]``,
the first-order change of the gradient (``dg/dtheta = -H``); the information
``H`` is kept as computed. What each rule makes of that:

- ``recursive`` is **exact at any version**: it carries
  ``h <- lam h + H_t theta_t + g_t``, and with the rebased gradient
  ``H_v theta + g_v - H_v (theta - theta_v) = H_v theta_v + g_v`` — exactly
  the term the worker's own sums define, whatever ``theta`` is now.
- ``tracking`` and ``vllm`` take one Newton-type step from the current point
  with the round's gradient there; the rebased gradient is that gradient to
  first order (the error is quadratic in ``theta - theta_v``, small for the
  one or two refits a worker lags). Both **accept** older statistics
  rather than drop them: with W workers and a refit per pooled round, most
  summaries are a refit behind, and dropping them would discard most labels.
- The calibration sketch is merged as sent: it scores each draft with the
  coefficients the worker actually served (predict, then learn).

The calibration layer (:class:`~avest.core.calibration.Recalibrator`) learns
from the sketch's linear-predictor histogram (:func:`observe_sketch`): its
bins are 21.3 AUC slots wide, an AUC slot that straddles one of its edges is
split by overlap, and the losses that decide whether the layer is served are
taken at slot centres (a draft moves by at most half an AUC slot, 0.012 in
``eta``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from avest.core.calibration import Recalibrator, slot
from avest.core.errors import InvalidInput
from avest.core.metrics import AUC_SLOTS, ECE_BINS, ETA_RANGE, CalibrationState
from avest.core.model import Coefficients, check_k
from avest.core.numeric import bernoulli_nll
from avest.core.stats import RoundStats

FloatArray = npt.NDArray[np.float64]

#: Most steps one summary may cover.
MAX_SUMMARY_STEPS = 1_000_000
#: Cells of a sketch's linear-predictor histogram per position: (label, slot).
CELLS_PER_POSITION = 2 * AUC_SLOTS


@dataclass(frozen=True)
class RoundSummary:
    """One worker's round: sums at ``at`` (version ``version``), steps, drafts, sketch."""

    version: int
    at: Coefficients
    stats: RoundStats
    steps: int
    drafts: int
    calibration: Sketch | None = None

    @property
    def k(self) -> int:
        return self.stats.k


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
    drafts: int,
    calibration: Sketch | None = None,
) -> RoundSummary:
    """Validate one summary (``info`` [K, 3], ``grad`` [K, 2], ``counts`` [K]) completely.

    Ingest cost matters here (thousands of summaries a second): the parts are
    checked together, in one buffer, with a handful of numpy calls.
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
    if not (math.isfinite(w) and w >= 0.0):
        raise InvalidInput("slope", f"must be finite and >= 0, got {w}")
    # one fresh buffer [intercepts | info | grad | counts]: the statistics view it
    every = np.concatenate(parts)
    if not np.isfinite(every).all():
        bad = next(n for (n, _), v in zip(sizes, parts, strict=True) if not np.isfinite(v).all())
        raise InvalidInput(bad, "must be finite")
    inf = every[k : 4 * k].reshape(k, 3)
    g = every[4 * k : 6 * k].reshape(k, 2)
    n = every[6 * k :]
    if inf[:, 0::2].min() < 0:
        raise InvalidInput("info", "a_k and c_k must be >= 0")
    if n.min() < 0 or (n != np.rint(n)).any():
        raise InvalidInput("counts", "must be whole numbers >= 0")
    if not 1 <= steps <= MAX_SUMMARY_STEPS:
        raise InvalidInput("steps", f"must lie in [1, {MAX_SUMMARY_STEPS}], got {steps}")
    total = int(n.sum())
    if drafts != total:
        raise InvalidInput("drafts", f"is {drafts}, the counts add up to {total}")
    if calibration is not None:
        if calibration.k != k:
            raise InvalidInput("sketch", f"has K={calibration.k}, expected {k}")
        if not np.array_equal(calibration.drafts_per_position(), n):
            raise InvalidInput("sketch", "its drafts per position differ from counts")
    stats = RoundStats(a=inf[:, 0], b=inf[:, 1], c=inf[:, 2], g0=g[:, 0], g1=g[:, 1], n=n)
    at = Coefficients(w, tuple(every[:k].tolist()))
    return RoundSummary(int(version), at, stats, int(steps), total, calibration)


def rebase(stats: RoundStats, at: Coefficients, to: Coefficients) -> RoundStats:
    """Statistics computed at ``at`` with their gradient moved to ``to`` (first order).

    ``g_k <- g_k - H_k (to - at)`` per position; ``a, b, c, n`` unchanged.
    Exact for the ``recursive`` rule (see the module docstring). Returns
    ``stats`` itself when ``at == to``.
    """
    if at.k != stats.k or to.k != stats.k:
        raise InvalidInput("intercepts", f"coefficients and statistics disagree on K={stats.k}")
    if at == to:
        return stats
    dw = to.slope - at.slope
    db = to.intercept_array() - at.intercept_array()
    return RoundStats(
        a=stats.a.copy(),
        b=stats.b.copy(),
        c=stats.c.copy(),
        g0=stats.g0 - stats.a * dw - stats.b * db,
        g1=stats.g1 - stats.b * dw - stats.c * db,
        n=stats.n.copy(),
    )


# -- the calibration sketch ------------------------------------------------------


@dataclass(frozen=True)
class Sketch:
    """A round's calibration sums, the eta histogram kept sparse.

    ``cells``: ascending flat indices ``(position * 2 + label) * AUC_SLOTS +
    slot`` of the occupied histogram cells, ``counts`` their drafts; ``ece``
    ``[K, ECE_BINS, 2]`` (rejected, accepted) drafts, ``psum`` ``[K,
    ECE_BINS]`` predicted probabilities, ``nll`` ``[K]`` log loss. Merging
    into a pair's round costs O(occupied cells), not O(K x 2052).
    """

    k: int
    cells: npt.NDArray[np.int64]
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

    def add_to(self, state: CalibrationState) -> None:
        """Add these sums into ``state`` (in place), in O(occupied cells).

        Writes the state's arrays directly (its layout: ``_auc`` an
        :class:`~avest.core.histogram.EtaHistogram` [K, 2, window], ``_ece``
        [K, ECE_BINS, 2], ``_psum``, ``_nll``): building a dense state per
        summary to :meth:`CalibrationState.merge` would cost O(K x 2052) per
        summary, the most of a K = 64 summary's ingest.
        """
        if state.k != self.k:
            raise InvalidInput("sketch", f"has K={self.k}, the state has K={state.k}")
        if self.cells.size:
            hist = state._auc
            rows, slots = np.divmod(self.cells, AUC_SLOTS)  # rows: position * 2 + label
            hist.cover(int(slots.min()), int(slots.max()) + 1)
            flat = rows * hist.width + (slots - hist.first)
            np.add.at(hist.counts.reshape(-1), flat, self.counts.astype(hist.counts.dtype))
        state._ece += self.ece
        state._psum += self.psum
        state._nll += self.nll

    def state(self) -> CalibrationState:
        """The sums as a :class:`CalibrationState` of their own."""
        out = CalibrationState.empty(self.k)
        self.add_to(out)
        return out

    @classmethod
    def of(cls, state: CalibrationState) -> Sketch:
        """The sketch of a whole state (its occupied cells)."""
        a = state.to_arrays()
        first = int(a["auc_first_slot"][0])
        window = np.stack([a["auc_rejected"], a["auc_accepted"]], axis=1)
        dense = np.zeros((state.k, 2, AUC_SLOTS))
        dense[:, :, first : first + window.shape[2]] = window
        auc = dense.reshape(-1)
        idx = np.flatnonzero(auc).astype(np.int64)
        ece = np.stack([a["ece_rejected"], a["ece_accepted"]], axis=2)
        return cls(state.k, idx, auc[idx], ece, a["ece_sum_predicted"], a["logloss_sum"])


def make_sketch(
    k: int,
    cells: npt.ArrayLike,
    cell_counts: npt.ArrayLike,
    ece_rejected: npt.ArrayLike,
    ece_accepted: npt.ArrayLike,
    ece_sum_predicted: npt.ArrayLike,
    logloss_sum: npt.ArrayLike,
) -> Sketch:
    """Validate a sketch's parts (``cells``: absolute flat indices) into a :class:`Sketch`."""
    check_k(k)
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
    if (psum > both + 1e-3).any():
        raise InvalidInput("ece_sum_predicted", "a bin's predictions exceed its drafts")
    ece = np.stack([rej, acc], axis=2)
    sketch = Sketch(k, idx, cnt, ece, psum, nll)
    if not np.array_equal(sketch.drafts_per_position(), both.sum(axis=1)):
        raise InvalidInput(
            "cell_counts", "the eta histogram and the ECE bins count different drafts"
        )
    return sketch


#: Centre of each AUC slot in ``eta`` (the edge slots at the grid's ends).
SLOT_CENTRES = np.concatenate(
    (
        [-ETA_RANGE],
        -ETA_RANGE + (np.arange(AUC_SLOTS - 2) + 0.5) * (2.0 * ETA_RANGE / (AUC_SLOTS - 2)),
        [ETA_RANGE],
    )
)


def observe_sketch(recal: Recalibrator, sketch: Sketch) -> None:
    """Feed a sketch to the calibration layer (see the module docstring)."""
    slots = sketch.cells % AUC_SLOTS
    accepted = (sketch.cells // AUC_SLOTS) % 2 == 1
    acc = np.bincount(slots[accepted], weights=sketch.counts[accepted], minlength=AUC_SLOTS)
    rej = np.bincount(slots[~accepted], weights=sketch.counts[~accepted], minlength=AUC_SLOTS)
    observe_counts(recal, rej, acc)


def observe_counts(recal: Recalibrator, rej: npt.ArrayLike, acc: npt.ArrayLike) -> None:
    """Feed the layer rejected and accepted drafts per AUC slot (``[AUC_SLOTS]`` each,
    every position together): scored at slot centres with the map in force."""
    rej = np.asarray(rej, dtype=np.float64)
    acc = np.asarray(acc, dtype=np.float64)
    tot = rej + acc
    live = tot > 0
    if not live.any():
        return
    e = SLOT_CENTRES[live]
    m = recal.mapped(e)
    n_acc, n_rej = acc[live], rej[live]
    ones, zeros = np.ones(e.size, dtype=bool), np.zeros(e.size, dtype=bool)
    map_acc, map_rej = bernoulli_nll(m, ones), bernoulli_nll(m, zeros)
    lin_acc, lin_rej = bernoulli_nll(e, ones), bernoulli_nll(e, zeros)
    recal.loss[0] += float(n_acc @ map_acc + n_rej @ map_rej)
    recal.loss[1] += float(n_acc @ lin_acc + n_rej @ lin_rej)
    # The serving test's spread, as Recalibrator.observe keeps it per draft.
    recal.spread[0] += float(n_acc @ (lin_acc - map_acc) ** 2 + n_rej @ (lin_rej - map_rej) ** 2)
    recal.spread[1] += float(n_acc.sum() + n_rej.sum())
    recal.round_total += tot @ _TO_RECAL_SLOTS
    recal.round_accepted += acc @ _TO_RECAL_SLOTS


def _recal_split() -> FloatArray:
    """``[AUC_SLOTS, SLOTS]``: the share of each AUC slot in each calibration-layer slot.

    An AUC slot that straddles a calibration-layer edge is split by overlap
    (drafts taken as uniform within it); the edge slots go to the end slots.
    """
    from avest.core.calibration import ETA_MAX, SLOTS

    width = 2.0 * ETA_RANGE / (AUC_SLOTS - 2)
    inner = np.concatenate(
        ([-np.inf], -ETA_MAX + np.arange(SLOTS - 1) * (2 * ETA_MAX / (SLOTS - 2)))
    )
    upper = np.concatenate((inner[1:], [np.inf]))
    out = np.zeros((AUC_SLOTS, SLOTS))
    out[0, slot(-ETA_RANGE - 1.0)[()]] = 1.0
    out[-1, slot(ETA_RANGE)[()]] = 1.0
    for i in range(1, AUC_SLOTS - 1):
        lo = -ETA_RANGE + (i - 1) * width
        hi = lo + width
        overlap = np.clip(np.minimum(hi, upper) - np.maximum(lo, inner), 0.0, None)
        out[i] = overlap / width
    return out


_TO_RECAL_SLOTS = _recal_split()


def summarise(
    batches: list[tuple[FloatArray, npt.NDArray[np.bool_], npt.NDArray[np.bool_]]],
    at: Coefficients,
    version: int,
) -> RoundSummary:
    """The summary a worker sends for ``batches`` (``(features, observed, accepted)``,
    each ``[R, K]``) scored at ``at``: the reference the workers' sums must match."""
    from avest.core.model import linear_predictor
    from avest.core.stats import fold

    stats = RoundStats.zeros(at.k)
    cal = CalibrationState.empty(at.k)
    for x, obs, acc in batches:
        eta = linear_predictor(at, x)
        stats.add_(fold(x, eta, obs, acc))
        cal.update(eta, obs, acc)
    return RoundSummary(version, at, stats, len(batches), stats.labelled(), Sketch.of(cal))
