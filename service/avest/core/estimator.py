"""The online estimator: predict, fold verified drafts into a round, refit.

One :class:`OnlineEstimator` is the whole learning state of one model pair:
the coefficients in force, the open round's statistics, the update rule's
carried information and the calibration measured so far. The service keeps
one per pair and feeds it the batches every worker streams; the offline
evaluation replays a trace through the same object, so both produce the same
coefficients from the same steps.

Each batch is validated completely before anything changes: a refused batch
leaves the estimator exactly as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from avest.core.calibration import Recalibrator, layer_map
from avest.core.features import check_features
from avest.core.labels import check_counts, check_exclude, labels
from avest.core.metrics import CalibrationState
from avest.core.model import Coefficients, check_k, linear_predictor
from avest.core.pooling import PendingSketches
from avest.core.rules import REJECTED, Refit, UpdateRule, VllmRule
from avest.core.schedule import FeatureHistogram
from avest.core.stats import RoundStats, fold
from avest.core.summary import rebase, summary_coefficients, summary_stats
from avest.core.tracking import round_steps
from avest_wire.summary import RoundSummary

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

#: vLLM refits every this many decode steps.
DEFAULT_REFIT_INTERVAL = 100
#: Weight the recent calibration keeps per round: about a 20-round window,
#: so drift shows within a few thousand pooled steps.
DEFAULT_RECENT_DECAY = 0.95


@dataclass(frozen=True)
class Batch:
    """One decode step's validated drafts and verdicts."""

    features: FloatArray  # [R, K]
    observed: BoolArray  # [R, K]
    accepted: BoolArray  # [R, K]

    @property
    def labelled(self) -> int:
        return int(np.count_nonzero(self.observed))

    def reached(self) -> BoolArray:
        """``[R, K]``: the drafts that reached their position (every earlier draft
        verified and accepted), verified or not. A raw step names a request with
        nothing verified (``num_verified = 0``) alike whether adaptive verification
        trimmed all its drafts or it drafted none: such rows are left out."""
        drafted = self.observed[:, :1]
        before = np.cumprod(self.accepted[:, :-1], axis=1, dtype=bool)
        return np.asarray(np.concatenate([drafted, drafted & before], axis=1), dtype=bool)


def make_batch(
    features: npt.ArrayLike,
    num_verified: npt.ArrayLike,
    num_accepted: npt.ArrayLike,
    k: int,
    exclude: npt.ArrayLike | None = None,
) -> Batch:
    """Validate one step (features ``[R, K]``, counts ``[R]``) into a :class:`Batch`."""
    x = check_features(features, k)
    d, a = check_counts(num_verified, num_accepted, x.shape[0], k)
    observed, accepted = labels(d, a, k, check_exclude(exclude, x.shape[0]))
    return Batch(x, observed, accepted)


@dataclass(frozen=True)
class ServedModel:
    """What an estimator serves at one moment, frozen, so that any thread may score
    with it: the coefficients in force, the calibration layer's table while the layer
    is served (a copy; ``None`` while it is not) and the version they belong to."""

    k: int
    version: int
    coefficients: Coefficients
    layer: FloatArray | None

    @property
    def layer_served(self) -> bool:
        return self.layer is not None

    def eta(self, features: npt.ArrayLike) -> FloatArray:
        """The served linear predictor of each draft ``[R, K]`` (features checked)."""
        eta = linear_predictor(self.coefficients, check_features(features, self.k))
        return eta if self.layer is None else layer_map(eta, self.layer)

    def predict(self, features: npt.ArrayLike) -> FloatArray:
        """Served acceptance probabilities ``[R, K]``."""
        from avest.core.numeric import sigmoid

        return sigmoid(self.eta(features))


