"""Summary mode, client side: a worker's round as sums, and their wire form.

A :class:`RoundSummaryData` is what a forwarder queues with
:meth:`~avest_client.forwarder.Forwarder.submit_summary`: the IRLS sums of one
round (``info`` [K, 3], ``grad`` [K, 2], ``counts`` [K], as vLLM's estimator
keeps them), the coefficients (and their version) the round's predictions
were made with, the steps and labelled drafts it covers, and optionally a
calibration sketch in the service's bins. It takes the next sequence number
like a step, so summaries and raw steps share one ledger: acknowledgements,
resends after a reconnect and drops work the same.

:class:`RoundAccumulator` builds summaries on the host from raw steps
(numpy, float64): the reference for the shim's on-device accumulator and the
way ``avest replay --summary`` sends a trace in summary mode.

The bins mirror the service's (``avest.core.metrics``): the linear predictor
``eta`` in 1024 equal bins on [-12, 12) plus an underflow and an overflow slot
(1026 slots) by label; 15 equal-width probability bins.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from avest_wire.v1 import estimator_pb2 as pb

AUC_BINS = 1024
ETA_RANGE = 12.0
AUC_SLOTS = AUC_BINS + 2
ECE_BINS = 15
_SCALE = AUC_BINS / (2.0 * ETA_RANGE)
_OFFSET = ETA_RANGE * _SCALE + 1.0

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Sketch:
    """A round's calibration sums: the eta histogram (sparse) and the ECE/log-loss sums."""

    cells: npt.NDArray[np.int64]  # ascending flat (position * 2 + label) * 1026 + slot
    cell_counts: npt.NDArray[np.int64]
    ece_rejected: npt.NDArray[np.int64]  # [K, 15]
    ece_accepted: npt.NDArray[np.int64]  # [K, 15]
    ece_sum_predicted: FloatArray  # [K, 15]
    logloss_sum: FloatArray  # [K]

    @classmethod
    def from_dense(
        cls,
        histogram: npt.ArrayLike,
        ece_rejected: npt.ArrayLike,
        ece_accepted: npt.ArrayLike,
        ece_sum_predicted: npt.ArrayLike,
        logloss_sum: npt.ArrayLike,
    ) -> Sketch:
        """From a dense histogram ``[K, 2, 1026]`` (or flat) and the ECE sums."""
        h = np.rint(np.asarray(histogram, dtype=np.float64).reshape(-1)).astype(np.int64)
        idx = np.flatnonzero(h)
        k = int(np.asarray(logloss_sum).reshape(-1).size)
        return cls(
            cells=idx.astype(np.int64),
            cell_counts=h[idx],
            ece_rejected=np.rint(np.asarray(ece_rejected, dtype=np.float64)).astype(np.int64).reshape(k, ECE_BINS),
            ece_accepted=np.rint(np.asarray(ece_accepted, dtype=np.float64)).astype(np.int64).reshape(k, ECE_BINS),
            ece_sum_predicted=np.asarray(ece_sum_predicted, dtype=np.float64).reshape(k, ECE_BINS),
            logloss_sum=np.asarray(logloss_sum, dtype=np.float64).reshape(k),
        )  # fmt: skip

    def to_pb(self) -> pb.CalibrationSketch:
        deltas = np.diff(self.cells, prepend=0) if self.cells.size else self.cells
        return pb.CalibrationSketch(
            cell_deltas=deltas.tolist(),
            cell_counts=self.cell_counts.tolist(),
            ece_rejected=self.ece_rejected.reshape(-1).tolist(),
            ece_accepted=self.ece_accepted.reshape(-1).tolist(),
            ece_sum_predicted=self.ece_sum_predicted.reshape(-1).tolist(),
            logloss_sum=self.logloss_sum.tolist(),
        )


@dataclass(frozen=True)
class RoundSummaryData:
    """One round in summary form, ready to queue (see the module docstring)."""

    version: int
    slope: float
    intercepts: tuple[float, ...]
    info: FloatArray  # [K, 3]
    grad: FloatArray  # [K, 2]
    counts: FloatArray  # [K]
    steps: int
    sketch: Sketch | None = None

    @property
    def k(self) -> int:
        return len(self.intercepts)

    @property
    def drafts(self) -> int:
        return int(round(float(np.asarray(self.counts).sum())))

    def validate(self, k: int | None = None) -> None:
        """The checks the service makes that a sender can make; ValueError if bad."""
        kk = self.k
        if not 1 <= kk <= 64 or (k is not None and kk != k):
            raise ValueError(f"summary has K={kk}, expected {k if k is not None else '1..64'}")
        for name, arr, shape in (
            ("info", self.info, (kk, 3)),
            ("grad", self.grad, (kk, 2)),
            ("counts", self.counts, (kk,)),
        ):
            a = np.asarray(arr)
            if a.shape != shape or not np.all(np.isfinite(a)):
                raise ValueError(f"{name} must be finite with shape {list(shape)}")
        if not (np.isfinite(self.slope) and self.slope >= 0.0):
            raise ValueError("slope must be finite and >= 0")
        if self.steps < 1:
            raise ValueError("a summary covers at least one step")

    def to_pb(self) -> pb.RoundSummary:
        return pb.RoundSummary(
            coefficients_version=int(self.version),
            slope=float(self.slope),
            intercepts=list(self.intercepts),
            k=self.k,
            info=np.asarray(self.info, dtype=np.float64).reshape(-1).tolist(),
            grad=np.asarray(self.grad, dtype=np.float64).reshape(-1).tolist(),
            counts=np.asarray(self.counts, dtype=np.float64).reshape(-1).tolist(),
            steps=int(self.steps),
            drafts=self.drafts,
            sketch=self.sketch.to_pb() if self.sketch is not None else None,
        )


