"""What summary mode adds to vLLM's ``step``, isolated from the estimator's own work.

Used by ``bench/bench_summary.py`` (its shim section).

* :func:`bench_overhead`: the shim wrapped around :class:`NullEstimator`, a
  stand-in whose ``step`` does only the Python bookkeeping of vLLM's (the
  step counter; its kernels are launched asynchronously on a GPU and cost the
  host a few launches that the shim does not change). Each step gets fresh
  ``idx_mapping``, ``num_sampled`` and ``num_rejected`` tensors, as vLLM 0.33
  allocates them, and is followed by a gap that yields the GIL (vLLM's
  thread waiting on the GPU), so the sender thread builds every round's
  sketch as it would in a worker. Shim and plain estimator alternate in
  blocks; "added" is the median of the shim's per-step times minus the
  plain median of the same phase. Variants: summary mode with the sketch
  (steps kept by reference, the default), the same forced to copy the
  per-step vectors (the fallback for reused buffers: the per-step work of
  the previous version plus building three views), without the sketch,
  and raw mode.
* :func:`compare_trees`: both, before and after, alternating processes on an
  earlier checkout's code and this tree's.
* :func:`bench_record`: ``SummaryRound.record`` alone in blocks of one
  round's steps (the round ended, untimed, between blocks), by reference and
  by copy, against one plain stand-in step.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from shim_variants import CPU, BenchSink, StandinAcceptanceEstimator

from avest_client.vllm.config import ShimConfig
from avest_client.vllm.estimator import make_sidecar_estimator
from avest_wire.pair import PairKey

Steps = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class NullEstimator(StandinAcceptanceEstimator):
    """The stand-in with vLLM's step bookkeeping only: no accumulate, no refit."""

    def step(self, idx_mapping: Any, num_sampled: Any, num_rejected: Any) -> None:
        self._steps_since_refit += 1
        if self._steps_since_refit < self.REFIT_INTERVAL:
            return
        self._steps_since_refit = 0
        self._refits += 1


class SummarySink(BenchSink):
    """The bench sink (connected: pooled coefficients govern), keeping round summaries."""

    def __init__(self, k: int) -> None:
        super().__init__(True, k=k)
        self.summaries: list[Any] = []

    def submit_summary(self, summary: Any) -> None:
        self.summaries.append(summary)


def summary_shim(
    mode: str, batch: int, k: int, sketch: bool = True, base: type = StandinAcceptanceEstimator
) -> tuple[Any, SummarySink]:
    sink = SummarySink(k)
    cls = make_sidecar_estimator(
        base,
        lambda config, pair: sink,
        config=ShimConfig(address="bench", queue_size=64, mode=mode, sketch=sketch),
        pair_resolver=lambda kk: PairKey("bench-target", "bench-draft", "draft_model", kk),
    )
    return cls(batch, k, CPU), sink


