"""Summary mode on the Observe stream: a ``RoundSummary`` message into the core's form."""

from __future__ import annotations

import numpy as np

from avest.core.errors import InvalidInput
from avest.core.intake import intake
from avest.core.summary import RoundSummary, make_sketch, make_summary
from avest.state.pairs import Pair
from avest_wire.v1 import estimator_pb2 as pb


def summary_from_pb(req: pb.ObserveRequest, pair: Pair) -> RoundSummary:
    """Validate an Observe message carrying a summary; InvalidInput names the field."""
    if req.rows or req.features or len(req.num_verified) or len(req.num_accepted):
        raise InvalidInput("summary", "a summary message carries no step (rows, features, counts)")
    if len(req.exclude):
        raise InvalidInput("exclude", "must be empty in a summary message")
    if req.k not in (0, pair.k):
        raise InvalidInput("k", f"is {req.k}, the pair has K={pair.k}")
    s = req.summary
    if s.k != pair.k:
        raise InvalidInput("summary.k", f"is {s.k}, the pair has K={pair.k}")
    sk = s.sketch
    with_sketch = s.HasField("sketch") and bool(len(sk.cell_deltas) or len(sk.logloss_sum))
    fast = intake(
        pair.k,
        version=s.coefficients_version,
        slope=s.slope,
        intercepts=s.intercepts,
        info=s.info,
        grad=s.grad,
        counts=s.counts,
        steps=s.steps,
        drafts=s.drafts,
        sketch=(
            (
                sk.cell_deltas,
                sk.cell_counts,
                sk.ece_rejected,
                sk.ece_accepted,
                sk.ece_sum_predicted,
                sk.logloss_sum,
            )
            if with_sketch
            else None
        ),
    )
    if fast is not None:
        return fast
    return _checked(s, pair, with_sketch)


def _checked(s: pb.RoundSummary, pair: Pair, with_sketch: bool) -> RoundSummary:
    """The thorough path: every check in turn, naming the field that fails."""
    calibration = None
    sk = s.sketch
    if with_sketch:
        deltas = np.asarray(sk.cell_deltas, dtype=np.int64)
        if deltas.size > 1 and deltas[1:].min() < 1:
            raise InvalidInput("sketch.cell_deltas", "gaps after the first cell must be >= 1")
        # the other repeated fields go to numpy as they are (one conversion each)
        try:
            calibration = make_sketch(
                pair.k,
                deltas.cumsum(),
                sk.cell_counts,
                sk.ece_rejected,
                sk.ece_accepted,
                sk.ece_sum_predicted,
                sk.logloss_sum,
            )
        except InvalidInput as exc:
            raise InvalidInput(f"sketch.{exc.field}", exc.problem) from None
    try:
        return make_summary(
            pair.k,
            version=int(s.coefficients_version),
            slope=float(s.slope),
            intercepts=s.intercepts,
            info=s.info,
            grad=s.grad,
            counts=s.counts,
            steps=int(s.steps),
            drafts=int(s.drafts),
            calibration=calibration,
        )
    except InvalidInput as exc:
        field = exc.field if exc.field.startswith("sketch") else f"summary.{exc.field}"
        raise InvalidInput(field, exc.problem) from None
