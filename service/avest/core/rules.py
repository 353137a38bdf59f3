"""Update rules: how one round's statistics move the coefficients.

``vllm``      exactly vLLM 0.33's refit: one ridge-regularised, damped
              Newton step on the round's own statistics, which are then
              discarded.
``recursive`` carries the information across rounds (a recursive Newton
              filter): ``A <- lam A + H_t``, ``h <- lam h + H_t theta_t + g_t``,
              ``theta <- (A + L0)^-1 (h + L0 mu0)``, with forgetting ``lam``
              and a weak prior ``L0`` toward the starting coefficients ``mu0``.

Both take a :class:`RoundStats` computed at the current coefficients and
return the new coefficients with an outcome label. Neither raises on bad
numbers: a step that would make the slope negative or non-finite is dropped,
and the intercepts are those solved with the slope held (never the ones
solved together with the dropped slope). ``tracking`` (the default, in
:mod:`avest.core.tracking`) is a third rule.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from avest.core.model import Coefficients
from avest.core.stats import RoundStats

FloatArray = npt.NDArray[np.float64]

#: Outcomes of a refit, used as a bounded metric label.
APPLIED = "applied"
SLOPE_HELD = "slope_held"  # the slope step was dropped (negative slope or NaN)
REJECTED = "rejected"  # the whole step was dropped (non-finite solve)
OUTCOMES = (APPLIED, SLOPE_HELD, REJECTED)


@dataclass(frozen=True)
class Refit:
    coefficients: Coefficients
    outcome: str


class UpdateRule(ABC):
    """What every update rule offers; the estimator, the state and the metrics
    read a rule through this and nothing else.

    A rule takes the round's sums at the coefficients in force and returns
    the next ones; its carried state is named float64 arrays, so a snapshot
    restores it exactly. The two properties have the values of a rule that
    lacks the feature: no shortened first rounds, and all carried information
    kept (nothing to discount).
    """

    name: ClassVar[str]

    @abstractmethod
    def refit(self, coef: Coefficients, stats: RoundStats) -> Refit:
        """One round's step from ``coef``; never raises on bad numbers."""

    @abstractmethod
    def state(self) -> dict[str, FloatArray]:
        """The carried state as named arrays (empty when the rule carries none)."""

    @abstractmethod
    def load_state(self, arrays: dict[str, FloatArray]) -> None:
        """Resume from :meth:`state` output (empty: keep the state after ``reset``)."""

    @abstractmethod
    def reset(self, start: Coefficients) -> None:
        """Forget everything carried; ``start`` is the new starting point."""

    @property
    def warmup_rounds(self) -> int:
        """Rounds shortened at the start (see :func:`avest.core.tracking.round_steps`)."""
        return 0

    @property
    def carried_weight(self) -> float:
        """Share of the carried information the last refit kept; below 1 the
        rule found that the workload moved (the calibration layer ages its
        evidence by it)."""
        return 1.0


def _damp(n: FloatArray | float, damping: float) -> FloatArray:
    """``n / (n + damping)``; 0/0 gives NaN, which the guards then drop, as in vLLM."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.asarray(np.true_divide(n, np.add(n, damping)), dtype=np.float64)


def schur_slope_step(stats: RoundStats, l2: float) -> float:
    """Undamped slope step of ``(X^T W X + l2 I) d = X^T r``.

    The Schur complement of the arrowhead's diagonal intercept block:
    ``(g0 - sum b g1 / c') / (a - sum b^2 / c')`` with ``c' = c + l2``.
    """
    c = stats.c + l2
    with np.errstate(divide="ignore", invalid="ignore"):
        num = float(stats.g0.sum()) - float(np.sum(stats.b * stats.g1 / c))
        den = float(stats.a.sum()) + l2 - float(np.sum(stats.b * stats.b / c))
        return (
            num / den if den != 0.0 else (math.nan if num == 0.0 else math.copysign(math.inf, num))
        )


def intercept_steps(stats: RoundStats, l2: float, step_w: float) -> FloatArray:
    """Undamped intercept steps given the slope step: ``(g1 - b step_w) / c'``."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.asarray((stats.g1 - stats.b * step_w) / (stats.c + l2), dtype=np.float64)


def vllm_step(
    slope: float, stats: RoundStats, l2: float, damping: float
) -> tuple[float, FloatArray, bool]:
    """vLLM 0.33's damped, guarded step: ``(step_w, step_b, slope_held)``.

    The slope step is damped by the round's total count and dropped when it
    is NaN or would make the slope negative; the intercept steps are then
    solved with the (guarded) slope step, damped by each position's count,
    and dropped where NaN.
    """
    step_w = schur_slope_step(stats, l2) * float(_damp(float(stats.n.sum()), damping))
    held = not (step_w == step_w and slope + step_w >= 0.0)
    if held:
        step_w = 0.0
    step_b = intercept_steps(stats, l2, step_w) * _damp(stats.n, damping)
    step_b = np.where(np.isnan(step_b), 0.0, step_b)
    return step_w, step_b, held


