"""Ingestion over gRPC against the in-process core, Score/Budget latency, memory per pair.

One run, one table:

* **Ingest**: decode steps of B=64 requests x K=8 drafts, one step per
  Observe message, streamed on 1, 4 and 16 concurrent streams (one worker
  each, all pooled into one pair) into ``avest serve`` running in a
  subprocess on loopback, so client and server do not share a GIL. Rate =
  drafts (B*K per step) whose steps were *acknowledged* (applied and durable)
  per second of wall time, from the first write to the last acknowledgement.
  The same steps fed to ``OnlineEstimator.observe`` in this process give the
  in-process rate; the table reports the ratio. Raw ``grpc.aio`` streams
  with prebuilt messages measure the server; the ``Forwarder`` rows add the
  client library's cost (validation, copying, its sender thread).
  For the raw streams the server process's CPU seconds give the rate per
  server core (drafts per CPU second), whatever the client took.
* **Latency**: ``Score`` and ``Budget`` (lossless default, cost curves set
  first) at B=256, K=16 through the sync :class:`EstimatorClient`,
  sequential calls, p50/p99 of the round trip.
* **Memory**: the server's resident set size before and after registering 200
  pairs (K=8) and feeding each a few steps; delta per pair.

Usage: python bench/bench_ingest.py [--steps N] [--streams 1,4,16] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
import numpy as np
from serve_proc import ADMIN_TOKEN, serve
from timing import call_seconds

from avest.core.estimator import OnlineEstimator
from avest.core.rule_factory import make_rule
from avest.settings import Settings
from avest_client import EstimatorClient, Forwarder
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc
from tests.support.rpc import observe_request
from tests.support.serve import stop_process

B, K = 64, 8
LAT_B, LAT_K = 256, 16
REFIT_INTERVAL = 100


def start_server(
    data_dir: str, extra: Sequence[str] = (), tree: Path | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """``avest serve`` from this checkout, or from the source ``tree`` given; its
    process (``avest_http``: its HTTP URL) and gRPC address."""
    served = serve(
        Path(data_dir),
        [
            *("--log-level", "warning", "--max-pairs", "4096"),
            # Admin token for SetCostCurves; no call-rate or step-rate limits
            # (the benchmark measures the server, from one client address).
            *("--admin-token", ADMIN_TOKEN, "--rpc-rate", "0"),
            *extra,
        ],
        tokens=False,
        tree=tree,
    )
    served.proc.avest_http = served.http_url  # type: ignore[attr-defined]
    return served.proc, served.grpc_address


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def make_steps(n: int, rows: int, k: int, seed: int) -> list[tuple[np.ndarray, ...]]:
    """Synthetic steps from the logistic model (every draft verified)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = (-2.5 + rng.gamma(1.5, 1.7, size=(rows, k))).clip(-40, 40).astype(np.float32)
        p = 1.0 / (1.0 + np.exp(-(0.5 * x + np.linspace(0.5, -0.5, k))))
        ok = rng.random((rows, k)) < p
        a = np.where(ok.all(axis=1), k, np.argmin(ok, axis=1)).astype(np.int32)
        out.append((x, np.full(rows, k, dtype=np.int32), a))
    return out


def in_process_rate(steps: list[tuple[np.ndarray, ...]], rule: str) -> float:
    s = Settings()
    est = OnlineEstimator(
        K, make_rule(rule, forgetting=s.forgetting, prior=s.prior), refit_interval=REFIT_INTERVAL
    )
    for x, d, a in steps[:50]:  # warm up
        est.observe(x, d, a)
    t = time.perf_counter()
    for x, d, a in steps:
        est.observe(x, d, a)
    return len(steps) * B * K / (time.perf_counter() - t)


def messages(pair_id: str, worker: str, steps: list[tuple[np.ndarray, ...]]) -> list:
    return [observe_request(pair_id, worker, seq, *step) for seq, step in enumerate(steps, 1)]


