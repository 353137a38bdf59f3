"""The ``tracking`` update rule: a Newton step from the current point.

Each refit solves ``(H_t + D_t + s A) d = g_t`` and moves ``theta += d``:

- ``H_t, g_t`` are the round's IRLS sums (the arrowhead ``a, b, c`` and the
  gradient ``g0, g1``) at the coefficients in force, exactly what a worker
  computes, so rounds from many workers merge by addition and nothing else
  is needed;
- ``D_t`` is vLLM's damping written as a prior centred at the current point:
  ``H_t * c / n`` (slope block) and ``c_k * c / n_k`` (each intercept), so a
  first round moves like vLLM's ``n / (n + c)`` and a thinly labelled
  position moves little;
- ``A`` is the information of earlier rounds, forgotten by ``forgetting``
  per round, used as a prior centred at the *current* coefficients (it never
  pulls toward the cold start). Its weight ``s`` comes from the round's own
  innovation test: with ``z = g^T H_t^-1 g`` and ``d`` degrees of freedom,
  ``E[z] = d + tr(A^-1 H_t)`` when the current point is as good as ``A``
  claims; a larger ``z`` means the point is off (not yet converged, or the
  workload moved), and ``s = 1 / max(1, (z - d) / tr(A^-1 H_t))`` discounts
  the old information by that much, here and in what is carried forward.

Guards leave a consistent fit: a slope step that would go negative is cut
at 0 with the intercepts re-solved for it (the Newton step constrained to
``slope >= 0``, so that where acceptance does not rise with the feature the
slope settles at 0 and the intercepts carry the per-position rates: the
constrained MLE); one that is not finite is replaced by the solve with the
slope held. While the slope sits at 0 with the round pushing it below, the
innovation test reads the intercepts alone (the slope's gradient there is
the bound's, not a sign that the point is off). Each position's step is
bounded in the linear predictor by a trust region that still allows the
jump that matches the position's observed rate (so drafts piled at one
feature value, e.g. vLLM's +40 clamp, are calibrated within a round or two
instead of being driven to 0 or 1).

A fall of the slope is bounded too (:attr:`TrackingConfig.slope_decrease`), with the
intercepts re-solved for the bounded slope. The step's Hessian is taken at
the current coefficients; when the slope has to fall, the current
predictions are more confident than the round's labels, their weights
``p(1 - p)`` understate the curvature between here and the fit, and the
full step overshoots: after a switch from greedy story prompts to code the
slope went from 1.04 to 0.34 in one refit where the round's own MLE is
0.69 (vLLM's rule overshoots the same way). A rise of the slope has the
opposite bias (the step falls short) and is left alone.

The estimator also refits early while the rule is new (``warmup_rounds``
rounds ending at ``N/16, N/8, N/4, N/2, N`` steps, then every ``N``), so the
cold-start coefficients serve a sixteenth of the first round, not all of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from avest.core.model import Coefficients
from avest.core.numeric import sigmoid
from avest.core.rules import (
    APPLIED,
    REJECTED,
    SLOPE_HELD,
    Refit,
    UpdateRule,
    arrowhead_dense,
)
from avest.core.stats import RoundStats

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class TrackingConfig:
    """Every tuned value of the default rule; ``math.inf`` or ``False`` turns a bound off.

    The first six are the tracking step's, the last two bound it.
    """

    #: vLLM's count damping ``n / (n + 50)``, written as a prior at the current
    #: point: a first round moves as far as vLLM's refit and a position with a
    #: few labels barely moves; larger is slower to leave the cold start.
    damping: float = 50.0
    #: vLLM's ridge: keeps a position without labels solvable, far too small to
    #: bias one that has them.
    l2: float = 1e-3
    #: Carried information kept per round (about a ten-round memory): higher is
    #: steadier on a stationary workload and slower on a drift the innovation
    #: test does not flag.
    forgetting: float = 0.9
    #: Use the carried information as a prior at all (off: each round's own
    #: Newton step, as vLLM's, with the bounds below).
    carry: bool = True
    #: Discount the carried information by the round's innovation test: a
    #: switch of workload is followed within a round instead of ``1 / (1 -
    #: forgetting)`` rounds; off trusts the old information whatever the round.
    innovation: bool = True
    #: Rounds shortened at the start (``N/16, N/8, N/4, N/2``): the cold start
    #: serves a sixteenth of the first round; more would refit on fewer labels.
    warmup_rounds: int = 4
    #: Least bound on a position's move of its mean linear predictor per refit:
    #: a thin round cannot throw a position far, while the jump to the observed
    #: rate (drafts piled at the +40 clamp) is always allowed.
    trust_region: float = 2.0
    #: Largest fall of the slope per refit, in the linear predictor per weighted
    #: within-position standard deviation of the features: the Newton step from
    #: over-confident coefficients overshoots; lower follows a real fall slower.
    slope_decrease: float = 0.5
    #: A slope step past 0 is cut at 0, the intercepts re-solved for it (the
    #: Newton step constrained to ``slope >= 0``), so that where acceptance does
    #: not rise with the feature the fit reaches the constrained MLE; off drops
    #: the slope step as vLLM does, leaving the slope where the last applied step
    #: put it and the predictions inverted.
    slope_floor: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.forgetting <= 1.0:
            raise ValueError("forgetting must be in [0, 1]")
        if self.damping < 0.0 or self.l2 < 0.0:
            raise ValueError("damping and l2 must be >= 0")
        if self.warmup_rounds < 0:
            raise ValueError("warmup_rounds must be >= 0")
        if not (self.trust_region > 0.0 and self.slope_decrease > 0.0):
            raise ValueError("trust_region and slope_decrease must be > 0")


#: The default rule as served.
DEFAULT_TRACKING = TrackingConfig()


def solve_arrowhead(
    a: float,
    b: FloatArray,
    c: FloatArray,
    g: FloatArray,
    hold_slope: bool = False,
    slope_step: float | None = None,
) -> FloatArray:
    """Solve ``[[a, b^T], [b, diag(c)]] d = g`` in O(K).

    ``slope_step`` fixes ``d[0]`` and solves the intercept rows for it
    (``hold_slope``: ``d[0] = 0``): the minimum of the quadratic model on
    that line.
    """
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if slope_step is not None:
            dw = float(slope_step)
        elif hold_slope:
            dw = 0.0
        else:
            den = a - float(np.sum(b * b / c))
            dw = (float(g[0]) - float(np.sum(b * g[1:] / c))) / den if den > 0.0 else math.nan
        return np.concatenate(([dw], (g[1:] - b * dw) / c))


def round_steps(rule: UpdateRule, round_index: int, refit_interval: int) -> int:
    """Steps in round ``round_index`` under ``rule``: shorter while warming up.

    With ``W = rule.warmup_rounds`` the first rounds end at ``N/2^W, N/2^(W-1),
    ..., N/2`` steps and then every ``N``, so the refits after the warm-up fall
    where vLLM's do.
    """
    warmup = rule.warmup_rounds
    if round_index > warmup or warmup <= 0:
        return refit_interval

    def end(r: int) -> int:
        return refit_interval if r >= warmup else max(1, refit_interval >> (warmup - r))

    return max(1, end(round_index) - (end(round_index - 1) if round_index > 0 else 0))


class TrackingRule(UpdateRule):
    """Newton step from the current point with an adaptively discounted information prior."""

    name: ClassVar[str] = "tracking"

    def __init__(self, config: TrackingConfig = DEFAULT_TRACKING) -> None:
        self.config = config
        self._a = 0.0
        self._b: FloatArray = np.zeros(0)
        self._c: FloatArray = np.zeros(0)
        #: Weight given to the carried information at the last refit (1: all of it).
        self.last_weight = 1.0

    @property
    def warmup_rounds(self) -> int:
        return self.config.warmup_rounds

    @property
    def carried_weight(self) -> float:
        """Share of the carried information the last refit kept (the innovation test)."""
        return self.last_weight

    def reset(self, start: Coefficients) -> None:
        self._a = 0.0
        self._b = np.zeros(start.k)
        self._c = np.zeros(start.k)
        self.last_weight = 1.0

    def _prior_weight(self, slope: float, stats: RoundStats, g: FloatArray, l2: float) -> float:
        """The innovation test: how much of the carried information still applies.

        With the slope at its bound 0 and the round's own step pushing it
        below, the slope's gradient is the constraint's, not a sign that the
        point is off (it stays however long the point is right): the test
        then reads the intercepts alone.
        """
        if self._a <= 0.0 or not self.config.innovation:
            return 1.0
        at = float(stats.a.sum())
        live = stats.n > 0
        hg = solve_arrowhead(at + l2, stats.b, stats.c + l2, g)
        pinned = self.config.slope_floor and slope <= 0.0 and bool(hg[0] < 0.0)
        free = slice(1, None) if pinned else slice(0, None)
        dof = int(np.count_nonzero(live)) + (0 if pinned else 1)
        z = float(np.sum(g[1:] ** 2 / (stats.c + l2))) if pinned else float(g @ hg)
        h = arrowhead_dense(at, stats.b, stats.c)[free, free]
        p = arrowhead_dense(self._a + l2, self._b, self._c + l2)[free, free]
        try:
            tr = float(np.trace(np.linalg.solve(p, h)))
        except np.linalg.LinAlgError:
            return 0.0
        if not (math.isfinite(z) and math.isfinite(tr)) or tr <= 0.0:
            return 0.0 if not math.isfinite(z) else 1.0
        return 1.0 / max(1.0, (z - dof) / tr)

    def refit(self, coef: Coefficients, stats: RoundStats) -> Refit:
        if self._b.shape[0] != coef.k:
            self.reset(coef)
        cfg = self.config
        n = stats.n
        total = float(n.sum())
        if total <= 0.0:
            return Refit(coef, APPLIED)
        g = np.concatenate(([float(stats.g0.sum())], stats.g1))
        if not np.all(np.isfinite(g)):
            return Refit(coef, REJECTED)
        at = float(stats.a.sum())
        with np.errstate(divide="ignore", invalid="ignore"):
            damp_k = np.where(n > 0, cfg.damping / np.maximum(n, 1e-300), 0.0)
        s = self._prior_weight(coef.slope, stats, g, cfg.l2)
        a = at * (1.0 + cfg.damping / total) + cfg.l2 + s * self._a
        b = stats.b + s * self._b
        c = stats.c * (1.0 + damp_k) + cfg.l2 + s * self._c
        step = solve_arrowhead(a, b, c, g)
        outcome = APPLIED
        if np.all(np.isfinite(step)):
            step = _bound_slope_decrease(stats, b, c, g, step, cfg.slope_decrease)
            if coef.slope + step[0] < 0.0 and cfg.slope_floor:
                step = solve_arrowhead(a, b, c, g, slope_step=-coef.slope)
        if not (np.all(np.isfinite(step)) and coef.slope + step[0] >= 0.0):
            step = solve_arrowhead(a, b, c, g, hold_slope=True)
            outcome = SLOPE_HELD
        if not np.all(np.isfinite(step)):
            return Refit(coef, REJECTED)
        step = _trust_region(coef, stats, step, cfg.trust_region)
        new = coef.as_vector() + step
        if not np.all(np.isfinite(new)):
            return Refit(coef, REJECTED)
        if cfg.carry:
            lam = cfg.forgetting * s
            self._a = lam * self._a + at
            self._b = lam * self._b + stats.b
            self._c = lam * self._c + stats.c
        self.last_weight = s
        return Refit(Coefficients.from_vector(new), outcome)

    def state(self) -> dict[str, FloatArray]:
        return {
            "a": np.array([self._a]),
            "b": self._b.copy(),
            "c": self._c.copy(),
            "weight": np.array([self.last_weight]),
        }

    def load_state(self, arrays: dict[str, FloatArray]) -> None:
        if not arrays:
            return
        self._a = float(np.asarray(arrays["a"]).reshape(-1)[0])
        self._b = np.asarray(arrays["b"], dtype=np.float64).copy()
        self._c = np.asarray(arrays["c"], dtype=np.float64).copy()
        self.last_weight = float(np.asarray(arrays["weight"]).reshape(-1)[0])


def _bound_slope_decrease(
    stats: RoundStats, b: FloatArray, c: FloatArray, g: FloatArray, step: FloatArray, most: float
) -> FloatArray:
    """A slope step below ``-most / sd`` is raised to it, where ``sd``
    is the round's weighted within-position standard deviation of the
    features; the intercepts are then re-solved with that slope step
    (rows of the same damped system ``c d_b = g_b - b d_w``)."""
    if not step[0] < 0.0:
        return step
    live = stats.c > 0
    weight = float(stats.c[live].sum())
    if weight <= 0.0:
        return step
    spread = float(np.sum(stats.a[live] - stats.b[live] ** 2 / stats.c[live])) / weight
    if not spread > 0.0:
        return step
    limit = most / math.sqrt(spread)
    if -step[0] <= limit:
        return step
    return np.concatenate(([-limit], (g[1:] + b * limit) / c))


def _trust_region(
    coef: Coefficients, stats: RoundStats, step: FloatArray, least: float
) -> FloatArray:
    """Bound each position's move of its mean linear predictor.

    The bound is ``max(least, |logit(observed) - eta|)`` at the
    position's weighted mean feature, with the observed rate read from the
    sums (``p + g1 / n``) and kept half a draft away from 0 and 1.
    """
    n = stats.n
    live = n > 0
    safe_n = np.maximum(n, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        xbar = np.where(stats.c > 0, stats.b / np.where(stats.c > 0, stats.c, 1.0), 0.0)
    eta = coef.slope * xbar + coef.intercept_array()
    observed = np.clip(sigmoid(eta) + stats.g1 / safe_n, 0.5 / safe_n, 1.0 - 0.5 / safe_n)
    target = np.log(observed) - np.log1p(-observed)
    bound = np.maximum(least, np.abs(target - eta))
    move = np.abs(step[1:] + step[0] * xbar)
    ratio = np.where(live, move / bound, 0.0)
    out = step.copy()
    worst = float(ratio.max()) if ratio.size else 0.0
    if worst > 1.0:
        # The shared slope moves by the most any position allows; each
        # intercept is then clipped to its own bound around that move.
        out[0] = step[0] / worst
        lo = -bound - out[0] * xbar
        hi = bound - out[0] * xbar
        out[1:] = np.where(live, np.clip(step[1:], lo, hi), step[1:])
    return out
