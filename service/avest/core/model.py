"""The acceptance model's math: ``p_k = sigmoid(slope * x + intercept_k)``.

The coefficients themselves, their check and the cold-start constants are the wire's
(:mod:`avest_wire.coefficients`), one type for client, shim and service.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from avest.core.numeric import sigmoid
from avest_wire.coefficients import INIT_INTERCEPT, INIT_SLOPE, Coefficients, check_k

FloatArray = npt.NDArray[np.float64]

__all__ = [
    "INIT_INTERCEPT",
    "INIT_SLOPE",
    "Coefficients",
    "check_k",
    "linear_predictor",
    "predict",
    "survival",
]


def linear_predictor(coef: Coefficients, features: npt.ArrayLike) -> FloatArray:
    """``eta[r, k] = slope * x[r, k] + intercept_k`` for features ``[R, K]``."""
    x = np.asarray(features, dtype=np.float64)
    return np.asarray(coef.slope * x + coef.intercept_array(), dtype=np.float64)


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
