"""Where a unary call waits on a saturated grpc.aio server, reduced to grpcio alone.

A server process holds one grpc.aio server whose stream handler spends ``--work-us``
of CPU on each message before it acks it (a stand-in for reading, checking and
queueing a round summary), and a trivial unary method. Load processes keep
``--streams`` streams flat out, one message in flight each: the event loop is
saturated. A probe process then calls the unary method every ``--every-ms``,
alternately on

- the same grpc.aio server (``aio``), and
- a second, synchronous grpcio server in the same process (``grpc.server`` on a
  thread pool, its own completion queue, on a port of its own) serving the same
  method (``sync``),

and prints each one's round trip p50 / p99 / max, with the server loop's lag (a 10 ms
timer's lateness) over the same window. Nothing of avest is imported: what it shows is
grpcio's, and what avest's own ``--read-port`` stands on.

    python bench/grpc_unary_wait.py [--streams 200] [--work-us 300] [--seconds 20]

It fails (exit 1) when a probe or a stream fails, when the streams ack nothing, or when
not every stream is open within ``--open-wait-s`` (a saturated grpc.aio server may stop
accepting new calls: with 500 streams here, 25 never opened in 300 s).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time
from typing import Any

import grpc

SERVICE = "wait.Wait"


def _spin(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def _serve(ports: Any, lags: Any, stop: Any, work_us: float) -> None:
    def unary(request: bytes, context: Any) -> bytes:
        return b"r" * 64

    sync = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
    sync.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE, {"Unary": grpc.unary_unary_rpc_method_handler(unary)}
            ),
        )
    )
    sync_port = sync.add_insecure_port("127.0.0.1:0")
    sync.start()

    async def main() -> None:
        async def stream(requests: Any, context: Any) -> Any:
            async for _ in requests:
                _spin(work_us)
                yield b"a" * 40

        async def aio_unary(request: bytes, context: Any) -> bytes:
            return unary(request, context)

        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    SERVICE,
                    {
                        "Stream": grpc.stream_stream_rpc_method_handler(stream),
                        "Unary": grpc.unary_unary_rpc_method_handler(aio_unary),
                    },
                ),
            )
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ports.put((port, sync_port))
        loop = asyncio.get_running_loop()
        samples: list[float] = []
        while not stop.is_set():
            t = loop.time()
            await asyncio.sleep(0.01)
            samples.append(loop.time() - t - 0.01)
            if len(samples) >= 100:
                lags.put(samples)
                samples = []
        await server.stop(0)

    asyncio.run(main())
    sync.stop(0)


def _load(port: int, streams: int, stop: Any, counts: Any, opened: Any) -> None:
    async def main() -> None:
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(8)]
        acked = failures = 0
        failed = ""

        async def one(i: int) -> None:
            nonlocal acked, failed, failures
            call = channels[i % len(channels)].stream_stream(f"/{SERVICE}/Stream")()
            try:
                first = True
                while not stop.is_set():
                    await call.write(b"s" * 6900)
                    await call.read()
                    acked += 1
                    if first:
                        first = False
                        with opened.get_lock():
                            opened.value += 1
                await call.done_writing()
            except grpc.aio.AioRpcError as exc:
                if not stop.is_set():
                    failures += 1
                    failed = failed or f"stream {i}: {exc.code().name}: {exc.details()}"
            finally:
                call.cancel()

        await asyncio.gather(*(one(i) for i in range(streams)))
        counts.put((acked, f"{failures} stream(s) failed, the first {failed}" if failed else ""))

    asyncio.run(main())


def _quantiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {
        "n": len(xs),
        "p50_ms": round(statistics.median(xs) * 1e3, 2),
        "p99_ms": round(xs[min(len(xs) - 1, int(0.99 * len(xs)))] * 1e3, 2),
        "max_ms": round(xs[-1] * 1e3, 2),
    }


def run(
    streams: int, work_us: float, seconds: float, every_ms: float, loaders: int, open_wait_s: float
) -> dict:
    ctx = mp.get_context("spawn")
    ports, lags, counts = ctx.Queue(), ctx.Queue(), ctx.Queue()
    opened = ctx.Value("i", 0)
    stop, stop_load = ctx.Event(), ctx.Event()
    server = ctx.Process(target=_serve, args=(ports, lags, stop, work_us), daemon=True)
    server.start()
    aio_port, sync_port = ports.get(timeout=60)
    per = [streams // loaders + (i < streams % loaders) for i in range(loaders)]
    load = [
        ctx.Process(target=_load, args=(aio_port, n, stop_load, counts, opened), daemon=True)
        for n in per
    ]
    for p in load:
        p.start()
    targets = {"aio": aio_port, "sync": sync_port}
    stubs = {
        name: grpc.insecure_channel(f"127.0.0.1:{p}").unary_unary(f"/{SERVICE}/Unary")
        for name, p in targets.items()
    }
    for stub in stubs.values():
        stub(b"q", timeout=60)  # connect before timing
    # A stream opened before the load: one message and its ack per probe.
    sends: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    stream_channel = grpc.insecure_channel(f"127.0.0.1:{aio_port}")
    acks = stream_channel.stream_stream(f"/{SERVICE}/Stream")(iter(sends.get, None), timeout=3600)

    def stream_probe(request: bytes, timeout: float) -> None:
        sends.put(b"s" * 6900)
        next(acks)

    stream_probe(b"", 60)
    t_open = time.perf_counter()
    while opened.value < streams:  # every stream acked once: the loop is saturated
        if time.perf_counter() - t_open > open_wait_s:
            raise SystemExit(
                f"grpc_unary_wait: {opened.value} of {streams} streams opened in "
                f"{open_wait_s:g} s: the saturated grpc.aio server accepts no more"
            )
        time.sleep(0.1)
    open_s = time.perf_counter() - t_open
    while not lags.empty():
        lags.get()
    probes: dict[str, Any] = {**stubs, "aio_stream": stream_probe}
    rtt: dict[str, list[float]] = {name: [] for name in probes}
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for name, stub in probes.items():
            t = time.perf_counter()
            stub(b"q", timeout=30)
            rtt[name].append(time.perf_counter() - t)
            time.sleep(every_ms / 1e3)
    sends.put(None)
    acks.cancel()
    lag: list[float] = []
    while not lags.empty():
        lag.extend(lags.get())
    stop_load.set()
    acked, failures = 0, []
    for _ in load:
        n, failed = counts.get(timeout=60)
        acked += n
        if failed:
            failures.append(failed)
    stop.set()
    for p in [*load, server]:
        p.join(timeout=30)
    if failures:
        raise SystemExit(f"grpc_unary_wait: {len(failures)} load process(es) failed: {failures[0]}")
    if acked == 0 or not lag:
        raise SystemExit("grpc_unary_wait: the streams acked nothing; no load was measured")
    return {
        "streams": streams,
        "work_us": work_us,
        "acked": acked,
        "open_s": round(open_s, 1),
        "loop_lag": _quantiles(lag),
        **{name: _quantiles(xs) for name, xs in rtt.items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--work-us", type=float, default=300.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--every-ms", type=float, default=50.0)
    ap.add_argument("--loaders", type=int, default=2)
    ap.add_argument("--open-wait-s", type=float, default=120.0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    r = run(a.streams, a.work_us, a.seconds, a.every_ms, a.loaders, a.open_wait_s)
    if a.json:
        print(json.dumps(r))
        return 0
    print(
        f"{r['streams']} streams flat out, {r['work_us']:g} µs of work per message, "
        f"{r['acked']} acked, opened in {r['open_s']} s; cores: {os.cpu_count()}"
    )
    print(f"{'':26} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'n':>6}")
    for name, label in (
        ("loop_lag", "server loop lag"),
        ("aio", "unary, grpc.aio server"),
        ("aio_stream", "an open stream's message"),
        ("sync", "unary, sync grpc.server"),
    ):
        q = r[name]
        print(f"{label:26} {q['p50_ms']:8.2f} {q['p99_ms']:8.2f} {q['max_ms']:8.2f} {q['n']:6d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