class OnlineEstimator:
    """Coefficients, the open round, the update rule and calibration of one pair."""

    def __init__(
        self,
        k: int,
        rule: UpdateRule | None = None,
        refit_interval: int = DEFAULT_REFIT_INTERVAL,
        start: Coefficients | None = None,
        recent_decay: float = DEFAULT_RECENT_DECAY,
        calibrate: bool = False,
    ) -> None:
        check_k(k)
        #: The monotone calibration layer over the linear predictor, if enabled
        #: (read it as :attr:`recalibrator`, which folds pending sketches first).
        self._layer: Recalibrator | None = Recalibrator() if calibrate else None
        #: Round summaries' sketches not yet folded into the open round.
        self._pending = PendingSketches(k)
        if not 0.0 <= recent_decay <= 1.0:
            raise ValueError("recent_decay must lie in [0, 1]")
        self.recent_decay = recent_decay
        if refit_interval < 1:
            raise ValueError("refit_interval must be >= 1")
        self.k = k
        self.rule: UpdateRule = rule if rule is not None else VllmRule()
        self.refit_interval = refit_interval
        self.start = start if start is not None else Coefficients.cold_start(k)
        if self.start.k != k:
            raise ValueError(f"start coefficients have K={self.start.k}, expected {k}")
        self.version = 0
        self.reset(self.start)
        self.version = 0

    def reset(self, start: Coefficients | None = None) -> None:
        """Forget everything learned; start again from ``start`` (default: as built).

        The version still moves forward (it never decreases), so watchers see
        the reset as a new set of coefficients.
        """
        self.coefficients = start if start is not None else self.start
        self.rule.reset(self.coefficients)
        self.round_stats = RoundStats.zeros(self.k)
        # Calibration of the open round, folded at each refit into the
        # all-time state and the exponentially forgetting recent one.
        self._calibration_round = CalibrationState.empty(self.k)
        self._calibration_total = CalibrationState.empty(self.k)
        self._calibration_recent = CalibrationState.empty(self.k)
        # The features of the drafts that reached each position, verified or not
        # (the draft-length schedule's input), aged like the recent calibration.
        self._reached_round = FeatureHistogram.empty(self.k)
        self._reached_recent = FeatureHistogram.empty(self.k)
        self._pending.clear()
        if self._layer is not None:
            self._layer = Recalibrator(self._layer.config)
        self.version += 1
        self.round = 0
        self.steps = 0
        self.steps_in_round = 0
        self.drafts = 0
        self.last_outcome = ""

    # -- learning ---------------------------------------------------------

    def observe(
        self,
        features: npt.ArrayLike,
        num_verified: npt.ArrayLike,
        num_accepted: npt.ArrayLike,
        exclude: npt.ArrayLike | None = None,
    ) -> Refit | None:
        """Validate and fold one decode step; refit when the round is full."""
        return self.apply(make_batch(features, num_verified, num_accepted, self.k, exclude))

    def apply(
        self, batch: Batch, stats: RoundStats | None = None, refit: bool = True
    ) -> Refit | None:
        """Fold a validated batch scored at the coefficients in force.

        ``stats``: the batch's round statistics as the caller wants them folded
        (:meth:`contribution`, bounded by :mod:`avest.core.quarantine`); the
        calibration measures always score the batch itself. ``refit``: whether a
        round this batch fills may refit now (else it stays open, :attr:`round_full`,
        until the caller calls :meth:`refit`).
        """
        eta = linear_predictor(self.coefficients, batch.features)
        # The IRLS sums stay on the logistic prediction; the calibration
        # measures score what was served (the layer's map while it is served).
        if stats is None:
            stats = fold(batch.features, eta, batch.observed, batch.accepted)
        self.round_stats.add_(stats)
        layer = self.recalibrator
        served = eta if layer is None else layer.apply(eta)
        self._calibration_round.update(served, batch.observed, batch.accepted)
        self._reached_round.add(batch.features, batch.reached())
        if layer is not None:
            layer.observe(eta, batch.observed, batch.accepted)
        self.drafts += batch.labelled
        self.steps += 1
        self.steps_in_round += 1
        return self.refit() if refit and self.round_full else None

    def contribution(self, batch: Batch | RoundSummary) -> RoundStats:
        """The round statistics ``batch`` adds to the open round, at the coefficients in force."""
        if isinstance(batch, Batch):
            eta = linear_predictor(self.coefficients, batch.features)
            return fold(batch.features, eta, batch.observed, batch.accepted)
        if batch.k != self.k:
            raise ValueError(f"summary has K={batch.k}, estimator has K={self.k}")
        stats = summary_stats(batch)
        if batch.version != self.version:
            stats = rebase(stats, summary_coefficients(batch), self.coefficients)
        return stats

    def apply_summary(
        self, summary: RoundSummary, stats: RoundStats | None = None, refit: bool = True
    ) -> Refit | None:
        """Pool one worker's round summary into the open round; refit when it is full.

        Statistics at the current version merge as they are; older ones are
        first moved to the coefficients in force (:func:`avest.core.summary.rebase`).
        ``stats``: those statistics as the caller wants them folded (see :meth:`apply`).
        """
        if summary.k != self.k:
            raise ValueError(f"summary has K={summary.k}, estimator has K={self.k}")
        if stats is None:
            stats = self.contribution(summary)
        self.round_stats.add_(stats)
        if summary.reached is not None:
            self._reached_round.add_cells(summary.reached.cells, summary.reached.counts)
        if summary.sketch is not None:
            # Folded when something reads the round (avest.core.pooling).
            self._pending.add(summary.sketch)
            if self._pending.full:
                self.settle()
        self.drafts += summary.drafts
        self.steps += summary.steps
        self.steps_in_round += summary.steps
        return self.refit() if refit and self.round_full else None

    def settle(self) -> None:
        """Fold the pending summaries' sketches into the open round and the layer.

        Every reader of the round's calibration or of the layer calls it first,
        so what they see is as if each sketch had been folded on arrival.
        """
        if len(self._pending):
            self._pending.settle(self._calibration_round, self._layer)

    @property
    def recalibrator(self) -> Recalibrator | None:
        """The calibration layer (pending sketches folded into it first)."""
        self.settle()
        return self._layer

    @recalibrator.setter
    def recalibrator(self, layer: Recalibrator | None) -> None:
        self.settle()
        self._layer = layer

    @property
    def round_length(self) -> int:
        """Steps in the open round: ``refit_interval``, less while the rule warms up."""
        return round_steps(self.rule, self.round, self.refit_interval)

    @property
    def round_full(self) -> bool:
        """The open round holds its :attr:`round_length` steps (or more, when held open)."""
        return self.steps_in_round >= self.round_length

    def refit(self) -> Refit:
        """Close the round now: one update-rule step, then a fresh round."""
        self.settle()
        result = self.rule.refit(self.coefficients, self.round_stats)
        self.round += 1
        self.last_outcome = result.outcome
        if result.outcome != REJECTED:
            self.coefficients = result.coefficients
            self.version += 1
        self.round_stats = RoundStats.zeros(self.k)
        self.steps_in_round = 0
        if self._layer is not None:
            # A workload change the rule detected also ages the layer's evidence.
            self._layer.refit(self.rule.carried_weight)
        self._calibration_total.merge(self._calibration_round)
        self._calibration_recent.scale(self.recent_decay)
        self._calibration_recent.merge(self._calibration_round)
        self._calibration_round = CalibrationState.empty(self.k)
        self._reached_recent.scale(self.recent_decay)
        self._reached_recent.merge(self._reached_round)
        self._reached_round = FeatureHistogram.empty(self.k)
        return result

    @property
    def calibration(self) -> CalibrationState:
        """Calibration of every draft observed since the start (or last reset).

        Each draft is scored by the served prediction: the calibration
        layer's while it was served, the logistic's otherwise.
        """
        self.settle()
        return self._calibration_total + self._calibration_round

    @property
    def recent_calibration(self) -> CalibrationState:
        """Calibration with older rounds down-weighted by ``recent_decay`` per round."""
        self.settle()
        return self._calibration_recent + self._calibration_round

    @property
    def recent_reached(self) -> FeatureHistogram:
        """The features of the drafts that reached each position (verified or trimmed),
        older rounds down-weighted by ``recent_decay`` per round."""
        out = self._reached_recent.copy()
        out.merge(self._reached_round)
        return out

    # -- scoring ----------------------------------------------------------

    def predict(self, features: npt.ArrayLike) -> FloatArray:
        """Acceptance probability of each draft ``[R, K]`` at the coefficients in force."""
        from avest.core.numeric import sigmoid

        return sigmoid(linear_predictor(self.coefficients, check_features(features, self.k)))

    def served(self) -> ServedModel:
        """What is served now, frozen (the layer's table copied while it is served)."""
        layer = self.recalibrator
        table = layer.table.copy() if layer is not None and layer.active else None
        return ServedModel(self.k, self.version, self.coefficients, table)

    def served_eta(self, features: npt.ArrayLike) -> FloatArray:
        """The served linear predictor: the calibration layer's map while it is active."""
        return self.served().eta(features)

    @property
    def layer_served(self) -> bool:
        """Whether the calibration layer's map is served now."""
        return self.recalibrator is not None and self.recalibrator.active

    def predict_served(self, features: npt.ArrayLike) -> FloatArray:
        """Served acceptance probabilities ``[R, K]`` (calibration layer included)."""
        return self.served().predict(features)

    # -- persistence ------------------------------------------------------

    def snapshot(self) -> dict[str, FloatArray]:
        """Everything needed to resume exactly, as named float64 arrays."""
        self.settle()
        out: dict[str, FloatArray] = {
            "coefficients": self.coefficients.as_vector(),
            "start": self.start.as_vector(),
            "counters": np.array(
                [self.version, self.round, self.steps, self.steps_in_round, self.drafts],
                dtype=np.float64,
            ),
        }
        out.update({f"round.{n}": v for n, v in self.round_stats.to_arrays().items()})
        for name, state in (
            ("calibration", self._calibration_total),
            ("calibration_recent", self._calibration_recent),
            ("calibration_round", self._calibration_round),
        ):
            out.update({f"{name}.{n}": v for n, v in state.to_arrays().items()})
        for name, held in (("recent", self._reached_recent), ("round", self._reached_round)):
            # sparse, [2, cells]: flat index and count (a dense K = 64 histogram is 164 kB)
            counts = held.counts.reshape(-1)
            cells = np.flatnonzero(counts)
            out[f"reached.{name}"] = np.stack([cells.astype(np.float64), counts[cells]])
        out.update({f"rule.{n}": v for n, v in self.rule.state().items()})
        if self._layer is not None:
            out.update({f"recal.{n}": v for n, v in self._layer.to_arrays().items()})
        return out

    def restore(self, arrays: dict[str, FloatArray]) -> None:
        """Resume from :meth:`snapshot` output (same K and rule)."""

        def part(prefix: str) -> dict[str, FloatArray]:
            return {n[len(prefix) :]: v for n, v in arrays.items() if n.startswith(prefix)}

        coef = Coefficients.from_vector(arrays["coefficients"])
        if coef.k != self.k:
            raise ValueError(f"snapshot has K={coef.k}, estimator has K={self.k}")
        self.coefficients = coef
        self.start = Coefficients.from_vector(arrays["start"])
        counters = [int(v) for v in arrays["counters"]]
        self.version, self.round, self.steps, self.steps_in_round, self.drafts = counters
        self.round_stats = RoundStats.from_arrays(part("round."))
        self._calibration_total = CalibrationState.from_arrays(part("calibration."))
        self._calibration_recent = CalibrationState.from_arrays(part("calibration_recent."))
        self._calibration_round = CalibrationState.from_arrays(part("calibration_round."))
        for name in ("recent", "round"):
            histogram = FeatureHistogram.empty(self.k)
            held = arrays.get(f"reached.{name}")  # absent from snapshots before 0.2
            if held is not None and held.size:
                histogram.add_cells(held[0], held[1])
            setattr(self, f"_reached_{name}", histogram)
        self._pending.clear()
        self.rule.reset(self.start)
        self.rule.load_state(part("rule."))
        if self._layer is not None:
            self._layer = Recalibrator(self._layer.config)
            self._layer.load_arrays(part("recal."))
