"""What a fleet gains: vLLM's in-worker estimator against avest's pooled one.

A trace is replayed as a fleet of ``W`` workers: request ``r`` runs on worker
``r mod W``, so each decode step of the trace becomes one step on every
worker that holds one of its requests (in trace order, worker by worker).
Each worker restarts every ``S`` of its own steps (``S = 0``: never). Every
labelled draft is scored predict-then-learn by each estimator:

``in-worker``           vLLM today: each worker runs vLLM's rule on its own
                        steps only, from the cold start at launch and at every
                        restart, refitting every ``N`` of its own steps;
``pooled``              avest: one estimator fed by every worker's steps (one
                        pooled round, refit every ``N`` pooled steps, as the
                        service), warm across restarts (the service keeps it);
``pooled+calibration``  the same estimator's served confidences with the
                        calibration layer (identical coefficients: the layer
                        never changes the round statistics);
``pooled-cold``         pooled, but reset to the cold start with the workers
                        (at the first restart of each wave): what pooling
                        alone gives;
``pooled+strata``       when the trace carries strata (its ``stratum`` array):
                        the pooled estimator plus a coefficient set per
                        stratum (:mod:`avest.core.strata`; the pooled one's
                        coefficients are unchanged by it).

The measures are the core's :class:`CalibrationState` over every draft, and
over the drafts of each worker's first ``early`` steps after launch and after
every restart (when the in-worker estimator is coldest). With strata, every
estimator is also measured per stratum and overall with the exact measures of
:func:`avest.offline.strata.measures_by_stratum` (a stratum's calibration on its
own rows: the strata's errors cancel in the overall ECE).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from avest.core.estimator import DEFAULT_REFIT_INTERVAL, Batch, OnlineEstimator
from avest.core.metrics import CalibrationState, CalibrationSummary
from avest.core.model import linear_predictor
from avest.core.rule_factory import DEFAULT_RULE, make_rule
from avest.core.rules import VllmRule
from avest.core.strata import StratifiedEstimator
from avest.offline.evaluate import Steps
from avest.offline.strata import Measures, measures_by_stratum
from avest.offline.trace import Trace

IntArray = npt.NDArray[np.int64]

IN_WORKER = "in-worker"
POOLED = "pooled"
POOLED_CALIBRATED = "pooled+calibration"
POOLED_COLD = "pooled-cold"
POOLED_STRATA = "pooled+strata"
ESTIMATORS: dict[str, str] = {
    IN_WORKER: "vLLM today: vLLM's rule per worker, cold at launch and every restart",
    POOLED: "avest: one estimator fed by every worker, warm across restarts",
    POOLED_CALIBRATED: "avest pooled, served through the calibration layer",
    POOLED_COLD: "avest pooled, reset with the workers: pooling alone",
    POOLED_STRATA: "avest pooled, plus a coefficient set per stratum (the trace's strata)",
}
#: Steps after launch and after each restart scored in the ``early`` window.
EARLY_STEPS = 100


@dataclass(frozen=True)
class Fleet:
    """The fleet: workers, restarts, refits and the pooled estimator's rule."""

    workers: int = 8
    restart_every: int = 0
    refit_interval: int = DEFAULT_REFIT_INTERVAL
    pooled_rule: str = DEFAULT_RULE
    early: int = EARLY_STEPS
    calibrate: bool = True

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.restart_every < 0:
            raise ValueError(f"restart_every must be >= 0, got {self.restart_every}")
        if self.refit_interval < 1:
            raise ValueError("refit_interval must be >= 1")
        if self.early < 0:
            raise ValueError("early must be >= 0")
        make_rule(self.pooled_rule)  # an unknown rule fails here, before any replay

    def estimators(self) -> list[str]:
        names = [IN_WORKER, POOLED]
        if self.calibrate:
            names.append(POOLED_CALIBRATED)
        return names + [POOLED_COLD]

    def label(self) -> str:
        restarts = (
            f"restart every {self.restart_every} steps" if self.restart_every else "no restarts"
        )
        return f"W={self.workers}, {restarts}"


