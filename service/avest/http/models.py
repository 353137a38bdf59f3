"""Response models of the admin HTTP API and their conversion from the state.

Floats that are undefined (NaN: AUC with one class, anything with no drafts)
become ``None`` (JSON ``null``).
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, Field

from avest.core.estimator import DEFAULT_RECENT_DECAY
from avest.core.metrics import CalibrationSummary, PositionSummary
from avest.state.pairs import Pair


class Status(BaseModel):
    status: str = Field(
        description="ok / ready, or why not: starting, draining, stopped, store-error"
    )
    version: str | None = Field(None, description="The avest release serving (/healthz)")
    reason: str | None = Field(None, description="Why not ready: the store error, verbatim")
    quarantined: dict[str, str] | None = Field(
        None,
        description="Pairs whose stored state failed to load (id -> reason), kept aside in "
        "the store's quarantine table; the other pairs serve",
    )


class ErrorOut(BaseModel):
    detail: str = Field(description="What went wrong, naming the offending value")


class PairKeyOut(BaseModel):
    target: str = Field(description="Target model")
    draft: str = Field(description="Draft model (or speculative method's drafter)")
    method: str = Field(description="Speculative decoding method")
    k: int = Field(description="Draft positions K (num_speculative_tokens)")
    labels: dict[str, str] = Field(description="Free-form labels of the key")


class CoefficientsOut(BaseModel):
    slope: float = Field(description="Shared slope on the feature logit(q_max)")
    intercepts: list[float] = Field(description="One intercept per draft position")


class PositionCalibrationOut(BaseModel):
    position: int = Field(description="Draft position, 0-based")
    count: float = Field(description="Labelled drafts at this position")
    auc: float | None
    logloss: float | None
    ece: float | None
    mean_predicted: float | None = Field(description="Mean predicted acceptance")
    observed: float | None = Field(
        description="Observed acceptance rate, given the position was verified"
    )


class CalibrationOut(BaseModel):
    count: float = Field(
        description="Labelled drafts the measures cover (recent_calibration: a weighted count)"
    )
    auc: float | None = Field(description="AUC; null until both outcomes are seen")
    logloss: float | None = Field(description="Mean log loss in nats; null with no drafts")
    ece: float | None = Field(description="Expected calibration error (15 bins)")
    mean_predicted: float | None
    observed: float | None
    by_position: list[PositionCalibrationOut]


class CalibrationLayerOut(BaseModel):
    served: bool = Field(
        description="Whether Score (and the pushed coefficients) apply the map: only while "
        "its recent predictive log loss beats the plain logistic's by a margin"
    )
    recent_logloss: float | None = Field(
        description="Recent mean predictive log loss of the map, nats per draft"
    )
    recent_logloss_logistic: float | None = Field(
        description="Recent mean predictive log loss of the plain logistic, nats per draft"
    )
    recent_drafts: float = Field(description="Decayed number of drafts both were scored on")
    knots: list[float] = Field(description="The map's knots on the linear predictor")
    logits: list[float] = Field(description="The mapped log-odds at each knot (as served)")


class PairOut(BaseModel):
    id: str = Field(description="Stable pair id (hash of the key)")
    key: PairKeyOut
    K: int = Field(description="Draft positions")
    rule: str = Field(description="Update rule: tracking, vllm or recursive")
    refit_interval: int = Field(description="Refit every this many observed steps")
    coefficients: CoefficientsOut
    version: int = Field(
        description="Coefficients version: +1 per applied refit and per reset; never decreases"
    )
    round: int = Field(description="Refit rounds closed")
    observed_drafts: int = Field(description="Labelled drafts observed")
    observed_steps: int = Field(description="Observe steps applied")
    steps_in_round: int = Field(description="Steps in the open round")
    last_outcome: str = Field(description="Outcome of the last refit ('' before any)")
    updated: float = Field(description="Unix time of the last applied step")
    cost_curve_hardware: list[str] = Field(description="Hardware labels with cost curves")
    calibration: CalibrationOut = Field(
        description="Every draft since registration or the last reset"
    )
    recent_calibration: CalibrationOut = Field(
        description="Recent drafts: each refit round down-weights older ones by "
        f"{DEFAULT_RECENT_DECAY:g} (a window of about 20 rounds); what the drift alerts watch"
    )
    calibration_layer: CalibrationLayerOut | None = Field(
        None, description="The pair's calibration layer over the linear predictor"
    )
    refitter: str | None = Field(
        None,
        description="Replicas (a PostgreSQL store): the replica that refits the pair, whose "
        "worker table /workers reads ('' while none does); absent on one process",
    )


class PairsOut(BaseModel):
    pairs: list[PairOut] = Field(description="One page of the pairs, ordered by id")
    next_page_token: str = Field(
        "", description="page_token of the next page; empty when this page holds the last pair"
    )


class HistoryEntryOut(BaseModel):
    version: int
    round: int
    time: float = Field(description="Unix time")
    slope: float
    intercepts: list[float]
    outcome: str = Field(description="registered, reset, applied, slope_held or rejected")


class HistoryOut(BaseModel):
    id: str
    history: list[HistoryEntryOut]


class StratumOut(BaseModel):
    stratum: str = Field(description="The stratum's name (docs/strata.md)")
    slope: float = Field(description="Served slope: its own fit shrunk toward the pair's")
    intercepts: list[float] = Field(description="Served intercepts, one per draft position")
    rounds: int = Field(description="Refits that moved the stratum on its own drafts")
    drafts: int = Field(description="Labelled drafts of the stratum applied since placed")
    idle: int = Field(description="The pair's refits since the stratum last had a draft")
    calibration: CalibrationOut = Field(
        description="Calibration of what the stratum served (predict, then learn): raw rows "
        "at its served coefficients, and the sketches of its round summaries"
    )


class StrataOut(BaseModel):
    id: str
    strata: list[StratumOut] = Field(description="In name order")
    max_strata: int = Field(description="Most strata the pair fits at once")
    fallback_rows: int = Field(
        description="Rows predicted with the pair's coefficients: their stratum found no place"
    )
    fallback_drafts: int = Field(description="Labelled drafts among the fallback rows")
    retired: int = Field(description="Strata retired for idleness")


class ReliabilityBinOut(BaseModel):
    bin: int
    lower: float
    upper: float
    count: float
    mean_predicted: float | None
    observed: float | None


class ReliabilityOut(BaseModel):
    id: str
    position: int | None = Field(description="The position, or null for all pooled")
    bins: list[ReliabilityBinOut]


# -- conversion ----------------------------------------------------------------


def finite(v: float) -> float | None:
    """NaN/inf -> None (JSON null)."""
    v = float(v)
    return v if math.isfinite(v) else None


def _measures(s: PositionSummary) -> dict[str, float | None]:
    return {name: finite(v) for name, v in s.measures().items()}


def _position(i: int, p: PositionSummary) -> PositionCalibrationOut:
    return PositionCalibrationOut(position=i, count=float(p.count), **_measures(p))


def calibration_out(s: CalibrationSummary) -> CalibrationOut:
    return CalibrationOut(
        count=float(s.count),
        **_measures(s),
        by_position=[_position(i, p) for i, p in enumerate(s.by_position)],
    )


def pair_out(pair: Pair, metrics: Any) -> PairOut:
    """``metrics``: the :class:`avest.metrics.registry.Metrics` whose summary cache to use."""
    est = pair.estimator
    return PairOut(
        id=pair.id,
        key=PairKeyOut.model_validate(pair.key, from_attributes=True),
        K=pair.k,
        rule=pair.rule_name,
        refit_interval=est.refit_interval,
        coefficients=CoefficientsOut(
            slope=est.coefficients.slope, intercepts=list(est.coefficients.intercepts)
        ),
        version=est.version,
        round=est.round,
        observed_drafts=est.drafts,
        observed_steps=est.steps,
        steps_in_round=est.steps_in_round,
        last_outcome=est.last_outcome,
        updated=pair.updated,
        cost_curve_hardware=sorted(pair.costs),
        calibration=calibration_out(metrics.summary(pair)),
        recent_calibration=calibration_out(metrics.recent_summary(pair)),
        calibration_layer=calibration_layer_out(pair),
        refitter=refitter_of(getattr(metrics, "app", None), pair),
    )


def refitter_of(app: Any, pair: Pair) -> str | None:
    replication = getattr(app, "replication", None)
    return None if replication is None else str(replication.refitter(pair))


def calibration_layer_out(pair: Pair) -> CalibrationLayerOut | None:
    layer = pair.estimator.recalibrator
    if layer is None:
        return None
    mapped, plain = layer.recent_logloss
    knots, logits = layer.export()
    return CalibrationLayerOut(
        served=layer.active,
        recent_logloss=finite(mapped),
        recent_logloss_logistic=finite(plain),
        recent_drafts=float(layer.spread[1]),
        knots=knots.tolist(),
        logits=logits.tolist(),
    )


class WorkerOut(BaseModel):
    worker_id: str = Field(description="The sender's worker id, or 'other' folding the rest")
    mode: str = Field(description="summary or raw: the kind of its last message")
    first_seen: float = Field(description="Unix time")
    last_seen: float = Field(description="Unix time")
    summaries: int
    sketches: int = Field(
        0,
        description="Round summaries that carried their calibration sketch (with more of "
        "the pair's workers streaming than --sketched-workers, one round in several does)",
    )
    raw_steps: int
    steps: int = Field(description="Decode steps covered (summaries' steps and raw steps)")
    drafts: int = Field(description="Labelled drafts")
    version: int | None = Field(description="Coefficients version of its last summary")
    lag: int = Field(description="Versions its last summary was behind the pair")
    last_summary: float | None = Field(description="Unix time of its last summary")
    last_steps: int
    last_drafts: int
    state: str = Field(
        "ok", description="ok (its data is folded) or quarantined (scored, not folded)"
    )
    score: float | None = Field(
        None,
        description="Its recent acceptance against the other workers', in standard "
        "deviations (beyond 5 it is quarantined); null until it can be judged",
    )
    quarantines: int = Field(0, description="Times quarantined")
    quarantined_steps: int = Field(0, description="Steps scored but not folded while quarantined")
    quarantined_drafts: int = Field(0, description="Their labelled drafts")
    held: int = Field(0, description="Messages held back beyond the margin before a quarantine")
    held_steps: int = Field(0, description="Their steps")
    state_since: float | None = Field(None, description="Unix time of its last change of state")


class WorkersOut(BaseModel):
    id: str
    workers: list[WorkerOut] = Field(description="Most recently seen first")
    quarantined: int = Field(0, description="Workers quarantined now")
    quarantined_steps: int = Field(
        0, description="Steps scored but not folded while their worker was quarantined"
    )
    tracked: int = Field(description="Workers remembered for the pair")
    forgotten: int = Field(description="Workers forgotten to keep the table bounded")
