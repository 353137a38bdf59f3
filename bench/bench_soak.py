"""Soak: 64 Observe streams for N minutes next to 1,000 idle connections (a report).

``avest serve`` runs in a subprocess with tokens. 64 workers (8 pairs, 8
workers each) stream steps of 32 requests x K=5 at a steady rate each and
time every acknowledgement; 1,000 sockets (half gRPC, half HTTP) connect
and send nothing, and whichever the service closes is opened again, so a
thousand idle connections stand throughout. Every ``--interval`` seconds one
row: the server's resident memory and open descriptors, steps acknowledged,
ack latency p50/p99/max in that window, idle sockets the service closed.

Usage: python bench/bench_soak.py [--minutes 10] [--interval 10] [--rate 20] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_proc import WORKER_TOKEN, serve  # noqa: E402

from avest_wire.v1 import estimator_pb2 as pb  # noqa: E402
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc  # noqa: E402
from tests.support.rpc import observe_request  # noqa: E402

K, ROWS = 5, 32
WORKER = (("authorization", f"Bearer {WORKER_TOKEN}"),)


class Window:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.acked = 0
        self.closed = 0


async def worker(
    stub: pb_grpc.EstimatorServiceStub,
    pid: str,
    name: str,
    rate: float,
    end: float,
    win: list[Window],
) -> None:
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    sent: dict[int, float] = {}

    async def gen():  # noqa: ANN202
        seq = 0
        while time.monotonic() < end:
            seq += 1
            d = rng.integers(0, K + 1, size=ROWS)
            sent[seq] = time.perf_counter()
            x = rng.normal(0, 2, size=(ROWS, K))
            yield observe_request(pid, name, seq, x, d, [rng.integers(0, v + 1) for v in d])
            await asyncio.sleep(1.0 / rate)

    last = 0
    with contextlib.suppress(grpc.aio.AioRpcError):
        async for resp in stub.Observe(gen(), metadata=WORKER):
            if resp.HasField("ack"):
                now = time.perf_counter()
                for s in range(last + 1, resp.ack.acked_sequence + 1):
                    t = sent.pop(s, None)
                    if t is not None:
                        win[-1].latencies.append(now - t)
                        win[-1].acked += 1
                last = max(last, resp.ack.acked_sequence)


def open_idle(host: str, port: int) -> socket.socket:
    s = socket.socket()
    s.setblocking(False)
    with contextlib.suppress(OSError):
        s.connect_ex((host, port))
    return s


async def idle_keeper(
    host: str, ports: list[int], count: int, end: float, win: list[Window]
) -> None:
    socks = [open_idle(host, ports[i % 2]) for i in range(count)]
    while time.monotonic() < end:
        await asyncio.sleep(1.0)
        for i, s in enumerate(socks):
            try:
                while s.recv(65536):
                    pass
                closed = True
            except BlockingIOError:
                closed = False
            except OSError:
                closed = True
            if closed:
                win[-1].closed += 1
                s.close()
                socks[i] = open_idle(host, ports[i % 2])
    for s in socks:
        s.close()


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def soak(minutes: float, interval: float, rate: float, idle: int) -> list[dict[str, Any]]:
    served = serve(Path(tempfile.mkdtemp(prefix="avest-soak-")), ["--log-level", "warning"])
    rows: list[dict[str, Any]] = []
    try:
        channel = grpc.aio.insecure_channel(served.grpc_address)
        stub = pb_grpc.EstimatorServiceStub(channel)
        pairs = []
        for p in range(8):
            key = pb.PairKey(
                target_model=f"soak-{p}", draft_model="d", method="eagle", num_speculative_tokens=K
            )
            pairs.append(
                (await stub.RegisterPair(pb.RegisterPairRequest(key=key), metadata=WORKER)).pair_id
            )
        start = time.monotonic()
        end = start + minutes * 60
        win = [Window()]
        host, gport = served.grpc_address.rsplit(":", 1)
        hport = int(served.http_url.rsplit(":", 1)[1])
        tasks = [
            asyncio.create_task(worker(stub, pairs[w % 8], f"soak-w{w}", rate, end, win))
            for w in range(64)
        ]
        tasks.append(asyncio.create_task(idle_keeper(host, [int(gport), hport], idle, end, win)))
        while time.monotonic() < end:
            await asyncio.sleep(interval)
            w = win[-1]
            win.append(Window())
            lat = np.array(w.latencies) * 1000 if w.latencies else np.array([np.nan])
            rows.append(
                {
                    "t_s": round(time.monotonic() - start),
                    "rss_mib": round(served.rss_mib(), 1),
                    "fds": fds(served.proc.pid),
                    "steps_acked": w.acked,
                    "ack_ms_p50": round(float(np.nanpercentile(lat, 50)), 1),
                    "ack_ms_p99": round(float(np.nanpercentile(lat, 99)), 1),
                    "ack_ms_max": round(float(np.nanmax(lat)), 1),
                    "idle_closed_by_server": w.closed,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        await asyncio.gather(*tasks, return_exceptions=True)
        await channel.close()
    finally:
        served.stop()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=20.0, help="steps per second per stream")
    parser.add_argument("--idle", type=int, default=1000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    rows = asyncio.run(soak(args.minutes, args.interval, args.rate, args.idle))
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
