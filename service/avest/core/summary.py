"""Round summaries (:mod:`avest_wire.summary`) merged into a pair's round.

In summary mode a worker sends, once per round, the IRLS sums vLLM's
estimator accumulates on the device, the coefficients they were computed at,
the number of steps and labelled drafts, and a calibration sketch (the
:class:`~avest.core.metrics.CalibrationState` sums of the round in the
contract's bins, :mod:`avest_wire.bins`). The type and its checks are the
contract's; this module is what the core does with one. Everything is a sum,
so summaries from W workers add up to the round the pair would have pooled
from their raw steps.

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

import numpy as np
import numpy.typing as npt

from avest.core.calibration import Recalibrator, slot
from avest.core.metrics import CalibrationState
from avest.core.model import Coefficients
from avest.core.numeric import bernoulli_nll
from avest.core.stats import RoundStats
from avest_wire.bins import AUC_SLOTS, ETA_RANGE
from avest_wire.errors import InvalidInput
from avest_wire.summary import RoundSummary, Sketch, make_summary

FloatArray = npt.NDArray[np.float64]


def summary_stats(summary: RoundSummary) -> RoundStats:
    """The summary's sums as round statistics (views of its arrays)."""
    inf, g = summary.info, summary.grad
    return RoundStats(
        a=inf[:, 0], b=inf[:, 1], c=inf[:, 2], g0=g[:, 0], g1=g[:, 1], n=summary.counts
    )


def summary_coefficients(summary: RoundSummary) -> Coefficients:
    """The coefficients the summary's sums were computed at."""
    return Coefficients(summary.slope, summary.intercepts)


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


def add_sketch(sketch: Sketch, state: CalibrationState) -> None:
    """Add a sketch's sums into ``state`` (in place), in O(occupied cells).

    Writes the state's arrays directly (its layout: ``_auc`` an
    :class:`~avest.core.histogram.EtaHistogram` [K, 2, window], ``_ece``
    [K, ECE_BINS, 2], ``_psum``, ``_nll``): building a dense state per
    summary to :meth:`CalibrationState.merge` would cost O(K x 2052) per
    summary, the most of a K = 64 summary's ingest.
    """
    if state.k != sketch.k:
        raise InvalidInput("sketch", f"has K={sketch.k}, the state has K={state.k}")
    if sketch.cells.size:
        hist = state._auc
        rows, slots = np.divmod(sketch.cells, AUC_SLOTS)  # rows: position * 2 + label
        hist.cover(int(slots.min()), int(slots.max()) + 1)
        flat = rows * hist.width + (slots - hist.first)
        np.add.at(hist.counts.reshape(-1), flat, sketch.counts.astype(hist.counts.dtype))
    state._ece += sketch.ece
    state._psum += sketch.psum
    state._nll += sketch.nll


def sketch_state(sketch: Sketch) -> CalibrationState:
    """A sketch's sums as a :class:`CalibrationState` of their own."""
    out = CalibrationState.empty(sketch.k)
    add_sketch(sketch, out)
    return out


def sketch_of(state: CalibrationState) -> Sketch:
    """The sketch of a whole state (its occupied cells)."""
    a = state.to_arrays()
    first = int(a["auc_first_slot"][0])
    window = np.stack([a["auc_rejected"], a["auc_accepted"]], axis=1)
    dense = np.zeros((state.k, 2, AUC_SLOTS))
    dense[:, :, first : first + window.shape[2]] = window
    auc = dense.reshape(-1)
    idx = np.flatnonzero(auc).astype(np.int64)
    ece = np.stack([a["ece_rejected"], a["ece_accepted"]], axis=2)
    return Sketch(state.k, idx, auc[idx], ece, a["ece_sum_predicted"], a["logloss_sum"])


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
    every = (at.intercept_array(), stats.a, stats.b, stats.c, stats.g0, stats.g1)
    info = np.stack(every[1:4], axis=1)
    grad = np.stack(every[4:6], axis=1)
    return make_summary(
        at.k,
        version=version,
        slope=at.slope,
        intercepts=every[0],
        info=info,
        grad=grad,
        counts=stats.n,
        steps=len(batches),
        sketch=sketch_of(cal),
    )