async def raw_streams(address: str, pair_id: str, plans: list[list]) -> float:
    """Stream prebuilt messages on len(plans) streams; seconds until all are acknowledged."""
    async with grpc.aio.insecure_channel(address) as channel:
        await channel.channel_ready()
        stub = pb_grpc.EstimatorServiceStub(channel)

        async def one(msgs: list) -> None:
            call = stub.Observe()
            last = msgs[-1].sequence

            async def write() -> None:
                for m in msgs:
                    await call.write(m)
                await call.done_writing()

            writer = asyncio.ensure_future(write())
            async for resp in call:
                if resp.HasField("ack") and resp.ack.acked_sequence >= last:
                    break
            await writer
            call.cancel()

        t = time.perf_counter()
        await asyncio.gather(*(one(m) for m in plans))
        return time.perf_counter() - t


def forwarder_streams(address: str, pair_id: str, n: int, steps: list) -> float:
    fwds = [Forwarder(address, pair_id, queue_size=len(steps) + 1) for _ in range(n)]
    for f in fwds:
        f.start()
    time.sleep(0.5)  # connected
    t = time.perf_counter()

    def feed(f: Forwarder) -> None:
        for x, d, a in steps:
            f.submit(x, d, a, None)

    threads = [threading.Thread(target=feed, args=(f,)) for f in fwds]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for f in fwds:
        if not f.flush(timeout=300):
            raise RuntimeError(f"forwarder did not flush: {f.stats}")
    elapsed = time.perf_counter() - t
    for f in fwds:
        s = f.stats
        assert s.dropped == 0 and s.acked == len(steps), s
        f.close()
    return elapsed


def latency(client: EstimatorClient, calls: int) -> dict[str, tuple[float, float]]:
    reg = client.register("bench/target", "bench/draft", "bench", LAT_K, labels={"lat": "1"})
    pid = reg.pair_id
    draft = [(r, 1.0 + 0.01 * r) for r in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)]
    captured = [1, 2, 4, *range(8, 257, 8), *range(272, 513, 16)]
    verify = [(s, 5.0 + 0.004 * s + (0.4 if s > 256 else 0.0)) for s in captured]
    verify += [(768, 9.0), (1024, 11.0), (2048, 18.0), (4096, 33.0), (8192, 65.0)]
    client.set_cost_curves(pid, draft, verify, cudagraph_limit=512)
    rng = np.random.default_rng(1)
    feats = [rng.normal(0, 2, size=(LAT_B, LAT_K)).astype(np.float32) for _ in range(16)]
    confs = [rng.beta(5, 2, size=(LAT_B, LAT_K)).astype(np.float32) for _ in range(16)]
    sched = np.full(LAT_B, LAT_K)
    out = {}
    for name, fn in (
        ("Score", lambda i: client.score(pid, feats[i % 16])),
        ("Budget", lambda i: client.budget(pid, confs[i % 16], sched, LAT_B, LAT_B)),
    ):
        arr = np.array(call_seconds(fn, calls, warmup=50)) * 1e3
        out[name] = (float(np.percentile(arr, 50)), float(np.percentile(arr, 99)))
    return out


def stream_pairs(address: str, plans: list[list], streams: int = 8) -> None:
    """Send every pair's messages over ``streams`` Observe streams, each carrying
    whole pairs in order (a stream may carry many pairs); wait for every ack."""
    chunks = [[m for plan in plans[j::streams] for m in plan] for j in range(streams)]

    async def run_chunks() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.EstimatorServiceStub(channel)

            async def one(msgs: list) -> None:
                async def gen():
                    for m in msgs:
                        yield m

                async for _ in stub.Observe(gen()):
                    pass

            await asyncio.gather(*(one(c) for c in chunks))

    asyncio.run(run_chunks())


