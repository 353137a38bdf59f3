"""Ablation of the default rule: remove one mechanism at a time and score it.

Every variant is the served default (``tracking`` with the calibration layer,
what ``avest evaluate --method calibrated`` scores) with one switch of
:class:`~avest.core.tracking.TrackingConfig` or
:class:`~avest.core.calibration.LayerConfig` turned off. Each trace is
replayed predict-then-learn through :func:`avest.offline.evaluate.replay_online`
(the evaluator's own scoring), in ten consecutive blocks of decode steps, so
every measure comes with a paired noise estimate: the standard error of the
variant-minus-full difference over the blocks. ``second half`` is the last
five blocks (``--from 0.5``).

Traces: the three in ``--traces`` (the ones the default was chosen on), the
small engine traces in ``bench/data``, and variants made here: each shared
trace with its steps in reverse order, the three concatenated (cut to K = 5),
and synthetic traces with a known truth (stationary, drifting, an abrupt
shift of the intercepts, a fall of the slope, drafts at the +40 clamp: part
of them, or all).

    python bench/ablate_rule.py --json /tmp/ablation.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from avest.core.calibration import DEFAULT_LAYER, LayerConfig, Recalibrator
from avest.core.estimator import OnlineEstimator
from avest.core.metrics import CalibrationState
from avest.core.rule_factory import make_rule
from avest.core.tracking import DEFAULT_TRACKING, TrackingConfig
from avest.offline.evaluate import Steps, replay_online
from avest.offline.trace import Trace, read_trace

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "traces"
BLOCKS = 10


@dataclass(frozen=True)
class Variant:
    name: str
    what: str
    rule: TrackingConfig = DEFAULT_TRACKING
    layer: LayerConfig | None = DEFAULT_LAYER


def _t(**kw: Any) -> TrackingConfig:
    return replace(DEFAULT_TRACKING, **kw)


def _l(**kw: Any) -> LayerConfig:
    return replace(DEFAULT_LAYER, **kw)


VARIANTS = [
    Variant("full", "the default as served"),
    Variant("no-damping", "no vLLM count damping in the tracking step", _t(damping=0.0)),
    Variant("no-carry", "no carried information (one round's own step)", _t(carry=False)),
    Variant("no-innovation", "carried information never discounted", _t(innovation=False)),
    Variant("no-warmup", "full-length first rounds", _t(warmup_rounds=0)),
    Variant("no-trust-region", "no per-position trust region", _t(trust_region=math.inf)),
    Variant("no-slope-bound", "no bound on a fall of the slope", _t(slope_decrease=math.inf)),
    Variant("no-shadow", "the tracking step alone, no vLLM shadow", _t(shadow=False)),
    Variant("no-share", "shadow mixed by sigmoid(D) alone, no least share", _t(share=0.0)),
    Variant("no-share-fade", "the least share never fades", _t(share_fade=math.inf)),
    Variant("no-layer", "no calibration layer", layer=None),
    Variant("no-shift-discount", "layer not aged at a detected shift", layer=_l(shift_weight=0.0)),
    Variant("no-min-slope", "layer map merely monotone", layer=_l(min_slope=0.0)),
    Variant("no-serve-z", "layer served without the standard-error test", layer=_l(serve_z=0.0)),
    Variant("no-shrinkage", "layer bins not shrunk to the logistic", layer=_l(pseudo_count=1e-6)),
]


# -- traces -------------------------------------------------------------------


def _trace(x: np.ndarray, nv: np.ndarray, na: np.ndarray, step: np.ndarray) -> Trace:
    return Trace(
        features=np.asarray(x, dtype=np.float32),
        num_verified=np.asarray(nv, dtype=np.int32),
        num_accepted=np.asarray(na, dtype=np.int32),
        step=np.asarray(step, dtype=np.int64),
        request=np.arange(len(nv), dtype=np.int64),
    )


def _blocks_of(t: Trace) -> list[Trace]:
    return list(t.steps())


def reversed_steps(t: Trace) -> Trace:
    """The same batches in reverse order: the drift runs backwards."""
    parts = _blocks_of(t)[::-1]
    return _joined(parts, t.k)


def cut(t: Trace, k: int) -> Trace:
    """The first ``k`` positions: what a drafter proposing ``k`` would have had verified."""
    nv = np.minimum(t.num_verified, k)
    return _trace(t.features[:, :k], nv, np.minimum(t.num_accepted, nv), t.step)


def _joined(parts: list[Trace], k: int) -> Trace:
    x = np.concatenate([p.features[:, :k] for p in parts])
    nv = np.concatenate([np.minimum(p.num_verified, k) for p in parts])
    na = np.concatenate([np.minimum(p.num_accepted, np.minimum(p.num_verified, k)) for p in parts])
    step = np.concatenate([np.full(p.rows, i) for i, p in enumerate(parts)])
    return _trace(x, nv, na, step)


def synthetic(seed: int, kind: str, k: int = 5, n: int = 500, rows: int = 24) -> Trace:
    """Drafts from a known logistic truth; ``kind`` says how the truth moves."""
    rng = np.random.default_rng(seed)
    base = np.linspace(1.5, -0.5, k)
    xs, nvs, nas, steps = [], [], [], []
    for i in range(n):
        u = i / n
        slope, b = 1.0, base.copy()
        if kind == "drift":
            slope, b = 1.2 - 0.5 * u, base + 0.8 * u
        elif kind == "jump":
            b = base - (1.0 if u >= 0.5 else 0.0)
        elif kind == "slope-fall":
            slope, b = (1.2, base) if u < 0.5 else (0.6, base - 0.5)
        x = rng.normal(1.0, 2.5, size=(rows, k))
        if kind == "clamp":
            x[rng.random(rows) < 0.4] = 40.0  # confident drafts at vLLM's float32 clamp
        if kind == "piled":
            x[:] = 40.0  # every draft at the clamp: only the intercepts can fit
        x = x.clip(-40, 40)
        p = 1 / (1 + np.exp(-(slope * x + b)))
        if kind in ("clamp", "piled"):
            p = np.where(x >= 40.0, 0.3, p)
        ok = rng.random((rows, k)) < p
        xs.append(x)
        nvs.append(np.full(rows, k))
        nas.append(np.where(ok.all(axis=1), k, np.argmin(ok, axis=1)))
        steps.append(np.full(rows, i))
    return _trace(*(np.concatenate(a) for a in (xs, nvs, nas, steps)))


def trace_set(shared: Path) -> dict[str, Trace]:
    out: dict[str, Trace] = {}
    recorded = {p.stem.split("-")[0]: read_trace(p) for p in sorted(shared.glob("*.npz"))}
    out.update({f"{n}": t for n, t in recorded.items()})
    for p in sorted((ROOT / "bench" / "data").glob("*.npz")):
        out[f"engine:{p.stem.split('-c1x4-')[1]}"] = read_trace(p)
    out.update({f"{n} reversed": reversed_steps(t) for n, t in recorded.items()})
    if recorded:
        out["+".join(recorded) + " K=5"] = _joined(
            [s for t in recorded.values() for s in _blocks_of(t)], 5
        )
    for kind, seeds in (
        ("stationary", (1,)),
        ("drift", (2, 3, 4)),
        ("jump", (5,)),
        ("slope-fall", (6,)),
        ("clamp", (7,)),
        ("piled", (8,)),
    ):
        out.update({f"syn-{kind}:{s}": synthetic(s, kind) for s in seeds})
    return out


# -- scoring ------------------------------------------------------------------


def estimator(k: int, v: Variant, refit_interval: int) -> OnlineEstimator:
    est = OnlineEstimator(
        k, make_rule("tracking", tracking=v.rule), refit_interval, calibrate=v.layer is not None
    )
    if v.layer is not None:
        est.recalibrator = Recalibrator(v.layer)
    return est


def block_scores(t: Trace, v: Variant, refit_interval: int) -> list[CalibrationState]:
    """The evaluator's scoring, one :class:`CalibrationState` per block of steps."""
    steps = Steps.of(t)
    est = estimator(t.k, v, refit_interval)
    edges = np.linspace(0, len(steps.bounds), BLOCKS + 1).round().astype(int)
    out = []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        part = Steps(steps.bounds[lo:hi], steps.features, steps.observed, steps.accepted)
        out.append(replay_online(part, est, 0))
    return out


