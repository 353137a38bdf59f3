"""Goodput of a fleet: each worker's estimator driving its own budgets.

The fleet of :mod:`avest.offline.fleet` (request ``r`` on worker ``r mod W``,
restarts every ``S`` of a worker's own steps) under one cost profile: every
worker runs ``C`` of its own rows per step (cycling its share of the trace:
requests re-enter with their rows), workers take turns step by step, and each
adaptive policy sizes and allocates every worker's budget from the
confidences of its estimator, then learns the verdicts of what it verified:

* ``in-worker``: each worker's own vLLM-rule estimator, cold at every restart;
* ``pooled`` (and ``pooled+calibration``): one estimator learning from every
  worker, warm across restarts;
* ``pooled-cold``: pooled, reset with the workers;
* ``pooled+strata`` (on a trace that carries a ``stratum`` array): pooled
  plus a coefficient set per stratum (:mod:`avest.core.strata`), each row's
  confidences from its stratum's served coefficients;
* ``oracle``: the trace's true acceptance rates (the ceiling);
* ``fixed-v`` (``v = 0..K``): no adaptive verification; ``fixed-0`` is
  speculation off.

Fleet throughput is the sum of the workers' throughputs (each worker's output
tokens over its own simulated time); every policy sees the same rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from avest.core.budget import DEFAULT_RULE, decide
from avest.core.estimator import Batch, OnlineEstimator
from avest.core.model import predict
from avest.core.numeric import sigmoid
from avest.core.strata import StratifiedEstimator
from avest.offline.fleet import (
    IN_WORKER,
    POOLED,
    POOLED_CALIBRATED,
    POOLED_COLD,
    POOLED_STRATA,
    Fleet,
    Restarts,
    in_worker_estimator,
    pooled_estimator,
)
from avest.offline.simulate.engine import Progress, truncate
from avest.offline.simulate.profiles import CostProfile, StepCosts
from avest.offline.trace import Trace

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

#: Fleet steps simulated at least (cycling the trace when it is shorter).
MIN_FLEET_STEPS = 2000
ORACLE = "oracle"


@dataclass
class Goodput:
    """One policy over the whole fleet."""

    tokens: IntArray  # per worker
    time_ms: FloatArray  # per worker
    verified: int = 0

    @property
    def throughput(self) -> float:
        """Fleet output tokens per second: the workers' throughputs summed."""
        return float(np.sum(1000.0 * self.tokens / self.time_ms))


@dataclass
class FleetGoodput:
    trace: str
    fleet: Fleet
    profile: CostProfile
    concurrency: int
    steps_per_worker: int
    cycles: float
    rule: str
    results: dict[str, Goodput] = field(default_factory=dict)

    def best_fixed(self) -> str:
        fixed = {n: g for n, g in self.results.items() if n.startswith("fixed-")}
        return max(fixed, key=lambda n: fixed[n].throughput)

    def gain(self, name: str) -> float:
        return self.results[name].throughput / self.results[self.best_fixed()].throughput - 1.0

    def as_json(self) -> dict[str, Any]:
        return {
            "trace": self.trace,
            "workers": self.fleet.workers,
            "restart_every": self.fleet.restart_every,
            "profile": self.profile.name,
            "draft_per": self.profile.draft_per,
            "concurrency": self.concurrency,
            "steps_per_worker": self.steps_per_worker,
            "trace_cycles": self.cycles,
            "budget_rule": self.rule,
            "best_fixed": self.best_fixed(),
            "policies": {
                n: {
                    "throughput": g.throughput,
                    "gain_vs_best_fixed": self.gain(n),
                    "verified": g.verified,
                }
                for n, g in self.results.items()
            },
        }


class _Shares:
    """Each worker's rows, cycled: step ``j`` of worker ``w`` is ``C`` consecutive rows."""

    def __init__(self, trace: Trace, workers: int, c: int, steps: int) -> None:
        owner = trace.request % workers
        self.rows = []
        for w in range(workers):
            mine = np.flatnonzero(owner == w)
            if mine.size == 0:
                raise ValueError(f"worker {w} of {workers} serves no request of the trace")
            need = steps * c
            self.rows.append(np.resize(mine, need).reshape(steps, c))
        self.cycles = steps * c * workers / trace.rows

    def step(self, worker: int, j: int) -> IntArray:
        return np.asarray(self.rows[worker][j], dtype=np.int64)


