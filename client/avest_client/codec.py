"""Conversions between the wire messages and the client's plain values."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from avest_client.types import (
    BudgetResult,
    Calibration,
    Coefficients,
    PairInfo,
    PairKey,
    PositionCalibration,
    Registration,
    Schedule,
    ScheduleRange,
)
from avest_wire import matrix as wire
from avest_wire.rules import BUDGET_RULE_NAMES, BUDGET_RULES, UPDATE_RULE_NAMES, UPDATE_RULES
from avest_wire.v1 import estimator_pb2 as pb


def update_rule(name: str | None) -> int:
    key = (name or "").lower().replace("_", "-")
    try:
        return int(UPDATE_RULES[key])
    except KeyError:
        raise ValueError(
            f"unknown update rule {name!r}; expected tracking, vllm or recursive"
        ) from None


def budget_rule(name: str | None) -> int:
    key = (name or "").lower().replace("_", "-")
    if key == "lossless":  # the default is the lossless one
        key = ""
    try:
        return int(BUDGET_RULES[key])
    except KeyError:
        known = ", ".join(k for k in BUDGET_RULES if k)
        raise ValueError(f"unknown budget rule {name!r}; expected one of {known}") from None


def coefficients(msg: pb.Coefficients) -> Coefficients:
    ts = msg.update_time
    return Coefficients(
        version=int(msg.version),
        round=int(msg.round),
        slope=float(msg.slope),
        intercepts=tuple(float(v) for v in msg.intercepts),
        pair_id=msg.pair_id,
        update_time=ts.seconds + ts.nanos * 1e-9,
    )


def registration(msg: pb.RegisterPairResponse) -> Registration:
    return Registration(
        pair_id=msg.pair_id,
        rule=UPDATE_RULE_NAMES.get(msg.update_rule, str(msg.update_rule)),
        refit_interval=int(msg.refit_interval),
        coefficients=coefficients(msg.coefficients),
        created=bool(msg.created),
        accepts_round_summaries=bool(msg.accepts_round_summaries),
    )


def _measures(m: pb.Calibration | pb.PositionCalibration) -> dict[str, Any]:
    """The measures a pair's calibration and each of its positions carry, as fields."""
    return dict(
        count=int(m.count),
        auc=m.auc,
        logloss=m.logloss,
        ece=m.ece,
        mean_predicted=m.mean_predicted,
        observed=m.observed,
    )


def pair_info(msg: pb.Pair) -> PairInfo:
    c = msg.calibration
    return PairInfo(
        pair_id=msg.pair_id,
        key=PairKey(
            msg.key.target_model,
            msg.key.draft_model,
            msg.key.method,
            int(msg.key.num_speculative_tokens),
            dict(msg.key.labels),
        ),
        rule=UPDATE_RULE_NAMES.get(msg.update_rule, str(msg.update_rule)),
        refit_interval=int(msg.refit_interval),
        coefficients=coefficients(msg.coefficients),
        drafts_observed=int(msg.drafts_observed),
        steps_observed=int(msg.steps_observed),
        calibration=Calibration(
            **_measures(c),
            by_position=tuple(PositionCalibration(**_measures(p)) for p in c.by_position),
        ),
        cost_curve_hardware=tuple(msg.cost_curve_hardware),
    )


def matrix(data: bytes, rows: int, k: int, name: str) -> npt.NDArray[np.float32]:
    """A writable float32 ``[rows, k]`` copy of a wire matrix."""
    return wire.decode(data, rows, k, name).copy()


def budget_result(msg: pb.BudgetResponse) -> BudgetResult:
    return BudgetResult(
        budget=int(msg.budget),
        verify_lengths=np.asarray(msg.verify_lengths, dtype=np.int64),
        expected_tokens=float(msg.expected_tokens),
        cost_ms=float(msg.cost_ms),
        rule=BUDGET_RULE_NAMES.get(msg.rule, str(msg.rule)),
        lossless=bool(msg.lossless),
        coefficients_version=int(msg.coefficients_version),
        calibration_layer_served=bool(msg.calibration_layer_served),
    )