MEASURES = ("logloss", "ece", "auc")


def summarise(states: list[CalibrationState]) -> dict[str, float]:
    total = CalibrationState.empty(states[0].k)
    for s in states:
        total.merge(s)
    s = total.summary()
    return {"logloss": s.logloss, "ece": s.ece, "auc": s.auc}


def compare(full: list[CalibrationState], var: list[CalibrationState]) -> dict[str, Any]:
    """Measures of ``var`` on the whole trace and its second half, with the
    difference from ``full`` and the standard error of that difference over blocks."""
    out: dict[str, Any] = {}
    for part, sl in (("whole", slice(0, BLOCKS)), ("second", slice(BLOCKS // 2, BLOCKS))):
        here, base = summarise(var[sl]), summarise(full[sl])
        per_block = [
            (summarise([a]), summarise([b])) for a, b in zip(var[sl], full[sl], strict=True)
        ]
        row: dict[str, Any] = {}
        for m in MEASURES:
            d = np.array([a[m] - b[m] for a, b in per_block], dtype=np.float64)
            d = d[np.isfinite(d)]
            se = float(d.std(ddof=1) / math.sqrt(d.size)) if d.size > 1 else math.nan
            row[m] = {"value": here[m], "delta": here[m] - base[m], "se": se}
        out[part] = row
    return out


def run(refit_interval: int, shared: Path) -> dict[str, Any]:
    traces = trace_set(shared)
    results: dict[str, Any] = {"traces": {}, "variants": [v.name for v in VARIANTS]}
    for name, t in traces.items():
        started = time.perf_counter()
        full = block_scores(t, VARIANTS[0], refit_interval)
        rows = {v.name: compare(full, block_scores(t, v, refit_interval)) for v in VARIANTS}
        results["traces"][name] = rows
        print(f"{name}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return results


def _beyond(cell: dict[str, Any], sign: int) -> bool:
    """Whether a measure moved the ``sign`` way (1: worse) by more than twice its noise."""
    return any(
        sign * way * cell[m]["delta"] > 2 * cell[m]["se"]
        for m, way in (("logloss", 1), ("ece", 1), ("auc", -1))
    )


def aggregate(results: dict[str, Any], part: str) -> list[dict[str, Any]]:
    """Per variant: mean delta over the traces, its noise, and the traces that moved.

    A trace counts as worse when its log loss rises, or its ECE rises, or its AUC
    falls, by more than twice that trace's standard error (better: the reverse).
    """
    rows = []
    for v in results["variants"]:
        row: dict[str, Any] = {"variant": v}
        cells = [results["traces"][t][v][part] for t in results["traces"]]
        for m in MEASURES:
            d = np.array([c[m]["delta"] for c in cells])
            se = np.array([c[m]["se"] for c in cells])
            ok = np.isfinite(d) & np.isfinite(se)
            row[m] = float(d[ok].mean())
            row[m + "_value"] = float(np.nanmean([c[m]["value"] for c in cells]))
            row[m + "_noise"] = float(math.sqrt(float(np.sum(se[ok] ** 2))) / max(1, ok.sum()))
        row["worse"] = [t for t in results["traces"] if _beyond(results["traces"][t][v][part], 1)]
        row["better"] = [t for t in results["traces"] if _beyond(results["traces"][t][v][part], -1)]
        rows.append(row)
    return rows


def table(results: dict[str, Any]) -> str:
    lines = []
    for part in ("whole", "second"):
        lines.append(
            f"\n{part} trace: mean over {len(results['traces'])} traces; delta vs full ± noise"
        )
        lines.append(
            f"{'variant':<19} {'logloss':>8} {'Δ':>9} {'±':>7} {'ECE':>7} {'Δ':>8} {'±':>7}"
            f" {'AUC':>7} {'Δ':>8} {'±':>7}  traces worse / better beyond 2 SE"
        )
        for r in aggregate(results, part):
            lines.append(
                f"{r['variant']:<19} {r['logloss_value']:>8.4f} {r['logloss']:>+9.5f}"
                f" {r['logloss_noise']:>7.5f} {r['ece_value']:>7.4f} {r['ece']:>+8.5f}"
                f" {r['ece_noise']:>7.5f} {r['auc_value']:>7.4f} {r['auc']:>+8.5f}"
                f" {r['auc_noise']:>7.5f}  {len(r['worse'])} / {len(r['better'])}"
                + (f" (worse: {', '.join(r['worse'])})" if r["worse"] else "")
            )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--refit-interval", type=int, default=100)
    ap.add_argument("--traces", type=Path, default=SHARED, help="folder of the shared traces")
    ap.add_argument("--only", action="append", help="only these variants (and full)")
    ap.add_argument("--json", type=Path, help="write every cell here")
    args = ap.parse_args()
    if args.only:
        keep = {"full", *args.only}
        VARIANTS[:] = [v for v in VARIANTS if v.name in keep]
    results = run(args.refit_interval, args.traces)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
