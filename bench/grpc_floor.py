"""The bare gRPC floor on this machine: server CPU per message on an Observe-like stream.

A grpc.aio server in a subprocess whose stream handler reads each message and
answers it with one small ack, doing nothing else; a grpc.aio client writes
``n`` messages of ``size`` bytes over ``streams`` streams, flat out. The
server's CPU per message is the floor under any Python gRPC server's cost per
summary on this host (avest's adds parsing, checks, the fold, the group
commit and the ack bookkeeping): ``bench_summary.py`` prints both.

:func:`unary_floor` does the same for a unary call (a ``size``-byte request,
a ``reply``-byte answer, sequential, through a sync channel as the client
library calls ``Score`` and ``Budget``): the round-trip latency and the CPU
under any unary RPC on this host (``bench_rpc_latency.py`` prints it).

    python bench/grpc_floor.py [--messages 20000] [--streams 16] [--size 6900]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import grpc


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _serve(ports: Any, reply: int = 40) -> None:
    async def main() -> None:
        async def stream(requests: Any, context: Any) -> Any:
            async for _ in requests:
                yield b"a" * 40

        async def unary(request: bytes, context: Any) -> bytes:
            return b"r" * reply

        handlers = {
            "Stream": grpc.stream_stream_rpc_method_handler(stream),
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
        }
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("floor.Floor", handlers),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ports.put(port)
        await server.wait_for_termination()

    asyncio.run(main())


async def _send(port: int, n: int, streams: int, size: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        method = channel.stream_stream("/floor.Floor/Stream")
        body = b"b" * size

        async def one(count: int) -> None:
            call = method()

            async def write() -> None:
                for _ in range(count):
                    await call.write(body)
                await call.done_writing()

            writer = asyncio.ensure_future(write())
            async for _ in call:
                pass
            await writer

        await asyncio.gather(*(one(n // streams) for _ in range(streams)))


def grpc_floor(size: int, streams: int = 16, n: int = 20000) -> dict[str, float]:
    """Server and client CPU per message, and messages per second, flat out."""
    ports: Any = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=_serve, args=(ports,), daemon=True)
    proc.start()
    try:
        port = ports.get(timeout=60)
        assert proc.pid is not None
        server0, client0, t0 = _cpu_s(proc.pid), time.process_time(), time.perf_counter()
        asyncio.run(_send(port, n, streams, size))
        sent = (n // streams) * streams
        return {
            "bytes": size,
            "per_s": sent / (time.perf_counter() - t0),
            "server_cpu_us": 1e6 * (_cpu_s(proc.pid) - server0) / sent,
            "client_cpu_us": 1e6 * (time.process_time() - client0) / sent,
        }
    finally:
        proc.kill()
        proc.join(10)


def unary_floor(size: int, reply: int, n: int = 2000) -> dict[str, float]:
    """Sequential unary calls through a sync channel: p50/p99 ms and CPU ms per call."""
    ports: Any = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=_serve, args=(ports, reply), daemon=True)
    proc.start()
    try:
        port = ports.get(timeout=60)
        assert proc.pid is not None
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/floor.Floor/Unary")
            body = b"b" * size
            for _ in range(200):  # warm up
                call(body)
            lat = []
            server0, client0 = _cpu_s(proc.pid), time.process_time()
            for _ in range(n):
                t0 = time.perf_counter()
                call(body)
                lat.append(time.perf_counter() - t0)
            server_ms = 1e3 * (_cpu_s(proc.pid) - server0) / n
            client_ms = 1e3 * (time.process_time() - client0) / n
        ms = sorted(1e3 * v for v in lat)
        return {
            "p50_ms": ms[n // 2],
            "p99_ms": ms[min(n - 1, int(0.99 * n))],
            "server_cpu_ms": server_ms,
            "client_cpu_ms": client_ms,
        }
    finally:
        proc.kill()
        proc.join(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=20000)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--size", type=int, default=6900)
    a = ap.parse_args()
    out = {
        "stream": grpc_floor(a.size, a.streams, a.messages),
        "unary": unary_floor(16384, 2048),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
