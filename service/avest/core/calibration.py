"""A calibration layer over the linear predictor: a monotone map learned online.

The linear-logistic map ``p = sigmoid(eta)`` bends away from what is observed
(and saturates for features piled at vLLM's +40 clamp). :class:`Recalibrator`
learns a monotone map ``eta -> eta'`` from decayed, mergeable histograms of
the drafts' linear predictors (accepted and total per bin), predict-then-
learn, and serves it only while its recent predictive log loss beats the
plain logistic's. It changes the served confidences, never the IRLS round
statistics (those stay on the logistic prediction).

The map is a fixed-size table (:data:`SLOTS` knots, the bin centres plus one
below and one above the grid; the sizes are the wire contract's, in
:mod:`avest_wire.bins`, so the shim's table has the same shape) applied by
piecewise-linear interpolation in ``eta``, flat beyond the end knots, so a
GPU kernel can apply it with fixed shapes. Each refit, every bin's rate is
shrunk toward the logistic rate at its centre (:attr:`LayerConfig.pseudo_count`
drafts' worth), made monotone by weighted pool-adjacent-violators, and stored
as log-odds.

When the update rule reports that the workload moved (the tracking rule's
innovation test keeps less than :attr:`LayerConfig.shift_weight` of its carried
information), the histograms and the serving test are discounted by the
same weight: a map learned on the old workload stops being served until it
wins again on the new one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from avest.core.numeric import bernoulli_nll, sigmoid
from avest_wire.bins import CALIBRATION_BINS, CALIBRATION_ETA_MAX, CALIBRATION_SLOTS

FloatArray = npt.NDArray[np.float64]

#: The table's sizes, as the wire contract fixes them.
BINS: int = CALIBRATION_BINS
ETA_MAX: float = CALIBRATION_ETA_MAX
SLOTS: int = CALIBRATION_SLOTS


@dataclass(frozen=True)
class LayerConfig:
    """Every tuned value of the calibration layer (``0`` turns a test off)."""

    #: Drafts' worth of shrinkage toward the logistic rate in every bin: a bin
    #: with a few drafts keeps the logistic's rate; more needs more evidence.
    pseudo_count: float = 20.0
    #: Histogram and serving-test weight kept per refit (about a five-round
    #: memory): follows drift within a few rounds; higher is steadier.
    decay: float = 0.8
    #: The map's decayed loss must beat the logistic's by this many standard
    #: errors of the summed per-draft differences (a one-sided sequential
    #: test): a map that wins on noise, or has only just caught up, is not served.
    serve_z: float = 2.5
    #: Log-odds of served confidences are kept within this range (a
    #: probability within 6e-6 of 0 or 1).
    max_logit: float = 12.0
    #: A refit keeping less than this share of the rule's carried information
    #: means the workload moved: the layer's evidence is discounted by that
    #: share. (The tracking rule's innovation test keeps 0.1-1 of it while it
    #: converges or on a stationary workload the logistic does not fit
    #: exactly, and 0-0.01 at a switch of drafter or prompts.)
    shift_weight: float = 0.05

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay <= 1.0:
            raise ValueError("decay must lie in [0, 1]")
        if not self.pseudo_count > 0.0:
            raise ValueError("pseudo_count must be > 0")


#: The layer as served.
DEFAULT_LAYER = LayerConfig()

_WIDTH = 2.0 * ETA_MAX / BINS
KNOTS = np.concatenate(
    ([-ETA_MAX - _WIDTH / 2], -ETA_MAX + _WIDTH * (np.arange(BINS) + 0.5), [ETA_MAX + _WIDTH / 2])
)


def slot(eta: npt.ArrayLike) -> npt.NDArray[np.intp]:
    """Histogram slot of each ``eta``: 0 below the grid, 1..BINS inside, BINS+1 above."""
    v = np.floor((np.asarray(eta, dtype=np.float64) + ETA_MAX) / _WIDTH) + 1.0
    return np.clip(v, 0, SLOTS - 1).astype(np.intp)


def pool_adjacent_violators(values: FloatArray, weights: FloatArray) -> FloatArray:
    """Weighted non-decreasing least-squares fit of ``values``."""
    blocks: list[list[float]] = []  # [mean, weight, length]
    for v, w in zip(values.tolist(), weights.tolist(), strict=True):
        blocks.append([v, w, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            tot = w1 + w2
            blocks.append([(m1 * w1 + m2 * w2) / tot if tot > 0 else m2, tot, n1 + n2])
    return np.concatenate([np.full(int(n), m) for m, _, n in blocks])


def layer_map(eta: npt.ArrayLike, table: FloatArray) -> FloatArray:
    """A layer's map of ``eta``: ``table`` holds the mapped log-odds at :data:`KNOTS`,
    linear between them, flat beyond the end knots."""
    e = np.asarray(eta, dtype=np.float64)
    return np.asarray(np.interp(e, KNOTS, table), dtype=np.float64)


_ARRAYS = ("accepted", "total", "round_accepted", "round_total", "table", "loss", "spread")


class Recalibrator:
    """Monotone recalibration of one pair's linear predictor."""

    def __init__(self, config: LayerConfig = DEFAULT_LAYER) -> None:
        self.config = config
        self.accepted = np.zeros(SLOTS)
        self.total = np.zeros(SLOTS)
        self.round_accepted = np.zeros(SLOTS)
        self.round_total = np.zeros(SLOTS)
        self.table = KNOTS.copy()  # identity map until learned
        # Decayed predictive log loss of the map and of the plain logistic.
        self.loss = np.zeros(2)
        # Decayed sum of squared per-draft loss differences (logistic - map),
        # and decayed number of drafts scored.
        self.spread = np.zeros(2)

    @property
    def gain(self) -> float:
        """Recent predictive log loss saved by the map, nats (negative: it loses)."""
        return float(self.loss[1] - self.loss[0])

    @property
    def recent_logloss(self) -> tuple[float, float]:
        """Recent mean predictive log loss ``(map, logistic)`` per draft (NaN: none yet)."""
        n = float(self.spread[1])
        if n <= 0.0:
            return float("nan"), float("nan")
        return float(self.loss[0] / n), float(self.loss[1] / n)

    @property
    def active(self) -> bool:
        """Serve the map only while its recent predictive log loss is lower by a margin.

        The margin, :attr:`LayerConfig.serve_z` standard errors of the summed
        per-draft differences (a one-sided sequential test on the decayed
        sums), keeps a map that has only just caught up, or wins on noise,
        from being served.
        """
        return bool(self.gain > self.config.serve_z * float(np.sqrt(self.spread[0])))

    def mapped(self, eta: npt.ArrayLike) -> FloatArray:
        """The learned map applied to ``eta`` (whether or not it is served)."""
        return layer_map(eta, self.table)

    def apply(self, eta: npt.ArrayLike) -> FloatArray:
        """The served linear predictor: mapped while active, else unchanged."""
        e = np.asarray(eta, dtype=np.float64)
        return self.mapped(e) if self.active else e

    def observe(self, eta: npt.ArrayLike, observed: npt.ArrayLike, accepted: npt.ArrayLike) -> None:
        """Score the drafts with the map in force, then add them to the open round."""
        e = np.asarray(eta, dtype=np.float64)
        obs = np.asarray(observed, dtype=bool)
        y = np.asarray(accepted, dtype=bool) & obs
        if not obs.any():
            return
        mapped_loss = bernoulli_nll(self.mapped(e[obs]), y[obs])
        plain_loss = bernoulli_nll(e[obs], y[obs])
        self.loss[0] += float(np.sum(mapped_loss))
        self.loss[1] += float(np.sum(plain_loss))
        self.spread[0] += float(np.sum((plain_loss - mapped_loss) ** 2))
        self.spread[1] += float(plain_loss.size)
        s = slot(e[obs])
        self.round_total += np.bincount(s, minlength=SLOTS)
        self.round_accepted += np.bincount(s, weights=y[obs].astype(np.float64), minlength=SLOTS)

    def refit(self, carried: float = 1.0) -> None:
        """Close the round: decay, merge, and fit the table again.

        ``carried`` is the share of its information the update rule kept at
        this refit; below :attr:`LayerConfig.shift_weight` the workload moved, and the
        old histograms and serving evidence are discounted by it.
        """
        cfg = self.config
        if 0.0 <= carried < cfg.shift_weight:
            self.discount(carried)
        self.accepted = cfg.decay * self.accepted + self.round_accepted
        self.total = cfg.decay * self.total + self.round_total
        self.loss *= cfg.decay
        self.spread *= cfg.decay
        self.round_accepted = np.zeros(SLOTS)
        self.round_total = np.zeros(SLOTS)
        prior = sigmoid(KNOTS)
        rate = (self.accepted + cfg.pseudo_count * prior) / (self.total + cfg.pseudo_count)
        weights = self.total + cfg.pseudo_count
        rate = pool_adjacent_violators(rate, weights)
        rate = np.clip(rate, sigmoid(-cfg.max_logit), sigmoid(cfg.max_logit))
        logits = np.log(rate) - np.log1p(-rate)
        self.table = np.clip(logits, -cfg.max_logit, cfg.max_logit)

    def discount(self, weight: float) -> None:
        """Keep only ``weight`` of the evidence so far (histograms, serving test)."""
        w = min(max(float(weight), 0.0), 1.0)
        self.accepted *= w
        self.total *= w
        self.loss *= w
        self.spread *= w

    def export(self) -> tuple[FloatArray, FloatArray]:
        """``(knots, logits)`` of the served map, each ``[SLOTS]``: identity when inactive."""
        return KNOTS.copy(), (self.table.copy() if self.active else KNOTS.copy())

    def to_arrays(self) -> dict[str, FloatArray]:
        return {
            "accepted": self.accepted.copy(),
            "total": self.total.copy(),
            "round_accepted": self.round_accepted.copy(),
            "round_total": self.round_total.copy(),
            "table": self.table.copy(),
            "loss": self.loss.copy(),
            "spread": self.spread.copy(),
        }

    def load_arrays(self, arrays: dict[str, FloatArray]) -> None:
        for name, value in arrays.items():
            if name in _ARRAYS:
                setattr(self, name, np.asarray(value, dtype=np.float64).copy())
