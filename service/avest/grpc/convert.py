"""Conversions between the service's state and ``avest.v1`` messages (``avest_wire.v1``)."""

from __future__ import annotations

from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from avest.core import budget as budget_rules
from avest.state.pairs import Pair
from avest.state.schedules import PairSchedule
from avest_wire.rules import BUDGET_RULE_NAMES, UPDATE_RULE_NAMES, UPDATE_RULES
from avest_wire.v1 import estimator_pb2 as pb

#: every named update rule (the empty name, UNSPECIFIED, is the service's default)
RULE_TO_PB = {name: value for name, value in UPDATE_RULES.items() if name}
RULE_FROM_PB = dict(UPDATE_RULE_NAMES)
#: UNSPECIFIED is the core's default budget rule
BUDGET_FROM_PB = {**BUDGET_RULE_NAMES, pb.BUDGET_RULE_UNSPECIFIED: budget_rules.DEFAULT_RULE}
BUDGET_TO_PB = {v: k for k, v in BUDGET_FROM_PB.items() if k != pb.BUDGET_RULE_UNSPECIFIED}


def coefficients_pb(pair: Pair, strata: bool = True) -> pb.Coefficients:
    """The pair's coefficients, with its strata's unless ``strata`` is false (a
    ``ListPairs`` page, sized without them)."""
    c = pair.coefficients
    ts = Timestamp()
    ts.FromNanoseconds(int(pair.refitted * 1e9))
    return pb.Coefficients(
        pair_id=pair.id,
        version=pair.estimator.version,
        round=pair.estimator.round,
        slope=c.slope,
        intercepts=list(c.intercepts),
        update_time=ts,
        **calibration_layer(pair),
        strata=strata_pb(pair) if strata else None,
    )


def strata_pb(pair: Pair) -> list[pb.StratumCoefficients]:
    """Each stratum's served coefficients, in name order (``Coefficients.strata``)."""
    return [
        pb.StratumCoefficients(
            stratum=name,
            slope=c.slope,
            intercepts=list(c.intercepts),
            rounds=rounds,
            drafts=drafts,
        )
        for name, c, rounds, drafts in pair.stratum_coefficients()
    ]


def calibration_layer(pair: Pair) -> dict[str, Any]:
    """The layer's fixed-size table for ``Coefficients`` (none when the pair has no layer)."""
    layer = pair.estimator.recalibrator
    if layer is None:
        return {}
    knots, logits = layer.export()
    return {
        "calibration_knots": knots.tolist(),
        "calibration_logits": logits.tolist(),
        "calibration_served": layer.active,
    }


def pair_pb(pair: Pair, strata: bool = True) -> pb.Pair:
    s = pair.estimator.calibration.summary()
    key = pair.key
    return pb.Pair(
        pair_id=pair.id,
        key=pb.PairKey(
            target_model=key.target,
            draft_model=key.draft,
            method=key.method,
            num_speculative_tokens=key.k,
            labels=dict(key.labels),
        ),
        update_rule=RULE_TO_PB[pair.rule_name],
        refit_interval=pair.estimator.refit_interval,
        coefficients=coefficients_pb(pair, strata),
        drafts_observed=pair.estimator.drafts,
        steps_observed=pair.estimator.steps,
        calibration=pb.Calibration(
            count=int(s.count),
            **s.measures(),
            by_position=[
                pb.PositionCalibration(count=int(p.count), **p.measures()) for p in s.by_position
            ],
        ),
        cost_curve_hardware=sorted(pair.costs),
    )


def schedule_pb(served: PairSchedule) -> pb.GetScheduleResponse:
    return pb.GetScheduleResponse(
        pair_id=served.pair_id,
        hardware=served.hardware,
        coefficients_version=served.version,
        ranges=[pb.ScheduleRange(**r.fields()) for r in served.ranges()],
        features=served.features,
    )