@dataclass
class VllmRule(UpdateRule):
    """vLLM 0.33's refit (``L2 = 1e-3``, damping ``c = 50``); stateless."""

    l2: float = 1e-3
    damping: float = 50.0
    name: ClassVar[str] = "vllm"

    def refit(self, coef: Coefficients, stats: RoundStats) -> Refit:
        step_w, step_b, held = vllm_step(coef.slope, stats, self.l2, self.damping)
        slope = coef.slope + step_w
        intercepts = coef.intercept_array() + step_b
        if not (math.isfinite(slope) and np.all(np.isfinite(intercepts))):
            return Refit(coef, REJECTED)
        new = Coefficients.from_vector(np.concatenate(([slope], intercepts)))
        return Refit(new, SLOPE_HELD if held else APPLIED)

    def state(self) -> dict[str, FloatArray]:
        return {}

    def load_state(self, arrays: dict[str, FloatArray]) -> None:
        return None

    def reset(self, start: Coefficients) -> None:
        return None


def arrowhead_dense(a: float, b: FloatArray, c: FloatArray) -> FloatArray:
    """The dense ``(K+1) x (K+1)`` matrix of an arrowhead ``(a, b, c)``."""
    k = b.shape[0]
    m = np.zeros((k + 1, k + 1), dtype=np.float64)
    m[0, 0] = a
    m[0, 1:] = b
    m[1:, 0] = b
    m[1:, 1:] = np.diag(c)
    return m


def arrowhead_matvec(a: float, b: FloatArray, c: FloatArray, theta: FloatArray) -> FloatArray:
    """``H @ theta`` for an arrowhead ``H`` in O(K)."""
    out = np.empty_like(theta)
    out[0] = a * theta[0] + float(b @ theta[1:])
    out[1:] = b * theta[0] + c * theta[1:]
    return out


@dataclass
class RecursiveRule(UpdateRule):
    """Recursive Newton filter with forgetting and a weak prior.

    ``forgetting`` (lambda) in (0, 1]: 1 keeps all information (best for a
    stationary workload); 0.9-0.95 tracks a workload shift within tens of
    rounds. ``prior`` is the precision of the pull toward the starting
    coefficients (in the units of ``X^T W X``: one draft near p = 0.5 adds
    0.25), weak enough that a few dozen labels override it.
    """

    forgetting: float = 0.95
    prior: float = 1.0
    name: ClassVar[str] = "recursive"
    _a: float = 0.0
    _b: FloatArray = field(default_factory=lambda: np.zeros(0))
    _c: FloatArray = field(default_factory=lambda: np.zeros(0))
    _h: FloatArray = field(default_factory=lambda: np.zeros(0))
    _mu0: FloatArray = field(default_factory=lambda: np.zeros(0))

    def __post_init__(self) -> None:
        if not 0.0 < self.forgetting <= 1.0:
            raise ValueError("forgetting must be in (0, 1]")
        if not self.prior > 0.0:
            raise ValueError("prior must be > 0")

    def reset(self, start: Coefficients) -> None:
        k = start.k
        self._a = 0.0
        self._b = np.zeros(k)
        self._c = np.zeros(k)
        self._h = np.zeros(k + 1)
        self._mu0 = start.as_vector()

    def refit(self, coef: Coefficients, stats: RoundStats) -> Refit:
        if self._mu0.shape[0] != coef.k + 1:
            self.reset(coef)
        theta = coef.as_vector()
        lam = self.forgetting
        a_t = float(stats.a.sum())
        a = lam * self._a + a_t
        b = lam * self._b + stats.b
        c = lam * self._c + stats.c
        g = np.concatenate(([float(stats.g0.sum())], stats.g1))
        h = lam * self._h + arrowhead_matvec(a_t, stats.b, stats.c, theta) + g
        system = arrowhead_dense(a, b, c) + self.prior * np.eye(coef.k + 1)
        rhs = h + self.prior * self._mu0
        new = _solve_spd(system, rhs)
        if new is None or not np.all(np.isfinite(new)):
            return Refit(coef, REJECTED)
        # The information is kept either way: it is valid whatever the step.
        self._a, self._b, self._c, self._h = a, b, c, h
        outcome = APPLIED
        if new[0] < 0.0:
            # The best fit with the slope held: re-solve the intercept rows of
            # the same system given the old slope (its block is diagonal).
            new[0] = coef.slope
            new[1:] = (rhs[1:] - b * coef.slope) / (c + self.prior)
            outcome = SLOPE_HELD
        return Refit(Coefficients.from_vector(new), outcome)

    def state(self) -> dict[str, FloatArray]:
        return {
            "a": np.array([self._a]),
            "b": self._b.copy(),
            "c": self._c.copy(),
            "h": self._h.copy(),
            "mu0": self._mu0.copy(),
        }

    def load_state(self, arrays: dict[str, FloatArray]) -> None:
        if not arrays:
            return
        self._a = float(np.asarray(arrays["a"]).reshape(-1)[0])
        self._b = np.asarray(arrays["b"], dtype=np.float64).copy()
        self._c = np.asarray(arrays["c"], dtype=np.float64).copy()
        self._h = np.asarray(arrays["h"], dtype=np.float64).copy()
        self._mu0 = np.asarray(arrays["mu0"], dtype=np.float64).copy()


def _solve_spd(m: FloatArray, rhs: FloatArray) -> FloatArray | None:
    """Cholesky solve, falling back to least squares when not positive definite."""
    try:
        chol = np.linalg.cholesky(m)
        y = np.linalg.solve(chol, rhs)
        return np.asarray(np.linalg.solve(chol.T, y), dtype=np.float64)
    except np.linalg.LinAlgError:
        try:
            sol = np.linalg.lstsq(m, rhs, rcond=None)[0]
            return np.asarray(sol, dtype=np.float64)
        except np.linalg.LinAlgError:
            return None
