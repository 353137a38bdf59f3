"""The ingest sections of ``bench/bench_summary.py``: the server's work per summary in
process (parse, check, apply), and ``avest serve`` in a subprocess taking summaries from
many workers over gRPC (acknowledged per second, ack latency, CPU per summary)."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from bench_ingest import cpu_s, make_steps, start_server

from avest_client import EstimatorClient
from avest_client.summary import RoundAccumulator
from avest_wire.messages import summary_to_pb
from avest_wire.v1 import estimator_pb2 as pb
from tests.support.serve import stop_process

#: Steps one worker's round covers (vLLM's REFIT_INTERVAL).
ROUND_STEPS = 100


def summary_body(k: int, batch: int = 256, reached: bool = False) -> bytes:
    """A realistic summary (100 steps of B x K drafts) serialized as ObserveRequest's field;
    ``reached``: with its reached counts (the vLLM plugin sends them with one round in ten)."""
    acc = RoundAccumulator(k, reached=reached)
    for x, d, a in make_steps(ROUND_STEPS, batch, k, seed=3):
        acc.add(x, d, a, 0.5, [-0.2] * k)
    s = acc.take(0, 0.5, [-0.2] * k)
    assert s is not None
    return pb.ObserveRequest(k=k, summary=summary_to_pb(s)).SerializeToString()


async def ingest(address: str, pair_id: str, body: bytes, workers: int, streams: int,
                 rate: float, seconds: float, wait_s: float = 120.0) -> dict[str, float]:  # fmt: skip
    """Offered ``rate`` summaries/s (0: flat out) from ``workers`` over ``streams``.

    Gives up ``wait_s`` after the last write is due (reporting the summaries never
    acknowledged as ``unacked``) rather than wait for ever."""
    per_stream = [list(range(s, workers, streams)) for s in range(streams)]
    lat: list[float] = []
    acked = [0]
    async with grpc.aio.insecure_channel(
        address, options=[("grpc.max_send_message_length", 64 << 20)]
    ) as channel:
        await channel.channel_ready()
        observe = channel.stream_stream(
            "/avest.v1.EstimatorService/Observe",
            request_serializer=lambda b: b,
            response_deserializer=pb.ObserveResponse.FromString,
        )
        total = int(rate * seconds) if rate else workers * 5
        t0 = time.perf_counter()

        async def one(ws: list[int], share: int) -> None:
            call = observe()
            sent: dict[str, list[tuple[int, float]]] = {}
            seq = {w: 0 for w in ws}
            done = asyncio.Event()
            remaining = [share]

            async def write() -> None:
                for i in range(share):
                    w = ws[i % len(ws)]
                    seq[w] += 1
                    if rate:
                        due = t0 + (i * len(per_stream)) / rate
                        delay = due - time.perf_counter()
                        if delay > 0:
                            await asyncio.sleep(delay)
                    head = pb.ObserveRequest(
                        pair_id=pair_id, worker_id=f"w{w}", sequence=seq[w]
                    ).SerializeToString()
                    sent.setdefault(f"w{w}", []).append((seq[w], time.perf_counter()))
                    await call.write(head + body)
                await done.wait()
                await call.done_writing()

            writer = asyncio.ensure_future(write())
            async for resp in call:
                if resp.HasField("ack"):
                    now = time.perf_counter()
                    pend = sent.get(resp.ack.worker_id, [])
                    while pend and pend[0][0] <= resp.ack.acked_sequence:
                        lat.append(now - pend.pop(0)[1])
                        remaining[0] -= 1
                        acked[0] += 1
                    if remaining[0] == 0:
                        done.set()
                        break
            await writer
            call.cancel()

        shares = [total // streams + (1 if s < total % streams else 0) for s in range(streams)]
        unacked = 0
        try:
            await asyncio.wait_for(
                asyncio.gather(*(one(ws, n) for ws, n in zip(per_stream, shares, strict=True))),
                (total / rate if rate else 0.0) + wait_s,
            )
        except asyncio.TimeoutError:
            unacked = total - acked[0]
        elapsed = time.perf_counter() - t0
    ms = np.array(lat or [float("nan")]) * 1e3
    return {
        "offered_per_s": rate,
        "acked_per_s": acked[0] / elapsed,
        "ack_p50_ms": float(np.percentile(ms, 50)),
        "ack_p99_ms": float(np.percentile(ms, 99)),
        "summaries": acked[0],
        "unacked": unacked,
        "bytes_per_summary": len(body) + 40,
    }


def bench_handler(
    k: int, n: int = 1000, repeats: int = 3, reached: bool = False
) -> dict[str, float]:
    """The server's work per summary without gRPC, in this process: parse the message,
    validate it (``summary_from_pb``), apply it (``Pair.observe``, a refit every 1,000
    summaries as in the ingest runs). CPU microseconds per summary, best of ``repeats``."""
    from avest.grpc.summaries import summary_from_pb
    from avest.state.pairs import Registry, RuleConfig
    from avest_wire.pair import PairKey

    body = summary_body(k, reached=reached)
    best: dict[str, float] = {}
    for _ in range(repeats):
        reg = Registry(RuleConfig())
        pair, _ = reg.register(PairKey.of("t", "d", "m", k), "recursive", 1000 * ROUND_STEPS)
        msgs = [
            pb.ObserveRequest(
                pair_id=pair.id, worker_id=f"w{i % 1000}", sequence=i // 1000 + 1
            ).SerializeToString()
            + body
            for i in range(n)
        ]
        t0 = time.process_time()
        reqs = [pb.ObserveRequest.FromString(m) for m in msgs]
        t1 = time.process_time()
        summaries = [summary_from_pb(r, pair) for r in reqs]
        t2 = time.process_time()
        for r, s in zip(reqs, summaries, strict=True):
            pair.observe(r.worker_id, r.sequence, s)
        t3 = time.process_time()
        for key, v in (("parse_us", t1 - t0), ("validate_us", t2 - t1), ("apply_us", t3 - t2)):
            best[key] = min(best.get(key, float("inf")), 1e6 * v / n)
    best["total_us"] = best["parse_us"] + best["validate_us"] + best["apply_us"]
    return best


def bench_ingest_summaries(ks: list[int], workers: int, streams: int, rate: float,
                           seconds: float, flush_ms: int = 100,
                           tree: Path | None = None) -> dict[str, Any]:  # fmt: skip
    tmp = tempfile.mkdtemp(prefix="avest-bench-summary-")
    proc, address = start_server(tmp, ["--flush-interval-ms", str(flush_ms)], tree)
    out: dict[str, Any] = {}
    try:
        with EstimatorClient(address, timeout=30) as client:
            for k in ks:
                body = summary_body(k)
                for label, r in (("offered", rate), ("flat out", 0.0)):
                    # a pair refits once per pooled round of every worker (W x 100 steps)
                    reg = client.register(
                        "bench/target", "bench/draft", "bench", k, labels={"run": f"{k}-{label}"},
                        rule="recursive", refit_interval=min(1_000_000, workers * ROUND_STEPS),
                    )  # fmt: skip
                    server0, client0 = cpu_s(proc.pid), time.process_time()
                    res = asyncio.run(
                        ingest(address, reg.pair_id, body, workers, streams, r, seconds)
                    )
                    n = max(1, res["summaries"])
                    res["server_cpu_us"] = 1e6 * (cpu_s(proc.pid) - server0) / n
                    res["client_cpu_us"] = 1e6 * (time.process_time() - client0) / n
                    info = client.pair(reg.pair_id)
                    res["refits"] = info.coefficients.round
                    out[f"K={k} {label}"] = res
    finally:
        stop_process(proc, 30)
    return out


def print_ingest(res: dict[str, Any]) -> None:
    for name, h in res.get("handler", {}).items():
        print(
            f"handler {name:<5} CPU per summary: parse {h['parse_us']:.0f} µs, validate "
            f"{h['validate_us']:.0f} µs, apply {h['apply_us']:.0f} µs = {h['total_us']:.0f} µs "
            f"({1e6 / h['total_us']:.0f} summaries/s per core, no gRPC)"
        )
    for flush, runs in res.get("ingest", {}).items():
        for name, r in runs.items():
            print(
                f"ingest {flush:<24} {name:<14} acked {r['acked_per_s']:>7.0f}/s  ack p50 "
                f"{r['ack_p50_ms']:>7.1f} ms  p99 {r['ack_p99_ms']:>7.1f} ms  CPU per summary: "
                f"server {r['server_cpu_us']:>5.0f} µs, client {r['client_cpu_us']:>5.0f} µs  "
                f"({r['summaries']} summaries, {r['unacked']} unacked, {r['refits']} refits)"
            )
    if "grpc_floor" in res:
        f = res["grpc_floor"]
        print(
            f"bare gRPC floor (one {f['bytes']}-byte message in, one ack out, nothing done): "
            f"server {f['server_cpu_us']:.0f} µs, client {f['client_cpu_us']:.0f} µs CPU per "
            f"message, {f['per_s']:.0f} messages/s"
        )