def memory_per_pair(address: str, server_pid: int, pairs: int, steps_each: int) -> float:
    steps = make_steps(steps_each, B, K, seed=7)
    with EstimatorClient(address, timeout=30) as client:
        time.sleep(0.5)
        before = rss_bytes(server_pid)
        ids = [
            client.register("mem/target", f"mem/draft-{i}", "bench", K).pair_id
            for i in range(pairs)
        ]
    plans = [messages(pid, f"mem-{i}", steps) for i, pid in enumerate(ids)]
    stream_pairs(address, plans)
    time.sleep(1.0)
    after = rss_bytes(server_pid)
    return (after - before) / pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000, help="steps per stream")
    parser.add_argument("--streams", default="1,4,16")
    parser.add_argument("--forwarder-streams", default="1,4")
    parser.add_argument("--latency-calls", type=int, default=2000)
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    streams = [int(s) for s in args.streams.split(",") if s]
    fstreams = [int(s) for s in args.forwarder_streams.split(",") if s]

    tmp = tempfile.mkdtemp(prefix="avest-bench-")
    proc, address = start_server(tmp)
    rows: list[dict] = []
    try:
        with EstimatorClient(address, timeout=30, token=ADMIN_TOKEN) as client:
            reg = client.register("bench/target", "bench/draft", "bench", K)
            rule = reg.rule
            # In-process core on the same kind of steps (same rule, same interval).
            pool = make_steps(400, B, K, seed=0)
            core_steps = [pool[i % len(pool)] for i in range(args.steps)]
            core = in_process_rate(core_steps, rule)
            rows.append({"what": "in-process OnlineEstimator.observe", "streams": 0, "rate": core})
            for n in streams:
                # A fresh pair per run, so every run starts from the same state.
                r = client.register("bench/target", "bench/draft", "bench", K, labels={"n": str(n)})
                plans = [
                    messages(
                        r.pair_id,
                        f"raw-{n}-{w}",
                        [pool[(i + w) % len(pool)] for i in range(args.steps)],
                    )
                    for w in range(n)
                ]
                cpu0 = cpu_s(proc.pid)
                secs = asyncio.run(raw_streams(address, r.pair_id, plans))
                drafts = n * args.steps * B * K
                rate = drafts / secs
                # drafts per CPU second of the server process: the rate per server core
                per_core = drafts / max(cpu_s(proc.pid) - cpu0, 1e-9)
                rows.append(
                    {
                        "what": "gRPC raw aio streams",
                        "streams": n,
                        "rate": rate,
                        "per_core": per_core,
                    }
                )
            for n in fstreams:
                r = client.register("bench/target", "bench/draft", "bench", K, labels={"f": str(n)})
                steps = [pool[i % len(pool)] for i in range(args.steps)]
                secs = forwarder_streams(address, r.pair_id, n, steps)
                rate = n * args.steps * B * K / secs
                rows.append({"what": "gRPC Forwarder (client lib)", "streams": n, "rate": rate})
            lat = latency(client, args.latency_calls)
        per_pair = memory_per_pair(address, proc.pid, args.pairs, steps_each=5)
    finally:
        stop_process(proc, 30)

    if args.json:
        print(
            json.dumps(
                {
                    "ingest": [{**r, "ratio_to_in_process": r["rate"] / core} for r in rows],
                    "latency_ms": {k: {"p50": v[0], "p99": v[1]} for k, v in lat.items()},
                    "rss_bytes_per_pair": per_pair,
                    "cpus": os.cpu_count(),
                },
                indent=2,
            )
        )
        return
    print(
        f"avest ingest benchmark: B={B}, K={K}, one step per message, {args.steps} steps per stream"
    )
    print(f"(server in a subprocess on loopback; {os.cpu_count()} CPUs on this machine)\n")
    print(
        f"{'path':<36} {'streams':>7} {'Mdrafts/s':>10} {'vs in-process':>14} "
        f"{'per server CPU s':>17}"
    )
    for r in rows:
        n = str(r["streams"]) if r["streams"] else "-"
        per_core = f"{r['per_core'] / 1e6:>15.2f} M" if "per_core" in r else f"{'':>17}"
        print(
            f"{r['what']:<36} {n:>7} {r['rate'] / 1e6:>10.2f} {r['rate'] / core:>13.0%} {per_core}"
        )
    print(f"\nlatency at B={LAT_B}, K={LAT_K} ({args.latency_calls} sequential calls, sync client)")
    print(f"{'RPC':<10} {'p50 ms':>8} {'p99 ms':>8}")
    for name, (p50, p99) in lat.items():
        print(f"{name:<10} {p50:>8.3f} {p99:>8.3f}")
    print(
        f"\nserver RSS per pair ({args.pairs} pairs, K={K}, 5 steps each): {per_pair / 1024:.1f} KiB"
    )


if __name__ == "__main__":
    main()
