"""What a Budget request budgets with: the confidences it sent, or its features
scored as Score scores them.

A request that sends ``features`` (and optionally ``stale_features``) gets
budgets from the pair's *served* confidences: the calibration layer's map
while it is served, the linear-logistic model otherwise, at the coefficients
in force. Confidences a client sends are used as they are (they may already
be served ones, e.g. from Score or from a vLLM worker that applies the pushed
layer table), so they are never mapped a second time.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from avest.core.features import check_features
from avest.state.pairs import Pair
from avest_wire import matrix as wire
from avest_wire.errors import InvalidInput
from avest_wire.v1 import estimator_pb2 as pb

Matrix = npt.NDArray[np.floating]


def _features(pair: Pair, request: pb.BudgetRequest, field: str) -> Matrix:
    data = getattr(request, field)
    try:
        return check_features(wire.decode(data, request.rows, request.k, field), pair.k)
    except InvalidInput as exc:
        raise InvalidInput(field, exc.problem) from None


def budget_confidences(pair: Pair, request: pb.BudgetRequest) -> tuple[Matrix, Matrix | None, bool]:
    """``(confidences, stale confidences or None, scored)``: ``scored`` when they
    were computed here from the request's features. Refuses (``InvalidInput``)
    before anything is read from the pair's state."""
    rows, k = request.rows, request.k
    if not request.features:
        if request.stale_features:
            raise InvalidInput("stale_features", "only together with features")
        conf = wire.decode(request.confidences, rows, k, "confidences")
        stale = (
            wire.decode(request.stale_confidences, rows, k, "stale_confidences")
            if request.stale_confidences
            else None
        )
        return conf, stale, False
    for name in ("confidences", "stale_confidences"):
        if getattr(request, name):
            raise InvalidInput(name, "must be empty when features are sent")
    x = _features(pair, request, "features")
    sx = _features(pair, request, "stale_features") if request.stale_features else None
    est = pair.estimator
    # Both at the same coefficients and layer: nothing else runs between these lines.
    return est.predict_served(x), None if sx is None else est.predict_served(sx), True
