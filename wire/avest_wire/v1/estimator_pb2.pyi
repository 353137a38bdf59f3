import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class UpdateRule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UPDATE_RULE_UNSPECIFIED: _ClassVar[UpdateRule]
    UPDATE_RULE_VLLM: _ClassVar[UpdateRule]
    UPDATE_RULE_RECURSIVE: _ClassVar[UpdateRule]
    UPDATE_RULE_TRACKING: _ClassVar[UpdateRule]

class BudgetRule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BUDGET_RULE_UNSPECIFIED: _ClassVar[BudgetRule]
    BUDGET_RULE_STALE: _ClassVar[BudgetRule]
    BUDGET_RULE_LOSSLESS_WALK: _ClassVar[BudgetRule]
    BUDGET_RULE_ARGMAX: _ClassVar[BudgetRule]
    BUDGET_RULE_FULL: _ClassVar[BudgetRule]
UPDATE_RULE_UNSPECIFIED: UpdateRule
UPDATE_RULE_VLLM: UpdateRule
UPDATE_RULE_RECURSIVE: UpdateRule
UPDATE_RULE_TRACKING: UpdateRule
BUDGET_RULE_UNSPECIFIED: BudgetRule
BUDGET_RULE_STALE: BudgetRule
BUDGET_RULE_LOSSLESS_WALK: BudgetRule
BUDGET_RULE_ARGMAX: BudgetRule
BUDGET_RULE_FULL: BudgetRule

