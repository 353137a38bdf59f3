"""Score and Budget, from what a pair serves at one moment (``ServedModel``), one code
for both gRPC ports: the main port scores with the pair as it is now, the read port
(:mod:`avest.grpc.reads`) with the model published at the pair's last change (its
registration, a refit or reset), as workers' pushed coefficients carry it. The two can
differ between refits in one thing: whether the calibration layer is served, which its
recent evidence may switch before the next refit publishes it.

A Budget request that sends ``features`` (and optionally ``stale_features``) gets
budgets from the pair's *served* confidences: the calibration layer's map while it is
served, the linear-logistic model otherwise, at the coefficients in force. Confidences
a client sends are used as they are (they may already be served ones, e.g. from Score
or from a vLLM worker that applies the pushed layer table), so they are never mapped a
second time.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import numpy as np
import numpy.typing as npt

from avest.core import budget as budget_rules
from avest.core.costs import CostTable
from avest.core.estimator import ServedModel
from avest.core.features import check_features
from avest.core.model import survival
from avest.grpc.convert import BUDGET_FROM_PB, BUDGET_TO_PB
from avest.grpc.refusals import Refused
from avest.state.errors import Exhausted, NotFound
from avest_wire import matrix as wire
from avest_wire.errors import InvalidInput
from avest_wire.v1 import estimator_pb2 as pb

Matrix = npt.NDArray[np.floating]


def check_shape(pair_k: int, rows: int, k: int, max_rows: int) -> None:
    """A request's K against the pair's, its rows against the limit per message."""
    if k != pair_k:
        raise InvalidInput("k", f"is {k}, the pair has K={pair_k}")
    if rows > max_rows:
        raise Exhausted("rows", f"{rows} exceeds the limit of {max_rows} rows per message")


def score(model: ServedModel, request: pb.ScoreRequest, max_rows: int) -> pb.ScoreResponse:
    check_shape(model.k, request.rows, request.k, max_rows)
    x = wire.decode(request.features, request.rows, request.k)
    p = model.predict(x)  # validated; the calibration layer while served
    return pb.ScoreResponse(
        confidences=wire.encode(p)[0],
        survival=wire.encode(survival(p))[0],
        coefficients_version=model.version,
    )


def budget(
    k: int,
    served: Callable[[], ServedModel],
    cost_table: Callable[[str], CostTable],
    request: pb.BudgetRequest,
    max_rows: int,
) -> pb.BudgetResponse:
    """The budget for a pair of ``k`` positions; ``served`` gives the model to score
    features with, asked only when the request sends features. Refuses with
    ``InvalidInput`` and the like, and with FAILED_PRECONDITION (:class:`Refused`) when
    the pair has no cost curves for the hardware."""
    check_shape(k, request.rows, request.k, max_rows)
    if request.rule not in BUDGET_FROM_PB:
        raise InvalidInput("rule", f"unknown budget rule {request.rule}")
    conf, stale, model = budget_confidences(k, served, request)
    try:
        table = cost_table(request.hardware)
    except NotFound as exc:
        raise Refused(grpc.StatusCode.FAILED_PRECONDITION, str(exc.args[0])) from None
    rule = BUDGET_FROM_PB[request.rule]
    if request.rule == pb.BUDGET_RULE_UNSPECIFIED and stale is not None:
        rule = "stale"  # the contract's default: stale when given, else the walk
    decision = budget_rules.decide(
        rule,
        conf.astype(np.float64),
        np.asarray(request.scheduled_drafts, dtype=np.int64),
        table,
        num_non_draft_tokens=request.num_non_draft_tokens,
        num_sampling=request.num_sampling_requests,
        stale_confidences=None if stale is None else stale.astype(np.float64),
        min_per_request=request.min_drafts_per_request,
    )
    return pb.BudgetResponse(
        budget=int(decision.budget),
        verify_lengths=decision.verify_lengths.tolist(),
        expected_tokens=float(decision.expected_tokens),
        cost_ms=float(decision.cost_ms),
        rule=BUDGET_TO_PB[decision.rule],
        lossless=bool(decision.lossless),
        coefficients_version=0 if model is None else model.version,
        calibration_layer_served=model is not None and model.layer_served,
    )


def _features(k: int, request: pb.BudgetRequest, field: str) -> Matrix:
    data = getattr(request, field)
    try:
        return check_features(wire.decode(data, request.rows, request.k, field), k)
    except InvalidInput as exc:
        raise InvalidInput(field, exc.problem) from None


def budget_confidences(
    k: int, served: Callable[[], ServedModel], request: pb.BudgetRequest
) -> tuple[Matrix, Matrix | None, ServedModel | None]:
    """``(confidences, stale confidences or None, the model that scored them)``: the
    model when they were computed here from the request's features, else None.
    Refuses (``InvalidInput``) before anything is scored."""
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
        return conf, stale, None
    for name in ("confidences", "stale_confidences"):
        if getattr(request, name):
            raise InvalidInput(name, "must be empty when features are sent")
    x = _features(k, request, "features")
    sx = _features(k, request, "stale_features") if request.stale_features else None
    # Both at the same coefficients and layer: one frozen model.
    model = served()
    return model.predict(x), None if sx is None else model.predict(sx), model
