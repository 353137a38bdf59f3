"""The estimator under the service's refit gate: at most one refit per interval per pair.

The service refits a pair's round once it holds ``--refit-interval`` pooled steps
(100), but no sooner than ``--min-refit-interval-ms`` (100) after the pair's last
refit (:mod:`avest.state.admission`); the first round refits as soon as it fills.
With ``W`` workers each deciding ``--steps-per-s`` steps a second, a refit then pools
``max(100, W x steps-per-s)`` steps instead of 100. This replays each trace as the
pooled estimator of :func:`avest.offline.fleet.evaluate_fleet` sees it (request
``r`` on worker ``r mod W``, every labelled draft scored predict-then-learn), on a
simulated clock (pooled step ``i`` at ``i / (W x steps-per-s)`` seconds), once with
the gate off and once with it on, and reports both measures (over every draft, and
over the first ``--early-s`` simulated seconds) and their differences, in one run.

Besides the shared traces, variants built here: each trace with its requests'
order reversed (what is learnt early is learnt from other requests), and each with
its drafts' features shifted by +1 for the second half of its steps (a drift the
gated estimator must follow with fewer refits).

With ``--push-s`` the gated replay also paces what each worker scores with: a worker
gets the pooled coefficients at most every ``--push-s`` simulated seconds, as the
service pushes them (``--push-interval-ms``).

    python bench/bench_refit_gate.py [--traces DIR] [--workers 8 64 512]
        [--steps-per-s 30] [--gate-s 0.1] [--early-s 2.0] [--push-s 1.0] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from avest.core.estimator import DEFAULT_REFIT_INTERVAL, Batch, OnlineEstimator
from avest.core.metrics import CalibrationState
from avest.core.model import linear_predictor
from avest.core.rule_factory import DEFAULT_RULE, make_rule
from avest.offline.evaluate import Steps
from avest.offline.fleet import worker_steps
from avest.offline.trace import Trace, read_trace
from avest.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Run:
    overall: CalibrationState
    early: CalibrationState
    refits: int
    steps: int


def replay(
    trace: Trace,
    steps: Steps,
    workers: int,
    rate: float,
    gate_s: float,
    early_s: float,
    push_s: float = 0.0,
) -> Run:
    """The pooled estimator over ``trace`` split among ``workers``; refits gated by
    ``gate_s`` seconds of the simulated clock (0: every full round refits). Each worker
    scores its drafts with the coefficients it last received: with ``push_s`` > 0 a
    worker gets new ones at most that often (the service's push interval), the latest
    at its first step once the interval is over; at 0 it has every refit's at once."""
    k = trace.k
    est = OnlineEstimator(k, make_rule(DEFAULT_RULE), DEFAULT_REFIT_INTERVAL, calibrate=False)
    overall, early = CalibrationState.empty(k), CalibrationState.empty(k)
    last, refits, i = -float("inf"), 0, 0
    per_s = workers * rate
    #: per worker: the coefficients it holds and when it received them
    held: dict[int, tuple[Any, float]] = {}

    for ws in worker_steps(trace, workers):
        t = i / per_s
        if est.round_full and t - last >= gate_s:  # the owner refits a held round
            est.refit()
            last, refits = t, refits + 1
        batch = Batch(steps.features[ws.rows], steps.observed[ws.rows], steps.accepted[ws.rows])
        coefficients, received = held.get(ws.worker, (None, -float("inf")))
        if coefficients is not est.coefficients and t - received >= push_s:
            coefficients, received = est.coefficients, t
            held[ws.worker] = (coefficients, received)
        eta = linear_predictor(coefficients, batch.features)
        overall.update(eta, batch.observed, batch.accepted)
        if t < early_s:
            early.update(eta, batch.observed, batch.accepted)
        if est.apply(batch, refit=t - last >= gate_s) is not None:
            last, refits = t, refits + 1
        i += 1
    return Run(overall, early, refits, i)


def variants(trace: Trace) -> dict[str, Trace]:
    """The trace, its requests in reverse order, and a drift in its second half."""
    out = {"as recorded": trace}
    out["requests reversed"] = replace(trace, request=trace.request.max() - trace.request)
    half = trace.step >= np.median(trace.step)
    shifted = trace.features.copy()
    shifted[half] += 1.0
    out["features +1 in the second half"] = replace(trace, features=shifted)
    return out


def measures(s: CalibrationState) -> dict[str, Any]:
    m = s.summary()

    def num(v: float) -> float | None:
        return None if v != v else round(float(v), 4)

    return {"drafts": int(s.count), "logloss": num(m.logloss), "ece": num(m.ece), "auc": num(m.auc)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", type=Path, default=ROOT.parent / "shared" / "traces")
    p.add_argument("--workers", type=int, nargs="+", default=[8, 64, 512])
    p.add_argument("--steps-per-s", type=float, default=30.0, help="each worker's decode steps/s")
    p.add_argument(
        "--gate-s",
        type=float,
        default=Settings.model_fields["min_refit_interval_ms"].default / 1000.0,
        help="the min refit interval, seconds (default: the service's)",
    )
    p.add_argument("--early-s", type=float, default=2.0, help="the early window, seconds")
    p.add_argument(
        "--push-s",
        type=float,
        default=0.0,
        help="with the gate on, workers get new coefficients at most this often (the "
        "service's --push-interval-ms, in seconds; default 0: every refit's at once)",
    )
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    files = sorted(a.traces.glob("*.npz"))
    if not files:
        raise SystemExit(f"no traces (*.npz) in {a.traces}")
    rows: list[dict[str, Any]] = []
    for f in files:
        for vname, trace in variants(read_trace(f)).items():
            steps = Steps.of(trace)
            for w in a.workers:
                off = replay(trace, steps, w, a.steps_per_s, 0.0, a.early_s)
                on = replay(trace, steps, w, a.steps_per_s, a.gate_s, a.early_s, a.push_s)
                if off.steps != on.steps or off.overall.count != on.overall.count:
                    raise SystemExit(f"{f.name} {vname} W={w}: the two replays scored other drafts")
                if off.refits == 0:
                    raise SystemExit(f"{f.name} {vname} W={w}: no refit at all; nothing compared")
                row = {
                    "trace": f.stem,
                    "variant": vname,
                    "workers": w,
                    "simulated_s": round(off.steps / (w * a.steps_per_s), 1),
                    "refits": [off.refits, on.refits],
                    "overall": [measures(off.overall), measures(on.overall)],
                    "early": [measures(off.early), measures(on.early)],
                }
                rows.append(row)
                print(_line(row), file=sys.stderr, flush=True)
    if a.json:
        print(
            json.dumps(
                {"gate_s": a.gate_s, "push_s": a.push_s, "steps_per_s": a.steps_per_s, "rows": rows}
            )
        )
    else:
        print(_table(rows, a))
    return 0


def _d(a: float | None, b: float | None) -> str:
    return "—" if a is None or b is None else f"{b - a:+.4f}"


def _line(r: dict[str, Any]) -> str:
    (o0, o1), (e0, e1) = r["overall"], r["early"]
    return (
        f"{r['trace']} | {r['variant']} | W={r['workers']} | refits {r['refits'][0]} → "
        f"{r['refits'][1]} | logloss {o0['logloss']} → {o1['logloss']} | ECE {o0['ece']} → "
        f"{o1['ece']} | early logloss {e0['logloss']} → {e1['logloss']}"
    )


def _table(rows: list[dict[str, Any]], a: argparse.Namespace) -> str:
    out = [
        f"gate {a.gate_s:g} s, pushes every {a.push_s:g} s, {a.steps_per_s:g} steps/s per worker; "
        "each cell: gate off, every refit at once → gate and pushes on (difference)",
        "",
        "| trace | variant | W | s | refits | log loss | ECE | AUC | early log loss | early ECE |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        (o0, o1), (e0, e1) = r["overall"], r["early"]
        cell = [
            f"{o0['logloss']} → {o1['logloss']} ({_d(o0['logloss'], o1['logloss'])})",
            f"{o0['ece']} → {o1['ece']} ({_d(o0['ece'], o1['ece'])})",
            f"{o0['auc']} → {o1['auc']}",
            f"{e0['logloss']} → {e1['logloss']} ({_d(e0['logloss'], e1['logloss'])})",
            f"{e0['ece']} → {e1['ece']} ({_d(e0['ece'], e1['ece'])})",
        ]
        out.append(
            f"| {r['trace']} | {r['variant']} | {r['workers']} | {r['simulated_s']} | "
            f"{r['refits'][0]} → {r['refits'][1]} | " + " | ".join(cell) + " |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
