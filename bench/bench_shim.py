"""Added wall time per ``step`` on the critical path: the avest shim vs vLLM's estimator alone.

Runs the CPU stand-in of vLLM 0.33's ``OnlineAcceptanceEstimator`` (tests/shim/standin.py)
at B live requests and K draft positions, plain and wrapped by the shim with

* an in-memory sink (the shim's own cost): healthy (connected, pooled
  coefficients govern), absent (``connected`` False), slow (every ``submit``
  sleeps 500 ms);
* the real :class:`~avest_client.vllm.sidecar_sink.SidecarSink` (what runs in
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

    python bench/bench_shim.py [--batch 256] [--k 8] [--steps 4000] [--no-sidecar] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.shim.standin import StandinAcceptanceEstimator  # noqa: E402

from avest_client import Backoff  # noqa: E402
from avest_client.vllm import costs  # noqa: E402
from avest_client.vllm.config import ShimConfig  # noqa: E402
from avest_client.vllm.estimator import make_sidecar_estimator  # noqa: E402
from avest_client.vllm.pair import PairKey  # noqa: E402
from avest_client.vllm.sidecar_sink import SidecarSink  # noqa: E402

TARGET_US = 20.0
SLOW_S = 0.5
CPU = torch.device("cpu")

#: ``avest serve`` with every Observe message handled SLOW_S after it arrives.
SLOW_SERVER = f"""
import asyncio, sys
import avest.server
from avest.grpc_service import EstimatorService

class SlowObserve(EstimatorService):
    async def Observe(self, request_iterator, context):
        async def slow():
            async for req in request_iterator:
                await asyncio.sleep({SLOW_S})
                yield req
        async for resp in super().Observe(slow(), context):
            yield resp

avest.server.EstimatorService = SlowObserve
from avest.cli import main
sys.exit(main(sys.argv[1:]))
"""


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


# -- a real sidecar in a subprocess -------------------------------------------------


class Sidecar:
    """``avest serve`` (or its slow variant) on 127.0.0.1:0 with a fresh data directory."""

    def __init__(self, slow: bool = False) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="avest-bench-")
        head = [sys.executable, "-c", SLOW_SERVER] if slow else [sys.executable, "-m", "avest.cli"]
        args = ["serve", "--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0"]
        args += ["--data-dir", self._dir.name, "--log-level", "warning"]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            head + args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
        )
        self.address = self._wait_for_address(60.0)

    def _wait_for_address(self, timeout: float) -> str:
        found: list[str] = []

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                m = re.search(r"avest serving grpc=(\S+)", line)
                if m:
                    found.append(m.group(1))
                    return

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(timeout)
        if not found:
            self.stop()
            raise RuntimeError("avest serve did not announce its address")
        return found[0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._dir.cleanup()


def unused_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


# -- the estimators ------------------------------------------------------------------


def _inputs(batch: int, k: int, seed: int = 0):
    """Eight steps of valid verdicts: accepted a <= K, a + rejected <= K."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(batch, generator=g).to(torch.int64)
    feats = [(torch.randn(batch, k, generator=g) * 2 + 1).clamp_(-40, 40) for _ in range(8)]
    sampled, rejected = [], []
    for _ in range(8):
        s = torch.randint(0, k + 2, (batch,), generator=g, dtype=torch.int32)
        a = (s - 1).clamp(min=0)
        r = torch.randint(0, 2, (batch,), generator=g, dtype=torch.int32)
        sampled.append(s)
        rejected.append(torch.minimum(r, k - a).to(torch.int32))
    return idx, feats, sampled, rejected


def _shim(sink_factory: Callable[[ShimConfig, PairKey], Any], address: str, queue: int, k: int):
    cls = make_sidecar_estimator(
        StandinAcceptanceEstimator,
        sink_factory,
        config=ShimConfig(address=address, queue_size=queue, hardware="bench"),
        pair_resolver=lambda kk: PairKey("bench-target", "bench-draft", "draft_model", kk),
    )
    return cls


