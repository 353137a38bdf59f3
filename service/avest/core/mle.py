"""Maximum-likelihood fit of the model on a fixed data set.

Iterates the undamped, unregularised Newton step (the ``vllm`` rule with
``L2 = 0`` and no damping) to convergence. This is the reference the online
rules are measured against, and the in-sample ``mle`` row of ``avest
evaluate``.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from avest.core.model import Coefficients, linear_predictor
from avest.core.rules import VllmRule
from avest.core.stats import RoundStats, fold

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


def fit_mle(
    features: FloatArray,
    observed: BoolArray,
    accepted: BoolArray,
    start: Coefficients | None = None,
    tol: float = 1e-10,
    max_iter: int = 100,
) -> tuple[Coefficients, int]:
    """Newton iterations to the MLE; returns ``(coefficients, iterations)``.

    ``features``, ``observed`` and ``accepted`` are ``[R, K]``. Stops when
    the largest coefficient change is below ``tol``.
    """
    k = features.shape[1]
    coef = start if start is not None else Coefficients.cold_start(k)
    newton = VllmRule(l2=0.0, damping=0.0)
    for i in range(1, max_iter + 1):
        stats: RoundStats = fold(features, linear_predictor(coef, features), observed, accepted)
        new = newton.refit(coef, stats).coefficients
        delta = float(np.max(np.abs(new.as_vector() - coef.as_vector())))
        coef = new
        if delta < tol:
            return coef, i
    return coef, max_iter