@dataclass(frozen=True)
class WorkerStep:
    """One step of one worker: the trace rows it serves."""

    worker: int
    rows: IntArray


def worker_steps(trace: Trace, workers: int) -> Iterator[WorkerStep]:
    """The trace's steps split among ``workers`` (request mod W), in trace order."""
    bounds = np.concatenate(([0], np.flatnonzero(np.diff(trace.step)) + 1, [trace.rows]))
    owner = trace.request % workers
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        rows = np.arange(lo, hi, dtype=np.int64)
        if workers == 1:
            yield WorkerStep(0, rows)
            continue
        who = owner[lo:hi]
        for w in np.unique(who):
            yield WorkerStep(int(w), rows[who == w])


def count_worker_steps(trace: Trace, workers: int) -> int:
    """How many steps :func:`worker_steps` yields (what :func:`evaluate_fleet` reports)."""
    if trace.rows == 0:
        return 0
    step = np.concatenate(([0], np.cumsum(np.diff(trace.step) != 0)))
    return int(np.unique(step * workers + trace.request % workers).size)


class Restarts:
    """Each worker's own step clock: when it restarts and whether a step is early."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.since = np.zeros(fleet.workers, dtype=np.int64)
        self.count = np.zeros(fleet.workers, dtype=np.int64)
        self.waves = 0

    def tick(self, worker: int) -> tuple[bool, bool]:
        """Before a step of ``worker``: ``(worker restarts now, a new wave starts)``."""
        s = self.fleet.restart_every
        restart = bool(s and self.since[worker] >= s)
        wave = False
        if restart:
            self.since[worker] = 0
            self.count[worker] += 1
            if self.count[worker] > self.waves:
                self.waves = int(self.count[worker])
                wave = True
        return restart, wave

    def early(self, worker: int) -> bool:
        return bool(self.since[worker] < self.fleet.early)

    def done(self, worker: int) -> None:
        self.since[worker] += 1


@dataclass
class Scores:
    """One estimator's calibration over every draft and over the early window."""

    overall: CalibrationState
    early: CalibrationState

    @classmethod
    def empty(cls, k: int) -> Scores:
        return cls(CalibrationState.empty(k), CalibrationState.empty(k))


@dataclass
class FleetReport:
    trace: str
    fleet: Fleet
    k: int
    worker_steps: int
    restarts: int
    scores: dict[str, Scores] = field(default_factory=dict)
    #: With strata: their names, sorted.
    strata: list[str] = field(default_factory=list)
    #: With strata: each estimator's exact measures per stratum and overall
    #: (:data:`avest.offline.strata.OVERALL`).
    by_stratum: dict[str, dict[str, Measures]] = field(default_factory=dict)

    def summaries(self) -> dict[str, tuple[CalibrationSummary, CalibrationSummary]]:
        return {n: (s.overall.summary(), s.early.summary()) for n, s in self.scores.items()}

    def as_json(self) -> dict[str, Any]:
        def num(v: float) -> float | None:
            return None if v != v else float(v)

        def block(s: CalibrationState) -> dict[str, Any]:
            m = s.summary()
            return {
                "drafts": int(s.count),
                "auc": num(m.auc),
                "logloss": num(m.logloss),
                "ece": num(m.ece),
                "mean_predicted": num(m.mean_predicted),
                "observed": num(m.observed),
            }

        f = self.fleet
        strata = {
            "strata": {
                "names": self.strata,
                "estimators": {
                    name: {s: m.as_json() for s, m in by.items()}
                    for name, by in self.by_stratum.items()
                },
            }
        }
        return {
            "trace": self.trace,
            "k": self.k,
            "workers": f.workers,
            "restart_every": f.restart_every,
            "refit_interval": f.refit_interval,
            "pooled_rule": f.pooled_rule,
            "early_steps": f.early,
            "worker_steps": self.worker_steps,
            "restarts": self.restarts,
            "estimators": {
                name: {
                    "description": ESTIMATORS[name],
                    "overall": block(s.overall),
                    "early": block(s.early),
                }
                for name, s in self.scores.items()
            },
            **(strata if self.by_stratum else {}),
        }


