"""Goodput simulation: what adaptive verification buys on a recorded trace.

The trace's rows are replayed in order, ``C`` rows per simulated decode step
(rows ``[jC, (j+1)C)`` form step ``j``; a remainder shorter than ``C`` is
dropped), for each concurrency ``C``. A trace too short for ``min_steps``
steps at ``C`` is cycled (its requests re-enter with their rows, in order)
until it gives ``min_steps``; the report says how many passes that took.
Every policy sees the same rows:

* ``fixed-v`` drafts and verifies ``v`` positions per request (vLLM with
  ``num_speculative_tokens = v``, no adaptive verification); ``fixed-0`` is
  speculation off;
* ``avest/<rule>`` sizes and allocates the budget with the core's budget rule
  from the confidences of an :class:`OnlineEstimator` learning online as the
  service does: predict with the coefficients in force, verify, learn the
  verdicts of what was verified, refit every ``refit_interval`` steps;
* ``avest+calibration`` the same estimator served through its calibration
  layer; ``avest+strata`` (on a trace that carries a ``stratum`` array) the
  same estimator wrapped in a :class:`~avest.core.strata.StratifiedEstimator`:
  each row's confidences from its stratum's served coefficients, every
  verdict fed to the pair's estimator as without strata and to its stratum's
  round (``avest/<rule>`` under the same budget rule is the one set), and
  ``mle+strata`` the in-sample fit of each stratum's rows (against ``mle``); ``mle`` the maximum-likelihood linear fit of the whole trace, in
  sample (what the linear model can know, against what the online estimator
  has learned so far);
* ``qmax-nofit``, ``position-rate`` and ``oracle`` (the trace's
  ``accept_rate_dist``: the best any lossless estimator can know) do the same
  under one rule (``baseline_rule``) with other confidences. The oracle is a
  ceiling on confidences, not on goodput: every rule maximises each step's
  own goodput (and the lossless walk bounds it optimistically), which is not
  quite the best long-run throughput, so a policy may beat it by a hair.

``schedule`` runs, at each concurrency, what the draft-length schedule of
:mod:`avest.core.schedule` says for it (a length, AV on or off), computed
online as the service would: from the estimator's coefficients in force and
the histogram of the features it has seen (the drafts that reached each
position, decayed by the estimator's ``recent_decay`` per refit), recomputed
at every refit with the schedule in force as ``previous`` (hysteresis). It
drafts ``K`` under AV until every position has ``MIN_DRAFTS`` drafts (then
computes the first schedule at once, with the coefficients of the last refit). Where it chooses speculation
off nothing is drafted, so nothing is learnt and the choice stays (a real
deployment keeps learning from the batch sizes that still speculate).

Adaptive policies draft all ``K`` positions, or ``d < K`` when named ``@d``
(vLLM with ``num_speculative_tokens = d`` and adaptive verification on). The
``stale`` rule sizes its budget from the previous simulated step's
confidences (vLLM copies them to the host a step or two late); that step held
other rows, but a budget size reads only the sorted survivals.

Truncation is exact with the recorded labels: acceptance at a position does
not depend on later positions, so verifying ``v`` drafts of a row that
accepted ``a`` yields ``min(a, v)`` accepted drafts plus one token from the
target. Rows recorded with fewer than ``K`` verified drafts can verify at most
those (nothing is known about the rest).

Cost accounting, identical for every policy (see ``simulate_profiles``):

* step time = draft cost + ``verify_cost[T]``;
* ``T = C + verified drafts``: every request feeds the target one non-draft
  token (its last sampled token), so ``T0 = C``; a pure-decode steady state
  (no prefill chunks in the step);
* every request samples one token from the target whatever is accepted
  (``S = C``);
* draft cost = (positions drafted) x ``draft_curve[C]`` for ``draft_per =
  position``: ``fixed-v`` drafts ``v`` positions, an adaptive policy drafts
  ``K`` (or ``d``) and pays for them whatever it trims; for ``draft_per =
  proposal`` every policy pays ``draft_curve[C]`` once. The budget rules see
  the same numbers: the draft cost of the step's proposal and the verify curve.

Throughput is output tokens (``C`` + accepted drafts per step) over simulated
time; interactivity is throughput per request (every request is in every
step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from avest.core.budget import DEFAULT_RULE, decide
from avest.core.estimator import DEFAULT_REFIT_INTERVAL, Batch, OnlineEstimator
from avest.core.mle import fit_mle
from avest.core.model import Coefficients, linear_predictor, predict
from avest.core.numeric import sigmoid
from avest.core.rule_factory import DEFAULT_RULE as DEFAULT_UPDATE_RULE
from avest.core.rule_factory import make_rule
from avest.core.schedule import (
    DEFAULT_MAX_BATCH_SIZE,
    MIN_DRAFTS,
    Choice,
    FeatureHistogram,
    Schedule,
    compute_schedule,
    reached,
)
from avest.core.strata import StratifiedEstimator
from avest.offline.simulate.profiles import CostProfile, StepCosts
from avest.offline.simulate.results import (
    BASELINES,
    CALIBRATED,
    DEFAULT_CONCURRENCY,
    SCHEDULED,
    STRATIFIED,
    STRATIFIED_MLE,
    Policy,
    Simulation,
    Totals,
    make_policies,
)
from avest.offline.trace import Trace

__all__ = [
    "BASELINES",
    "DEFAULT_CONCURRENCY",
    "Policy",
    "Simulation",
    "Totals",
    "make_policies",
    "planned_steps",
    "simulate",
    "truncate",
]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
Progress = Callable[[int], object]


def truncate(
    num_accepted: npt.ArrayLike, verify_lengths: npt.ArrayLike, k: int
) -> tuple[IntArray, BoolArray, BoolArray]:
    """Verdicts of verifying ``v`` drafts of rows that accepted ``a`` of their recorded drafts.

    Returns ``(accepted counts min(a, v), observed[R, K], accepted[R, K])``:
    the labels the estimator learns from (position ``i`` observed iff
    ``i <= min(a, v)`` and ``i < v``; accepted iff ``i < min(a, v)``). Each
    row also gets one token from the target, so it emits ``min(a, v) + 1``.
    """
    a = np.asarray(num_accepted, dtype=np.int64)
    v = np.asarray(verify_lengths, dtype=np.int64)
    got = np.minimum(a, v)
    pos = np.arange(k)[None, :]
    observed = (pos <= got[:, None]) & (pos < v[:, None])
    return got, observed, pos < got[:, None]


@dataclass(frozen=True)
class _Rows:
    """The first ``steps * c`` rows of a trace, ready for one concurrency."""

    c: int
    steps: int
    features: FloatArray
    accepted: IntArray
    scheduled: IntArray  # drafts whose fate the trace records (num_verified)
    oracle: FloatArray | None
    strata: npt.NDArray[np.str_] | None = None  # each row's stratum (a stratified trace)

    @classmethod
    def of(cls, trace: Trace, c: int, min_steps: int = 0) -> _Rows:
        steps = _steps(trace.rows, c, min_steps)
        n = steps * c
        # Rows in trace order, the trace repeated as often as it takes.
        idx = np.resize(np.arange(trace.rows), n) if n > trace.rows else np.arange(n)
        oracle = trace.accept_rate_dist
        return cls(
            c,
            steps,
            trace.features[idx].astype(np.float64),
            trace.num_accepted[idx].astype(np.int64),
            trace.num_verified[idx].astype(np.int64),
            None if oracle is None else np.clip(oracle[idx].astype(np.float64), 0.0, 1.0),
            None if trace.stratum is None else trace.stratum[idx],
        )


def _steps(rows: int, c: int, min_steps: int) -> int:
    """Steps at concurrency ``c``: the whole trace, cycled up to ``min_steps``."""
    whole = rows // c
    return max(whole, min_steps) if whole else 0


def cycles(trace: Trace, c: int, min_steps: int = 0) -> float:
    """Passes over the trace that ``min_steps`` steps at ``c`` take (1 when not cycled)."""
    steps = _steps(trace.rows, c, min_steps)
    return max(1.0, steps * c / trace.rows) if trace.rows else 1.0


class _Source(Protocol):
    def confidences(self, lo: int, hi: int, x: FloatArray) -> FloatArray: ...

    def learn(self, x: FloatArray, observed: BoolArray, accepted: BoolArray) -> None: ...


class _StrataSource:
    """Each row's confidences at its stratum's served coefficients; the verdicts
    feed the pair's estimator (as without strata) and each stratum's round."""

    def __init__(self, estimator: StratifiedEstimator, strata: npt.NDArray[np.str_]) -> None:
        self.estimator = estimator
        self.strata = strata
        self.rows: list[str] = []

    def confidences(self, lo: int, hi: int, x: FloatArray) -> FloatArray:
        self.rows = [str(s) for s in self.strata[lo:hi]]
        return sigmoid(self.estimator.linear_predictor(x, self.rows))

    def learn(self, x: FloatArray, observed: BoolArray, accepted: BoolArray) -> None:
        # The rows of the step just predicted (``confidences`` comes first).
        self.estimator.apply(Batch(x, observed, accepted), self.rows)


class _EstimatorSource:
    def __init__(self, estimator: OnlineEstimator, served: bool = False) -> None:
        self.estimator = estimator
        self.served = served

    def confidences(self, lo: int, hi: int, x: FloatArray) -> FloatArray:
        if self.served:
            return self.estimator.predict_served(x)
        return predict(self.estimator.coefficients, x)

    def learn(self, x: FloatArray, observed: BoolArray, accepted: BoolArray) -> None:
        self.estimator.apply(Batch(x, observed, accepted))


class _StaticSource:
    def __init__(self, probabilities: FloatArray) -> None:
        self.p = probabilities

    def confidences(self, lo: int, hi: int, x: FloatArray) -> FloatArray:
        return self.p[lo:hi]

    def learn(self, x: FloatArray, observed: BoolArray, accepted: BoolArray) -> None:
        return None


class _PositionRateSource:
    """``(accepted + 1) / (observed + 2)`` per position, from every verdict so far."""

    def __init__(self, k: int) -> None:
        self.hits = np.zeros(k)
        self.seen = np.zeros(k)

    def confidences(self, lo: int, hi: int, x: FloatArray) -> FloatArray:
        return np.broadcast_to((self.hits + 1.0) / (self.seen + 2.0), x.shape)

    def learn(self, x: FloatArray, observed: BoolArray, accepted: BoolArray) -> None:
        self.seen += observed.sum(axis=0)
        self.hits += (observed & accepted).sum(axis=0)


def _fixed(policy: Policy, rows: _Rows, costs: StepCosts) -> Totals:
    """A fixed length, vectorised over all steps."""
    c, steps = rows.c, rows.steps
    v = np.minimum(rows.scheduled, policy.length)
    got = np.minimum(rows.accepted, v).reshape(steps, c).sum(axis=1)
    verified = v.reshape(steps, c).sum(axis=1)
    time = steps * costs.draft_ms(c, policy.length) + float(costs.verify_ms(c + verified).sum())
    tokens = int(steps * c + got.sum())
    return Totals(c, steps, time, tokens, int(got.sum()), int(verified.sum()))


def _adaptive(
    policy: Policy,
    source: _Source,
    rows: _Rows,
    costs: StepCosts,
    passes: int,
    progress: Progress | None,
    min_per_request: int = 0,
) -> Totals:
    """One adaptive policy, step by step; only the last pass is measured."""
    c, steps, k, d = rows.c, rows.steps, costs.k, policy.drafts
    scheduled = np.minimum(rows.scheduled, d)
    budget = costs.budget(d)
    verified = np.zeros(steps, dtype=np.int64)
    got_sum = np.zeros(steps, dtype=np.int64)
    stale: FloatArray | None = None
    for p in range(passes):
        for j in range(steps):
            lo, hi = j * c, (j + 1) * c
            x = rows.features[lo:hi]
            conf = source.confidences(lo, hi, x)
            decision = decide(
                policy.rule,
                conf,
                scheduled[lo:hi],
                budget,
                c,
                c,
                stale_confidences=stale if policy.rule == "stale" else None,
                min_per_request=min_per_request,
            )
            got, observed, accepted = truncate(rows.accepted[lo:hi], decision.verify_lengths, k)
            source.learn(x, observed, accepted)
            stale = conf
            if p == passes - 1:
                verified[j] = int(decision.verify_lengths.sum())
                got_sum[j] = int(got.sum())
        if progress is not None:
            progress(steps)
    time = steps * costs.draft_ms(c, d) + float(costs.verify_ms(c + verified).sum())
    tokens = int(steps * c + got_sum.sum())
    return Totals(c, steps, time, tokens, int(got_sum.sum()), int(verified.sum()))


def _scheduled(
    policy: Policy,
    estimator: OnlineEstimator,
    rows: _Rows,
    costs: StepCosts,
    passes: int,
    progress: Progress | None,
    min_per_request: int = 0,
) -> tuple[Totals, dict[str, int]]:
    """The ``schedule`` policy, step by step; only the last pass is measured.

    Returns the totals and how many measured steps ran each choice (by name).
    """
    c, steps, k = rows.c, rows.steps, costs.k
    per_position = costs.profile.draft_per == "position"
    features = FeatureHistogram.empty(k)
    seen = np.zeros(k)  # drafts that reached each position, undecayed (the gate)
    schedule: Schedule | None = None
    choice = Choice(k, adaptive=True)
    time = 0.0
    tokens = got_total = verified_total = 0
    used: dict[str, int] = {}
    for p in range(passes):
        for j in range(steps):
            lo, hi = j * c, (j + 1) * c
            d = choice.length
            x = rows.features[lo:hi]
            scheduled = np.minimum(rows.scheduled[lo:hi], d)
            if choice.adaptive:
                conf = predict(estimator.coefficients, x)
                decision = decide(
                    policy.rule,
                    conf,
                    scheduled,
                    costs.budget(d),
                    c,
                    c,
                    min_per_request=min_per_request,
                )
                lengths = decision.verify_lengths
            else:
                lengths = scheduled
            got, observed, accepted = truncate(rows.accepted[lo:hi], lengths, k)
            if p == passes - 1:
                verified = int(lengths.sum())
                time += costs.draft_ms(c, d) + float(costs.verify_ms([c + verified])[0])
                tokens += c + int(got.sum())
                got_total += int(got.sum())
                verified_total += verified
                used[choice.name] = used.get(choice.name, 0) + 1
            if d == 0:
                continue  # nothing drafted: nothing to learn
            mask = np.zeros((c, k), dtype=bool)
            mask[:, :d] = reached(rows.accepted[lo:hi], lengths, d) & (
                np.arange(d)[None, :] < rows.scheduled[lo:hi, None]
            )
            features.add(x, mask)
            seen += mask.sum(axis=0)
            refit = estimator.apply(Batch(x, observed, accepted)) is not None
            if seen[0] < MIN_DRAFTS or not (refit or schedule is None):
                continue  # recomputed at each refit, and as soon as the evidence suffices
            schedule = compute_schedule(
                estimator.coefficients,
                features,
                costs.per_pass,
                per_position=per_position,
                proposal_length=1,
                previous=schedule,
                max_batch_size=max(DEFAULT_MAX_BATCH_SIZE, c),
                budget_rule="argmax" if policy.rule in ("argmax", "stale") else "lossless-walk",
            )
            features.scale(estimator.recent_decay)
            choice = schedule.choice_at(c)
        if progress is not None:
            progress(steps)
    totals = Totals(c, steps, time, tokens, got_total, verified_total)
    totals.refits = estimator.round
    return totals, used


def planned_steps(
    trace: Trace,
    concurrencies: Iterable[int],
    policies: Sequence[Policy],
    warmup_passes: int = 0,
    min_steps: int = 0,
) -> int:
    """Step-policy iterations ``simulate`` will report to ``progress``."""
    adaptive = sum(p.adaptive for p in policies)
    steps = sum(_steps(trace.rows, c, min_steps) for c in concurrencies)
    return steps * adaptive * (warmup_passes + 1)


def trace_mle(trace: Trace) -> Coefficients:
    """The maximum-likelihood linear fit of every recorded label of ``trace``."""
    observed, accepted = trace.labels()
    coef, _ = fit_mle(trace.features.astype(np.float64), observed, accepted)
    return coef


def strata_mle(trace: Trace) -> dict[str, Coefficients]:
    """The maximum-likelihood linear fit of each stratum's recorded labels."""
    observed, accepted = trace.labels()
    x = trace.features.astype(np.float64)
    strata = trace.strata()
    out = {}
    for name in sorted({str(s) for s in strata}):
        rows = strata == name
        out[name], _ = fit_mle(x[rows], observed[rows], accepted[rows])
    return out


