"""Hostile clients against ``avest serve`` in a subprocess (reports, never assertions).

* ``poison``: an outsider who knows the model names (pair ids are a hash of
  the key) streams 200 steps of "everything accepted" in about 0.2 s, sends
  sequence 2^64-1 under a real worker's id and overwrites the cost curves;
  once against a service with tokens, once against one without (loopback).
* ``busy``: N busy Observe streams (default 1,000, each sending as fast as
  flow control lets it) next to a light worker that sends 20 steps, one every
  5 s (a worker in summary mode sending its rounds), each waiting for its
  acknowledgement, once the open-stream gauge stopped growing: the light worker's
  ack latency (p50, p99, max), and /healthz latency meanwhile.
* ``idle``: the service under a 1,024 open-file limit, then 1,100 sockets
  that connect and send nothing (half to gRPC, half to HTTP): for 30 s,
  fresh /healthz and gRPC health probes every 0.5 s (share answered, longest
  outage), idle sockets the service closed, and bytes of log written.

* ``overload``: the capacity first (raw steps folded per second with every
  stream flat out), then N streams (default 1,000) each paced so that together
  they offer twice that, next to the light worker of ``busy``: its ack latency,
  the steps folded and the backpressure waits, at the defaults; with
  ``--baseline TREE``, first the same on another source tree's server, e.g. an
  export of an earlier commit. (``bench_fleet.py --overload`` does the same with
  round summaries.)
* ``heavy``: one stream sending 2 MiB steps (8,192 rows x K = 64, the largest
  allowed) flat out, while /healthz and GetCoefficients are probed every 50 ms:
  their latency (p50, p99, max), once with every step folded on the event loop
  (``--fold-thread-cells 0``, as before) and once with the default (heavy steps
  folded on a worker thread), in the same run.

Usage: python bench/bench_abuse.py poison|busy|overload|idle|heavy|all [--streams N]
       [--baseline TREE] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import random
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from abuse_heavy import heavy  # noqa: E402
from serve_proc import ADMIN_TOKEN, WORKER_TOKEN, serve  # noqa: E402

from avest_wire.v1 import estimator_pb2 as pb  # noqa: E402
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc  # noqa: E402
from tests.support.rpc import flood, random_step  # noqa: E402

K = 5
#: The light worker: this many steps, one every LIGHT_EVERY_S seconds (a worker in
#: summary mode sends a round every few seconds), each after the last one's ack.
LIGHT_STEPS = 20
LIGHT_EVERY_S = 5.0
WORKER = (("authorization", f"Bearer {WORKER_TOKEN}"),)
ADMIN = (("authorization", f"Bearer {ADMIN_TOKEN}"),)


def key(name: str = "victim") -> pb.PairKey:
    return pb.PairKey(
        target_model=name, draft_model="draft", method="eagle", num_speculative_tokens=K
    )


def step(
    pair_id: str, worker: str, seq: int, rows: int = 8, accept: int | None = None
) -> pb.ObserveRequest:
    return random_step(pair_id, worker, seq, rows, K, seed=seq, accept=accept)


def _outcome(fn: Any) -> str:
    try:
        fn()
        return "OK"
    except grpc.RpcError as exc:
        return f"{exc.code().name}: {exc.details()[:60]}"


def poison_once(tokens: bool) -> dict[str, Any]:
    served = serve(Path(tempfile.mkdtemp(prefix="avest-poison-")), tokens=tokens)
    try:
        md = WORKER if tokens else ()
        with grpc.insecure_channel(served.grpc_address) as ch:
            stub = pb_grpc.EstimatorServiceStub(ch)
            pid = stub.RegisterPair(
                pb.RegisterPairRequest(key=key(), refit_interval=20), metadata=md
            ).pair_id
            list(stub.Observe(iter([step(pid, "real", s) for s in range(1, 101)]), metadata=md))
            before = stub.GetPair(pb.GetPairRequest(pair_id=pid), metadata=md).pair
            curves = pb.SetCostCurvesRequest(
                pair_id=pid,
                draft_curve=[pb.CostPoint(size=1, ms=1000.0)],
                verify_curve=[pb.CostPoint(size=1, ms=1000.0)],
            )
            t0 = time.perf_counter()
            fake = [step(pid, "outsider", s, accept=K) for s in range(1, 201)]
            fake_outcome = _outcome(lambda: list(stub.Observe(iter(fake), timeout=10)))
            fake_s = time.perf_counter() - t0
            outcomes = {
                "ListPairs": _outcome(lambda: stub.ListPairs(pb.ListPairsRequest(), timeout=5)),
                "200 fake steps": fake_outcome,
                "sequence 2^64-1 as the real worker": _outcome(
                    lambda: list(stub.Observe(iter([step(pid, "real", 2**64 - 1)]), timeout=5))
                ),
                "SetCostCurves": _outcome(lambda: stub.SetCostCurves(curves, timeout=5)),
            }
            list(stub.Observe(iter([step(pid, "real", 101)]), metadata=md))
            after = stub.GetPair(pb.GetPairRequest(pair_id=pid), metadata=md).pair
        return {
            "tokens": tokens,
            "outcomes": outcomes,
            "fake_steps_s": round(fake_s, 3),
            "steps_before_after": (before.steps_observed, after.steps_observed),
            "intercepts_before": [round(v, 3) for v in before.coefficients.intercepts],
            "intercepts_after": [round(v, 3) for v in after.coefficients.intercepts],
            "cost_curves_after": list(after.cost_curve_hardware),
            "real_worker_step_101_applied": after.steps_observed > before.steps_observed
            and after.steps_observed - before.steps_observed in (1, 201),
        }
    finally:
        served.stop()


# -- busy streams --------------------------------------------------------------------------


def _busy_proc(
    address: str, pid: str, first: int, count: int, seconds: float, rate: float = 0.0
) -> None:
    """``count`` streams sending for ``seconds``: flat out (as fast as flow control
    lets them) with ``rate`` 0, else ``rate`` steps per second each, no faster."""

    async def paced(stub: pb_grpc.EstimatorServiceStub, msg: pb.ObserveRequest) -> None:
        deadline = time.monotonic() + seconds
        await asyncio.sleep(random.uniform(0, 1.0 / rate))

        async def gen():  # noqa: ANN202
            seq, t = 0, time.monotonic()
            while time.monotonic() < deadline:
                seq += 1
                msg.sequence = seq
                yield msg
                t += 1.0 / rate
                await asyncio.sleep(max(0.0, t - time.monotonic()))

        with contextlib.suppress(grpc.aio.AioRpcError):
            async for _ in stub.Observe(gen(), metadata=WORKER, timeout=seconds + 60):
                pass

    async def one(w: int) -> None:
        channel = grpc.aio.insecure_channel(address)
        stub = pb_grpc.EstimatorServiceStub(channel)
        msg = step(pid, f"busy-{w}", 1)
        if rate > 0:
            await paced(stub, msg)
        else:
            await flood(stub, msg, seconds, metadata=WORKER)
        await channel.close()

    async def main() -> None:
        await asyncio.gather(*(one(w) for w in range(first, first + count)))

    resource.setrlimit(
        resource.RLIMIT_NOFILE, (8192, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    )
    asyncio.run(main())


def _start_busy(
    address: str, pid: str, streams: int, procs: int, seconds: float, rate: float = 0.0
) -> list[Any]:
    """``streams`` busy streams (:func:`_busy_proc`) in ``procs`` processes, started."""
    ctx = mp.get_context("spawn")
    per = streams // procs
    workers = [
        ctx.Process(target=_busy_proc, args=(address, pid, i * per, per, seconds, rate))
        for i in range(procs)
    ]
    for p in workers:
        p.start()
    return workers


def _busy_and_light(address: str) -> tuple[str, str]:
    """The pairs of the busy streams and of the light worker, registered."""
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.EstimatorServiceStub(ch)
        return tuple(  # type: ignore[return-value]
            stub.RegisterPair(pb.RegisterPairRequest(key=key(name)), metadata=WORKER).pair_id
            for name in ("busy", "light")
        )


def _scrape(http_url: str, name: str) -> float:
    text = httpx.get(http_url + "/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _opened(http_url: str) -> tuple[float, float]:
    """Wait until every stream that will open is open (a thousand streams opening at
    once is its own storm; the light worker is measured next to them running): the
    open-stream gauge has not grown for 5 s; then 5 s more for the line. Returns the
    streams open and the seconds they took."""
    t_open = t_grew = time.monotonic()
    opened = -1.0
    while time.monotonic() - t_open < 180 and time.monotonic() - t_grew < 5:
        n = _scrape(http_url, "avest_open_streams")
        if n > opened:
            opened, t_grew = n, time.monotonic()
        time.sleep(1.0)
    opened_s = time.monotonic() - t_open
    time.sleep(5.0)
    return opened, round(opened_s, 1)


def _capacity(streams: int = 200, seconds: float = 15.0, procs: int = 4) -> float:
    """Steps folded per second with ``streams`` streams flat out."""
    served = serve(Path(tempfile.mkdtemp(prefix="avest-capacity-")), [])
    try:
        with grpc.insecure_channel(served.grpc_address) as ch:
            stub = pb_grpc.EstimatorServiceStub(ch)
            pid = stub.RegisterPair(pb.RegisterPairRequest(key=key("cap")), metadata=WORKER).pair_id
        workers = _start_busy(served.grpc_address, pid, streams, procs, seconds)
        time.sleep(5.0)  # every stream open and running
        s0, t0 = _scrape(served.http_url, "avest_steps_observed_total"), time.monotonic()
        time.sleep(seconds - 7.0)
        s1, t1 = _scrape(served.http_url, "avest_steps_observed_total"), time.monotonic()
        for p in workers:
            p.join(seconds + 60)
        return (s1 - s0) / (t1 - t0)
    finally:
        served.stop()


def overload(
    streams: int,
    factor: float = 2.0,
    steps: int = LIGHT_STEPS,
    procs: int = 4,
    baseline: Path | None = None,
) -> dict[str, Any]:
    capacity = _capacity(procs=procs)
    rate = factor * capacity / streams
    out: dict[str, Any] = {
        "capacity_steps_per_s": round(capacity, 1),
        "streams": streams,
        "per_stream_rate": round(rate, 3),
        "offered_steps_per_s": round(rate * streams, 1),
    }
    configs: list[tuple[str, list[str], Path | None]] = [("default", [], None)]
    if baseline is not None:
        configs.insert(0, ("baseline", [], baseline))
    for name, extra, tree in configs:
        served = serve(Path(tempfile.mkdtemp(prefix="avest-overload-")), extra, tree=tree)
        try:
            busy_pid, light_pid = _busy_and_light(served.grpc_address)
            # Covers the wait for the streams to open and the light worker's steps.
            seconds = 200.0 + steps * (LIGHT_EVERY_S + 2.0)
            workers = _start_busy(served.grpc_address, busy_pid, streams, procs, seconds, rate)
            opened, opened_s = _opened(served.http_url)
            s0 = _scrape(served.http_url, "avest_steps_observed_total")
            t0 = time.monotonic()
            result = asyncio.run(_light(served.grpc_address, light_pid, steps, served.http_url))
            s1 = _scrape(served.http_url, "avest_steps_observed_total")
            result["folded_steps_per_s"] = round((s1 - s0) / (time.monotonic() - t0), 1)
            result["backpressure_waits"] = _scrape(
                served.http_url, "avest_backpressure_waits_total"
            )
            result["streams_open"] = int(opened)
            result["streams_open_s"] = opened_s
            out[name] = result
            for p in workers:  # measured: the rest of their time is not needed
                p.terminate()
                p.join(60)
        finally:
            served.stop()
    if "baseline" in out:
        out["light_ack_p99_ratio_default_vs_baseline"] = round(
            out["default"]["ack_ms_p99"] / out["baseline"]["ack_ms_p99"], 3
        )
    return out


async def _light(
    address: str, pid: str, steps: int, http_url: str, every_s: float = LIGHT_EVERY_S
) -> dict[str, Any]:
    channel = grpc.aio.insecure_channel(address)
    t_connect = time.perf_counter()
    await channel.channel_ready()
    connect_s = time.perf_counter() - t_connect
    stub = pb_grpc.EstimatorServiceStub(channel)
    queue: asyncio.Queue[pb.ObserveRequest | None] = asyncio.Queue()
    acked: dict[int, float] = {}
    sent: dict[int, float] = {}
    got = asyncio.Event()

    async def gen():  # noqa: ANN202
        while (m := await queue.get()) is not None:
            yield m

    async def read() -> None:
        async for resp in stub.Observe(gen(), metadata=WORKER):
            if resp.HasField("ack"):
                acked[resp.ack.acked_sequence] = time.perf_counter()
                got.set()

    reader = asyncio.create_task(read())
    health: list[float] = []
    async with httpx.AsyncClient(base_url=http_url, timeout=30) as http:
        for s in range(1, steps + 1):
            sent[s] = time.perf_counter()
            await queue.put(step(pid, "light", s))
            while max(acked, default=0) < s:
                got.clear()
                await asyncio.wait_for(got.wait(), timeout=120)
            t0 = time.perf_counter()
            await http.get("/healthz")
            health.append(time.perf_counter() - t0)
            await asyncio.sleep(every_s)
    await queue.put(None)
    await reader
    await channel.close()
    lat = []
    for s, t in sent.items():
        done = min(v for q, v in acked.items() if q >= s)
        lat.append(done - t)
    arr = np.array(lat) * 1000
    h = np.array(health) * 1000
    return {
        "connect_ms": round(connect_s * 1000, 1),
        "first_ack_ms": round(float(arr[0]), 1),
        # The first step also opens the stream: the steady state is the rest.
        "ack_ms_p99_after_first": round(float(np.percentile(arr[1:], 99)), 1),
        "ack_ms_p50": round(float(np.percentile(arr, 50)), 1),
        "ack_ms_p99": round(float(np.percentile(arr, 99)), 1),
        "ack_ms_max": round(float(arr.max()), 1),
        "healthz_ms_p50": round(float(np.percentile(h, 50)), 1),
        "healthz_ms_max": round(float(h.max()), 1),
    }


def busy(
    streams: int,
    procs: int = 4,
    steps: int = LIGHT_STEPS,
    tokens: bool = True,
    extra: list[str] | None = None,
) -> dict[str, Any]:
    served = serve(Path(tempfile.mkdtemp(prefix="avest-busy-")), extra or [], tokens=tokens)
    try:
        busy_pid, light_pid = _busy_and_light(served.grpc_address)
        seconds = 200.0 + steps * (LIGHT_EVERY_S + 2.0)
        workers = _start_busy(served.grpc_address, busy_pid, streams, procs, seconds)
        opened, opened_s = _opened(served.http_url)
        rss0 = served.rss_mib()
        result = asyncio.run(_light(served.grpc_address, light_pid, steps, served.http_url))
        with grpc.insecure_channel(served.grpc_address) as ch:
            stub = pb_grpc.EstimatorServiceStub(ch)
            busy_steps = stub.GetPair(
                pb.GetPairRequest(pair_id=busy_pid), metadata=WORKER
            ).pair.steps_observed
        result.update(
            busy_streams=streams,
            busy_steps_applied=busy_steps,
            rss_mib=round(rss0, 1),
            streams_open=int(opened),
            streams_open_s=opened_s,
            backpressure_waits=_scrape(served.http_url, "avest_backpressure_waits_total"),
        )
        for p in workers:  # measured: the rest of their time is not needed
            p.terminate()
            p.join(60)
        return result
    finally:
        served.stop()


# -- idle sockets ----------------------------------------------------------------------------


def idle(
    sockets: int = 1100, nofile: int = 1024, seconds: float = 30.0, tokens: bool = True
) -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    served = serve(Path(tempfile.mkdtemp(prefix="avest-idle-")), nofile=nofile, tokens=tokens)
    try:
        host, gport = served.grpc_address.rsplit(":", 1)
        hport = served.http_url.rsplit(":", 1)[1]
        log0 = served.log_bytes()
        socks: list[socket.socket] = []
        t_open = time.monotonic()
        for i in range(sockets):
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(OSError):
                s.connect_ex((host, int(gport if i % 2 == 0 else hport)))
            socks.append(s)
        probes: list[tuple[float, bool, bool]] = []
        deadline = t_open + seconds
        while time.monotonic() < deadline:
            t = time.monotonic() - t_open
            try:
                ok_http = httpx.get(served.http_url + "/healthz", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                ok_http = False
            try:
                with grpc.insecure_channel(served.grpc_address) as ch:
                    resp = health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(), timeout=1.0
                    )
                    ok_grpc = resp.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                ok_grpc = False
            probes.append((t, ok_http, ok_grpc))
            time.sleep(0.5)
        closed = 0
        for s in socks:
            try:
                while s.recv(65536):  # what it sent first (HTTP/2 settings), then EOF
                    pass
                closed += 1
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
            s.close()

        def outage(i: int) -> float:
            longest, start = 0.0, None
            for t, *ok in probes:
                if not ok[i]:
                    start = t if start is None else start
                    longest = max(longest, t - start + 0.5)
                else:
                    start = None
            return round(longest, 1)

        return {
            "sockets": sockets,
            "nofile": nofile,
            "probes": len(probes),
            "healthz_ok": sum(p[1] for p in probes),
            "grpc_health_ok": sum(p[2] for p in probes),
            "longest_http_outage_s": outage(0),
            "longest_grpc_outage_s": outage(1),
            "idle_sockets_closed_by_server": closed,
            "log_bytes_in_window": served.log_bytes() - log0,
            "alive": served.proc.poll() is None,
        }
    finally:
        served.stop()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["poison", "busy", "overload", "idle", "heavy", "all"])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--sockets", type=int, default=1100)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--baseline", type=Path, help="overload: also a server from this source tree, first"
    )
    parser.add_argument(
        "--no-tokens", action="store_true", help="serve without tokens (to compare older builds)"
    )
    args = parser.parse_args()
    out: dict[str, Any] = {}
    if args.what in ("poison", "all"):
        out["poison_with_tokens"] = poison_once(True)
        out["poison_without_tokens_loopback"] = poison_once(False)
    if args.what in ("busy", "all"):
        out["busy"] = busy(args.streams, tokens=not args.no_tokens)
    if args.what in ("overload", "all"):
        out["overload"] = overload(args.streams, baseline=args.baseline)
    if args.what in ("heavy", "all"):
        out["heavy"] = heavy()
    if args.what in ("idle", "all"):
        out["idle"] = idle(args.sockets, tokens=not args.no_tokens)
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
