"""Added wall time per ``step`` on the critical path: the avest shim vs vLLM's estimator alone.

Runs the CPU stand-in of vLLM 0.33's ``OnlineAcceptanceEstimator`` (tests/shim/standin.py)
at B live requests and K draft positions, plain and wrapped by the shim with an
in-memory sink that is healthy (connected, pooled coefficients govern), absent
(``connected`` False) or slow (every ``submit`` sleeps 500 ms). Variants are
interleaved in short rounds so drift in machine load hits all of them alike.
Only ``step`` is timed; writing the step's features (vLLM's ``propose``) is not.

Also measures the forwarder's throughput: drafts per second one worker hands
to a sink that does nothing.

    python bench/bench_shim.py [--batch 256] [--k 8] [--steps 4000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.shim.standin import StandinAcceptanceEstimator  # noqa: E402

from avest_client.vllm.config import ShimConfig  # noqa: E402
from avest_client.vllm.estimator import make_sidecar_estimator  # noqa: E402

TARGET_US = 20.0


class BenchSink:
    """Counts what it gets; optionally slow. Mirrors the Sink protocol."""

    def __init__(self, connected: bool, delay_s: float = 0.0, k: int = 8) -> None:
        self._connected = connected
        self.delay_s = delay_s
        self.rows = 0
        self.calls = 0
        self._coef = (1, 0.55, [0.4 - 0.1 * i for i in range(k)]) if connected else None

    def submit(self, features, num_verified, num_accepted, exclude) -> None:  # noqa: ANN001
        if self.delay_s:
            time.sleep(self.delay_s)
        self.rows += features.shape[0]
        self.calls += 1

    def latest_coefficients(self):  # noqa: ANN201
        return self._coef

    @property
    def connected(self) -> bool:
        return self._connected

    def close(self) -> None:
        pass


def _inputs(batch: int, k: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(batch, generator=g).to(torch.int64)
    feats = [torch.randn(batch, k, generator=g) * 2 + 1 for _ in range(8)]
    sampled = [torch.randint(0, k + 2, (batch,), generator=g, dtype=torch.int32) for _ in range(8)]
    rejected = [torch.randint(0, 2, (batch,), generator=g, dtype=torch.int32) for _ in range(8)]
    return idx, feats, sampled, rejected


def _make(kind: str, batch: int, k: int, queue: int):
    if kind.startswith("vLLM alone"):
        return StandinAcceptanceEstimator(batch, k, torch.device("cpu")), None
    sink = {
        "healthy": lambda: BenchSink(True, k=k),
        "absent": lambda: BenchSink(False, k=k),
        "slow (500 ms)": lambda: BenchSink(True, delay_s=0.5, k=k),
    }[kind]()
    cls = make_sidecar_estimator(
        StandinAcceptanceEstimator,
        lambda config, pair: sink,
        config=ShimConfig(address="bench", queue_size=queue),
    )
    return cls(batch, k, torch.device("cpu")), sink


def bench_steps(batch: int, k: int, steps: int, rounds: int, queue: int) -> dict:
    # "vLLM alone (A/A)" is a second plain estimator: its difference is the noise floor.
    kinds = ["vLLM alone", "vLLM alone (A/A)", "healthy", "absent", "slow (500 ms)"]
    made = {kind: _make(kind, batch, k, queue) for kind in kinds}
    idx, feats, sampled, rejected = _inputs(batch, k, steps)
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    per_round = max(1, steps // rounds)
    clock = time.perf_counter_ns
    for r in range(rounds + 1):  # round 0 is warm-up
        order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
        for kind in order:
            est, _ = made[kind]
            for i in range(per_round):
                j = i % len(feats)
                est.load_features(idx, feats[j])  # vLLM's propose: not timed
                t0 = clock()
                est.step(idx, sampled[j], rejected[j])
                dt = clock() - t0
                if r:
                    times[kind].append(dt / 1e3)
    out = {}
    base = statistics.median(times["vLLM alone"])
    for kind in kinds:
        t = np.array(times[kind])
        est, sink = made[kind]
        stats = est.avest_stats() if hasattr(est, "avest_stats") else {}
        out[kind] = {
            "median_us": float(np.median(t)),
            "p90_us": float(np.percentile(t, 90)),
            "p99_us": float(np.percentile(t, 99)),
            "added_median_us": float(np.median(t) - base),
            "steps": len(t),
            "dropped": stats.get("dropped", 0),
            "governed": stats.get("governed"),
        }
        if hasattr(est, "avest_close"):
            est.avest_close()
    return out


def bench_throughput(batch: int, k: int, steps: int) -> dict:
    """Drafts per second from capture to a no-op sink (queue large enough to drop nothing)."""
    sink = BenchSink(False, k=k)
    cls = make_sidecar_estimator(
        StandinAcceptanceEstimator,
        lambda config, pair: sink,
        config=ShimConfig(address="bench", queue_size=steps + 8),
    )
    est = cls(batch, k, torch.device("cpu"))
    fwd = est._avest.forwarder
    idx, feats, sampled, rejected = _inputs(batch, k, steps, seed=1)
    done = threading.Event()
    t0 = time.perf_counter()
    for i in range(steps):
        fwd.capture(feats[i % len(feats)], idx, sampled[i % 8], rejected[i % 8])
    produced = time.perf_counter() - t0
    fwd.flush(60)
    elapsed = time.perf_counter() - t0
    done.set()
    est.avest_close()
    return {
        "steps": steps,
        "rows": sink.rows,
        "drafts_per_s": sink.rows * k / elapsed,
        "steps_per_s": sink.calls / elapsed,
        "capture_us_per_step": produced / steps * 1e6,
        "dropped": fwd.dropped,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4000, help="timed steps per variant")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--queue", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    res = bench_steps(args.batch, args.k, args.steps, args.rounds, args.queue)
    thr = bench_throughput(args.batch, args.k, 2000)
    print(f"step() wall time, B={args.batch}, K={args.k}, CPU stand-in, {args.steps} steps/variant")
    print(
        f"{'variant':<16}{'median µs':>11}{'p90 µs':>9}{'p99 µs':>9}{'added µs':>10}{'dropped':>9}"
    )
    for kind, r in res.items():
        added = "" if kind == "vLLM alone" else f"{r['added_median_us']:+.1f}"
        print(
            f"{kind:<16}{r['median_us']:>11.1f}{r['p90_us']:>9.1f}{r['p99_us']:>9.1f}"
            f"{added:>10}{r['dropped']:>9}"
        )
    shim = {k: r for k, r in res.items() if not k.startswith("vLLM alone")}
    worst = max(r["added_median_us"] for r in shim.values())
    spread = max(r["median_us"] for r in shim.values()) - min(r["median_us"] for r in shim.values())
    verdict = "OK" if worst <= TARGET_US else "OVER"
    noise = res["vLLM alone (A/A)"]["added_median_us"]
    print(
        f"worst added median {worst:+.1f} µs (target <= {TARGET_US:.0f} µs: {verdict}); "
        f"A/A noise {noise:+.1f} µs; spread across sink states {spread:.1f} µs"
    )
    print(
        f"forwarding: {thr['drafts_per_s']:,.0f} drafts/s ({thr['steps_per_s']:,.0f} steps/s of "
        f"{args.batch}x{args.k}); capture {thr['capture_us_per_step']:.1f} µs/step; "
        f"dropped {thr['dropped']}"
    )
    if args.json:
        args.json.write_text(json.dumps({"steps": res, "throughput": thr}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
