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
shift of the intercepts, a fall of the slope, acceptance falling as the
feature rises, drafts at the +40 clamp: part of them, or all).

    python bench/ablate_rule.py --json /tmp/ablation.json

``--remove A --remove B ...`` also scores those mechanisms removed together,
and ``--greedy`` removes them one at a time, least costly first (by each
one's own removal), keeping a removal only while the joint variant stays
within noise of the full default (:func:`acceptable`).

``--save-full BLOCKS.npz`` writes the full default's per-block scores, and
``--before BLOCKS.npz`` scores the default against such a file written from
an earlier version of the code (its ``service`` folder first on
``PYTHONPATH``), paired block by block: the row ``after`` is this version
minus that one, e.g. before and after a mechanism is deleted:

    git archive REV service | tar -x -C /tmp/before
    PYTHONPATH=/tmp/before/service python bench/ablate_rule.py --only none \
        --seeds 8 --save-full /tmp/before.npz
    python bench/ablate_rule.py --only none --seeds 8 --before /tmp/before.npz
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


#: Each mechanism of the default and the values that switch it off: which
#: config (``rule``: :class:`TrackingConfig`, ``layer``: :class:`LayerConfig`,
#: ``layer`` with ``None``: no layer at all) and its fields.
OFF: dict[str, tuple[str, dict[str, Any] | None, str]] = {
    "damping": ("rule", {"damping": 0.0}, "no vLLM count damping in the tracking step"),
    "carry": ("rule", {"carry": False}, "no carried information (one round's own step)"),
    "innovation": ("rule", {"innovation": False}, "carried information never discounted"),
    "warmup": ("rule", {"warmup_rounds": 0}, "full-length first rounds"),
    "trust-region": ("rule", {"trust_region": math.inf}, "no per-position trust region"),
    "slope-bound": ("rule", {"slope_decrease": math.inf}, "no bound on a fall of the slope"),
    "slope-floor": ("rule", {"slope_floor": False}, "a slope step below 0 dropped, not cut at 0"),
    "layer": ("layer", None, "no calibration layer"),
    "shift-discount": ("layer", {"shift_weight": 0.0}, "layer not aged at a detected shift"),
    "shrinkage": ("layer", {"pseudo_count": 1e-6}, "layer bins not shrunk to the logistic"),
}


def without(*names: str) -> Variant:
    """The default with every mechanism in ``names`` switched off."""
    rule: dict[str, Any] = {}
    layer: dict[str, Any] | None = {}
    for n in names:
        target, fields, _ = OFF[n]
        if target == "rule":
            rule.update(fields or {})
        elif fields is None or layer is None:
            layer = None
        else:
            layer.update(fields)
    return Variant(
        "-".join(("no", *names)) if len(names) == 1 else "no " + "+".join(names),
        "; ".join(OFF[n][2] for n in names),
        replace(DEFAULT_TRACKING, **rule),
        None if layer is None else replace(DEFAULT_LAYER, **layer),
    )


FULL = Variant("full", "the default as served")
VARIANTS = [FULL, *(without(n) for n in OFF)]


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
        elif kind == "inverted":
            slope = -0.5  # acceptance falls as the drafter grows confident
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
    for kind, seeds in SYNTHETIC.items():
        out.update({f"syn-{kind}:{s}": synthetic(s, kind) for s in seeds})
    return out


#: The synthetic traces of :func:`trace_set`, by kind: their seeds.
SYNTHETIC = {
    "stationary": (1,),
    "drift": (2, 3, 4),
    "jump": (5,),
    "slope-fall": (6,),
    "inverted": (9,),
    "clamp": (7,),
    "piled": (8,),
}


def replicas(n: int) -> dict[str, list[Trace]]:
    """``n`` fresh seeds (100, 101, ...) of every synthetic kind: the noise of a
    kind's delta across seeds, where one trace's blocks cannot show it (a jump
    or a fall is one event per trace)."""
    return {kind: [synthetic(100 + i, kind) for i in range(n)] for kind in SYNTHETIC}


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


class Ablation:
    """Variants scored against the full default on one trace set (the full default
    replayed once per trace); ``results`` is what ``--json`` writes."""

    def __init__(self, refit_interval: int, shared: Path, seeds: int = 0) -> None:
        self.refit_interval = refit_interval
        self.traces = trace_set(shared)
        self.replicas = replicas(seeds) if seeds else {}
        self.full = {n: block_scores(t, FULL, refit_interval) for n, t in self.traces.items()}
        self.full_replicas = {
            kind: [block_scores(t, FULL, refit_interval) for t in ts]
            for kind, ts in self.replicas.items()
        }
        self.results: dict[str, Any] = {
            "traces": {n: {} for n in self.traces},
            "variants": [],
            "replicas": {kind: {} for kind in self.replicas},
        }

    def score(self, v: Variant) -> dict[str, Any]:
        """Score ``v`` on every trace (once) and return its aggregate row per part."""
        if v.name not in self.results["variants"]:
            started = time.perf_counter()
            for n, t in self.traces.items():
                got = block_scores(t, v, self.refit_interval)
                self.results["traces"][n][v.name] = compare(self.full[n], got)
            for kind, ts in self.replicas.items():
                self.results["replicas"][kind][v.name] = [
                    compare(full, block_scores(t, v, self.refit_interval))["second"]
                    for full, t in zip(self.full_replicas[kind], ts, strict=True)
                ]
            self.results["variants"].append(v.name)
            print(f"{v.name}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
        return {part: aggregate_one(self.results, v.name, part) for part in PARTS}

    def blocks(self) -> dict[str, list[CalibrationState]]:
        """The full default's per-block scores: each trace's, then each seed's of each kind."""
        out = dict(self.full)
        for kind, states in self.full_replicas.items():
            out.update({f"{kind}#{i}": s for i, s in enumerate(states)})
        return out

    def score_before(self, before: dict[str, list[CalibrationState]]) -> dict[str, Any]:
        """The full default scored against ``before`` (:meth:`blocks` of an earlier
        version) as the row ``after``: deltas are this version minus that one."""
        name = "after"
        for n in self.traces:
            self.results["traces"][n][name] = compare(before[n], self.full[n])
        for kind, states in self.full_replicas.items():
            self.results["replicas"][kind][name] = [
                compare(before[f"{kind}#{i}"], s)["second"] for i, s in enumerate(states)
            ]
        self.results["variants"].append(name)
        return {part: aggregate_one(self.results, name, part) for part in PARTS}

    def greedy(self, candidates: list[str]) -> list[str]:
        """The candidates removed one by one, least costly first (by their own
        removal), each kept out only while the joint removal stays :func:`acceptable`."""
        order = sorted(candidates, key=lambda n: cost(self.score(without(n))))
        out: list[str] = []
        for n in order:
            if acceptable(self.results, self.score(without(*out, n))):
                out.append(n)
        return out


PARTS = ("whole", "second")


def save_blocks(path: Path, blocks: dict[str, list[CalibrationState]]) -> None:
    """Per-block scores as one ``.npz``: ``NAME|BLOCK|ARRAY``."""
    arrays = {
        f"{n}|{i}|{a}": v
        for n, states in blocks.items()
        for i, state in enumerate(states)
        for a, v in state.to_arrays().items()
    }
    np.savez_compressed(path, **arrays)  # type: ignore[arg-type]


def load_blocks(path: Path) -> dict[str, list[CalibrationState]]:
    """:func:`save_blocks`' file read back."""
    parts: dict[str, dict[int, dict[str, np.ndarray]]] = {}
    with np.load(path) as z:
        for key in z.files:
            n, i, a = key.rsplit("|", 2)
            parts.setdefault(n, {}).setdefault(int(i), {})[a] = z[key]
    return {n: [CalibrationState.from_arrays(by[i]) for i in sorted(by)] for n, by in parts.items()}


def cost(rows: dict[str, dict[str, Any]]) -> float:
    """A removal's cost: its mean rise of log loss and ECE in units of their noise,
    summed over the whole trace and its second half (negative: it helps)."""
    return sum(r[m] / r[m + "_noise"] for r in rows.values() for m in ("logloss", "ece"))


#: A rise is clear when it is beyond 2 SE and beyond a rounding of the score:
#: 0.5 % of the full default's log loss, or 0.005 of ECE (a fifth of its typical ECE).
CLEAR_LOGLOSS, CLEAR_ECE = 0.005, 0.005


def clear_rise(m: str, delta: float, se: float, base: float) -> bool:
    """Whether measure ``m`` rose from ``base`` by ``delta`` beyond noise ``se`` and rounding."""
    floor = CLEAR_LOGLOSS * base if m == "logloss" else CLEAR_ECE
    return bool(delta > 2 * se and delta > floor)


def clearly_worse(cell: dict[str, Any]) -> bool:
    """A trace whose second half's log loss or ECE rose clearly (:func:`clear_rise`)."""
    return any(
        clear_rise(m, c["delta"], c["se"], c["value"] - c["delta"])
        for m in ("logloss", "ece")
        for c in (cell["second"][m],)
    )


def replicated(results: dict[str, Any], v: str) -> dict[str, dict[str, tuple[float, float, float]]]:
    """Per synthetic kind: ``(mean delta, its standard error, mean full score)``
    over the seeds, for each measure of ``v``'s second half."""
    out: dict[str, dict[str, tuple[float, float, float]]] = {}
    for kind, by_variant in results.get("replicas", {}).items():
        cells = by_variant.get(v)
        if not cells:
            continue
        out[kind] = {}
        for m in MEASURES:
            d = np.array([c[m]["delta"] for c in cells], dtype=np.float64)
            base = np.array([c[m]["value"] - c[m]["delta"] for c in cells], dtype=np.float64)
            ok = np.isfinite(d)
            d, base = d[ok], base[ok]
            se = float(d.std(ddof=1) / math.sqrt(d.size)) if d.size > 1 else math.nan
            mean = float(d.mean()) if d.size else math.nan
            out[kind][m] = (mean, se, float(base.mean()) if d.size else math.nan)
    return out


def acceptable(results: dict[str, Any], rows: dict[str, dict[str, Any]]) -> bool:
    """No worse than the full default beyond noise: the mean log loss and ECE rise
    by at most twice their noise on the whole trace and its second half, no trace
    is :func:`clearly_worse`, and (with ``--seeds``) no synthetic kind's mean
    second-half log loss or ECE over its seeds rises clearly (:func:`clear_rise`,
    the noise being the standard error over the seeds)."""
    name = rows["whole"]["variant"]
    return (
        all(r[m] <= 2 * r[m + "_noise"] for r in rows.values() for m in ("logloss", "ece"))
        and not any(clearly_worse(results["traces"][t][name]) for t in results["traces"])
        and not any(
            clear_rise(m, *kind[m])
            for kind in replicated(results, name).values()
            for m in ("logloss", "ece")
        )
    )


def _beyond(cell: dict[str, Any], sign: int) -> bool:
    """Whether a measure moved the ``sign`` way (1: worse) by more than twice its noise."""
    return any(
        sign * way * cell[m]["delta"] > 2 * cell[m]["se"]
        for m, way in (("logloss", 1), ("ece", 1), ("auc", -1))
    )


def aggregate_one(results: dict[str, Any], v: str, part: str) -> dict[str, Any]:
    """Variant ``v``'s mean delta over the traces, its noise, and the traces that moved.

    A trace counts as worse when its log loss rises, or its ECE rises, or its AUC
    falls, by more than twice that trace's standard error (better: the reverse).
    """
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
    row["clearly_worse"] = [t for t in results["traces"] if clearly_worse(results["traces"][t][v])]
    return row


def aggregate(results: dict[str, Any], part: str) -> list[dict[str, Any]]:
    """:func:`aggregate_one` for every variant scored, in order."""
    return [aggregate_one(results, v, part) for v in results["variants"]]


def table(results: dict[str, Any]) -> str:
    width = max(19, *(len(v) for v in results["variants"]))
    lines = []
    for part in PARTS:
        lines.append(
            f"\n{part} trace: mean over {len(results['traces'])} traces; delta vs full ± noise"
        )
        lines.append(
            f"{'variant':<{width}} {'logloss':>8} {'Δ':>9} {'±':>7} {'ECE':>7} {'Δ':>8} {'±':>7}"
            f" {'AUC':>7} {'Δ':>8} {'±':>7}  traces worse / better beyond 2 SE"
        )
        for r in aggregate(results, part):
            lines.append(
                f"{r['variant']:<{width}} {r['logloss_value']:>8.4f} {r['logloss']:>+9.5f}"
                f" {r['logloss_noise']:>7.5f} {r['ece_value']:>7.4f} {r['ece']:>+8.5f}"
                f" {r['ece_noise']:>7.5f} {r['auc_value']:>7.4f} {r['auc']:>+8.5f}"
                f" {r['auc_noise']:>7.5f}  {len(r['worse'])} / {len(r['better'])}"
                + (f" (worse: {', '.join(r['worse'])})" if r["worse"] else "")
                + (f"; clearly: {', '.join(r['clearly_worse'])}" if r["clearly_worse"] else "")
            )
    if any(results.get("replicas", {}).values()):
        kinds = list(results["replicas"])
        n = len(next(iter(next(iter(results["replicas"].values())).values())))
        lines.append(
            f"\nsecond half over {n} fresh seeds of each synthetic kind: mean delta vs full"
            " ± its standard error over the seeds, in thousandths: log loss, ECE, AUC"
        )
        lines.append(f"{'variant':<{width}} " + " ".join(f"{k:>29}" for k in kinds))
        for v in results["variants"]:
            rep = replicated(results, v)
            cell = {
                k: " ".join(
                    f"{1e3 * d:+5.1f}±{1e3 * e:3.1f}" for d, e, _ in (rep[k][m] for m in MEASURES)
                )
                for k in rep
            }
            lines.append(f"{v:<{width}} " + " ".join(f"{cell.get(k, ''):>29}" for k in kinds))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--refit-interval", type=int, default=100)
    ap.add_argument("--traces", type=Path, default=SHARED, help="folder of the shared traces")
    ap.add_argument("--only", action="append", help="only these one-at-a-time variants")
    ap.add_argument(
        "--remove",
        action="append",
        choices=sorted(OFF),
        help="also score these mechanisms removed together (repeat the flag)",
    )
    ap.add_argument(
        "--greedy", action="store_true", help="and remove them one by one, least costly first"
    )
    ap.add_argument(
        "--seeds",
        type=int,
        default=0,
        help="also score every variant on this many fresh seeds of each synthetic kind",
    )
    ap.add_argument("--save-full", type=Path, help="write the full default's block scores here")
    ap.add_argument(
        "--before",
        type=Path,
        help="score the full default against an earlier version's --save-full file",
    )
    ap.add_argument("--json", type=Path, help="write every cell here")
    args = ap.parse_args()
    ablation = Ablation(args.refit_interval, args.traces, args.seeds)
    for v in VARIANTS:
        if not args.only or v.name in {"full", *args.only}:
            ablation.score(v)
    if args.remove:
        ablation.score(without(*args.remove))
        if args.greedy:
            kept = ablation.greedy(args.remove)
            print(f"greedy: removable together: {', '.join(kept) or 'none'}", file=sys.stderr)
    if args.save_full:
        save_blocks(args.save_full, ablation.blocks())
    if args.before:
        rows = ablation.score_before(load_blocks(args.before))
        ok = acceptable(ablation.results, rows)
        print(f"after vs before: no worse beyond noise: {ok}", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(ablation.results, indent=1))
    print(table(ablation.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
