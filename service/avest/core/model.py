"""The acceptance model: ``p_k = sigmoid(slope * x + intercept_k)``.

One slope shared by every draft position (a property of the draft/target pair
and sampling method) and one intercept per position (the base acceptance rate
at that depth, which moves with the workload).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from avest.core.numeric import sigmoid
from avest_wire.errors import InvalidInput
from avest_wire.limits import MAX_K

FloatArray = npt.NDArray[np.float64]

#: Cold-start coefficients, as vLLM 0.33 (medians across five production pairs).
INIT_SLOPE = 0.5
INIT_INTERCEPT = -0.2


@dataclass(frozen=True)
class Coefficients:
    """Immutable coefficients: a shared ``slope`` and ``intercepts[K]``."""

    slope: float
    intercepts: tuple[float, ...]

    @property
    def k(self) -> int:
        return len(self.intercepts)

    @classmethod
    def cold_start(cls, k: int) -> Coefficients:
        check_k(k)
        return cls(INIT_SLOPE, (INIT_INTERCEPT,) * k)

    @classmethod
    def of(cls, slope: float, intercepts: npt.ArrayLike) -> Coefficients:
        b = np.asarray(intercepts, dtype=np.float64).reshape(-1)
        check_k(b.size, "intercepts")
        if not np.isfinite(slope) or slope < 0:
            raise InvalidInput("slope", f"must be finite and >= 0, got {slope!r}")
        if not np.all(np.isfinite(b)):
            raise InvalidInput("intercepts", "must be finite")
        return cls(float(slope), tuple(float(v) for v in b))

    def intercept_array(self) -> FloatArray:
        return np.asarray(self.intercepts, dtype=np.float64)

    def as_vector(self) -> FloatArray:
        """``[slope, intercept_0, ..., intercept_{K-1}]``."""
        return np.concatenate(([self.slope], self.intercept_array()))

    @classmethod
    def from_vector(cls, theta: npt.ArrayLike) -> Coefficients:
        v = np.asarray(theta, dtype=np.float64)
        return cls(float(v[0]), tuple(float(x) for x in v[1:]))


def check_k(k: int, field: str = "k") -> None:
    if not 1 <= k <= MAX_K:
        raise InvalidInput(field, f"K must be in [1, {MAX_K}], got {k}")


def linear_predictor(coef: Coefficients, features: npt.ArrayLike) -> FloatArray:
    """``eta[r, k] = slope * x[r, k] + intercept_k`` for features ``[R, K]``."""
    x = np.asarray(features, dtype=np.float64)
    return coef.slope * x + coef.intercept_array()


def predict(coef: Coefficients, features: npt.ArrayLike) -> FloatArray:
    """Acceptance probability of each draft, ``[R, K]``."""
    return sigmoid(linear_predictor(coef, features))


def survival(confidences: npt.ArrayLike) -> FloatArray:
    """Running product of confidences along each request's drafts.

    ``survival[r, k]`` is the probability that drafts ``0..k`` of request ``r``
    are all accepted: the expected contribution of slot ``(r, k)``.
    """
    p = np.asarray(confidences, dtype=np.float64)
    return np.asarray(np.cumprod(p, axis=-1), dtype=np.float64)
