"""Strata offline: mixed traces, and calibration per stratum.

:func:`merge_traces` builds a stream of mixed batches from recorded traces:
decode step ``i`` of the merged trace holds step ``i`` of every source still
running, each row in its source's stratum (its ``stratum`` array, else the
stratum of its meta's temperature, or a label given for the source), cut to the
smallest K of the sources (the counts capped as a K-position drafter would have
earned them).

:func:`evaluate_strata` replays a trace predict-then-learn (as
:func:`avest.offline.evaluate.replay_online` does): each draft is scored by the
coefficients in force when it was drafted, then the step is learned. Methods:
``vllm`` (one coefficient set, vLLM 0.33's rule: the reference), ``one-set``
(one set, the default rule: avest today) and ``strata`` (the pair's set plus
one per stratum, :mod:`avest.core.strata`). Each is measured per stratum and
overall with the exact measures of :mod:`avest.core.exact` (AUC, log loss, ECE
over 15 equal-width bins): a stratum's calibration must be measured on its own
rows, since the strata's errors cancel in the overall ECE.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from avest.core.estimator import Batch, OnlineEstimator
from avest.core.exact import exact_auc, exact_ece, exact_log_loss
from avest.core.model import Coefficients, linear_predictor
from avest.core.numeric import sigmoid
from avest.core.rule_factory import make_rule
from avest.core.strata import StrataConfig, StratifiedEstimator
from avest.offline.evaluate import Steps
from avest.offline.table import Column, format_columns
from avest.offline.trace import OPTIONAL_ARRAYS, Trace
from avest_wire.strata import check_stratum

FloatArray = npt.NDArray[np.float64]

#: Methods in the order the table lists them.
METHODS: dict[str, str] = {
    "vllm": "one coefficient set, vLLM 0.33's update rule (the reference)",
    "one-set": "one coefficient set, the default rule (avest without strata)",
    "strata": "the pair's set plus one per stratum, shrunk toward it (avest.core.strata)",
}
#: The row of every stratum together.
OVERALL = "(all)"


def cut_to_k(trace: Trace, k: int) -> Trace:
    """``trace`` with its first ``k`` positions: features cut, ``num_verified``
    capped at ``k`` and ``num_accepted`` at the new ``num_verified`` (what a
    drafter of ``k`` tokens would have earned: the first ``k`` verdicts are the same)."""
    if not 1 <= k <= trace.k:
        raise ValueError(f"k must lie in [1, {trace.k}], got {k}")
    d = np.minimum(trace.num_verified, k).astype(np.int32)
    extra = {name: a[:, :k] for name, a in trace.optional_arrays().items()}
    return Trace(
        features=trace.features[:, :k],
        num_verified=d,
        num_accepted=np.minimum(trace.num_accepted, d).astype(np.int32),
        step=trace.step,
        request=trace.request,
        meta={**trace.meta, "num_speculative_tokens": k},
        stratum=trace.stratum,
        **extra,
    )


def reverse_steps(trace: Trace) -> Trace:
    """``trace`` with its decode steps in reverse order (a variant: the end first)."""
    steps = list(trace.steps())[::-1]
    return _concat(steps, trace.meta, np.arange(len(steps)))


def _concat(parts: Sequence[Trace], meta: dict[str, Any], step_of_part: npt.ArrayLike) -> Trace:
    """One trace of ``parts``' rows in order, part ``j``'s rows at step ``step_of_part[j]``."""
    steps = np.asarray(step_of_part, dtype=np.int64)
    common = [n for n in OPTIONAL_ARRAYS if all(getattr(p, n) is not None for p in parts)]
    return Trace(
        features=np.concatenate([p.features for p in parts]),
        num_verified=np.concatenate([p.num_verified for p in parts]),
        num_accepted=np.concatenate([p.num_accepted for p in parts]),
        step=np.concatenate(
            [np.full(p.rows, s, np.int64) for p, s in zip(parts, steps, strict=True)]
        ),
        request=np.concatenate([p.request for p in parts]),
        meta=meta,
        stratum=np.concatenate([p.strata() for p in parts]),
        **{n: np.concatenate([getattr(p, n) for p in parts]) for n in common},
    )


def merge_traces(
    sources: Sequence[Trace],
    labels: Sequence[str | None] | None = None,
    names: Sequence[str] | None = None,
    k: int | None = None,
    longest: bool = False,
) -> Trace:
    """Merge ``sources`` step by step into one trace of mixed batches.

    Step ``i`` holds step ``i`` of every source, in source order, until the
    shortest source ends (every batch mixed), or with ``longest`` until the
    longest does (the sources that ended leave the batches);
    requests are renumbered so that no two sources share one. Each row's stratum
    is ``labels[j]`` when given for its source ``j``, else its source's own
    (:meth:`Trace.strata`). ``k``: the K of the result, at most (and by default)
    the smallest K of the sources. ``names`` (the sources' file names) go into
    the meta, beside each source's target, drafter and temperature.
    """
    if not sources:
        raise ValueError("no traces to merge")
    labels = list(labels) if labels is not None else [None] * len(sources)
    names = list(names) if names is not None else [f"trace{j}" for j in range(len(sources))]
    if len(labels) != len(sources) or len(names) != len(sources):
        raise ValueError("give one label and one name per trace")
    smallest = min(t.k for t in sources)
    k = smallest if k is None else k
    if not 1 <= k <= smallest:
        raise ValueError(f"k must lie in [1, {smallest}] (the smallest K of the traces), got {k}")
    prepared: list[list[Trace]] = []
    offset = 0
    for trace, label in zip(sources, labels, strict=True):
        t = cut_to_k(trace, k)
        stratum = t.strata() if label is None else np.full(t.rows, check_stratum(label))
        requests = t.request - (int(t.request.min()) if t.rows else 0) + offset
        offset = int(requests.max()) + 1 if t.rows else offset
        t = Trace(**{**_fields(t), "request": requests, "stratum": stratum})
        prepared.append(list(t.steps()))
    parts: list[Trace] = []
    step_of_part: list[int] = []
    lengths = [len(p) for p in prepared]
    for i in range(max(lengths) if longest else min(lengths)):
        for steps in prepared:
            if i < len(steps):
                parts.append(steps[i])
                step_of_part.append(i)
    first = sources[0].meta
    meta: dict[str, Any] = {
        **{key: first[key] for key in ("format", "top_p", "method") if key in first},
        "target": " + ".join(dict.fromkeys(str(t.meta.get("target")) for t in sources)),
        "draft": " + ".join(dict.fromkeys(str(t.meta.get("draft")) for t in sources)),
        "num_speculative_tokens": k,
        # The format needs one; each row's own is its stratum's (``sources``).
        "temperature": first.get("temperature", 1.0),
        "sources": [
            {
                "name": name,
                "target": t.meta.get("target"),
                "draft": t.meta.get("draft"),
                "temperature": t.meta.get("temperature"),
                "num_speculative_tokens": t.k,
                "strata": sorted({str(s) for s in p[0].strata()}) if p else [],
                "steps": min(len(p), max(step_of_part, default=-1) + 1),
            }
            for name, t, p in zip(names, sources, prepared, strict=True)
        ],
        "note": "merged step by step (avest.offline.strata.merge_traces); each row's "
        "stratum is its source's, the meta temperature the first source's",
    }
    return _concat(parts, meta, step_of_part).validate()


def _fields(t: Trace) -> dict[str, Any]:
    return {
        "features": t.features,
        "num_verified": t.num_verified,
        "num_accepted": t.num_accepted,
        "step": t.step,
        "request": t.request,
        "meta": t.meta,
        "stratum": t.stratum,
        **t.optional_arrays(),
    }


# -- evaluation -----------------------------------------------------------------


@dataclass(frozen=True)
class Measures:
    """Exact measures over one set of drafts (NaN where undefined)."""

    drafts: int
    auc: float
    logloss: float
    ece: float
    mean_predicted: float
    observed: float

    @classmethod
    def of(cls, eta: FloatArray, y: npt.NDArray[np.bool_]) -> Measures:
        p = sigmoid(eta)
        return cls(
            drafts=int(eta.size),
            auc=exact_auc(eta, y),
            logloss=exact_log_loss(eta, y),
            ece=exact_ece(p, y),
            mean_predicted=float(p.mean()) if p.size else float("nan"),
            observed=float(y.mean()) if y.size else float("nan"),
        )

    def as_json(self) -> dict[str, Any]:
        return {
            n: (None if v != v else v)
            for n, v in (
                ("drafts", self.drafts),
                ("auc", self.auc),
                ("logloss", self.logloss),
                ("ece", self.ece),
                ("mean_predicted", self.mean_predicted),
                ("observed", self.observed),
            )
        }


@dataclass
class StrataReport:
    """Each method's measures per stratum (and :data:`OVERALL`), and its final coefficients."""

    trace: str
    from_fraction: float
    refit_interval: int
    strata: list[str]
    measures: dict[str, dict[str, Measures]] = field(default_factory=dict)
    coefficients: dict[str, dict[str, Coefficients]] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        replayed = {"trace": self.trace, "from": self.from_fraction}
        return replayed | {
            "refit_interval": self.refit_interval,
            "strata": self.strata,
            "methods": {
                method: {
                    "measures": {s: m.as_json() for s, m in by.items()},
                    "slope": {s: c.slope for s, c in self.coefficients[method].items()},
                }
                for method, by in self.measures.items()
            },
        }


def evaluate_strata(
    trace: Trace,
    name: str = "",
    refit_interval: int = 100,
    from_fraction: float = 0.0,
    methods: Sequence[str] = tuple(METHODS),
    config: StrataConfig | None = None,
    progress: Callable[[int], object] | None = None,
) -> StrataReport:
    """Replay ``trace`` online with each method; measure drafts of steps from
    ``from_fraction`` on, per stratum and overall; ``progress(1)`` after each step
    replayed (``len(methods)`` times the trace's steps in all)."""
    if not 0.0 <= from_fraction < 1.0:
        raise ValueError(f"from_fraction must lie in [0, 1), got {from_fraction}")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {list(METHODS)}")
    steps = Steps.of(trace)
    strata = trace.strata()
    names = sorted({str(s) for s in strata})
    first = int(round(from_fraction * len(steps.bounds)))
    report = StrataReport(name, from_fraction, refit_interval, names)
    for method in methods:
        eta, final = replay_strata(steps, strata, method, refit_interval, config, progress)
        lo = steps.bounds[first][0] if first < len(steps.bounds) else trace.rows
        report.measures[method] = measures_by_stratum(
            eta[lo:], steps.observed[lo:], steps.accepted[lo:], strata[lo:], names
        )
        report.coefficients[method] = final
    return report


def replay_strata(
    steps: Steps,
    strata: npt.NDArray[np.str_],
    method: str,
    refit_interval: int = 100,
    config: StrataConfig | None = None,
    progress: Callable[[int], object] | None = None,
) -> tuple[FloatArray, dict[str, Coefficients]]:
    """Each draft's linear predictor ``[R, K]`` as ``method`` served it (predict, then
    learn), and the coefficients each stratum has at the end."""
    k = steps.features.shape[1]
    pooled = OnlineEstimator(
        k, make_rule("vllm" if method == "vllm" else "tracking"), refit_interval
    )
    stratified = StratifiedEstimator(pooled, config) if method == "strata" else None
    out = np.zeros_like(steps.features)
    for lo, hi in steps.bounds:
        batch = Batch(steps.features[lo:hi], steps.observed[lo:hi], steps.accepted[lo:hi])
        rows = [str(s) for s in strata[lo:hi]]
        if stratified is None:
            out[lo:hi] = linear_predictor(pooled.coefficients, batch.features)
            pooled.apply(batch)
        else:
            out[lo:hi] = stratified.linear_predictor(batch.features, rows)
            stratified.apply(batch, rows)
        if progress is not None:
            progress(1)
    final = {s: pooled.coefficients for s in sorted({str(s) for s in strata})}
    if stratified is not None:
        final = {s: stratified.coefficients_for(s) for s in final}
    return out, final


def measures_by_stratum(
    eta: FloatArray,
    observed: npt.NDArray[np.bool_],
    accepted: npt.NDArray[np.bool_],
    strata: npt.NDArray[np.str_],
    names: Sequence[str],
) -> dict[str, Measures]:
    """Exact measures of the observed drafts of each stratum's rows, and of all (:data:`OVERALL`)."""
    out = {}
    for s in names:
        rows = strata == s
        obs = observed[rows]
        out[s] = Measures.of(eta[rows][obs], accepted[rows][obs])
    out[OVERALL] = Measures.of(eta[observed], accepted[observed])
    return out


#: A per-stratum table's measure columns (here and ``avest fleet``'s): see :func:`cells`.
MEASURE_COLUMNS = (
    Column("drafts"),
    Column("AUC", width=7),
    Column("logloss", width=8),
    Column("ECE", width=7),
)


def number(v: float, digits: int = 4) -> str:
    """A table cell: ``v`` to ``digits`` places, ``-`` where undefined."""
    return f"{v:.{digits}f}" if v == v else "-"


def cells(m: Measures, base: Measures | None) -> list[str]:
    """The cells of :data:`MEASURE_COLUMNS`, then the ECE against ``base``'s."""
    ratio = m.ece / base.ece if base is not None and base.ece > 0 else float("nan")
    return [str(m.drafts), number(m.auc), number(m.logloss), number(m.ece), number(ratio, 2)]


_COLUMNS = (
    Column("stratum", "<"),
    Column("method", "<"),
    *MEASURE_COLUMNS,
    Column("ECE/one-set"),
    Column("pred", width=6),
    Column("obs", width=6),
    Column("slope", width=6),
)


def format_strata(report: StrataReport) -> str:
    """The report as an aligned table (:func:`avest.offline.table.format_columns`): a
    block per stratum, then :data:`OVERALL`, a line per method; ``-`` where undefined."""
    head = f"{report.trace}: refit every {report.refit_interval} steps" + (
        f", scoring steps from {report.from_fraction:g} on" if report.from_fraction else ""
    )
    rows: list[list[str]] = []
    for stratum in [*report.strata, OVERALL]:
        base = report.measures.get("one-set", {}).get(stratum)
        for i, (method, by) in enumerate(report.measures.items()):
            m = by[stratum]
            coef = report.coefficients[method].get(stratum)
            rows.append(
                [
                    stratum if i == 0 else "",
                    method,
                    *cells(m, base),
                    number(m.mean_predicted, 3),
                    number(m.observed, 3),
                    number(coef.slope if coef else float("nan"), 3),
                ]
            )
    return "\n".join([head, *format_columns(_COLUMNS, rows)])


def report_json(reports: Sequence[StrataReport]) -> str:
    return json.dumps([r.as_json() for r in reports], indent=2)