def pooled_estimator(k: int, fleet: Fleet) -> OnlineEstimator:
    """The pair's estimator as the service builds it (default rule, calibration layer)."""
    return OnlineEstimator(
        k, make_rule(fleet.pooled_rule), fleet.refit_interval, calibrate=fleet.calibrate
    )


def in_worker_estimator(k: int, fleet: Fleet) -> OnlineEstimator:
    """vLLM 0.33's estimator inside one worker."""
    return OnlineEstimator(k, VllmRule(), fleet.refit_interval)


def evaluate_fleet(
    trace: Trace,
    fleet: Fleet,
    name: str = "",
    progress: Callable[[int], object] | None = None,
    strata: bool | None = None,
) -> FleetReport:
    """Replay ``trace`` as ``fleet`` and score every estimator on every labelled draft;
    ``progress(1)`` after each worker step. ``strata`` (by default: when the trace
    carries a ``stratum`` array): add ``pooled+strata`` and measure every estimator
    per stratum too."""
    k = trace.k
    steps = Steps.of(trace)
    workers = [in_worker_estimator(k, fleet) for _ in range(fleet.workers)]
    pooled = pooled_estimator(k, fleet)
    cold = OnlineEstimator(k, make_rule(fleet.pooled_rule), fleet.refit_interval)
    clock = Restarts(fleet)
    names = fleet.estimators()
    stratified = None
    row_strata = trace.strata()
    if trace.stratum is not None if strata is None else strata:  # by default: if it has one
        # Wraps the pooled estimator, which it feeds exactly as before.
        stratified = StratifiedEstimator(pooled)
        names = [*names, POOLED_STRATA]
    full = {n: np.zeros_like(steps.features) for n in names} if stratified else {}
    scores = {n: Scores.empty(k) for n in names}
    count = 0
    for ws in worker_steps(trace, fleet.workers):
        restart, wave = clock.tick(ws.worker)
        if restart:
            workers[ws.worker] = in_worker_estimator(k, fleet)
        if wave:
            cold.reset()
        batch = Batch(steps.features[ws.rows], steps.observed[ws.rows], steps.accepted[ws.rows])
        etas = {
            IN_WORKER: linear_predictor(workers[ws.worker].coefficients, batch.features),
            POOLED: linear_predictor(pooled.coefficients, batch.features),
            POOLED_COLD: linear_predictor(cold.coefficients, batch.features),
        }
        if fleet.calibrate:
            etas[POOLED_CALIBRATED] = pooled.served_eta(batch.features)
        rows_strata = [str(s) for s in row_strata[ws.rows]] if stratified is not None else []
        if stratified is not None:
            etas[POOLED_STRATA] = stratified.linear_predictor(batch.features, rows_strata)
        early = clock.early(ws.worker)
        for n, eta in etas.items():
            scores[n].overall.update(eta, batch.observed, batch.accepted)
            if early:
                scores[n].early.update(eta, batch.observed, batch.accepted)
            if n in full:
                full[n][ws.rows] = eta
        for est in (workers[ws.worker], cold):
            est.apply(batch)
        if stratified is None:
            pooled.apply(batch)
        else:
            stratified.apply(batch, rows_strata)
        clock.done(ws.worker)
        count += 1
        if progress is not None:
            progress(1)
    report = FleetReport(
        name, fleet, k, count, int(clock.count.sum()), {n: scores[n] for n in names}
    )
    if stratified is not None:
        report.strata = sorted({str(s) for s in row_strata})
        report.by_stratum = {
            n: measures_by_stratum(eta, steps.observed, steps.accepted, row_strata, report.strata)
            for n, eta in full.items()
        }
    return report