def whole(value: Any, name: str) -> int:
    """``value`` as an int; a float (``k=2.5``, even ``2.0``) or a string is refused, where
    ``int()`` would silently truncate it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    return int(value)


def register_request(
    target: str,
    draft: str,
    method: str,
    k: int,
    labels: Mapping[str, str] | None,
    rule: str | None,
    refit_interval: int,
) -> pb.RegisterPairRequest:
    return pb.RegisterPairRequest(
        key=pb.PairKey(
            target_model=target,
            draft_model=draft,
            method=method,
            num_speculative_tokens=whole(k, "k (num_speculative_tokens)"),
            labels={str(a): str(b) for a, b in (labels or {}).items()},
        ),
        update_rule=update_rule(rule),
        refit_interval=whole(refit_interval, "refit_interval"),
    )


def score_request(pair_id: str, features: npt.ArrayLike) -> pb.ScoreRequest:
    data, rows, k = wire.encode(features)
    return pb.ScoreRequest(pair_id=pair_id, features=data, rows=rows, k=k)


def budget_request(
    pair_id: str,
    confidences: npt.ArrayLike,
    scheduled: npt.ArrayLike,
    num_non_draft_tokens: int,
    num_sampling: int,
    stale_confidences: npt.ArrayLike | None,
    hardware: str,
    rule: str | None,
    min_per_request: int,
    from_features: bool = False,
) -> pb.BudgetRequest:
    """``from_features``: the two matrices are features (``features``,
    ``stale_features``), scored by the service, not confidences."""
    current, stale_name = (
        ("features", "stale_features")
        if from_features
        else (
            "confidences",
            "stale_confidences",
        )
    )
    conf, rows, k = wire.encode(confidences)
    stale = b""
    if stale_confidences is not None:
        stale, srows, sk = wire.encode(stale_confidences)
        if (srows, sk) != (rows, k):
            raise ValueError(f"{stale_name} has shape [{srows}, {sk}], {current} [{rows}, {k}]")
    sched = np.asarray(scheduled).reshape(-1)
    if sched.size and (np.any(sched < 0) or not np.all(sched == np.round(sched))):
        raise ValueError("scheduled must hold non-negative whole numbers")
    return pb.BudgetRequest(
        pair_id=pair_id,
        rows=rows,
        k=k,
        **{current: conf, stale_name: stale},
        scheduled_drafts=sched.astype(np.int64).tolist(),
        num_non_draft_tokens=int(num_non_draft_tokens),
        num_sampling_requests=int(num_sampling),
        hardware=hardware,
        rule=budget_rule(rule),
        min_drafts_per_request=int(min_per_request),
    )


def cost_points(curve: Any, name: str) -> list[pb.CostPoint]:
    """``[(size, ms), ...]``, a ``{size: ms}`` mapping or an ``[n, 2]`` array, sorted by size."""
    items: Iterable[Any] = curve.items() if isinstance(curve, Mapping) else curve
    pairs = []
    for item in items:
        try:
            size, ms = item
        except (TypeError, ValueError):
            raise ValueError(f"{name}: expected (size, ms) pairs, got {item!r}") from None
        if float(size) != int(size):
            raise ValueError(f"{name}: size {size!r} is not a whole number")
        pairs.append((int(size), float(ms)))
    pairs.sort()
    return [pb.CostPoint(size=s, ms=m) for s, m in pairs]


def schedule(msg: pb.GetScheduleResponse) -> Schedule:
    return Schedule(
        pair_id=msg.pair_id,
        hardware=msg.hardware,
        coefficients_version=int(msg.coefficients_version),
        ranges=tuple(
            ScheduleRange(
                start=int(r.range_start),
                end=int(r.range_end),
                num_speculative_tokens=int(r.num_speculative_tokens),
                adaptive_verification=bool(r.adaptive_verification),
                expected_goodput=float(r.expected_goodput),
                best_fixed_goodput=float(r.best_fixed_goodput),
            )
            for r in msg.ranges
        ),
        features=msg.features,
    )