def fresh_steps(batch: int, k: int, n: int, seed: int = 0) -> Steps:
    """``n`` steps of distinct tensors (vLLM allocates each step's afresh): ``n`` must exceed
    a round (100 steps), or a round would hold one tensor twice and copy from then on."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        idx = torch.randperm(batch, generator=g).to(torch.int64)
        a = torch.randint(0, k + 1, (batch,), generator=g, dtype=torch.int32)
        rej = torch.randint(0, 2, (batch,), generator=g, dtype=torch.int32) * (a < k)
        out.append((idx, a + 1, rej.to(torch.int32)))
    return out


def _timed_phase(est: Any, plain: Any, steps: Steps, n: int, blocks: int, gap_s: float):
    clock = time.perf_counter_ns
    times: tuple[list[float], list[float]] = ([], [])
    per_block = max(1, n // blocks)
    j = 0
    for b in range(blocks + 1):  # block 0 is warm-up
        order = ((0, est), (1, plain)) if b % 2 else ((1, plain), (0, est))
        for which, e in order:
            for _ in range(per_block):
                args = steps[j % len(steps)]
                j += 1
                t0 = clock()
                e.step(*args)
                dt = clock() - t0
                if b:
                    times[which].append(dt / 1e3)
                until = time.perf_counter() + gap_s
                while time.perf_counter() < until:
                    time.sleep(0)
    return times


def bench_overhead(
    batch: int, k: int, n: int = 3000, blocks: int = 10, gap_s: float = 0.0005
) -> dict[str, dict[str, float]]:
    steps = fresh_steps(batch, k, 256, seed=5)
    out: dict[str, dict[str, float]] = {}
    for name, mode, sketch, copy in (
        ("summary + sketch (by reference)", "summary", True, False),
        ("summary + sketch (copies)", "summary", True, True),
        ("summary, no sketch", "summary", False, False),
        ("raw", "raw", True, False),
    ):
        est, sink = summary_shim(mode, batch, k, sketch, base=NullEstimator)
        rounds = est._avest.rounds
        if copy:
            rounds.copy_mode = True
        plain = NullEstimator(batch, k, CPU)
        try:
            shim_t, plain_t = _timed_phase(est, plain, steps, n, blocks, gap_s)
            if rounds is not None:
                rounds.flush(30)
        finally:
            est.avest_close()
        base = statistics.median(plain_t)
        out[name] = {
            "median_us": statistics.median(shim_t),
            "plain_median_us": base,
            "added_median_us": statistics.median(shim_t) - base,
            "added_p5_us": float(np.percentile(shim_t, 5) - np.percentile(plain_t, 5)),
            "summaries": float(len(sink.summaries)),
            "sketches": float(sum(s.sketch is not None for s in sink.summaries)),
            # (code before by-reference rounds always copied)
            "copy_mode": float(bool(rounds and getattr(rounds, "copy_mode", True))),
            # the sender thread's time per round (sketch and read-back), off the step
            "sender_ms_per_round": (
                1e3 * getattr(rounds, "sender_seconds", float("nan")) / max(1, len(sink.summaries))
                if rounds is not None
                else 0.0
            ),
        }
    return out


def bench_record(batch: int, k: int, blocks: int = 200) -> dict[str, float]:
    """``record`` alone, per call (5th percentile and median of block means of one round)."""
    from avest_client.vllm.rounds import SummaryRound

    est = StandinAcceptanceEstimator(batch, k, CPU)
    steps = fresh_steps(batch, k, 100, seed=4)
    est.load_features(steps[0][0], torch.randn(batch, k))
    sink = SummarySink(k)
    rounds = {
        "reference": SummaryRound(sink, k, CPU, True, max_num_reqs=batch, round_steps=100),
        "copy": SummaryRound(sink, k, CPU, True, max_num_reqs=batch, round_steps=100),
    }
    rounds["copy"].copy_mode = True
    means: dict[str, list[float]] = {name: [] for name in (*rounds, "step")}
    for _ in range(blocks):
        for name, r in rounds.items():
            r.start(1, 0.5, tuple([-0.2] * k))
            t = time.perf_counter_ns()
            for args in steps:
                r.record(est, *args)
            means[name].append((time.perf_counter_ns() - t) / len(steps) / 1e3)
            r.end(est)  # untimed: the round goes to the sender, which gives the set back
            r.flush(30)
        t = time.perf_counter_ns()
        for args in steps[:10]:
            est.step(*args)
        means["step"].append((time.perf_counter_ns() - t) / 10 / 1e3)
    for r in rounds.values():
        r.close()
    out = {}
    for name, v in means.items():
        out[f"{name}_p5_us"] = float(np.percentile(v, 5))
        out[f"{name}_median_us"] = float(np.median(v))
    out["sketches_skipped"] = float(sum(r.sketches_skipped for r in rounds.values()))
    return out


def print_shim_costs(res: dict[str, Any], batch: int, k: int, gap_ms: float) -> None:
    print(f"load average {res['load_average'][0]:.1f}; {res['cpus']} CPUs")
    print(
        f"shim's own work per step at B={batch}, K={k} (no-op base, fresh tensors, "
        f"{gap_ms} ms after each step)"
    )
    print(
        f"{'mode':<32} {'step µs':>8} {'plain µs':>9} {'added µs':>9} {'p5 added':>9} "
        "sketches  sender ms/round"
    )
    for name, r in res["shim_overhead"].items():
        print(
            f"{name:<32} {r['median_us']:>8.2f} {r['plain_median_us']:>9.2f} "
            f"{r['added_median_us']:>+9.2f} {r['added_p5_us']:>+9.2f} "
            f"{r['sketches']:>4.0f}/{r['summaries']:<4.0f} {r['sender_ms_per_round']:>8.1f}"
        )
    r = res["record"]
    print(
        f"record alone (median of block means; p5): by reference {r['reference_median_us']:.2f} "
        f"({r['reference_p5_us']:.2f}) µs, by copy {r['copy_median_us']:.2f} "
        f"({r['copy_p5_us']:.2f}) µs; plain stand-in step {r['step_median_us']:.1f} µs"
    )


def compare_trees(
    script: Path, baseline: Path, repeats: int, batch: int, k: int, gap_ms: float, steps: int
) -> None:
    """Before/after in one run: ``script``'s shim-only section (bench_summary.py) on the
    baseline tree's code and on this tree's, alternately, each in a fresh process."""
    trees = {"before": baseline.resolve(), "after": script.resolve().parents[1]}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for _ in range(repeats):
        for name, root in trees.items():
            path = os.pathsep.join(str(root / p) for p in ("service", "client", "wire"))
            proc = subprocess.run(
                [sys.executable, str(script), "--shim-only", "--json", "--batch", str(batch),
                 "--k", str(k), "--gap-ms", str(gap_ms), "--overhead-steps", str(steps)],
                env=dict(os.environ, PYTHONPATH=path), capture_output=True, text=True,
            )  # fmt: skip
            if proc.returncode:
                raise SystemExit(f"{name} ({root}) failed:\n{proc.stderr[-3000:]}")
            runs[name].append(json.loads(proc.stdout))
    print(
        f"B={batch}, K={k}, {gap_ms} ms after each step; added µs per step (median), "
        "each run in turn; load at start"
    )
    for variant in runs["after"][0]["shim_overhead"]:
        for name in trees:
            cells = [
                f"{r['shim_overhead'][variant]['added_median_us']:+7.2f} "
                f"(load {r['load_average'][0]:.1f})"
                for r in runs[name]
            ]
            print(f"{variant:<32} {name:<6} " + "  ".join(cells))
    for name in trees:
        cells = [
            f"{r['record']['reference_median_us']:.2f} of a {r['record']['step_median_us']:.0f}"
            for r in runs[name]
        ]
        print(f"record alone / stand-in step, µs  {name:<6} " + "  ".join(cells))
