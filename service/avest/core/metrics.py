"""Calibration measures as mergeable sums: AUC, log loss, ECE, mean acceptance.

Every measure is kept per draft position as float64 sums and histograms, so
states from different workers, rounds or trace shards merge by addition and
forget by scaling (weights become fractional; every measure stays a weighted
one). Nothing here keeps individual drafts.

- AUC: counts of accepted and rejected drafts in 1024 equal bins of the linear
  predictor ``eta`` on [-12, 12] plus underflow and overflow bins; drafts in
  one bin tie (one half). Binning ``eta``, not ``p``, keeps resolution where
  many predictions sit near 1. The gap to the exact AUC is at most half the
  fraction of (accepted, rejected) pairs sharing a bin; in practice ~1e-5 at
  1e5+ drafts, ~1e-4 at a few thousand (it shrinks like 1/n).
- Log loss: a running sum of ``softplus(eta) - y * eta``, stable for any eta.
- ECE: exact from 15 equal-width probability bins holding the counts of
  accepted and rejected drafts and the sum of predictions, which also give
  the mean predicted and observed acceptance.

:mod:`avest.core.exact` computes the same measures from individual drafts (references).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

import numpy as np
import numpy.typing as npt

from avest.core.histogram import EtaHistogram
from avest.core.labels import check_counts, labels
from avest.core.model import check_k
from avest_wire.bins import AUC_BINS, AUC_SLOTS, ECE_BINS, ETA_RANGE, eta_slot, probability_bin
from avest_wire.errors import InvalidInput
from avest_wire.limits import MAX_K

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.intp]
BoolArray = npt.NDArray[np.bool_]

#: Persisted with the arrays so a state saved under another binning is refused.
_LAYOUT = np.array([AUC_BINS, -ETA_RANGE, ETA_RANGE, ECE_BINS], dtype=np.float64)


def _array_shapes(k: int, auc_width: int) -> dict[str, tuple[int, ...]]:
    """Persisted arrays and their shapes for ``k`` positions."""
    auc, ece = (k, auc_width), (k, ECE_BINS)
    return {
        **dict.fromkeys(("auc_rejected", "auc_accepted"), auc),
        **dict.fromkeys(("ece_rejected", "ece_accepted", "ece_sum_predicted"), ece),
        "logloss_sum": (k,),
    }


@dataclass(frozen=True)
class PositionSummary:
    """The measures over one set of drafts; NaN where undefined.

    ``count`` is a float because forgetting makes it a weighted count. AUC is
    NaN unless both classes are present; everything else is NaN at count 0.
    """

    auc: float
    logloss: float
    ece: float
    mean_predicted: float
    observed: float
    count: float

    def measures(self) -> dict[str, float]:
        """Every measure but ``count``, by name: the wire's and the admin API's messages
        use the same names, and each gives ``count`` its own type."""
        return {f.name: float(getattr(self, f.name)) for f in _MEASURES}


#: The fields of :meth:`PositionSummary.measures`.
_MEASURES = tuple(f for f in fields(PositionSummary) if f.name != "count")


@dataclass(frozen=True)
class CalibrationSummary(PositionSummary):
    """Measures over all positions pooled, and per position in ``by_position``."""

    by_position: tuple[PositionSummary, ...] = ()


@dataclass(frozen=True)
class Reliability:
    """Reliability-diagram data: per probability bin, count, mean predicted, observed.

    ``edges`` has ``ECE_BINS + 1`` entries; ``mean_predicted`` and ``observed``
    are NaN for empty bins.
    """

    edges: FloatArray
    count: FloatArray
    mean_predicted: FloatArray
    observed: FloatArray


class CalibrationState:
    """Mergeable calibration sums for ``k`` draft positions.

    Build with :meth:`empty`, fold batches in with :meth:`update` (in place),
    combine with ``+`` or :meth:`merge`, forget with :meth:`scale`, read with
    :meth:`summary` and :meth:`reliability`, persist with :meth:`to_arrays`
    and :meth:`from_arrays`.
    """

    __slots__ = ("_auc", "_ece", "_psum", "_nll")

    def __init__(
        self, auc: EtaHistogram, ece: FloatArray, psum: FloatArray, nll: FloatArray
    ) -> None:
        # Use empty()/from_arrays(). auc (a window of [K, 2, AUC_SLOTS], float32)
        # and ece [K, ECE_BINS, 2] count (rejected, accepted) drafts; psum
        # [K, ECE_BINS] sums p; nll [K].
        self._auc, self._ece, self._psum, self._nll = auc, ece, psum, nll

    @classmethod
    def empty(cls, k: int) -> CalibrationState:
        check_k(k)
        return cls(
            EtaHistogram.empty(k),
            np.zeros((k, ECE_BINS, 2)),
            np.zeros((k, ECE_BINS)),
            np.zeros(k),
        )

    @classmethod
    def of(
        cls, eta: npt.ArrayLike, observed: npt.ArrayLike, accepted: npt.ArrayLike
    ) -> CalibrationState:
        """A state holding one batch ``[R, K]``."""
        e = np.asarray(eta, dtype=np.float64)
        if e.ndim != 2:
            raise InvalidInput("eta", f"must have shape [R, K], got {list(e.shape)}")
        check_k(e.shape[1], "eta")
        state = cls.empty(e.shape[1])
        state.update(e, observed, accepted)
        return state

    @property
    def k(self) -> int:
        return int(self._nll.shape[0])

    @property
    def count(self) -> float:
        """Total (weighted) number of labelled drafts folded in."""
        return float(self._ece.sum())

    def _parts(self) -> tuple[FloatArray, FloatArray, FloatArray]:
        return (self._ece, self._psum, self._nll)

    @property
    def nbytes(self) -> int:
        """Bytes held by the sums."""
        return self._auc.nbytes + sum(a.nbytes for a in self._parts())

    def histogram(self) -> EtaHistogram:
        """A copy of the linear-predictor histogram of the drafts counted, per
        position and label (what a draft-length schedule reads the features from)."""
        return self._auc.copy()

    def copy(self) -> CalibrationState:
        return CalibrationState(self._auc.copy(), *(a.copy() for a in self._parts()))

    def update(self, eta: npt.ArrayLike, observed: npt.ArrayLike, accepted: npt.ArrayLike) -> None:
        """Fold in one batch: linear predictors and label masks, all ``[R, K]``.

        Only drafts with ``observed`` count; ``accepted`` is their label.
        Validates everything before touching the state. Vectorised: one pass
        of elementwise ops over the observed drafts and four ``np.add.at``.
        """
        e_all = self._check_eta(eta)
        obs = _mask(observed, "observed", e_all.shape)
        acc = _mask(accepted, "accepted", e_all.shape)
        idx = np.flatnonzero(obs)
        e = e_all.reshape(-1)[idx]
        if not np.isfinite(e).all():
            raise InvalidInput("eta", "observed drafts need finite linear predictors")
        y = acc.reshape(-1)[idx]
        pos = idx % self.k
        # exp(-|eta|) never overflows; it gives both p and the log loss
        # softplus(eta) - y*eta = log1p(exp(-|eta|)) + max(+-eta, 0).
        t = np.exp(-np.abs(e))
        p = np.where(e >= 0.0, 1.0, t) / (1.0 + t)
        nll = np.log1p(t) + np.maximum(np.where(y, -e, e), 0.0)
        cell = pos * 2 + y  # (position, class) pairs
        self._auc.add(cell, eta_slot(e))
        pb = pos * ECE_BINS + probability_bin(p)
        np.add.at(self._ece.reshape(-1), pb * 2 + y, 1.0)
        np.add.at(self._psum.reshape(-1), pb, p)
        np.add.at(self._nll, pos, nll)

    def update_counts(
        self, eta: npt.ArrayLike, num_verified: npt.ArrayLike, num_accepted: npt.ArrayLike
    ) -> None:
        """Fold in one batch given per-request verification counts ``[R]``."""
        e = self._check_eta(eta)
        d, a = check_counts(num_verified, num_accepted, e.shape[0], self.k)
        obs, acc = labels(d, a, self.k)
        self.update(e, obs, acc)

    def merge(self, other: CalibrationState) -> None:
        """Add ``other``'s sums into this state (in place)."""
        self._check_same_k(other)
        self._auc.merge(other._auc)
        for mine, theirs in zip(self._parts(), other._parts(), strict=True):
            mine += theirs

    def __add__(self, other: CalibrationState) -> CalibrationState:
        if not isinstance(other, CalibrationState):
            return NotImplemented
        out = self.copy()
        out.merge(other)
        return out

    def __iadd__(self, other: CalibrationState) -> CalibrationState:
        self.merge(other)
        return self

    def scale(self, factor: float) -> None:
        """Multiply every sum by ``factor`` in [0, 1] (exponential forgetting, in place).

        Ratios (AUC, log loss, ECE, means) are unchanged by one scaling; it
        sets how much older drafts weigh against those folded in later.
        """
        f = float(factor)
        if not (np.isfinite(f) and 0.0 <= f <= 1.0):
            raise InvalidInput("factor", f"must lie in [0, 1], got {factor!r}")
        self._auc.scale(f)
        for a in self._parts():
            a *= f

    def summary(self) -> CalibrationSummary:
        """All measures, pooled over positions and per position (one vectorised pass)."""
        counts = self._auc.counts
        auc = np.concatenate((counts, counts.sum(axis=0, keepdims=True, dtype=np.float64)))
        ece = np.concatenate((self._ece, self._ece.sum(axis=0, keepdims=True)))
        psum = np.concatenate((self._psum, self._psum.sum(axis=0, keepdims=True)))
        nll = np.append(self._nll, self._nll.sum())
        *per, pooled = _summaries(auc, ece, psum, nll)
        return CalibrationSummary(**asdict(pooled), by_position=tuple(per))

    def reliability(self, position: int | None = None) -> Reliability:
        """Per ECE bin: count, mean predicted and observed rate (pooled or one position)."""
        if position is None:
            ece, psum = self._ece.sum(axis=0), self._psum.sum(axis=0)
        else:
            if not 0 <= position < self.k:
                raise InvalidInput("position", f"must lie in [0, {self.k}), got {position}")
            ece, psum = self._ece[position], self._psum[position]
        count = ece.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean_p = np.where(count > 0, psum / count, np.nan)
            obs = np.where(count > 0, ece[:, 1] / count, np.nan)
        edges = np.linspace(0.0, 1.0, ECE_BINS + 1)
        return Reliability(edges=edges, count=count, mean_predicted=mean_p, observed=obs)

    def to_arrays(self) -> dict[str, FloatArray]:
        """Copies of the sums, by name, for persistence; ``from_arrays`` inverts it exactly."""
        return {
            "layout": _LAYOUT.copy(),
            # slots [auc_first_slot, + width) of the AUC histograms, float32
            "auc_first_slot": np.array([float(self._auc.first)]),
            "auc_rejected": self._auc.counts[:, 0].copy(),
            "auc_accepted": self._auc.counts[:, 1].copy(),
            "ece_rejected": self._ece[:, :, 0].copy(),
            "ece_accepted": self._ece[:, :, 1].copy(),
            "ece_sum_predicted": self._psum.copy(),
            "logloss_sum": self._nll.copy(),
        }

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, npt.ArrayLike]) -> CalibrationState:
        """Rebuild a state from :meth:`to_arrays`' output, validating it."""
        if "layout" not in arrays:
            raise InvalidInput("layout", "missing")
        layout = np.asarray(arrays["layout"], dtype=np.float64)
        if layout.shape != _LAYOUT.shape or not np.array_equal(layout, _LAYOUT):
            raise InvalidInput("layout", f"expected {_LAYOUT.tolist()}, got {layout.tolist()}")
        nll_shape = np.shape(arrays["logloss_sum"]) if "logloss_sum" in arrays else ()
        k = nll_shape[0] if len(nll_shape) == 1 else 0
        if not 1 <= k <= MAX_K:
            raise InvalidInput("logloss_sum", f"needs shape [K], 1 <= K <= {MAX_K}")
        # A window of the AUC slots (float32), or all of them (snapshots before windows).
        first = 0
        if "auc_first_slot" in arrays:
            raw = np.asarray(arrays["auc_first_slot"], dtype=np.float64).reshape(-1)
            if raw.shape != (1,) or not (0 <= raw[0] <= AUC_SLOTS and raw[0] == int(raw[0])):
                raise InvalidInput("auc_first_slot", f"must be one slot in [0, {AUC_SLOTS}]")
            first = int(raw[0])
        auc_shape = np.shape(arrays["auc_rejected"]) if "auc_rejected" in arrays else ()
        width = auc_shape[1] if len(auc_shape) == 2 and "auc_first_slot" in arrays else AUC_SLOTS
        if first + width > AUC_SLOTS:
            raise InvalidInput("auc_rejected", f"window [{first}, +{width}) exceeds {AUC_SLOTS}")
        got: dict[str, FloatArray] = {}
        for key, shape in _array_shapes(k, width).items():
            if key not in arrays:
                raise InvalidInput(key, "missing")
            a = np.array(arrays[key], dtype=np.float64)
            if a.shape != shape:
                raise InvalidInput(key, f"must have shape {list(shape)} (K from logloss_sum)")
            if not np.all(np.isfinite(a)) or (a < 0).any():
                raise InvalidInput(key, "must be finite and non-negative")
            got[key] = a
        auc = EtaHistogram(np.stack([got["auc_rejected"], got["auc_accepted"]], axis=1), first)
        ece = np.stack([got["ece_rejected"], got["ece_accepted"]], axis=2)
        # float32 counts: sums agree to float32's precision
        if not np.allclose(auc.totals(), ece.sum(axis=(1, 2)), rtol=1e-5, atol=1e-6):
            raise InvalidInput("auc_accepted", "AUC and ECE histograms disagree on the draft count")
        return cls(auc.trimmed(), ece, got["ece_sum_predicted"], got["logloss_sum"])

    def _check_eta(self, eta: npt.ArrayLike) -> FloatArray:
        e = np.asarray(eta, dtype=np.float64)
        if e.ndim != 2 or e.shape[1] != self.k:
            raise InvalidInput("eta", f"must have shape [R, {self.k}], got {list(e.shape)}")
        return e

    def _check_same_k(self, other: CalibrationState) -> None:
        if not isinstance(other, CalibrationState):
            raise InvalidInput("other", f"must be a CalibrationState, got {type(other).__name__}")
        if other.k != self.k:
            raise InvalidInput("other", f"has K={other.k}, this state has K={self.k}")