def eta_slot(eta: npt.ArrayLike) -> npt.NDArray[np.intp]:
    """The service's AUC slot of each ``eta``."""
    v = np.clip(np.asarray(eta, dtype=np.float64) * _SCALE + _OFFSET, 0.0, AUC_SLOTS - 1)
    return v.astype(np.intp)


class RoundAccumulator:
    """A worker's open round on the host: fold raw steps, take a summary (numpy, float64)."""

    def __init__(self, k: int, sketch: bool = True) -> None:
        self.k = k
        self.sketch = sketch
        self.clear()

    def clear(self) -> None:
        k = self.k
        self.info = np.zeros((k, 3))
        self.grad = np.zeros((k, 2))
        self.counts = np.zeros(k)
        self.hist = np.zeros(k * 2 * AUC_SLOTS)
        self.ece = np.zeros((k, ECE_BINS, 2))
        self.psum = np.zeros((k, ECE_BINS))
        self.nll = np.zeros(k)
        self.steps = 0

    def add(
        self,
        features: npt.ArrayLike,
        num_verified: npt.ArrayLike,
        num_accepted: npt.ArrayLike,
        slope: float,
        intercepts: npt.ArrayLike,
        exclude: npt.ArrayLike | None = None,
    ) -> None:
        """Fold one step scored at ``(slope, intercepts)``."""
        x = np.asarray(features, dtype=np.float64)
        k = self.k
        pos = np.arange(k)[None, :]
        a = np.asarray(num_accepted, dtype=np.int64)[:, None]
        d = np.asarray(num_verified, dtype=np.int64)[:, None]
        obs = (pos <= a) & (pos < d)
        if exclude is not None:
            obs &= ~np.asarray(exclude, dtype=bool)[:, None]
        y = (pos < a) & obs
        eta = slope * x + np.asarray(intercepts, dtype=np.float64)[None, :]
        t = np.exp(-np.abs(eta))
        p = np.where(eta >= 0.0, 1.0, t) / (1.0 + t)
        m = obs.astype(np.float64)
        w = p * (1.0 - p) * m
        r = (y - p) * m
        xo = np.where(obs, x, 0.0)
        self.info[:, 0] += (w * xo * xo).sum(0)
        self.info[:, 1] += (w * xo).sum(0)
        self.info[:, 2] += w.sum(0)
        self.grad[:, 0] += (r * xo).sum(0)
        self.grad[:, 1] += r.sum(0)
        self.counts += m.sum(0)
        self.steps += 1
        if not self.sketch or not obs.any():
            return
        rows, cols = np.nonzero(obs)
        e, yy, pp = eta[rows, cols], y[rows, cols].astype(np.intp), p[rows, cols]
        np.add.at(self.hist, (cols * 2 + yy) * AUC_SLOTS + eta_slot(e), 1.0)
        b = np.minimum((pp * ECE_BINS).astype(np.intp), ECE_BINS - 1)
        np.add.at(self.ece, (cols, b, yy), 1.0)
        np.add.at(self.psum, (cols, b), pp)
        nll = np.log1p(np.exp(-np.abs(e))) + np.maximum(np.where(yy == 1, -e, e), 0.0)
        np.add.at(self.nll, cols, nll)

    def take(
        self, version: int, slope: float, intercepts: npt.ArrayLike
    ) -> RoundSummaryData | None:
        """The open round as a summary (None if it has no step), then a fresh round."""
        if self.steps == 0:
            return None
        sketch = (
            Sketch.from_dense(self.hist, self.ece[:, :, 0], self.ece[:, :, 1], self.psum, self.nll)
            if self.sketch
            else None
        )
        out = RoundSummaryData(
            version=int(version),
            slope=float(slope),
            intercepts=tuple(float(v) for v in np.asarray(intercepts).reshape(-1)),
            info=self.info.copy(),
            grad=self.grad.copy(),
            counts=self.counts.copy(),
            steps=self.steps,
            sketch=sketch,
        )
        self.clear()
        return out
