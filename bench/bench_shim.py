"""Added wall time per ``step`` on the critical path: the avest shim vs vLLM's estimator alone.

Runs the CPU stand-in of vLLM 0.33's ``OnlineAcceptanceEstimator`` (tests/support/standin.py)
at B live requests and K draft positions, plain and wrapped by the shim with

* an in-memory sink (the shim's own cost): healthy (connected, pooled
  coefficients govern), absent (``connected`` False), slow (every ``submit``
  sleeps 500 ms);
* the real :class:`~avest_client.vllm.sidecar.sink.SidecarSink` (what runs in
  vLLM) against a real sidecar in a subprocess: healthy (``avest serve
  --grpc-address 127.0.0.1:0 ...``), absent (an unused port), slow (the same
  server with every Observe message handled 500 ms after it arrives).

Each variant is measured in a phase of its own (only its threads and sidecar
exist), against a plain estimator in the same phase: blocks of consecutive
steps, alternating which goes first, so drift in machine load hits both alike.
"added" is the variant's median minus the plain median of its phase; the
"vLLM alone (A/A)" phase compares two plain estimators (the noise floor).
Only ``step`` is timed; writing the step's features (vLLM's ``propose``) is not.

Also measures forwarding throughput from one worker: drafts per second the
shim hands to a no-op in-memory sink, and drafts per second the real sink
delivers to a healthy sidecar (until acknowledged).

Each variant's path is checked by count after it is timed (:func:`check_variant`),
and the run ends with a message naming the variant (exit status 1) instead of a
figure when it failed: no step captured, a sink that received nothing, steps
failed in ``submit`` or refused by the sidecar, a healthy sidecar that
acknowledged nothing, pooled coefficients that never governed where the sink is
connected (or governed where it is absent); a throughput run that dropped or left
steps unacknowledged.

    python bench/bench_shim.py [--batch 256] [--k 8] [--steps 4000] [--no-sidecar] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from shim_variants import (
    CPU,
    KINDS,
    BenchSink,
    Sidecar,
    StandinAcceptanceEstimator,
    make_inputs,
    make_variant,
    shim_class,
)

from avest_client import Backoff
from avest_client.vllm import costs
from avest_client.vllm.config import ShimConfig
from avest_client.vllm.sidecar.sink import SidecarSink
from avest_wire.pair import PairKey

TARGET_US = 20.0


def _phase(
    est: Any, plain: Any, inputs, steps: int, rounds: int, gap_s: float
) -> tuple[list[float], list[float]]:
    """Per-step µs of ``est`` and ``plain``: ``rounds`` blocks each, alternating order.

    ``gap_s`` > 0 waits that long after each step, yielding the GIL the whole
    time (as vLLM's thread does while it waits for the GPU) but spinning, so
    caches and clocks stay warm: the background threads get the duty cycle of
    a real decode loop instead of back-to-back steps.
    """
    idx, feats, sampled, rejected = inputs
    per_round = max(1, steps // rounds)
    clock = time.perf_counter_ns
    times: tuple[list[float], list[float]] = ([], [])
    for r in range(rounds + 1):  # round 0 is warm-up
        order = ((0, est), (1, plain)) if r % 2 else ((1, plain), (0, est))
        for which, e in order:
            for i in range(per_round):
                j = i % len(feats)
                ix = idx[j] if isinstance(idx, list) else idx  # a list: a tensor per step
                e.load_features(ix, feats[j])  # vLLM's propose: not timed
                t0 = clock()
                e.step(ix, sampled[j], rejected[j])
                dt = clock() - t0
                if r:
                    times[which].append(dt / 1e3)
                if gap_s:
                    until = time.perf_counter() + gap_s
                    while time.perf_counter() < until:
                        time.sleep(0)
    return times


def check_variant(kind: str, stats: dict[str, Any], sink: Any) -> None:
    """Raise :class:`SystemExit` unless the path variant ``kind`` timed worked, by count.

    ``stats``: the shim's (``avest_stats``), read after the timed phase (after the
    acknowledgements, for a healthy sidecar); ``sink``: the in-memory sink, read after
    the cleanup (a slow one gets its first step 500 ms after it was captured), or None.
    """
    if kind == "vLLM alone (A/A)":
        return
    problems = []
    if not stats:
        problems.append("the shim is not running (no stats)")
    if not stats.get("captured"):
        problems.append("the shim captured no step")
    if stats.get("submit_errors"):
        problems.append(f"{stats['submit_errors']} steps failed in the sink's submit")
    absent = kind.endswith("absent")
    if not absent and not stats.get("governed"):
        problems.append("pooled coefficients never governed (the sink did not connect)")
    if absent and stats.get("governed"):
        problems.append("pooled coefficients governed with the sidecar absent")
    if sink is not None and not sink.calls:
        problems.append("the sink received no step")
    real = stats.get("sink") or {}
    if kind.startswith("sidecar"):
        if not real.get("received"):
            problems.append("the sink received no step")
        if real.get("refused") or real.get("invalid"):
            problems.append(
                f"{real.get('refused')} steps refused by the sidecar, {real.get('invalid')} invalid"
            )
        if kind == "sidecar: healthy" and not real.get("acked"):
            problems.append("the sidecar acknowledged no step")
    if problems:
        raise SystemExit(f"bench: {kind!r} timed a path that failed: " + "; ".join(problems))


def bench_steps(
    batch: int, k: int, steps: int, rounds: int, queue: int, sidecar: bool, gap_s: float = 0.0
) -> dict:
    inputs = make_inputs(batch, k)
    out = {}
    for kind in KINDS:
        if kind.startswith("sidecar") and not sidecar:
            continue
        est, cleanup = make_variant(kind, batch, k, queue)
        plain = StandinAcceptanceEstimator(batch, k, CPU)
        rt = getattr(est, "_avest", None)
        memory = rt.sink if rt is not None and isinstance(rt.sink, BenchSink) else None
        try:
            shim_t, plain_t = _phase(est, plain, inputs, steps, rounds, gap_s)
            if kind == "sidecar: healthy" and rt is not None and rt.transfer is not None:
                # untimed: what was captured, acknowledged
                rt.transfer.flush(60)
                rt.sink.flush(60)
            stats = est.avest_stats() if hasattr(est, "avest_stats") else {}
            sink = stats.get("sink") or {}
        finally:
            cleanup()
        check_variant(kind, stats, memory)
        t = np.array(shim_t)
        base = statistics.median(plain_t)
        out[kind] = {
            "median_us": float(np.median(t)),
            "p90_us": float(np.percentile(t, 90)),
            "p99_us": float(np.percentile(t, 99)),
            "plain_median_us": base,
            "added_median_us": float(np.median(t) - base),
            "steps": len(t),
            "ring_dropped": stats.get("dropped", 0),
            "sink_dropped": sink.get("dropped", 0),
            "governed": stats.get("governed"),
            "acked": sink.get("acked"),
        }
    return out


def bench_throughput_memory(batch: int, k: int, steps: int) -> dict:
    """Drafts per second from capture to a no-op sink (queue large enough to drop nothing)."""
    sink = BenchSink(False, k=k)
    est = shim_class(lambda config, pair: sink, "bench", steps + 8, k)(batch, k, CPU)
    fwd = est._avest.transfer
    idx, feats, sampled, rejected = make_inputs(batch, k, seed=1)
    t0 = time.perf_counter()
    for i in range(steps):
        fwd.capture(feats[i % len(feats)], idx, sampled[i % 8], rejected[i % 8])
    produced = time.perf_counter() - t0
    flushed = fwd.flush(60)
    elapsed = time.perf_counter() - t0
    est.avest_close()
    if not flushed or fwd.dropped or fwd.submit_errors or sink.calls != steps:
        raise SystemExit(
            f"bench: forwarding to the in-memory sink failed: the sink received {sink.calls} "
            f"of {steps} steps ({fwd.dropped} dropped, {fwd.submit_errors} failed in submit, "
            f"{'flushed' if flushed else 'not flushed after 60 s'})"
        )
    return {
        "steps": steps,
        "rows": sink.rows,
        "drafts_per_s": sink.rows * k / elapsed,
        "steps_per_s": sink.calls / elapsed,
        "capture_us_per_step": produced / steps * 1e6,
        "dropped": fwd.dropped,
    }


def bench_throughput_sidecar(batch: int, k: int, steps: int) -> dict:
    """Drafts per second one worker's shim delivers to a healthy sidecar, until acknowledged.

    The steps are driven through ``step`` back to back (the stand-in's own
    work included), queues large enough to drop nothing; the clock stops when
    the sidecar has acknowledged every step.
    """
    sidecar = Sidecar()
    try:

        def factory(config: ShimConfig, pair: PairKey) -> SidecarSink:
            return SidecarSink(
                config, pair, recorder=costs.CostCurveRecorder(), backoff=Backoff(0.02, 1.0)
            )

        est = shim_class(factory, sidecar.address, steps + 8, k)(batch, k, CPU)
        sink = est._avest.sink
        if not sink.wait_connected(30):
            raise RuntimeError("the sink did not connect")
        idx, feats, sampled, rejected = make_inputs(batch, k, seed=2)
        t0 = time.perf_counter()
        for i in range(steps):
            j = i % len(feats)
            est.load_features(idx, feats[j])
            est.step(idx, sampled[j], rejected[j])
        stepped = time.perf_counter() - t0
        est._avest.transfer.flush(120)
        ok = sink.flush(300)
        elapsed = time.perf_counter() - t0
        s = sink.stats
        est.avest_close()
    finally:
        sidecar.stop()
    if not ok or s["acked"] != steps:
        raise SystemExit(
            f"bench: forwarding to the sidecar failed: {s['acked']} of {steps} steps "
            f"acknowledged ({s['dropped']} dropped, {s['refused']} refused, "
            f"{'complete' if ok else 'incomplete after 300 s'})"
        )
    return {
        "steps": steps,
        "acked": s["acked"],
        "complete": bool(ok),
        "drafts_per_s": s["acked"] * batch * k / elapsed,
        "steps_per_s": s["acked"] / elapsed,
        "loop_steps_per_s": steps / stepped,
        "dropped": s["dropped"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4000, help="timed steps per variant")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--queue", type=int, default=64)
    ap.add_argument("--throughput-steps", type=int, default=2000)
    ap.add_argument(
        "--gap-us",
        type=float,
        default=0.0,
        help="wait (GIL released) after each timed step; 0: back to back, the worst case",
    )
    ap.add_argument("--no-sidecar", action="store_true", help="skip the real-sidecar variants")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    sidecar = not args.no_sidecar
    res = bench_steps(
        args.batch, args.k, args.steps, args.rounds, args.queue, sidecar, args.gap_us / 1e6
    )
    thr = bench_throughput_memory(args.batch, args.k, args.throughput_steps)
    thr_sc = (
        bench_throughput_sidecar(args.batch, args.k, args.throughput_steps) if sidecar else None
    )
    print(
        f"step() wall time, B={args.batch}, K={args.k}, CPU stand-in, {args.steps} steps/variant, "
        f"queue {args.queue}, gap {args.gap_us:.0f} µs"
    )
    print(
        f"{'variant':<26}{'median µs':>10}{'p90 µs':>9}{'p99 µs':>9}{'plain µs':>10}"
        f"{'added µs':>10}{'dropped':>9}"
    )
    for kind, r in res.items():
        dropped = r["ring_dropped"] + r["sink_dropped"]
        print(
            f"{kind:<26}{r['median_us']:>10.1f}{r['p90_us']:>9.1f}{r['p99_us']:>9.1f}"
            f"{r['plain_median_us']:>10.1f}{r['added_median_us']:>+10.1f}{dropped:>9}"
        )
    shim = {k: r for k, r in res.items() if k != "vLLM alone (A/A)"}
    worst = max(r["added_median_us"] for r in shim.values())
    spread = max(r["added_median_us"] for r in shim.values()) - min(
        r["added_median_us"] for r in shim.values()
    )
    verdict = "OK" if worst <= TARGET_US else "OVER"
    noise = res["vLLM alone (A/A)"]["added_median_us"]
    print(
        f"worst added median {worst:+.1f} µs (target <= {TARGET_US:.0f} µs: {verdict}); "
        f"A/A noise {noise:+.1f} µs; spread of added across sink states {spread:.1f} µs"
    )
    print(
        f"forwarding, in-memory sink: {thr['drafts_per_s']:,.0f} drafts/s "
        f"({thr['steps_per_s']:,.0f} steps/s of {args.batch}x{args.k}); "
        f"capture {thr['capture_us_per_step']:.1f} µs/step; dropped {thr['dropped']}"
    )
    if thr_sc is not None:
        print(
            f"forwarding, real sidecar (until acknowledged): {thr_sc['drafts_per_s']:,.0f} drafts/s "
            f"({thr_sc['steps_per_s']:,.0f} steps/s of {args.batch}x{args.k}; step loop "
            f"{thr_sc['loop_steps_per_s']:,.0f} steps/s); acked {thr_sc['acked']}/{thr_sc['steps']}, "
            f"dropped {thr_sc['dropped']}"
        )
    if args.json:
        out = {"steps": res, "throughput": thr, "throughput_sidecar": thr_sc}
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