def _eta_by_stratum(
    fits: dict[str, Coefficients], strata: npt.NDArray[np.str_], x: FloatArray
) -> FloatArray:
    eta = np.empty_like(x)
    for name, coef in fits.items():
        rows = strata == name
        eta[rows] = linear_predictor(coef, x[rows])
    return eta


def simulate(
    trace: Trace,
    profile: CostProfile,
    concurrencies: Iterable[int] = DEFAULT_CONCURRENCY,
    *,
    name: str = "",
    refit_interval: int = DEFAULT_REFIT_INTERVAL,
    update_rule: str = DEFAULT_UPDATE_RULE,
    forgetting: float | None = None,
    prior: float = 1.0,
    warmup_passes: int = 0,
    min_per_request: int = 0,
    baseline_rule: str = DEFAULT_RULE,
    draft_lengths: Iterable[int] | None = None,
    select: Sequence[str] | None = None,
    policies: Sequence[Policy] | None = None,
    progress: Progress | None = None,
    min_steps: int = 0,
) -> Simulation:
    """Replay ``trace`` at each concurrency under ``profile`` for every policy.

    Each adaptive policy learns from scratch (cold start) at each
    concurrency; ``warmup_passes`` replays the trace that many times first,
    learning but not measuring (a warm start from coefficients the service
    would have persisted; in-sample, but ``K + 1`` coefficients hardly overfit).
    ``min_per_request`` drafts of every request are always verified (the
    budget rules' minimum): without it a policy that trims everything learns
    nothing, since only verified drafts are labelled. A trace shorter than
    ``min_steps`` steps at a concurrency is cycled to that many
    (``Simulation.cycles``).
    """
    cs = sorted({int(c) for c in concurrencies})
    if not cs or cs[0] < 1:
        raise ValueError(f"concurrencies must be positive integers, got {cs}")
    if refit_interval < 1:
        raise ValueError("refit_interval must be >= 1")
    if warmup_passes < 0:
        raise ValueError("warmup_passes must be >= 0")
    if min_per_request < 0:
        raise ValueError("min_per_request must be >= 0")
    if min_steps < 0:
        raise ValueError("min_steps must be >= 0")
    k = trace.k
    chosen = (
        list(policies)
        if policies is not None
        else make_policies(
            k,
            trace.accept_rate_dist is not None,
            baseline_rule,
            draft_lengths,
            select,
            strata=trace.stratum is not None,
        )
    )
    sim = Simulation(
        name, k, profile, refit_interval, update_rule, warmup_passes, baseline_rule, chosen
    )
    sim.min_per_request = min_per_request
    sim.min_steps = min_steps
    costs = profile.step_costs(k, cs[-1], cs[-1] * (k + 1))
    mle: Coefficients | None = None
    fits: dict[str, Coefficients] | None = None
    for c in cs:
        rows = _Rows.of(trace, c, min_steps)
        sim.cycles[c] = round(cycles(trace, c, min_steps), 2)
        if rows.steps == 0:
            sim.skipped.append(c)
            continue
        out: dict[str, Totals] = {}
        for policy in chosen:
            if not policy.adaptive:
                out[policy.name] = _fixed(policy, rows, costs)
                continue
            estimator = None
            source: _Source
            if policy.kind == SCHEDULED:
                rule = make_rule(update_rule, forgetting=forgetting, prior=prior)
                estimator = OnlineEstimator(k, rule, refit_interval)
                out[policy.name], sim.choices[c] = _scheduled(
                    policy, estimator, rows, costs, warmup_passes + 1, progress, min_per_request
                )
                continue
            if policy.kind in ("avest", CALIBRATED):
                rule = make_rule(update_rule, forgetting=forgetting, prior=prior)
                calibrated = policy.kind == CALIBRATED
                estimator = OnlineEstimator(k, rule, refit_interval, calibrate=calibrated)
                source = _EstimatorSource(estimator, served=calibrated)
            elif policy.kind == STRATIFIED:
                if rows.strata is None:
                    continue
                rule = make_rule(update_rule, forgetting=forgetting, prior=prior)
                estimator = OnlineEstimator(k, rule, refit_interval)
                source = _StrataSource(StratifiedEstimator(estimator), rows.strata)
            elif policy.kind == "mle":
                mle = mle if mle is not None else trace_mle(trace)
                source = _StaticSource(sigmoid(linear_predictor(mle, rows.features)))
            elif policy.kind == STRATIFIED_MLE:
                if rows.strata is None:
                    continue
                fits = fits if fits is not None else strata_mle(trace)
                source = _StaticSource(sigmoid(_eta_by_stratum(fits, rows.strata, rows.features)))
            elif policy.kind == "qmax-nofit":
                source = _StaticSource(sigmoid(rows.features))
            elif policy.kind == "position-rate":
                source = _PositionRateSource(k)
            elif policy.kind == "oracle":
                if rows.oracle is None:
                    continue
                source = _StaticSource(rows.oracle)
            else:
                raise ValueError(f"unknown policy kind {policy.kind!r}")
            totals = _adaptive(
                policy, source, rows, costs, warmup_passes + 1, progress, min_per_request
            )
            if estimator is not None:
                totals.refits = estimator.round
            out[policy.name] = totals
        sim.results[c] = out
    return sim
