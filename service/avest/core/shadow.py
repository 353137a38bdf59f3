"""The default rule: ``tracking`` steps with vLLM's rule run as a shadow.

Two coefficient trajectories are kept: one moved by :class:`TrackingRule`
(accumulated, adaptively forgotten information) and one moved by vLLM's own
refit (:class:`VllmRule`, each round on its own). Only one of them is served
and scored by the workers, so the round's sums are taken at the served
coefficients ``theta``. Everything the other trajectory needs is read from
those same sums by expanding the log loss to second order around ``theta``
(exact for the quadratic part, which is all a Newton step uses):

- the sums at ``theta + d``: the same ``X^T W X`` and ``X^T r - X^T W X d``;
- the round's log loss at ``theta + d`` minus the served one:
  ``-d^T X^T r + d^T X^T W X d / 2``.

Both stay mergeable sums, so the rule works on rounds pooled from many
workers or sent as round summaries. The loss differences are decayed by
``decay`` per round into ``D`` (vLLM's trajectory's recent loss minus
tracking's, nats). The served coefficients are one linear-logistic model,
a point between the two trajectories (a fixed-share mixture in parameter
space):

    theta = w * theta_tracking + (1 - w) * theta_vllm,
    w = clip(sigmoid(D), f, 1 - f),   f = share * min(1, share_fade / |D|)

The trajectory with the lower recent loss carries most of the weight and
the other keeps ``share`` of it, so right after a switch the served point
is already part of the way toward the trajectory that turns out better
(the tracking step's bounded fall of the slope, while vLLM's overshoots),
and where the two scatter around the same fit their average is served
rather than one of them. A trajectory that is behind by far more than a
round's noise (vLLM's at the +40 feature clamp: thousands of nats) loses
its share. Where accumulated information wins ``tracking``
dominates; while the workload moves faster than its forgetting follows,
vLLM's one-round step does, so the default is never behind vLLM's rule for
long.
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from avest.core.model import Coefficients
from avest.core.numeric import sigmoid
from avest.core.rules import Refit, UpdateRule, VllmRule
from avest.core.stats import RoundStats
from avest.core.tracking import DEFAULT_TRACKING, TrackingConfig, TrackingRule

FloatArray = npt.NDArray[np.float64]

#: Trajectories: 0 the tracking rule's, 1 vLLM's.
TRACKING, VLLM = 0, 1


def shifted(stats: RoundStats, d: FloatArray) -> RoundStats:
    """The round's sums re-expanded at ``theta + d``: gradient ``g - H d``, same ``H``."""
    dw, db = float(d[0]), d[1:]
    return RoundStats(
        stats.a.copy(),
        stats.b.copy(),
        stats.c.copy(),
        stats.g0 - (stats.a * dw + stats.b * db),
        stats.g1 - (stats.b * dw + stats.c * db),
        stats.n.copy(),
    )


def loss_change(stats: RoundStats, d: FloatArray) -> float:
    """Second-order change of the round's summed log loss from ``theta`` to ``theta + d``."""
    dw, db = float(d[0]), d[1:]
    linear = -float(np.sum(stats.g0 * dw + stats.g1 * db))
    quadratic = 0.5 * float(np.sum(stats.a * dw * dw + 2.0 * stats.b * dw * db + stats.c * db * db))
    return linear + quadratic


class ShadowedTracking(UpdateRule):
    """``tracking`` and vLLM's rule, served mixed by their recent predictive losses."""

    name: ClassVar[str] = "tracking"

    def __init__(self, config: TrackingConfig = DEFAULT_TRACKING) -> None:
        self.config = config
        self.tracking = TrackingRule(config)
        self.shadow = VllmRule()  # vLLM's own rule, whatever the tracking step's values
        self.theta = np.zeros((2, 0))
        #: Decayed (vLLM's trajectory - tracking's) predictive log loss, nats.
        self.loss_difference = 0.0
        self.serving = TRACKING

    @property
    def warmup_rounds(self) -> int:
        return self.tracking.warmup_rounds

    @property
    def carried_weight(self) -> float:
        """Share of its carried information the tracking step kept at the last refit
        (its innovation test: well below 1 when the workload moved)."""
        return float(self.tracking.last_weight)

    @property
    def served(self) -> str:
        """The trajectory with the larger weight in the served coefficients."""
        return "tracking" if self.serving == TRACKING else "vllm"

    @property
    def tracking_weight(self) -> float:
        """``w``: the tracking trajectory's weight in the served coefficients."""
        d = self.loss_difference
        if not math.isfinite(d):
            return 1.0
        share = self.config.share
        floor = share * min(1.0, self.config.share_fade / abs(d)) if d else share
        return min(max(float(sigmoid(d)), floor), 1.0 - floor)

    def served_vector(self) -> FloatArray:
        """The served coefficients as a vector: the trajectories mixed by their weights."""
        w = self.tracking_weight
        mixed = np.asarray(w * self.theta[TRACKING] + (1.0 - w) * self.theta[VLLM])
        if not np.all(np.isfinite(mixed)):  # never let one trajectory's fault through
            finite = [j for j in (TRACKING, VLLM) if np.all(np.isfinite(self.theta[j]))]
            return np.asarray(self.theta[finite[0]] if finite else mixed)
        return mixed

    def reset(self, start: Coefficients) -> None:
        self.tracking.reset(start)
        v = start.as_vector()
        self.theta = np.stack([v, v])
        self.loss_difference = 0.0
        self.serving = TRACKING

    def refit(self, coef: Coefficients, stats: RoundStats) -> Refit:
        if self.theta.shape[1] != coef.k + 1:
            self.reset(coef)
        # The round's sums were taken at ``coef``; where it is not the mixture
        # (coefficients set from outside), both trajectories move with it.
        v = coef.as_vector()
        offset = v - self.served_vector()
        if np.any(offset):
            self.theta = self.theta + offset
        d = self.theta - v
        change = [loss_change(stats, d[j]) for j in (TRACKING, VLLM)]
        if all(np.isfinite(change)):
            self.loss_difference = self.config.decay * self.loss_difference + (
                change[VLLM] - change[TRACKING]
            )
        results = []
        for j, rule in ((TRACKING, self.tracking), (VLLM, self.shadow)):
            round_j = stats if not np.any(d[j]) else shifted(stats, d[j])
            result = rule.refit(Coefficients.from_vector(self.theta[j]), round_j)
            self.theta[j] = result.coefficients.as_vector()
            results.append(result)
        self.serving = TRACKING if self.tracking_weight >= 0.5 else VLLM
        return Refit(Coefficients.from_vector(self.served_vector()), results[self.serving].outcome)

    def state(self) -> dict[str, FloatArray]:
        out = {f"tracking.{n}": v for n, v in self.tracking.state().items()}
        out["theta"] = self.theta.copy()
        out["selection"] = np.array([self.loss_difference, float(self.serving)])
        return out

    def load_state(self, arrays: dict[str, FloatArray]) -> None:
        if not arrays:
            return
        prefix = "tracking."
        self.tracking.load_state(
            {n[len(prefix) :]: v for n, v in arrays.items() if n.startswith(prefix)}
        )
        self.theta = np.asarray(arrays["theta"], dtype=np.float64).copy()
        selection = np.asarray(arrays["selection"], dtype=np.float64).reshape(-1)
        self.loss_difference = float(selection[0])
        self.serving = int(selection[1])