def _variant(kind: str, batch: int, k: int, queue: int) -> tuple[Any, Callable[[], None]]:
    """``(estimator, cleanup)`` for one variant."""
    if kind == "vLLM alone (A/A)":
        return StandinAcceptanceEstimator(batch, k, CPU), lambda: None
    if kind.startswith("in-memory"):
        sink = {
            "in-memory: healthy": lambda: BenchSink(True, k=k),
            "in-memory: absent": lambda: BenchSink(False, k=k),
            "in-memory: slow (500 ms)": lambda: BenchSink(True, delay_s=SLOW_S, k=k),
        }[kind]()
        est = _shim(lambda config, pair: sink, "bench", queue, k)(batch, k, CPU)
        return est, est.avest_close
    sidecar = None
    if kind == "sidecar: absent":
        address = unused_address()
    else:
        sidecar = Sidecar(slow=kind.startswith("sidecar: slow"))
        address = sidecar.address

    def factory(config: ShimConfig, pair: PairKey) -> SidecarSink:
        return SidecarSink(config, pair, recorder=costs.CostCurveRecorder())

    est = _shim(factory, address, queue, k)(batch, k, CPU)
    if sidecar is not None and not est._avest.sink.wait_connected(30):
        raise RuntimeError(f"{kind}: the sink did not connect")

    def cleanup() -> None:
        est.avest_close()
        if sidecar is not None:
            sidecar.stop()

    return est, cleanup


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
                e.load_features(idx, feats[j])  # vLLM's propose: not timed
                t0 = clock()
                e.step(idx, sampled[j], rejected[j])
                dt = clock() - t0
                if r:
                    times[which].append(dt / 1e3)
                if gap_s:
                    until = time.perf_counter() + gap_s
                    while time.perf_counter() < until:
                        time.sleep(0)
    return times


KINDS = [
    "vLLM alone (A/A)",
    "in-memory: healthy",
    "in-memory: absent",
    "in-memory: slow (500 ms)",
    "sidecar: healthy",
    "sidecar: absent",
    "sidecar: slow (500 ms)",
]


def bench_steps(
    batch: int, k: int, steps: int, rounds: int, queue: int, sidecar: bool, gap_s: float = 0.0
) -> dict:
    inputs = _inputs(batch, k)
    out = {}
    for kind in KINDS:
        if kind.startswith("sidecar") and not sidecar:
            continue
        est, cleanup = _variant(kind, batch, k, queue)
        plain = StandinAcceptanceEstimator(batch, k, CPU)
        try:
            shim_t, plain_t = _phase(est, plain, inputs, steps, rounds, gap_s)
            stats = est.avest_stats() if hasattr(est, "avest_stats") else {}
            sink = stats.get("sink") or {}
        finally:
            cleanup()
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
    est = _shim(lambda config, pair: sink, "bench", steps + 8, k)(batch, k, CPU)
    fwd = est._avest.forwarder
    idx, feats, sampled, rejected = _inputs(batch, k, seed=1)
    t0 = time.perf_counter()
    for i in range(steps):
        fwd.capture(feats[i % len(feats)], idx, sampled[i % 8], rejected[i % 8])
    produced = time.perf_counter() - t0
    fwd.flush(60)
    elapsed = time.perf_counter() - t0
    est.avest_close()
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

        est = _shim(factory, sidecar.address, steps + 8, k)(batch, k, CPU)
        sink = est._avest.sink
        if not sink.wait_connected(30):
            raise RuntimeError("the sink did not connect")
        idx, feats, sampled, rejected = _inputs(batch, k, seed=2)
        t0 = time.perf_counter()
        for i in range(steps):
            j = i % len(feats)
            est.load_features(idx, feats[j])
            est.step(idx, sampled[j], rejected[j])
        stepped = time.perf_counter() - t0
        est._avest.forwarder.flush(120)
        ok = sink.flush(300)
        elapsed = time.perf_counter() - t0
        s = sink.stats
        est.avest_close()
    finally:
        sidecar.stop()
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