def _mask(value: npt.ArrayLike, field: str, shape: tuple[int, ...]) -> BoolArray:
    m = np.asarray(value)
    if m.dtype != np.bool_:
        raise InvalidInput(field, f"must be a boolean array, got dtype {m.dtype}")
    if m.shape != shape:
        raise InvalidInput(field, f"must have shape {list(shape)} like eta, got {list(m.shape)}")
    return m


def auc_from_histograms(rejected: FloatArray, accepted: FloatArray) -> float:
    """AUC from per-bin counts in ascending score order; a bin's drafts tie (one half)."""
    cum = np.cumsum(accepted)
    n_acc = float(cum[-1]) if cum.size else 0.0
    n_rej = float(rejected.sum())
    if n_acc <= 0.0 or n_rej <= 0.0:
        return float("nan")
    above = n_acc - cum
    return float(np.dot(rejected, above + 0.5 * accepted) / (n_acc * n_rej))


def _summaries(
    auc: FloatArray, ece: FloatArray, psum: FloatArray, nll: FloatArray
) -> list[PositionSummary]:
    """Measures of each row: ``auc`` [R, 2, AUC_SLOTS], ``ece`` [R, ECE_BINS, 2],
    ``psum`` [R, ECE_BINS], ``nll`` [R]."""
    count = ece.sum(axis=(1, 2))
    n_acc = ece[:, :, 1].sum(axis=1)
    rejected, accepted = auc[:, 0].astype(np.float64), auc[:, 1].astype(np.float64)
    cum = np.cumsum(accepted, axis=1)
    hist_acc = cum[:, -1] if cum.shape[1] else np.zeros(len(cum))
    hist_rej = rejected.sum(axis=1)
    # AUC from per-bin counts in ascending score order; a bin's drafts tie (one half).
    ties = np.einsum("rs,rs->r", rejected, hist_acc[:, None] - cum + 0.5 * accepted)
    with np.errstate(invalid="ignore", divide="ignore"):
        auc_v = np.where((hist_acc > 0) & (hist_rej > 0), ties / (hist_acc * hist_rej), np.nan)
        # sum_b (n_b / n) |psum_b / n_b - acc_b / n_b| = sum_b |psum_b - acc_b| / n
        gap = np.abs(psum - ece[:, :, 1]).sum(axis=1)
        measures = np.stack(
            (auc_v, nll / count, gap / count, psum.sum(axis=1) / count, n_acc / count, count),
            axis=1,
        )
    measures[count <= 0.0, :5] = np.nan
    measures[count <= 0.0, 5] = 0.0
    return [PositionSummary(*row) for row in measures.tolist()]