class PairKey(_message.Message):
    __slots__ = ("target_model", "draft_model", "method", "num_speculative_tokens", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    target_model: str
    draft_model: str
    method: str
    num_speculative_tokens: int
    labels: _containers.ScalarMap[str, str]
    def __init__(self, target_model: _Optional[str] = ..., draft_model: _Optional[str] = ..., method: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Coefficients(_message.Message):
    __slots__ = ("pair_id", "version", "round", "slope", "intercepts", "update_time", "calibration_knots", "calibration_logits", "calibration_served", "strata")
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SLOPE_FIELD_NUMBER: _ClassVar[int]
    INTERCEPTS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_TIME_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_KNOTS_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_LOGITS_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_SERVED_FIELD_NUMBER: _ClassVar[int]
    STRATA_FIELD_NUMBER: _ClassVar[int]
    pair_id: str
    version: int
    round: int
    slope: float
    intercepts: _containers.RepeatedScalarFieldContainer[float]
    update_time: _timestamp_pb2.Timestamp
    calibration_knots: _containers.RepeatedScalarFieldContainer[float]
    calibration_logits: _containers.RepeatedScalarFieldContainer[float]
    calibration_served: bool
    strata: _containers.RepeatedCompositeFieldContainer[StratumCoefficients]
    def __init__(self, pair_id: _Optional[str] = ..., version: _Optional[int] = ..., round: _Optional[int] = ..., slope: _Optional[float] = ..., intercepts: _Optional[_Iterable[float]] = ..., update_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., calibration_knots: _Optional[_Iterable[float]] = ..., calibration_logits: _Optional[_Iterable[float]] = ..., calibration_served: _Optional[bool] = ..., strata: _Optional[_Iterable[_Union[StratumCoefficients, _Mapping]]] = ...) -> None: ...

class StratumCoefficients(_message.Message):
    __slots__ = ("stratum", "slope", "intercepts", "rounds", "drafts")
    STRATUM_FIELD_NUMBER: _ClassVar[int]
    SLOPE_FIELD_NUMBER: _ClassVar[int]
    INTERCEPTS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    stratum: str
    slope: float
    intercepts: _containers.RepeatedScalarFieldContainer[float]
    rounds: int
    drafts: int
    def __init__(self, stratum: _Optional[str] = ..., slope: _Optional[float] = ..., intercepts: _Optional[_Iterable[float]] = ..., rounds: _Optional[int] = ..., drafts: _Optional[int] = ...) -> None: ...

class RegisterPairRequest(_message.Message):
    __slots__ = ("key", "update_rule", "refit_interval")
    KEY_FIELD_NUMBER: _ClassVar[int]
    UPDATE_RULE_FIELD_NUMBER: _ClassVar[int]
    REFIT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    key: PairKey
    update_rule: UpdateRule
    refit_interval: int
    def __init__(self, key: _Optional[_Union[PairKey, _Mapping]] = ..., update_rule: _Optional[_Union[UpdateRule, str]] = ..., refit_interval: _Optional[int] = ...) -> None: ...

class RegisterPairResponse(_message.Message):
    __slots__ = ("pair_id", "update_rule", "refit_interval", "coefficients", "created", "accepts_round_summaries")
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    UPDATE_RULE_FIELD_NUMBER: _ClassVar[int]
    REFIT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    COEFFICIENTS_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_ROUND_SUMMARIES_FIELD_NUMBER: _ClassVar[int]
    pair_id: str
    update_rule: UpdateRule
    refit_interval: int
    coefficients: Coefficients
    created: bool
    accepts_round_summaries: bool
    def __init__(self, pair_id: _Optional[str] = ..., update_rule: _Optional[_Union[UpdateRule, str]] = ..., refit_interval: _Optional[int] = ..., coefficients: _Optional[_Union[Coefficients, _Mapping]] = ..., created: _Optional[bool] = ..., accepts_round_summaries: _Optional[bool] = ...) -> None: ...

class ObserveRequest(_message.Message):
    __slots__ = ("pair_id", "worker_id", "sequence", "features", "rows", "k", "num_verified", "num_accepted", "exclude", "coefficients_version", "summary", "open", "strata", "stratum_index")
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    NUM_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_FIELD_NUMBER: _ClassVar[int]
    COEFFICIENTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    STRATA_FIELD_NUMBER: _ClassVar[int]
    STRATUM_INDEX_FIELD_NUMBER: _ClassVar[int]
    pair_id: str
    worker_id: str
    sequence: int
    features: bytes
    rows: int
    k: int
    num_verified: _containers.RepeatedScalarFieldContainer[int]
    num_accepted: _containers.RepeatedScalarFieldContainer[int]
    exclude: _containers.RepeatedScalarFieldContainer[bool]
    coefficients_version: int
    summary: RoundSummary
    open: bool
    strata: _containers.RepeatedScalarFieldContainer[str]
    stratum_index: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pair_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., sequence: _Optional[int] = ..., features: _Optional[bytes] = ..., rows: _Optional[int] = ..., k: _Optional[int] = ..., num_verified: _Optional[_Iterable[int]] = ..., num_accepted: _Optional[_Iterable[int]] = ..., exclude: _Optional[_Iterable[bool]] = ..., coefficients_version: _Optional[int] = ..., summary: _Optional[_Union[RoundSummary, _Mapping]] = ..., open: _Optional[bool] = ..., strata: _Optional[_Iterable[str]] = ..., stratum_index: _Optional[_Iterable[int]] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("pair_id", "worker_id", "acked_sequence")
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ACKED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    pair_id: str
    worker_id: str
    acked_sequence: int
    def __init__(self, pair_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., acked_sequence: _Optional[int] = ...) -> None: ...

class CoefficientsUpdate(_message.Message):
    __slots__ = ("coefficients", "sketch_every")
    COEFFICIENTS_FIELD_NUMBER: _ClassVar[int]
    SKETCH_EVERY_FIELD_NUMBER: _ClassVar[int]
    coefficients: Coefficients
    sketch_every: int
    def __init__(self, coefficients: _Optional[_Union[Coefficients, _Mapping]] = ..., sketch_every: _Optional[int] = ...) -> None: ...

class WorkerOpened(_message.Message):
    __slots__ = ("pair_id", "worker_id", "applied_sequence", "acked_sequence", "sketch_every")
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    APPLIED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ACKED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SKETCH_EVERY_FIELD_NUMBER: _ClassVar[int]
    pair_id: str
    worker_id: str
    applied_sequence: int
    acked_sequence: int
    sketch_every: int
    def __init__(self, pair_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., applied_sequence: _Optional[int] = ..., acked_sequence: _Optional[int] = ..., sketch_every: _Optional[int] = ...) -> None: ...

class ObserveResponse(_message.Message):
    __slots__ = ("ack", "coefficients_update", "opened")
    ACK_FIELD_NUMBER: _ClassVar[int]
    COEFFICIENTS_UPDATE_FIELD_NUMBER: _ClassVar[int]
    OPENED_FIELD_NUMBER: _ClassVar[int]
    ack: Ack
    coefficients_update: CoefficientsUpdate
    opened: WorkerOpened
    def __init__(self, ack: _Optional[_Union[Ack, _Mapping]] = ..., coefficients_update: _Optional[_Union[CoefficientsUpdate, _Mapping]] = ..., opened: _Optional[_Union[WorkerOpened, _Mapping]] = ...) -> None: ...

class GetCoefficientsRequest(_message.Message):
    __slots__ = ("pair_id",)
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    pair_id: str
    def __init__(self, pair_id: _Optional[str] = ...) -> None: ...

class GetCoefficientsResponse(_message.Message):
    __slots__ = ("coefficients",)
    COEFFICIENTS_FIELD_NUMBER: _ClassVar[int]
    coefficients: Coefficients
    def __init__(self, coefficients: _Optional[_Union[Coefficients, _Mapping]] = ...) -> None: ...

class WatchCoefficientsRequest(_message.Message):
    __slots__ = ("pair_id",)
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    pair_id: str
    def __init__(self, pair_id: _Optional[str] = ...) -> None: ...

class WatchCoefficientsResponse(_message.Message):
    __slots__ = ("coefficients",)
    COEFFICIENTS_FIELD_NUMBER: _ClassVar[int]
    coefficients: Coefficients
    def __init__(self, coefficients: _Optional[_Union[Coefficients, _Mapping]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("pair_id", "features", "rows", "k")
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    pair_id: str
    features: bytes
    rows: int
    k: int
    def __init__(self, pair_id: _Optional[str] = ..., features: _Optional[bytes] = ..., rows: _Optional[int] = ..., k: _Optional[int] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("confidences", "survival", "coefficients_version")
    CONFIDENCES_FIELD_NUMBER: _ClassVar[int]
    SURVIVAL_FIELD_NUMBER: _ClassVar[int]
    COEFFICIENTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    confidences: bytes
    survival: bytes
    coefficients_version: int
    def __init__(self, confidences: _Optional[bytes] = ..., survival: _Optional[bytes] = ..., coefficients_version: _Optional[int] = ...) -> None: ...

class BudgetRequest(_message.Message):
    __slots__ = ("pair_id", "confidences", "rows", "k", "stale_confidences", "scheduled_drafts", "num_non_draft_tokens", "num_sampling_requests", "hardware", "rule", "min_drafts_per_request", "features", "stale_features")
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCES_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    STALE_CONFIDENCES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_NON_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    MIN_DRAFTS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    STALE_FEATURES_FIELD_NUMBER: _ClassVar[int]
    pair_id: str
    confidences: bytes
    rows: int
    k: int
    stale_confidences: bytes
    scheduled_drafts: _containers.RepeatedScalarFieldContainer[int]
    num_non_draft_tokens: int
    num_sampling_requests: int
    hardware: str
    rule: BudgetRule
    min_drafts_per_request: int
    features: bytes
    stale_features: bytes
    def __init__(self, pair_id: _Optional[str] = ..., confidences: _Optional[bytes] = ..., rows: _Optional[int] = ..., k: _Optional[int] = ..., stale_confidences: _Optional[bytes] = ..., scheduled_drafts: _Optional[_Iterable[int]] = ..., num_non_draft_tokens: _Optional[int] = ..., num_sampling_requests: _Optional[int] = ..., hardware: _Optional[str] = ..., rule: _Optional[_Union[BudgetRule, str]] = ..., min_drafts_per_request: _Optional[int] = ..., features: _Optional[bytes] = ..., stale_features: _Optional[bytes] = ...) -> None: ...

class BudgetResponse(_message.Message):
    __slots__ = ("budget", "verify_lengths", "expected_tokens", "cost_ms", "rule", "lossless", "coefficients_version", "calibration_layer_served")
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    VERIFY_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COST_MS_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    LOSSLESS_FIELD_NUMBER: _ClassVar[int]
    COEFFICIENTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_LAYER_SERVED_FIELD_NUMBER: _ClassVar[int]
    budget: int
    verify_lengths: _containers.RepeatedScalarFieldContainer[int]
    expected_tokens: float
    cost_ms: float
    rule: BudgetRule
    lossless: bool
    coefficients_version: int
    calibration_layer_served: bool
    def __init__(self, budget: _Optional[int] = ..., verify_lengths: _Optional[_Iterable[int]] = ..., expected_tokens: _Optional[float] = ..., cost_ms: _Optional[float] = ..., rule: _Optional[_Union[BudgetRule, str]] = ..., lossless: _Optional[bool] = ..., coefficients_version: _Optional[int] = ..., calibration_layer_served: _Optional[bool] = ...) -> None: ...

class CostPoint(_message.Message):
    __slots__ = ("size", "ms")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MS_FIELD_NUMBER: _ClassVar[int]
    size: int
    ms: float
    def __init__(self, size: _Optional[int] = ..., ms: _Optional[float] = ...) -> None: ...

class SetCostCurvesRequest(_message.Message):
    __slots__ = ("pair_id", "hardware", "draft_curve", "verify_curve", "cudagraph_capture_limit")
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CURVE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_CURVE_FIELD_NUMBER: _ClassVar[int]
    CUDAGRAPH_CAPTURE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    pair_id: str
    hardware: str
    draft_curve: _containers.RepeatedCompositeFieldContainer[CostPoint]
    verify_curve: _containers.RepeatedCompositeFieldContainer[CostPoint]
    cudagraph_capture_limit: int
    def __init__(self, pair_id: _Optional[str] = ..., hardware: _Optional[str] = ..., draft_curve: _Optional[_Iterable[_Union[CostPoint, _Mapping]]] = ..., verify_curve: _Optional[_Iterable[_Union[CostPoint, _Mapping]]] = ..., cudagraph_capture_limit: _Optional[int] = ...) -> None: ...

class SetCostCurvesResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPairsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListPairsResponse(_message.Message):
    __slots__ = ("pairs", "next_page_token")
    PAIRS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    pairs: _containers.RepeatedCompositeFieldContainer[Pair]
    next_page_token: str
    def __init__(self, pairs: _Optional[_Iterable[_Union[Pair, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class GetPairRequest(_message.Message):
    __slots__ = ("pair_id",)
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    pair_id: str
    def __init__(self, pair_id: _Optional[str] = ...) -> None: ...

class GetPairResponse(_message.Message):
    __slots__ = ("pair",)
    PAIR_FIELD_NUMBER: _ClassVar[int]
    pair: Pair
    def __init__(self, pair: _Optional[_Union[Pair, _Mapping]] = ...) -> None: ...

class Pair(_message.Message):
    __slots__ = ("pair_id", "key", "update_rule", "refit_interval", "coefficients", "drafts_observed", "steps_observed", "calibration", "cost_curve_hardware")
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    UPDATE_RULE_FIELD_NUMBER: _ClassVar[int]
    REFIT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    COEFFICIENTS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_OBSERVED_FIELD_NUMBER: _ClassVar[int]
    STEPS_OBSERVED_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    COST_CURVE_HARDWARE_FIELD_NUMBER: _ClassVar[int]
    pair_id: str
    key: PairKey
    update_rule: UpdateRule
    refit_interval: int
    coefficients: Coefficients
    drafts_observed: int
    steps_observed: int
    calibration: Calibration
    cost_curve_hardware: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, pair_id: _Optional[str] = ..., key: _Optional[_Union[PairKey, _Mapping]] = ..., update_rule: _Optional[_Union[UpdateRule, str]] = ..., refit_interval: _Optional[int] = ..., coefficients: _Optional[_Union[Coefficients, _Mapping]] = ..., drafts_observed: _Optional[int] = ..., steps_observed: _Optional[int] = ..., calibration: _Optional[_Union[Calibration, _Mapping]] = ..., cost_curve_hardware: _Optional[_Iterable[str]] = ...) -> None: ...

class Calibration(_message.Message):
    __slots__ = ("count", "auc", "logloss", "ece", "mean_predicted", "observed", "by_position")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    AUC_FIELD_NUMBER: _ClassVar[int]
    LOGLOSS_FIELD_NUMBER: _ClassVar[int]
    ECE_FIELD_NUMBER: _ClassVar[int]
    MEAN_PREDICTED_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_FIELD_NUMBER: _ClassVar[int]
    BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    count: int
    auc: float
    logloss: float
    ece: float
    mean_predicted: float
    observed: float
    by_position: _containers.RepeatedCompositeFieldContainer[PositionCalibration]
    def __init__(self, count: _Optional[int] = ..., auc: _Optional[float] = ..., logloss: _Optional[float] = ..., ece: _Optional[float] = ..., mean_predicted: _Optional[float] = ..., observed: _Optional[float] = ..., by_position: _Optional[_Iterable[_Union[PositionCalibration, _Mapping]]] = ...) -> None: ...

class PositionCalibration(_message.Message):
    __slots__ = ("auc", "logloss", "ece", "mean_predicted", "observed", "count")
    AUC_FIELD_NUMBER: _ClassVar[int]
    LOGLOSS_FIELD_NUMBER: _ClassVar[int]
    ECE_FIELD_NUMBER: _ClassVar[int]
    MEAN_PREDICTED_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    auc: float
    logloss: float
    ece: float
    mean_predicted: float
    observed: float
    count: int
    def __init__(self, auc: _Optional[float] = ..., logloss: _Optional[float] = ..., ece: _Optional[float] = ..., mean_predicted: _Optional[float] = ..., observed: _Optional[float] = ..., count: _Optional[int] = ...) -> None: ...

class DeletePairRequest(_message.Message):
    __slots__ = ("pair_id",)
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    pair_id: str
    def __init__(self, pair_id: _Optional[str] = ...) -> None: ...

class DeletePairResponse(_message.Message):
    __slots__ = ("pair",)
    PAIR_FIELD_NUMBER: _ClassVar[int]
    pair: Pair
    def __init__(self, pair: _Optional[_Union[Pair, _Mapping]] = ...) -> None: ...

class RoundSummary(_message.Message):
    __slots__ = ("coefficients_version", "slope", "intercepts", "k", "info", "grad", "counts", "steps", "drafts", "sketch", "stratum", "reached")
    COEFFICIENTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    SLOPE_FIELD_NUMBER: _ClassVar[int]
    INTERCEPTS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    GRAD_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SKETCH_FIELD_NUMBER: _ClassVar[int]
    STRATUM_FIELD_NUMBER: _ClassVar[int]
    REACHED_FIELD_NUMBER: _ClassVar[int]
    coefficients_version: int
    slope: float
    intercepts: _containers.RepeatedScalarFieldContainer[float]
    k: int
    info: _containers.RepeatedScalarFieldContainer[float]
    grad: _containers.RepeatedScalarFieldContainer[float]
    counts: _containers.RepeatedScalarFieldContainer[float]
    steps: int
    drafts: int
    sketch: CalibrationSketch
    stratum: str
    reached: ReachedCounts
    def __init__(self, coefficients_version: _Optional[int] = ..., slope: _Optional[float] = ..., intercepts: _Optional[_Iterable[float]] = ..., k: _Optional[int] = ..., info: _Optional[_Iterable[float]] = ..., grad: _Optional[_Iterable[float]] = ..., counts: _Optional[_Iterable[float]] = ..., steps: _Optional[int] = ..., drafts: _Optional[int] = ..., sketch: _Optional[_Union[CalibrationSketch, _Mapping]] = ..., stratum: _Optional[str] = ..., reached: _Optional[_Union[ReachedCounts, _Mapping]] = ...) -> None: ...

class ReachedCounts(_message.Message):
    __slots__ = ("cell_deltas", "cell_counts")
    CELL_DELTAS_FIELD_NUMBER: _ClassVar[int]
    CELL_COUNTS_FIELD_NUMBER: _ClassVar[int]
    cell_deltas: _containers.RepeatedScalarFieldContainer[int]
    cell_counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, cell_deltas: _Optional[_Iterable[int]] = ..., cell_counts: _Optional[_Iterable[int]] = ...) -> None: ...

class CalibrationSketch(_message.Message):
    __slots__ = ("cell_deltas", "cell_counts", "ece_rejected", "ece_accepted", "ece_sum_predicted", "logloss_sum")
    CELL_DELTAS_FIELD_NUMBER: _ClassVar[int]
    CELL_COUNTS_FIELD_NUMBER: _ClassVar[int]
    ECE_REJECTED_FIELD_NUMBER: _ClassVar[int]
    ECE_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ECE_SUM_PREDICTED_FIELD_NUMBER: _ClassVar[int]
    LOGLOSS_SUM_FIELD_NUMBER: _ClassVar[int]
    cell_deltas: _containers.RepeatedScalarFieldContainer[int]
    cell_counts: _containers.RepeatedScalarFieldContainer[int]
    ece_rejected: _containers.RepeatedScalarFieldContainer[int]
    ece_accepted: _containers.RepeatedScalarFieldContainer[int]
    ece_sum_predicted: _containers.RepeatedScalarFieldContainer[float]
    logloss_sum: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, cell_deltas: _Optional[_Iterable[int]] = ..., cell_counts: _Optional[_Iterable[int]] = ..., ece_rejected: _Optional[_Iterable[int]] = ..., ece_accepted: _Optional[_Iterable[int]] = ..., ece_sum_predicted: _Optional[_Iterable[float]] = ..., logloss_sum: _Optional[_Iterable[float]] = ...) -> None: ...

class GetScheduleRequest(_message.Message):
    __slots__ = ("pair_id", "hardware")
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    pair_id: str
    hardware: str
    def __init__(self, pair_id: _Optional[str] = ..., hardware: _Optional[str] = ...) -> None: ...

class ScheduleRange(_message.Message):
    __slots__ = ("range_start", "range_end", "num_speculative_tokens", "adaptive_verification", "expected_goodput", "best_fixed_goodput")
    RANGE_START_FIELD_NUMBER: _ClassVar[int]
    RANGE_END_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_VERIFICATION_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_GOODPUT_FIELD_NUMBER: _ClassVar[int]
    BEST_FIXED_GOODPUT_FIELD_NUMBER: _ClassVar[int]
    range_start: int
    range_end: int
    num_speculative_tokens: int
    adaptive_verification: bool
    expected_goodput: float
    best_fixed_goodput: float
    def __init__(self, range_start: _Optional[int] = ..., range_end: _Optional[int] = ..., num_speculative_tokens: _Optional[int] = ..., adaptive_verification: _Optional[bool] = ..., expected_goodput: _Optional[float] = ..., best_fixed_goodput: _Optional[float] = ...) -> None: ...

class GetScheduleResponse(_message.Message):
    __slots__ = ("pair_id", "hardware", "coefficients_version", "ranges", "features")
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    COEFFICIENTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    pair_id: str
    hardware: str
    coefficients_version: int
    ranges: _containers.RepeatedCompositeFieldContainer[ScheduleRange]
    features: str
    def __init__(self, pair_id: _Optional[str] = ..., hardware: _Optional[str] = ..., coefficients_version: _Optional[int] = ..., ranges: _Optional[_Iterable[_Union[ScheduleRange, _Mapping]]] = ..., features: _Optional[str] = ...) -> None: ...
