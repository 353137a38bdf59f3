"""Each pair's draft-length schedule per hardware label, for both adapters.

The schedule (:mod:`avest.core.schedule`) is computed from what the pair holds now:
its coefficients, the recent distribution of its features and the cost curves of one
hardware label. The features are those of the drafts that reached each position,
verified or trimmed (:attr:`~avest.core.estimator.OnlineEstimator.recent_reached`: from
raw steps, and from round summaries that carry ``reached``); until
:data:`~avest.core.schedule.MIN_DRAFTS` of those reached the first position, they are
read back from the recent calibration histogram of the linear predictor at the
coefficients in force (:data:`LABELLED`), which counts the verified drafts only and so,
under adaptive verification, leans toward confident ones. Its inputs are
copied on the event loop, the computation (tens of milliseconds) runs on a worker
thread, and the result is kept per pair, hardware and coefficients version: asking
again at the same version costs nothing, and the schedule kept is the one in force
for the next computation's hysteresis (a batch size changes its length only for a
clear gain).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from avest.core.costs import CostTable
from avest.core.histogram import EtaHistogram
from avest.core.model import Coefficients
from avest.core.schedule import MIN_DRAFTS, Choice, FeatureHistogram, Schedule, compute_schedule
from avest.state.errors import Conflict, NotFound
from avest.state.pairs import Pair

#: Methods whose drafter proposes every position in one pass (its cost is paid once,
#: whatever the length); any other drafter pays per position.
PARALLEL_METHODS = frozenset({"dspark", "dflash"})
#: Where a schedule's features came from: every draft that reached each position, or
#: (workers that send no reached counts) the recent calibration's labelled drafts.
REACHED, LABELLED = "reached", "labelled"


@dataclass(frozen=True)
class ScheduledRange:
    """One range as both adapters serve it: what runs, and its expected goodput
    (tokens per second at the range's first batch size) against the best fixed length."""

    start: int
    end: int
    length: int
    adaptive: bool
    expected_goodput: float
    best_fixed_goodput: float

    def fields(self) -> dict[str, Any]:
        """By the names of the wire's ``ScheduleRange`` (and the admin API's)."""
        return {
            "range_start": self.start,
            "range_end": self.end,
            "num_speculative_tokens": self.length,
            "adaptive_verification": self.adaptive,
            "expected_goodput": self.expected_goodput,
            "best_fixed_goodput": self.best_fixed_goodput,
        }


@dataclass(frozen=True)
class PairSchedule:
    """A pair's schedule on one hardware label, at one coefficients version and the
    cost curves it was computed from."""

    pair_id: str
    hardware: str
    version: int
    schedule: Schedule
    costs: CostTable
    features: str = REACHED  # REACHED or LABELLED

    def ranges(self) -> list[ScheduledRange]:
        s = self.schedule
        fixed = [Choice(v) for v in range(s.k + 1)]
        return [
            ScheduledRange(
                r.start,
                r.end,
                r.choice.length,
                r.choice.adaptive,
                s.expected_goodput(r.start, r.choice),
                max(s.expected_goodput(r.start, c) for c in fixed),
            )
            for r in s.ranges
        ]


def drafter_of(pair: Pair) -> str:
    return "parallel" if pair.key.method.lower() in PARALLEL_METHODS else "autoregressive"


def hardware_of(pair: Pair, hardware: str | None) -> str:
    """The label named, or the pair's only one; NotFound names the labels known."""
    if hardware:
        return hardware
    if len(pair.costs) == 1:
        return next(iter(pair.costs))
    known = ", ".join(sorted(pair.costs)) or "none"
    raise NotFound(
        f"pair {pair.id} has cost curves for {len(pair.costs)} hardware labels ({known}): name one"
    )


class Schedules:
    """The schedules computed so far, the latest per pair and hardware label."""

    def __init__(self) -> None:
        self.latest: dict[tuple[str, str], PairSchedule] = {}

    async def get(self, pair: Pair, hardware: str | None = None) -> PairSchedule:
        """The pair's schedule on ``hardware``; computed off the loop when its
        coefficients moved since the last one. NotFound: no such hardware label;
        Conflict: too little evidence yet (the message says how much)."""
        label = hardware_of(pair, hardware)
        costs = pair.cost_table(label)  # NotFound names the labels known
        version = pair.estimator.version
        kept = self.latest.get((pair.id, label))
        if kept is not None and kept.version == version and kept.costs is costs:
            return kept
        coefficients = pair.estimator.coefficients
        features: FeatureHistogram | EtaHistogram = pair.estimator.recent_reached
        source = REACHED
        if features.totals()[0] < MIN_DRAFTS:
            features, source = pair.estimator.recent_calibration.histogram(), LABELLED
        drafts = float(features.totals()[0])
        if drafts < MIN_DRAFTS:
            raise Conflict(
                "pair_id",
                f"pair {pair.id} has {drafts:.0f} recent labelled drafts at the first "
                f"position; a schedule needs {MIN_DRAFTS}: send more steps first",
            )
        per_position = drafter_of(pair) == "autoregressive"
        previous = kept.schedule if kept is not None else None
        schedule = await asyncio.to_thread(
            _compute, coefficients, features, costs, per_position, previous
        )
        served = PairSchedule(pair.id, label, version, schedule, costs, source)
        self.latest[(pair.id, label)] = served
        return served

    def of(self, pair_id: str) -> list[PairSchedule]:
        """The pair's latest schedule per hardware label."""
        return [s for (pid, _), s in sorted(self.latest.items()) if pid == pair_id]

    def forget(self, pair_id: str) -> None:
        for key in [key for key in self.latest if key[0] == pair_id]:
            del self.latest[key]


def _compute(
    coefficients: Coefficients,
    recent: FeatureHistogram | EtaHistogram,
    costs: CostTable,
    per_position: bool,
    previous: Schedule | None,
) -> Schedule:
    if isinstance(recent, FeatureHistogram):
        features = recent
    else:
        features = FeatureHistogram.empty(coefficients.k)
        features.add_eta(recent, coefficients)
    return compute_schedule(
        coefficients, features, costs, per_position=per_position, previous=previous
    )