def default_steps(trace: Trace, fleet: Fleet, c: int) -> int:
    """Steps per worker: at least the whole share, ``MIN_FLEET_STEPS`` in all, 4 restarts."""
    share = max(
        int(np.count_nonzero(trace.request % fleet.workers == w)) for w in range(fleet.workers)
    )
    return max(
        math.ceil(share / c), math.ceil(MIN_FLEET_STEPS / fleet.workers), 4 * fleet.restart_every
    )


def estimators(trace: Trace, fleet: Fleet) -> list[str]:
    """The fleet's estimators, and ``pooled+strata`` on a trace that carries strata."""
    return fleet.estimators() + ([POOLED_STRATA] if trace.stratum is not None else [])


def planned_steps(trace: Trace, fleet: Fleet, concurrency: int, steps: int | None = None) -> int:
    """Worker steps :func:`simulate_fleet` reports to ``progress``."""
    n = steps if steps is not None else default_steps(trace, fleet, concurrency)
    policies = len(estimators(trace, fleet)) + (trace.accept_rate_dist is not None)
    return n * fleet.workers * policies


def simulate_fleet(
    trace: Trace,
    fleet: Fleet,
    profile: CostProfile,
    concurrency: int,
    *,
    name: str = "",
    steps: int | None = None,
    rule: str = DEFAULT_RULE,
    progress: Progress | None = None,
) -> FleetGoodput:
    """Every policy on the same fleet; see the module docstring. ``progress(W)`` after
    each fleet step of each adaptive policy."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    k, c = trace.k, concurrency
    n = steps if steps is not None else default_steps(trace, fleet, c)
    shares = _Shares(trace, fleet.workers, c, n)
    costs = profile.step_costs(k, c, c * (k + 1))
    x = trace.features.astype(np.float64)
    accepted = trace.num_accepted.astype(np.int64)
    scheduled = trace.num_verified.astype(np.int64)
    out = FleetGoodput(name, fleet, profile, c, n, round(shares.cycles, 2), rule)
    for v in range(k + 1):
        out.results[f"fixed-{v}"] = _fixed(v, shares, fleet.workers, n, accepted, scheduled, costs)
    oracle = None if trace.accept_rate_dist is None else trace.accept_rate_dist.astype(np.float64)
    strata = trace.stratum
    for policy in estimators(trace, fleet) + ([ORACLE] if oracle is not None else []):
        out.results[policy] = _adaptive(
            policy, fleet, shares, n, x, accepted, scheduled, costs, rule, oracle, progress, strata
        )
    return out


def _fixed(
    v: int,
    shares: _Shares,
    workers: int,
    steps: int,
    accepted: IntArray,
    scheduled: IntArray,
    costs: StepCosts,
) -> Goodput:
    tokens = np.zeros(workers, dtype=np.int64)
    time = np.zeros(workers)
    verified = 0
    for w in range(workers):
        rows = shares.rows[w]
        length = np.minimum(scheduled[rows], v)
        got = np.minimum(accepted[rows], length)
        c = rows.shape[1]
        tokens[w] = steps * c + int(got.sum())
        time[w] = steps * costs.draft_ms(c, v) + float(
            costs.verify_ms(c + length.sum(axis=1)).sum()
        )
        verified += int(length.sum())
    return Goodput(tokens, time, verified)


class _Confidences:
    """The estimators behind one adaptive policy, restarted as the fleet restarts."""

    def __init__(
        self,
        policy: str,
        fleet: Fleet,
        k: int,
        oracle: FloatArray | None,
        strata: npt.NDArray[np.str_] | None = None,
    ) -> None:
        self.policy, self.fleet, self.k, self.oracle = policy, fleet, k, oracle
        self.strata = strata
        if policy == IN_WORKER:
            self.workers = [in_worker_estimator(k, fleet) for _ in range(fleet.workers)]
        elif policy in (POOLED, POOLED_CALIBRATED, POOLED_COLD, POOLED_STRATA):
            shared = pooled_estimator(k, fleet)
            if policy != POOLED_CALIBRATED:
                shared.recalibrator = None
            self.shared = shared
            if policy == POOLED_STRATA:
                if strata is None:
                    raise ValueError(f"{POOLED_STRATA} needs a trace with a stratum array")
                self.stratified = StratifiedEstimator(shared)

    def estimator(self, worker: int) -> OnlineEstimator:
        return self.workers[worker] if self.policy == IN_WORKER else self.shared

    def restart(self, worker: int, wave: bool) -> None:
        if self.policy == IN_WORKER:
            self.workers[worker] = in_worker_estimator(self.k, self.fleet)
        elif self.policy == POOLED_COLD and wave:
            self.shared.reset()

    def confidences(self, worker: int, rows: IntArray, x: FloatArray) -> FloatArray:
        if self.policy == ORACLE:
            assert self.oracle is not None
            return np.clip(self.oracle[rows], 0.0, 1.0)
        est = self.estimator(worker)
        if self.policy == POOLED_CALIBRATED:
            return est.predict_served(x)
        if self.policy == POOLED_STRATA:
            return sigmoid(self.stratified.linear_predictor(x, self.names(rows)))
        return predict(est.coefficients, x)

    def names(self, rows: IntArray) -> list[str]:
        assert self.strata is not None
        return [str(s) for s in self.strata[rows]]

    def learn(self, worker: int, rows: IntArray, batch: Batch) -> None:
        if self.policy == POOLED_STRATA:
            self.stratified.apply(batch, self.names(rows))
        elif self.policy != ORACLE:
            self.estimator(worker).apply(batch)


def _adaptive(
    policy: str,
    fleet: Fleet,
    shares: _Shares,
    steps: int,
    x_all: FloatArray,
    accepted: IntArray,
    scheduled: IntArray,
    costs: StepCosts,
    rule: str,
    oracle: FloatArray | None,
    progress: Progress | None = None,
    strata: npt.NDArray[np.str_] | None = None,
) -> Goodput:
    k = costs.k
    workers = fleet.workers
    source = _Confidences(policy, fleet, k, oracle, strata)
    clock = Restarts(fleet)
    budget = costs.budget(k)
    tokens = np.zeros(workers, dtype=np.int64)
    verified = np.zeros((workers, steps), dtype=np.int64)
    stale: list[FloatArray | None] = [None] * workers
    for j in range(steps):
        for w in range(workers):
            restart, wave = clock.tick(w)
            if restart:
                source.restart(w, wave)
            rows = shares.step(w, j)
            x = x_all[rows]
            conf = source.confidences(w, rows, x)
            c = rows.shape[0]
            decision = decide(
                rule,
                conf,
                scheduled[rows],
                budget,
                c,
                c,
                stale_confidences=stale[w] if rule == "stale" else None,
            )
            got, observed, acc = truncate(accepted[rows], decision.verify_lengths, k)
            source.learn(w, rows, Batch(x, observed, acc))
            stale[w] = conf
            tokens[w] += c + int(got.sum())
            verified[w, j] = int(decision.verify_lengths.sum())
            clock.done(w)
        if progress is not None:
            progress(workers)
    c = shares.rows[0].shape[1]
    time = np.array(
        [
            steps * costs.draft_ms(c, k) + float(costs.verify_ms(c + verified[w]).sum())
            for w in range(workers)
        ]
    )
    return Goodput(tokens, time, int(verified.sum()))


def format_goodput(results: list[FleetGoodput]) -> str:
    """Fleet throughput of each policy against the best fixed length."""
    lines: list[str] = []
    for g in results:
        best = g.best_fixed()
        lines.append(
            f"{g.trace or 'trace'}: {g.fleet.label()}, C={g.concurrency} per worker under "
            f"{g.profile.name} (draft per {g.profile.draft_per}), {g.steps_per_worker} steps per "
            f"worker (trace cycled {g.cycles:g}x), budget rule {g.rule}; best fixed {best}"
        )
        head = f"{'policy':<20} {'fleet tok/s':>11} {'vs best fixed':>13}"
        lines += [head, "-" * len(head)]
        for n, res in g.results.items():
            lines.append(f"{n:<20} {res.throughput:>11,.0f} {100 * g.gain(n):>+12.1f}%")
        lines.append("")
    return "\n".join(lines).rstrip()
