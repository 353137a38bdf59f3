"""Plain values the client returns: no protobuf objects leak to callers."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from avest_wire.coefficients import Coefficients
from avest_wire.pair import PairKey

#: The coefficients a pair's stream serves a worker (what ``latest_coefficients()``
#: returns): the one coefficients type, with its ``version``.
Served = Coefficients


@dataclass(frozen=True)
class Registration:
    """What :meth:`register` returns: the pair's id, the rule and interval in force."""

    pair_id: str
    rule: str
    refit_interval: int
    coefficients: Coefficients
    #: True when this call created the pair.
    created: bool = False
    #: True when the service pools round summaries (false from a 0.1.0 service).
    accepts_round_summaries: bool = False


@dataclass(frozen=True)
class BudgetResult:
    """A budget decision: ``verify_lengths[r]`` drafts of request ``r`` are verified."""

    budget: int
    verify_lengths: npt.NDArray[np.int64]
    expected_tokens: float
    cost_ms: float
    rule: str
    lossless: bool
    #: When sent as features: the coefficients' version they were scored at (else 0).
    coefficients_version: int = 0
    #: When sent as features: whether the calibration layer mapped them.
    calibration_layer_served: bool = False


@dataclass(frozen=True)
class PositionCalibration:
    auc: float
    logloss: float
    ece: float
    mean_predicted: float
    observed: float
    count: int


@dataclass(frozen=True)
class Calibration:
    count: int
    auc: float
    logloss: float
    ece: float
    mean_predicted: float
    observed: float
    by_position: tuple[PositionCalibration, ...] = ()


@dataclass(frozen=True)
class PairInfo:
    """A registered pair and its state (``ListPairs`` / ``GetPair``)."""

    pair_id: str
    key: PairKey
    rule: str
    refit_interval: int
    coefficients: Coefficients
    drafts_observed: int
    steps_observed: int
    calibration: Calibration
    cost_curve_hardware: tuple[str, ...] = ()


@dataclass(frozen=True)
class PairsPage:
    """One page of ``ListPairs``: pairs in id order and the token of the next page."""

    pairs: tuple[PairInfo, ...]
    #: ``page_token`` of the next page; "" when this page holds the last pair.
    next_page_token: str = ""


@dataclass(frozen=True)
class ScheduleRange:
    """Batch sizes ``start..end`` (inclusive) and what to run there."""

    start: int
    end: int
    #: Drafts per request; 0 turns speculation off.
    num_speculative_tokens: int
    #: Whether adaptive verification is expected to pay off here.
    adaptive_verification: bool
    #: Expected tokens per second of this choice at ``start``.
    expected_goodput: float
    #: Expected tokens per second at ``start`` of the best fixed length (AV off).
    best_fixed_goodput: float


@dataclass(frozen=True)
class Schedule:
    """A pair's draft length by batch size on one hardware label (``GetSchedule``)."""

    pair_id: str
    hardware: str
    coefficients_version: int
    ranges: tuple[ScheduleRange, ...]
    #: Whose features it read: "reached" (every draft that reached each position) or
    #: "labelled" (the verified drafts alone, while workers send no reached counts);
    #: empty from a server that predates it.
    features: str = ""

    def to_vllm(self) -> list[tuple[int, int, int]]:
        """vLLM's ``speculative_config.num_speculative_tokens_per_batch_size``:
        ``(range_start, range_end, num_speculative_tokens)``, ends inclusive."""
        return [(r.start, r.end, r.num_speculative_tokens) for r in self.ranges]
