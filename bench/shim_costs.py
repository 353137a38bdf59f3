"""What summary mode adds to vLLM's ``step``, isolated from the estimator's own work.

Used by ``bench/bench_summary.py`` (its shim section).

* :func:`bench_overhead`: the shim wrapped around :class:`NullEstimator`, a
  stand-in whose ``step`` does only the Python bookkeeping of vLLM's (the
  step counter; its kernels are launched asynchronously on a GPU and cost the
  host a few launches that the shim does not change). What those kernels do
  is done off the clock before each step (:meth:`NullEstimator.device_work`):
  the step's ``features`` and ``predictions`` as ``propose`` writes them, and
  the round's sums (``info``, ``grad``, ``counts``) accumulated as vLLM 0.33's
  step accumulates them, so every round summary carries vLLM's sums and passes
  the host's check against its sketch. Each step gets fresh
  ``idx_mapping``, ``num_sampled`` and ``num_rejected`` tensors, as vLLM 0.33
  allocates them, and is followed by a gap that yields the GIL (vLLM's
  thread waiting on the GPU), so the sender thread builds every round's
  sketch as it would in a worker. Shim and plain estimator alternate in
  blocks; "added" is the median of the shim's per-step times minus the
  plain median of the same phase. Variants: summary mode with the sketch
  (steps kept by reference, the default), the same forced to copy the
  per-step vectors (the fallback for reused buffers: the per-step work of
  the previous version plus building three views), without the sketch,
  raw mode, and summary mode with the sketch and strata (``AVEST_STRATA=1``,
  the batch admitted at four temperatures, one per default stratum: the
  rounds summed per stratum by the sender, each stratum's summary with its
  sketch).
* :func:`compare_trees`: both, before and after, alternating processes on an
  earlier checkout's code and this tree's.
* :func:`bench_record`: ``SummaryRound.record`` alone in blocks of one
  round's steps (the round's sums filled and the round ended, untimed, between
  blocks), by reference and by copy, against one plain stand-in step.

Every measurement checks by count that the path it timed worked
(:func:`check_summaries`, :func:`check_raw`) and raises :class:`SystemExit`
naming the variant and what failed otherwise: a round summary refused on the
host, a sink that received nothing, summaries that cover no drafts (vLLM's
sums left empty), no sketch where one is timed.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import numpy as np
import torch
from shim_variants import CPU, BenchSink, StandinAcceptanceEstimator

from avest_client.vllm.config import ShimConfig
from avest_client.vllm.estimator import make_sidecar_estimator
from avest_wire.pair import PairKey


class Step(NamedTuple):
    """One decode step's inputs: ``step``'s three vectors and the features ``propose`` wrote."""

    idx: torch.Tensor
    sampled: torch.Tensor
    rejected: torch.Tensor
    features: torch.Tensor


Steps = list[Step]


class NullEstimator(StandinAcceptanceEstimator):
    """The stand-in with only vLLM's step bookkeeping on the clock.

    On a GPU, vLLM's ``propose`` and ``step`` launch kernels the host does not
    wait for: ``step`` costs the host its counter and a few launches, which
    the shim does not change. ``step`` here keeps the counter (and clears the
    sums at the refit, as vLLM's refit does; never reached while pooled
    coefficients govern); :meth:`device_work` does the kernels' work, called by
    the driver before each step, off the clock.
    """

    def device_work(self, step: Step) -> None:
        """What the device does for ``step`` before the shim reads it: ``propose``'s
        ``features`` and ``predictions``, and the step's labelled drafts added to the
        round's sums (``info``, ``grad``, ``counts``) as vLLM 0.33's step adds them."""
        self.load_features(step.idx, step.features)
        self._accumulate(step.idx, step.sampled, step.rejected)

    def step(self, idx_mapping: Any, num_sampled: Any, num_rejected: Any) -> None:
        self._steps_since_refit += 1
        if self._steps_since_refit < self.REFIT_INTERVAL:
            return
        self._steps_since_refit = 0
        self.info.zero_()
        self.grad.zero_()
        self.counts.zero_()
        self._refits += 1


class SummarySink(BenchSink):
    """The bench sink (connected: pooled coefficients govern), keeping round summaries."""

    def __init__(self, k: int) -> None:
        super().__init__(True, k=k)
        self.summaries: list[Any] = []
        #: Each summary's stratum (None: the pair's, without strata).
        self.strata: list[str | None] = []

    def submit_summary(self, summary: Any, stratum: str | None = None) -> None:
        self.summaries.append(summary)
        self.strata.append(stratum)


def summary_shim(
    mode: str,
    batch: int,
    k: int,
    sketch: bool = True,
    base: type = StandinAcceptanceEstimator,
    strata: int = 0,
) -> tuple[Any, SummarySink]:
    """The shim over ``base`` with an in-memory sink; ``strata`` > 0: strata on, the
    batch's slots admitted at that many temperatures (greedy, 0.3, 0.7, 1.2 under the
    default edges 0.5 and 1), round-robin."""
    sink = SummarySink(k)
    config = ShimConfig(address="bench", queue_size=64, mode=mode, sketch=sketch, strata=strata > 0)
    cls = make_sidecar_estimator(
        base,
        lambda config, pair: sink,
        config=config,
        pair_resolver=lambda kk: PairKey("bench-target", "bench-draft", "draft_model", kk),
    )
    if strata:
        from avest_client.vllm import strata as strata_mod

        # a registry of this shim's own (the process's is one per worker)
        strata_mod.REGISTRY = strata_mod.StrataRegistry()
    est = cls(batch, k, CPU)
    if strata:
        temperatures = (0.0, 0.3, 0.7, 1.2)[:strata]
        for slot in range(batch):
            t = temperatures[slot % len(temperatures)]
            strata_mod.REGISTRY.record(slot, SimpleNamespace(temperature=t))
    return est, sink


def fresh_steps(batch: int, k: int, n: int, seed: int = 0) -> Steps:
    """``n`` steps of distinct tensors (vLLM allocates each step's afresh): ``n`` must exceed
    a round (100 steps), or a round would hold one tensor twice and copy from then on.
    Verdicts are valid (accepted ``a <= K``, ``a + rejected <= K``); features as
    ``bench_shim.make_inputs`` draws them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        idx = torch.randperm(batch, generator=g).to(torch.int64)
        a = torch.randint(0, k + 1, (batch,), generator=g, dtype=torch.int32)
        rej = torch.randint(0, 2, (batch,), generator=g, dtype=torch.int32) * (a < k)
        x = (torch.randn(batch, k, generator=g) * 2 + 1).clamp_(-40, 40)
        out.append(Step(idx, a + 1, rej.to(torch.int32), x))
    return out


# -- the guard: a figure only for a path that worked ---------------------------------


def check_summaries(
    name: str,
    sink: SummarySink,
    rounds: Any,
    *,
    sketch: bool,
    copies: bool = False,
    strata: int = 0,
) -> None:
    """Raise :class:`SystemExit` unless the summary path ``name`` timed worked, by count:
    no round summary refused on the host, at least one reached ``sink``, each covers
    drafts (vLLM's sums filled), and a sketch rode with them where one is timed (at
    least half the rounds: the rest may have been skipped because the sender fell
    behind, which ``sketches_skipped`` counts) and with none where none is; the steps
    kept by reference unless ``copies`` (a driver that hands a round one tensor twice
    switches the shim to copying: the variant would time the fallback); with ``strata``,
    summaries that name that many strata and no round sent pooled (not summed per
    stratum)."""
    got = sink.summaries
    problems = []
    refused = int(getattr(rounds, "send_errors", 0))
    if refused:
        problems.append(
            f"{refused} round summaries refused on the host (by their check or the sink's "
            "submit_summary; the sender logged the first)"
        )
    if not got:
        problems.append("the sink received no round summary")
    empty = sum(1 for s in got if s.drafts == 0)
    if empty:
        problems.append(f"{empty} of {len(got)} summaries cover no drafts (vLLM's sums left empty)")
    sketches = sum(1 for s in got if s.sketch is not None)
    skipped = int(getattr(rounds, "sketches_skipped", 0))
    if sketch and got and 2 * sketches < len(got):
        problems.append(f"{sketches} of {len(got)} summaries carried a sketch ({skipped} skipped)")
    if not sketch and sketches:
        problems.append(f"{sketches} summaries carried a sketch in a mode without one")
    copy_mode = getattr(rounds, "copy_mode", None)  # (code before by-reference rounds: None)
    if sketch and copy_mode is not None and bool(copy_mode) != copies:
        problems.append(
            "the steps were copied (a round held one tensor twice: the driver reused them)"
            if copy_mode
            else "the steps were kept by reference, not copied"
        )
    if strata:
        named = len(set(sink.strata) - {None})
        if named < strata:
            problems.append(f"summaries named {named} strata, not {strata}")
        pooled = int(getattr(rounds, "strata_rounds_pooled", 0))
        if pooled:
            problems.append(f"{pooled} rounds sent pooled, not summed per stratum")
    if problems:
        raise SystemExit(f"bench: {name!r} timed a path that failed: " + "; ".join(problems))


def check_raw(name: str, est: Any, sink: BenchSink) -> None:
    """Raise :class:`SystemExit` unless raw mode's path ``name`` worked, by count: the
    shim captured steps and the sink received them, none failed in ``submit``."""
    stats = est.avest_stats() if hasattr(est, "avest_stats") else {}
    problems = []
    if not stats.get("captured"):
        problems.append("the shim captured no step")
    if stats.get("submit_errors"):
        problems.append(f"{stats['submit_errors']} steps failed in the sink's submit")
    if not sink.rows:
        problems.append("the sink received no step")
    if problems:
        raise SystemExit(f"bench: {name!r} timed a path that failed: " + "; ".join(problems))


def _timed_phase(est: Any, plain: Any, steps: Steps, n: int, blocks: int, gap_s: float):
    clock = time.perf_counter_ns
    times: tuple[list[float], list[float]] = ([], [])
    per_block = max(1, n // blocks)
    # each estimator walks the steps on its own: a round's consecutive steps are distinct
    # tensors whatever the blocks (a round may span two blocks of the other)
    at = [0, 0]
    for b in range(blocks + 1):  # block 0 is warm-up
        order = ((0, est), (1, plain)) if b % 2 else ((1, plain), (0, est))
        for which, e in order:
            for _ in range(per_block):
                s = steps[at[which] % len(steps)]
                at[which] += 1
                e.device_work(s)  # propose and the step's kernels: the device's, not timed
                t0 = clock()
                e.step(s.idx, s.sampled, s.rejected)
                dt = clock() - t0
                if b:
                    times[which].append(dt / 1e3)
                until = time.perf_counter() + gap_s
                while time.perf_counter() < until:
                    time.sleep(0)
    return times


#: bench_overhead's variants: ``(name, mode, sketch, forced copies, strata)``.
OVERHEAD_VARIANTS = (
    ("summary + sketch (by reference)", "summary", True, False, 0),
    ("summary + sketch (copies)", "summary", True, True, 0),
    ("summary, no sketch", "summary", False, False, 0),
    ("raw", "raw", True, False, 0),
    ("summary + sketch, 4 strata", "summary", True, False, 4),
)


def bench_overhead(
    batch: int,
    k: int,
    n: int = 3000,
    blocks: int = 10,
    gap_s: float = 0.0005,
    base: type[NullEstimator] = NullEstimator,
    variants: tuple[tuple[str, str, bool, bool, int], ...] = OVERHEAD_VARIANTS,
) -> dict[str, dict[str, float]]:
    """The shim's own work per step, each variant around ``base``; raises SystemExit
    (:func:`check_summaries`, :func:`check_raw`) if a variant's path failed."""
    steps = fresh_steps(batch, k, 256, seed=5)
    out: dict[str, dict[str, float]] = {}
    for name, mode, sketch, copy, strata in variants:
        est, sink = summary_shim(mode, batch, k, sketch, base=base, strata=strata)
        rounds = est._avest.rounds
        if copy:
            rounds.copy_mode = True
        plain = base(batch, k, CPU)
        try:
            shim_t, plain_t = _timed_phase(est, plain, steps, n, blocks, gap_s)
            if rounds is not None and not rounds.flush(30):
                raise SystemExit(f"bench: {name!r}: rounds still with the sender after 30 s")
            if est._avest.transfer is not None and not est._avest.transfer.flush(30):
                raise SystemExit(f"bench: {name!r}: steps still with the forwarder after 30 s")
        finally:
            est.avest_close()
        if rounds is not None:
            check_summaries(name, sink, rounds, sketch=sketch, copies=copy, strata=strata)
        else:
            check_raw(name, est, sink)
        base_us = statistics.median(plain_t)
        out[name] = {
            "median_us": statistics.median(shim_t),
            "plain_median_us": base_us,
            "added_median_us": statistics.median(shim_t) - base_us,
            "added_p5_us": float(np.percentile(shim_t, 5) - np.percentile(plain_t, 5)),
            "summaries": float(len(sink.summaries)),
            "sketches": float(sum(s.sketch is not None for s in sink.summaries)),
            "drafts": float(sum(s.drafts for s in sink.summaries)),
            "sketches_skipped": float(getattr(rounds, "sketches_skipped", 0)),
            "raw_steps": float(sink.calls),  # raw mode: steps the sink received
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


def bench_strata_step(batch: int, k: int, n: int = 2000, repeats: int = 2) -> dict[str, float]:
    """The step's own work with 4 strata against one set: the shim around
    :class:`NullEstimator`, one set and 4 strata in turn (``repeats`` times each, ``n``
    steps), the sender flushed at every round's end so that it never runs beside a
    timed step (what :func:`bench_overhead` cannot separate on a two-core machine).
    Median per-step µs of each; raises SystemExit if either path failed."""
    steps = fresh_steps(batch, k, 256, seed=6)
    clock = time.perf_counter_ns
    medians: dict[int, list[float]] = {0: [], 4: []}
    for _ in range(repeats):
        for strata in (0, 4):
            est, sink = summary_shim("summary", batch, k, True, base=NullEstimator, strata=strata)
            rounds = est._avest.rounds
            times = []
            try:
                for j in range(n):
                    s = steps[j % len(steps)]
                    est.device_work(s)
                    t0 = clock()
                    est.step(s.idx, s.sampled, s.rejected)
                    times.append((clock() - t0) / 1e3)
                    if rounds.steps == 0 and not rounds.flush(30):  # a round just ended
                        raise SystemExit("bench: strata step: the sender held a round 30 s")
            finally:
                est.avest_close()
            name = "summary + sketch, 4 strata" if strata else "summary + sketch"
            check_summaries(f"{name} (step alone)", sink, rounds, sketch=True, strata=strata)
            medians[strata].append(statistics.median(times[n // 10 :]))
    one, four = statistics.median(medians[0]), statistics.median(medians[4])
    return {"one_set_us": one, "strata_us": four, "added_us": four - one}


def fill_sums(est: StandinAcceptanceEstimator, steps: Steps) -> None:
    """vLLM's sums of a round of ``steps`` (what its step kernels add up), from zero."""
    est.info.zero_()
    est.grad.zero_()
    est.counts.zero_()
    for s in steps:
        est._accumulate(s.idx, s.sampled, s.rejected)


def bench_record(batch: int, k: int, blocks: int = 200) -> dict[str, float]:
    """``record`` alone, per call (5th percentile and median of block means of one round).

    Every round is ended with vLLM's sums of its steps filled (untimed), so the sender
    builds and checks a real summary with its sketch; raises SystemExit if any failed."""
    from avest_client.vllm.rounds import SummaryRound

    est = StandinAcceptanceEstimator(batch, k, CPU)
    steps = fresh_steps(batch, k, 100, seed=4)
    est.load_features(steps[0].idx, torch.randn(batch, k))
    sinks = {name: SummarySink(k) for name in ("reference", "copy")}
    rounds = {
        name: SummaryRound(sink, k, CPU, True, max_num_reqs=batch, round_steps=100)
        for name, sink in sinks.items()
    }
    rounds["copy"].copy_mode = True
    means: dict[str, list[float]] = {name: [] for name in (*rounds, "step")}
    for _ in range(blocks):
        for name, r in rounds.items():
            r.start(1, 0.5, tuple([-0.2] * k))
            t = time.perf_counter_ns()
            for s in steps:
                r.record(est, s.idx, s.sampled, s.rejected)
            means[name].append((time.perf_counter_ns() - t) / len(steps) / 1e3)
            # untimed: the round's sums as vLLM's step kernels add them, and its step count
            # as the shim's step keeps it; the round goes to the sender, which gives the
            # set back
            fill_sums(est, steps)
            r.steps = len(steps)
            r.end(est)
            if not r.flush(30):
                raise SystemExit(
                    f"bench: record ({name}): a round still with the sender after 30 s"
                )
        t = time.perf_counter_ns()
        for s in steps[:10]:
            est.step(s.idx, s.sampled, s.rejected)
        means["step"].append((time.perf_counter_ns() - t) / 10 / 1e3)
    for r in rounds.values():
        r.close()
    for name, r in rounds.items():
        check_summaries(f"record ({name})", sinks[name], r, sketch=True, copies=name == "copy")
        if len(sinks[name].summaries) != blocks:
            raise SystemExit(
                f"bench: 'record ({name})': {len(sinks[name].summaries)} of {blocks} rounds "
                "reached the sink"
            )
    out = {}
    for name, v in means.items():
        out[f"{name}_p5_us"] = float(np.percentile(v, 5))
        out[f"{name}_median_us"] = float(np.median(v))
    out["sketches_skipped"] = float(sum(r.sketches_skipped for r in rounds.values()))
    out["summaries"] = float(sum(len(sink.summaries) for sink in sinks.values()))
    out["sketches"] = float(
        sum(s.sketch is not None for sink in sinks.values() for s in sink.summaries)
    )
    return out


def print_shim_costs(res: dict[str, Any], batch: int, k: int, gap_ms: float) -> None:
    print(f"load average {res['load_average'][0]:.1f}; {res['cpus']} CPUs")
    print(
        f"shim's own work per step at B={batch}, K={k} (no-op base, fresh tensors, "
        f"{gap_ms} ms after each step)"
    )
    print(
        f"{'mode':<32} {'step µs':>8} {'plain µs':>9} {'added µs':>9} {'p5 added':>9} "
        f"{'sent (sketches/summaries; drafts)':<34} sender ms/round"
    )
    for name, r in res["shim_overhead"].items():
        if r["summaries"]:
            sent = f"{r['sketches']:.0f}/{r['summaries']:.0f}; {r['drafts']:,.0f}"
        else:  # raw mode: steps to the sink
            sent = f"{r.get('raw_steps', 0):,.0f} steps"
        print(
            f"{name:<32} {r['median_us']:>8.2f} {r['plain_median_us']:>9.2f} "
            f"{r['added_median_us']:>+9.2f} {r['added_p5_us']:>+9.2f} "
            f"{sent:<34} {r['sender_ms_per_round']:>8.1f}"
        )
    if "strata_step" in res:
        r = res["strata_step"]
        print(
            f"the step alone (sender flushed at each round's end): one set {r['one_set_us']:.2f} "
            f"µs, 4 strata {r['strata_us']:.2f} µs ({r['added_us']:+.2f})"
        )
    r = res["record"]
    print(
        f"record alone (median of block means; p5): by reference {r['reference_median_us']:.2f} "
        f"({r['reference_p5_us']:.2f}) µs, by copy {r['copy_median_us']:.2f} "
        f"({r['copy_p5_us']:.2f}) µs; plain stand-in step {r['step_median_us']:.1f} µs; "
        f"{r.get('sketches', 0):.0f}/{r.get('summaries', 0):.0f} rounds sent with a sketch"
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
