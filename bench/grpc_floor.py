"""The bare gRPC floor on this machine: server CPU per message on an Observe-like stream.

A grpc.aio server in a subprocess whose stream handler reads each message and
answers it with one small ack, doing nothing else; a grpc.aio client writes
``n`` messages of ``size`` bytes over ``streams`` streams, flat out. The
server's CPU per message is the floor under any Python gRPC server's cost per
summary on this host (avest's adds parsing, checks, the fold, the group
commit and the ack bookkeeping): ``bench_summary.py`` prints both.

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


def _serve(ports: Any) -> None:
    async def main() -> None:
        async def stream(requests: Any, context: Any) -> Any:
            async for _ in requests:
                yield b"a" * 40

        handler = grpc.stream_stream_rpc_method_handler(stream)
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("floor.Floor", {"Stream": handler}),)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=20000)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--size", type=int, default=6900)
    a = ap.parse_args()
    print(json.dumps(grpc_floor(a.size, a.streams, a.messages), indent=2))


if __name__ == "__main__":
    main()
