"""Maximum-likelihood fit of the model on a fixed data set.

Iterates the undamped, unregularised Newton step (the ``vllm`` rule with
``L2 = 0`` and no damping) to convergence. This is the reference the online
rules are measured against, and the in-sample ``mle`` row of ``avest
evaluate``.

Positions that cannot be fitted are taken out of the Newton system first,
so they never stall the rest: a position with no observed draft keeps its
starting intercept, and a position whose observed drafts are all accepted
(or all rejected) has its maximum-likelihood intercept at +inf (-inf); it is
reported as the finite value that puts every one of its drafts at a linear
predictor of at least ``SEPARATED_LOGIT`` (at most minus it), and the slope
and other intercepts are the maximum-likelihood fit of the remaining drafts,
which is the limit of the full fit as that intercept runs off.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from avest.core.model import Coefficients, linear_predictor
from avest.core.stats import fold
from avest.core.tracking import solve_arrowhead

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

#: |linear predictor| at which a separated position's drafts are reported.
SEPARATED_LOGIT = 30.0


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
    seen = observed.sum(axis=0)
    hits = (observed & accepted).sum(axis=0)
    separated = (seen > 0) & ((hits == 0) | (hits == seen))
    active = (seen > 0) & ~separated
    theta = coef.as_vector()
    iterations = 0
    if active.any():
        cols = np.flatnonzero(active)
        x = features[:, cols]
        obs = observed[:, cols]
        acc = accepted[:, cols]
        for i in range(1, max_iter + 1):
            iterations = i
            sub = Coefficients.from_vector(np.concatenate(([theta[0]], theta[1 + cols])))
            stats = fold(x, linear_predictor(sub, x), obs, acc)
            g = np.concatenate(([float(stats.g0.sum())], stats.g1))
            step = solve_arrowhead(float(stats.a.sum()), stats.b, stats.c, g)
            if not np.all(np.isfinite(step)):
                break
            if theta[0] + step[0] < 0.0:
                step = solve_arrowhead(float(stats.a.sum()), stats.b, stats.c, g, hold_slope=True)
            theta[0] += step[0]
            theta[1 + cols] += step[1:]
            if float(np.max(np.abs(step))) < tol:
                break
    slope = theta[0]
    for j in np.flatnonzero(separated):
        x_j = features[observed[:, j], j]
        if hits[j] == seen[j]:
            theta[1 + j] = SEPARATED_LOGIT - slope * float(x_j.min())
        else:
            theta[1 + j] = -SEPARATED_LOGIT - slope * float(x_j.max())
    return Coefficients.from_vector(theta), iterations
