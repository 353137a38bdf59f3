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
``decay`` per round; the served trajectory switches when the other one's
recent predictive log loss is lower. Where accumulated information wins
(stationary traffic, thinly labelled positions) ``tracking`` is served;
while the workload moves faster than its forgetting follows, vLLM's one-
round step is, so the default is never behind vLLM's rule for long.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import numpy.typing as npt

from avest.core.model import Coefficients
from avest.core.rules import Refit, VllmRule
from avest.core.stats import RoundStats
from avest.core.tracking import TrackingRule

FloatArray = npt.NDArray[np.float64]

#: Weight the loss comparison keeps per round.
DEFAULT_SHADOW_DECAY = 0.7
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


class ShadowedTracking:
    """``tracking`` served while its recent predictive loss is no worse than vLLM's rule's."""

    name: ClassVar[str] = "tracking"

    def __init__(
        self,
        forgetting: float = 0.9,
        damping: float = 50.0,
        l2: float = 1e-3,
        warmup_rounds: int = 4,
        decay: float = DEFAULT_SHADOW_DECAY,
    ) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError("decay must lie in [0, 1]")
        self.tracking = TrackingRule(
            forgetting=forgetting, damping=damping, l2=l2, warmup_rounds=warmup_rounds
        )
        self.shadow = VllmRule(l2=l2, damping=damping)
        self.decay = decay
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
        return "tracking" if self.serving == TRACKING else "vllm"

    def reset(self, start: Coefficients) -> None:
        self.tracking.reset(start)
        v = start.as_vector()
        self.theta = np.stack([v, v])
        self.loss_difference = 0.0
        self.serving = TRACKING

    def refit(self, coef: Coefficients, stats: RoundStats) -> Refit:
        if self.theta.shape[1] != coef.k + 1:
            self.reset(coef)
        # The served trajectory is what the workers scored: re-anchor it there.
        self.theta[self.serving] = coef.as_vector()
        d = self.theta - coef.as_vector()
        change = [loss_change(stats, d[j]) for j in (TRACKING, VLLM)]
        if all(np.isfinite(change)):
            self.loss_difference = self.decay * self.loss_difference + (
                change[VLLM] - change[TRACKING]
            )
        results = []
        for j, rule in ((TRACKING, self.tracking), (VLLM, self.shadow)):
            round_j = stats if not np.any(d[j]) else shifted(stats, d[j])
            result = rule.refit(Coefficients.from_vector(self.theta[j]), round_j)
            self.theta[j] = result.coefficients.as_vector()
            results.append(result)
        if self.serving == TRACKING and self.loss_difference < 0.0:
            self.serving = VLLM
        elif self.serving == VLLM and self.loss_difference > 0.0:
            self.serving = TRACKING
        return Refit(
            Coefficients.from_vector(self.theta[self.serving]), results[self.serving].outcome
        )

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
