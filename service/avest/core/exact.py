"""Exact calibration measures from individual drafts: the references for
:mod:`avest.core.metrics`' mergeable sums (tests, offline comparisons)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from avest.core.numeric import bernoulli_nll
from avest_wire.bins import ECE_BINS
from avest_wire.errors import InvalidInput

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


def _pair(x: npt.ArrayLike, y_true: npt.ArrayLike, field: str) -> tuple[FloatArray, BoolArray]:
    s = np.asarray(x, dtype=np.float64).reshape(-1)
    y = np.asarray(y_true).reshape(-1)
    if y.dtype != np.bool_ and y.size and not np.isin(y, (0, 1)).all():
        raise InvalidInput("labels", "must be 0/1 or boolean")
    y = y.astype(np.bool_)
    if y.shape != s.shape:
        raise InvalidInput("labels", f"has {y.size} entries, {field} has {s.size}")
    if not np.isfinite(s).all():
        raise InvalidInput(field, "must be finite")
    return s, y


def exact_auc(scores: npt.ArrayLike, y_true: npt.ArrayLike) -> float:
    """Exact AUC (Mann-Whitney, tied scores count one half); NaN with one class."""
    s, y = _pair(scores, y_true, "scores")
    n_acc = int(y.sum())
    n_rej = y.size - n_acc
    if n_acc == 0 or n_rej == 0:
        return float("nan")
    _, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    # Average 1-based rank of each group of tied scores.
    start = np.cumsum(counts) - counts
    rank = (start + (counts + 1) / 2.0)[inverse.reshape(-1)]
    u = float(rank[y].sum()) - n_acc * (n_acc + 1) / 2.0
    return u / (n_acc * n_rej)


def exact_log_loss(eta: npt.ArrayLike, y_true: npt.ArrayLike) -> float:
    """Mean negative log-likelihood from linear predictors; NaN with no drafts."""
    e, y = _pair(eta, y_true, "eta")
    return float(np.mean(bernoulli_nll(e, y))) if e.size else float("nan")


def exact_ece(probs: npt.ArrayLike, y_true: npt.ArrayLike, bins: int = ECE_BINS) -> float:
    """ECE over ``bins`` equal-width probability bins; NaN with no drafts."""
    p, y = _pair(probs, y_true, "probs")
    if p.size and (p.min() < 0.0 or p.max() > 1.0):
        raise InvalidInput("probs", "must lie in [0, 1]")
    if bins < 1:
        raise InvalidInput("bins", f"must be >= 1, got {bins}")
    if p.size == 0:
        return float("nan")
    b = np.minimum((p * bins).astype(np.intp), bins - 1)
    gap = np.bincount(b, weights=p, minlength=bins) - np.bincount(b, weights=y, minlength=bins)
    return float(np.abs(gap).sum()) / p.size
