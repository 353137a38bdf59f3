"""Offline evaluation: replay a trace predict-then-learn and measure each method.

Every draft is scored by what the method knew when it was drafted (the
coefficients in force at that step), then the step's verdicts are learned.
The measures are the core's mergeable calibration state, so the numbers here
are the ones the service reports for live traffic.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from avest.core.estimator import OnlineEstimator
from avest.core.metrics import CalibrationState, CalibrationSummary
from avest.core.mle import fit_mle
from avest.core.model import Coefficients, linear_predictor
from avest.core.rule_factory import make_rule
from avest.core.rules import RecursiveRule, VllmRule
from avest.offline.table import Column, format_columns
from avest.offline.trace import Trace

FloatArray = npt.NDArray[np.float64]

#: Methods in the order the table lists them; the bool says whether the
#: method could trim drafts losslessly (it reads only the draft distribution).
METHODS: dict[str, tuple[bool, str]] = {
    "vllm": (True, "online, vLLM 0.33's update rule (one damped Newton step per round)"),
    "recursive": (True, "online, recursive Newton filter (information carried across rounds)"),
    "tracking": (
        True,
        "online, the default rule: Newton steps from the current point with the "
        "earlier rounds' information as an adaptively discounted prior",
    ),
    "calibrated": (
        True,
        "online, the default rule with the calibration layer (a monotone map over the "
        "linear predictor, served while its recent loss beats the logistic's)",
    ),
    "mle": (True, "maximum-likelihood fit on the whole trace, scored in-sample"),
    "qmax-nofit": (True, "q_max itself as the probability, no fit"),
    "position-rate": (True, "per-position running acceptance rate, no feature"),
    "oracle": (True, "true acceptance rate given the distributions (accept_rate_dist)"),
    "lossy-sampled": (False, "online vllm rule on the sampled token's log-odds (biases output)"),
}

#: The methods replayed step by step (through ``evaluate``'s ``progress``).
ONLINE_METHODS = ("vllm", "recursive", "tracking", "calibrated")


@dataclass
class MethodResult:
    name: str
    lossless: bool
    summary: CalibrationSummary
    calibration: CalibrationState
    coefficients: Coefficients | None = None

    def as_json(self) -> dict[str, Any]:
        s = self.summary
        out: dict[str, Any] = {
            "lossless": self.lossless,
            "auc": _num(s.auc),
            "logloss": _num(s.logloss),
            "ece": _num(s.ece),
            "mean_predicted": _num(s.mean_predicted),
            "observed": _num(s.observed),
            "auc_by_position": [_num(p.auc) for p in s.by_position],
        }
        if self.coefficients is not None:
            out["slope"] = self.coefficients.slope
            out["intercepts"] = list(self.coefficients.intercepts)
        return out


@dataclass
class Report:
    trace: str
    labelled: int
    scored_labelled: int
    from_fraction: float
    refit_interval: int
    methods: dict[str, MethodResult] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        out = {n: getattr(self, n) for n in ("trace", "labelled", "scored_labelled")}
        out["from"] = self.from_fraction
        out["refit_interval"] = self.refit_interval
        out["methods"] = {n: m.as_json() for n, m in self.methods.items()}
        return out


def _num(v: float) -> float | None:
    return None if v != v else float(v)


def _logit(p: npt.ArrayLike) -> FloatArray:
    q = np.clip(np.asarray(p, dtype=np.float64), 1e-12, 1 - 1e-12)
    return np.asarray(np.log(q) - np.log1p(-q), dtype=np.float64)


@dataclass(frozen=True)
class Steps:
    """A trace cut into decode steps, with labels computed once."""

    bounds: list[tuple[int, int]]
    features: FloatArray
    observed: npt.NDArray[np.bool_]
    accepted: npt.NDArray[np.bool_]

    @classmethod
    def of(cls, trace: Trace, features: npt.ArrayLike | None = None) -> Steps:
        starts = np.concatenate(([0], np.flatnonzero(np.diff(trace.step)) + 1, [trace.rows]))
        bounds = [(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:], strict=True)]
        observed, accepted = trace.labels()
        x = trace.features if features is None else features
        return cls(bounds, np.asarray(x, dtype=np.float64), observed, accepted)


def replay_online(
    steps: Steps,
    estimator: OnlineEstimator,
    first_scored: int,
    progress: Callable[[Iterable[int]], Iterable[int]] = lambda it: it,
) -> CalibrationState:
    """Feed every step to ``estimator``; score steps from ``first_scored`` on."""
    from avest.core.estimator import Batch

    scored = CalibrationState.empty(estimator.k)
    for i in progress(range(len(steps.bounds))):
        lo, hi = steps.bounds[i]
        batch = Batch(steps.features[lo:hi], steps.observed[lo:hi], steps.accepted[lo:hi])
        if i >= first_scored:
            # What the service serves: the calibration layer's map while it is served.
            eta = linear_predictor(estimator.coefficients, batch.features)
            if estimator.recalibrator is not None:
                eta = estimator.recalibrator.apply(eta)
            scored.update(eta, batch.observed, batch.accepted)
        estimator.apply(batch)
    return scored


def _score_static(steps: Steps, eta: FloatArray, first_scored: int, k: int) -> CalibrationState:
    lo = (
        steps.bounds[first_scored][0]
        if first_scored < len(steps.bounds)
        else steps.features.shape[0]
    )
    state = CalibrationState.empty(k)
    state.update(eta[lo:], steps.observed[lo:], steps.accepted[lo:])
    return state


def _position_rate(steps: Steps, first_scored: int, k: int) -> CalibrationState:
    acc = np.zeros(k)
    seen = np.zeros(k)
    state = CalibrationState.empty(k)
    for i, (lo, hi) in enumerate(steps.bounds):
        obs, ok = steps.observed[lo:hi], steps.accepted[lo:hi]
        if i >= first_scored:
            eta = np.broadcast_to(_logit((acc + 1.0) / (seen + 2.0)), obs.shape)
            state.update(eta, obs, ok)
        seen += obs.sum(axis=0)
        acc += (obs & ok).sum(axis=0)
    return state


def evaluate(
    trace: Trace,
    name: str = "",
    refit_interval: int = 100,
    from_fraction: float = 0.0,
    forgetting: float = 0.95,
    prior: float = 1.0,
    methods: Iterable[str] | None = None,
    progress: Callable[[Iterable[int]], Iterable[int]] = lambda it: it,
) -> Report:
    """Evaluate ``methods`` (default: all the trace supports) on ``trace``."""
    if not 0.0 <= from_fraction < 1.0:
        raise ValueError(f"--from must lie in [0, 1), got {from_fraction}")
    k = trace.k
    steps = Steps.of(trace)
    first = int(round(from_fraction * len(steps.bounds)))
    lo = steps.bounds[first][0] if first < len(steps.bounds) else trace.rows
    report = Report(
        trace=name,
        labelled=int(steps.observed.sum()),
        scored_labelled=int(steps.observed[lo:].sum()),
        from_fraction=from_fraction,
        refit_interval=refit_interval,
    )
    wanted = list(methods) if methods is not None else list(METHODS)
    unknown = [m for m in wanted if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {list(METHODS)}")

    def add(method: str, state: CalibrationState, coef: Coefficients | None = None) -> None:
        report.methods[method] = MethodResult(
            method, METHODS[method][0], state.summary(), state, coef
        )

    for method in wanted:
        if method in ("vllm", "recursive"):
            rule = (
                VllmRule()
                if method == "vllm"
                else RecursiveRule(forgetting=forgetting, prior=prior)
            )
            est = OnlineEstimator(k, rule, refit_interval)
            add(method, replay_online(steps, est, first, progress), est.coefficients)
        elif method in ("tracking", "calibrated"):
            est = OnlineEstimator(
                k,
                make_rule("tracking"),
                refit_interval,
                calibrate=method == "calibrated",
            )
            add(method, replay_online(steps, est, first, progress), est.coefficients)
        elif method == "mle":
            coef, _ = fit_mle(steps.features, steps.observed, steps.accepted)
            add(
                method, _score_static(steps, linear_predictor(coef, steps.features), first, k), coef
            )
        elif method == "qmax-nofit":
            add(method, _score_static(steps, steps.features, first, k))
        elif method == "position-rate":
            add(method, _position_rate(steps, first, k))
        elif method == "oracle" and trace.accept_rate_dist is not None:
            add(method, _score_static(steps, _logit(trace.accept_rate_dist), first, k))
        elif method == "lossy-sampled" and trace.logit_q_sampled is not None:
            lossy = Steps.of(trace, trace.logit_q_sampled)
            est = OnlineEstimator(k, VllmRule(), refit_interval)
            add(method, replay_online(lossy, est, first), est.coefficients)
    return report


def format_table(report: Report) -> str:
    """The report as a fixed-width text table."""
    head = (
        f"{report.trace}: {report.labelled} labelled drafts"
        + (
            f", scoring {report.scored_labelled} from {report.from_fraction:g} on"
            if report.from_fraction
            else ""
        )
        + f", refit every {report.refit_interval} steps"
    )
    columns = (
        Column("method", "<", width=15),
        Column("AUC", width=7),
        Column("logloss", width=8),
        Column("ECE", width=7),
        Column("pred", width=6),
        Column("obs", width=6),
        Column("AUC by position / coefficients", "<", gap=2),
    )

    def f(v: float, d: int = 4) -> str:
        return f"{v:.{d}f}" if v == v else "-"

    rows: list[list[str]] = []
    for name, m in report.methods.items():
        s = m.summary
        label = name + ("" if m.lossless else " *")
        by_pos = " ".join(f"{p.auc:.3f}" if p.auc == p.auc else "-" for p in s.by_position)
        rows.append(
            [label, f(s.auc), f(s.logloss), f(s.ece), f(s.mean_predicted, 3), f(s.observed, 3)]
            + [by_pos]
        )
        if m.coefficients is not None:
            c = m.coefficients
            coefs = " ".join(f"{b:+.3f}" for b in c.intercepts)
            rows.append([*[""] * 6, f"slope {c.slope:.4f}  intercepts {coefs}"])
    lines = [head, *format_columns(columns, rows)]
    if any(not m.lossless for m in report.methods.values()):
        lines.append(
            "* not lossless: reads the sampled token; for comparison only, never for trimming"
        )
    return "\n".join(lines)
