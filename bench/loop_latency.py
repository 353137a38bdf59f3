"""A unary call next to saturated streams, five server shapes. A minimal
reproduction, no avest code (bench/RESULTS.md, issue 29).

The server (a subprocess) serves a bidirectional stream whose handler spends
``--work-us`` of CPU on each message (a stand-in for checks and fold) and acks it,
and a unary call that answers at once, as:

- ``aio``: grpc.aio, the work on the event loop (avest's shape: the stream
  handlers check, the pair's owner task folds, all on the loop);
- ``aio-gated``: the same, but a stream reads its next message and does its work only
  with room for it, at most ``--in-flight`` messages in hand across the streams (the
  room avest tried took a message's room after reading it: bench/RESULTS.md);
- ``aio-thread``: grpc.aio, the work on one thread of its own, the loop doing
  I/O only (each stream waits for its message's work before it reads the next);
- ``aio-process``: grpc.aio, the work in a process of its own (the owners off the
  loop and off its GIL): the loop sends each message's bytes down a socket pair and
  awaits its ack id, with at most ``--in-flight`` messages at the process, the
  streams beyond that waiting for room (their next message stays unread);
- ``sync``: grpcio's synchronous server, a thread per call.

Beside each grpc.aio shape, the same process runs a synchronous server on a port of
its own serving only the unary call (avest's read port, ``--read-address``): the probe
calls it too, alternately with the main port.

``--streams`` client streams send flat out (at most ``--window`` unacknowledged
each) from ``--procs`` processes, opening at once; after ``--settle`` seconds one
client calls the unary every 50 ms on a connection opened before the load.
Printed as JSON, one line per shape: the unary's latency p50 / p99, the streams'
acked messages per second, how long the streams waited for their first ack (how
fast the server takes new calls), and (aio) the loop's lag, a ``sleep(0.01)``
measured against the clock. A stream that fails fails the run.

Why a saturated loop delays every call: grpc.aio learns of completions from a thread
that writes one byte per completion to a socket, and the loop reads one byte each
time it turns (draining every completion queued so far). A Unix socket holds about
278 such one-byte writes (212,992 bytes of send buffer at 768 bytes each); past that
the writing thread blocks, the completion queue fills behind it, and completions
reach the loop about one per turn: a unary call then waits behind every stream's
pending read and write. ``--switch-interval-ms`` (``sys.setswitchinterval`` in the
server) lets ``aio-thread`` hand the GIL back to the loop sooner, so the loop turns
often while the thread works.

    python bench/loop_latency.py [--streams 300] [--work-us 300] [--seconds 40] [--settle 28]
        [--switch-interval-ms 0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import statistics
import struct
import sys
import time
from concurrent import futures
from typing import Any

import grpc


def _burn(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


#: a message to the work process: its id and length, then its bytes; the ack: the id
_FRAME = struct.Struct("<QI")
_ACK = struct.Struct("<Q")


def _work(sock: socket.socket, other: socket.socket, work_us: float) -> None:
    """The work process: each message's work, then its id back (until the pipe closes)."""
    other.close()  # the server's end, inherited: closed, so that its exit ends this
    buf = b""
    while True:
        data = sock.recv(1 << 20)
        if not data:
            return
        buf += data
        acks = []
        while len(buf) >= _FRAME.size:
            ident, size = _FRAME.unpack_from(buf)
            if len(buf) < _FRAME.size + size:
                break
            buf = buf[_FRAME.size + size :]
            _burn(work_us)
            acks.append(_ACK.pack(ident))
        if acks:
            sock.sendall(b"".join(acks))


class _Process:
    """The loop's side of the work process: send a message, await its ack."""

    def __init__(self, work_us: float, in_flight: int) -> None:
        ours, theirs = socket.socketpair()
        mp.get_context("fork").Process(
            target=_work, args=(theirs, ours, work_us), daemon=True
        ).start()
        theirs.close()
        self.sock, self.room = ours, asyncio.Semaphore(in_flight)
        self.waiting: dict[int, asyncio.Future[None]] = {}
        self.next = 0

    async def start(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(sock=self.sock)
        asyncio.create_task(self._acks())

    async def _acks(self) -> None:
        while True:
            data = await self.reader.readexactly(_ACK.size)
            done = self.waiting.pop(_ACK.unpack(data)[0])
            if not done.done():  # not a stream that ended meanwhile
                done.set_result(None)

    async def work(self, message: bytes) -> None:
        async with self.room:
            self.next += 1
            done = self.waiting[self.next] = asyncio.get_running_loop().create_future()
            self.writer.write(_FRAME.pack(self.next, len(message)) + message)
            await done


def _serve_aio(
    ports: Any, work_us: float, lags: Any, where: str, in_flight: int, switch_ms: float | None
) -> None:
    if switch_ms is not None:  # how often a thread waiting for the GIL gets it
        sys.setswitchinterval(switch_ms / 1e3)
    process = _Process(work_us, in_flight) if where == "process" else None

    async def main() -> None:
        worker = futures.ThreadPoolExecutor(1)
        loop = asyncio.get_running_loop()
        if process is not None:
            await process.start()

        gate = asyncio.Semaphore(in_flight)

        async def gated(requests: Any, context: Any) -> None:
            while True:
                async with gate:  # the next message is read only with room for it
                    message = await context.read()
                    if message is grpc.aio.EOF:
                        return
                    _burn(work_us)
                await context.write(b"a" * 40)

        async def stream(requests: Any, context: Any) -> Any:
            async for message in requests:
                if process is not None:  # the work in a process of its own
                    await process.work(message)
                elif where == "thread":  # the work on a thread of its own
                    await loop.run_in_executor(worker, _burn, work_us)
                else:
                    _burn(work_us)
                yield b"a" * 40

        async def unary(request: bytes, context: Any) -> bytes:
            return b"r" * 40

        async def lag() -> None:
            loop = asyncio.get_running_loop()
            while True:
                t = loop.time()
                await asyncio.sleep(0.01)
                lags.put(loop.time() - t - 0.01)

        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        handler = gated if where == "gated" else stream
        server.add_generic_rpc_handlers((_handlers(handler, unary),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        # the read port's shape: its own completion queue and threads, in this process
        reads = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        reads.add_generic_rpc_handlers((_handlers(None, _answer),))
        read_port = reads.add_insecure_port("127.0.0.1:0")
        reads.start()
        task = asyncio.create_task(lag())
        ports.put((port, read_port))
        await server.wait_for_termination()
        task.cancel()

    asyncio.run(main())


def _serve_sync(ports: Any, work_us: float, lags: Any, threads: int) -> None:
    def stream(requests: Any, context: Any) -> Any:
        for _ in requests:
            _burn(work_us)
            yield b"a" * 40

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads),
        options=[("grpc.so_reuseport", 0)],
        maximum_concurrent_rpcs=threads,
    )
    server.add_generic_rpc_handlers((_handlers(stream, _answer),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    ports.put((port, 0))
    server.wait_for_termination()


def _answer(request: bytes, context: Any) -> bytes:
    return b"r" * 40


def _handlers(stream: Any, unary: Any) -> Any:
    """The stream (unless ``None``) and the unary call, as one service."""
    methods = {"Unary": grpc.unary_unary_rpc_method_handler(unary)}
    if stream is not None:
        methods["Stream"] = grpc.stream_stream_rpc_method_handler(stream)
    return grpc.method_handlers_generic_handler("floor.Floor", methods)


def _clients(port: int, streams: int, window: int, seconds: float, acked: Any) -> None:
    async def one(channel: grpc.aio.Channel, stop: float) -> tuple[int, float]:
        start = time.perf_counter()
        call = channel.stream_stream("/floor.Floor/Stream")()
        sent = got = 0
        first = float("nan")
        while time.perf_counter() < stop:
            while sent - got < window:
                await call.write(b"m" * 6900)
                sent += 1
            await call.read()
            if got == 0:
                first = time.perf_counter() - start
            got += 1
        call.cancel()
        return got, first

    async def main() -> None:
        stop = time.perf_counter() + seconds
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(8)]
        counts = await asyncio.gather(
            *(one(channels[i % 8], stop) for i in range(streams)), return_exceptions=True
        )
        errors = [repr(c) for c in counts if not isinstance(c, tuple)]
        done = [c for c in counts if isinstance(c, tuple)]
        acked.put((sum(c[0] for c in done), [c[1] for c in done], errors))
        for c in channels:
            await c.close()

    asyncio.run(main())


def run(
    kind: str, streams: int, work_us: float, seconds: float, procs: int, window: int,
    settle: float, in_flight: int, switch_ms: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    ctx = mp.get_context("spawn")
    ports, lags, acked = ctx.Queue(), ctx.Queue(), ctx.Queue()
    args: tuple[Any, ...]
    if kind.startswith("aio"):
        args = (ports, work_us, lags, kind.partition("-")[2] or "loop", in_flight, switch_ms)
        # not a daemon: the process shape starts a process of its own (killed below)
        server = ctx.Process(target=_serve_aio, args=args, daemon=kind != "aio-process")
    else:
        args = (ports, work_us, lags, streams + 16)
        server = ctx.Process(target=_serve_sync, args=args, daemon=True)
    server.start()
    port, read_port = ports.get(timeout=30)
    # the probe's connections open before the load (opening one under it is another
    # question): every call below is a call on an open connection
    probes = {
        name: grpc.insecure_channel(f"127.0.0.1:{p}").unary_unary("/floor.Floor/Unary")
        for name, p in (("unary", port), ("read_unary", read_port))
        if p
    }
    for unary in probes.values():
        unary(b"q", timeout=30)
    clients = [
        ctx.Process(
            target=_clients, args=(port, streams // procs, window, seconds, acked), daemon=True
        )
        for _ in range(procs)
    ]
    for c in clients:
        c.start()
    time.sleep(settle)  # the streams open and fill
    samples: dict[str, list[float]] = {name: [] for name in probes}
    end = time.perf_counter() + seconds - settle - 1.0
    while time.perf_counter() < end:
        for name, unary in probes.items():
            t = time.perf_counter()
            unary(b"q", timeout=60)
            samples[name].append(time.perf_counter() - t)
            time.sleep(max(0.0, 0.05 - (time.perf_counter() - t)))
    total, firsts = 0, []
    for _ in clients:
        got, first, errors = acked.get(timeout=120)
        firsts += first
        if errors:  # a benchmark of streams that failed times nothing: say so
            server.kill()
            raise SystemExit(f"{len(errors)} streams failed, the first: {errors[0]}")
        total += got
    loop_lags = []
    while not lags.empty():
        loop_lags.append(lags.get())
    server.kill()
    out: dict[str, Any] = {"server": kind, "streams": streams, "work_us": work_us}
    if switch_ms is not None:
        out["switch_interval_ms"] = switch_ms
    for name, xs in samples.items():
        xs.sort()
        out[f"{name}_calls"] = len(xs)
        out[f"{name}_p50_ms"] = round(1e3 * statistics.median(xs), 1)
        out[f"{name}_p99_ms"] = round(1e3 * xs[int(0.99 * (len(xs) - 1))], 1)
    out |= {
        "acked_per_s": round(total / seconds),
        # from a stream's call to its first ack: how fast the server takes new calls
        "stream_first_ack_p50_s": round(statistics.median(firsts), 2),
        "stream_first_ack_max_s": round(max(firsts), 2),
    }
    if loop_lags:
        loop_lags.sort()
        out["loop_lag_p50_ms"] = round(1e3 * statistics.median(loop_lags), 1)
        out["loop_lag_p99_ms"] = round(1e3 * loop_lags[int(0.99 * (len(loop_lags) - 1))], 1)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=300)
    p.add_argument("--work-us", type=float, default=300.0)
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--settle", type=float, default=28.0, help="s before the first probe")
    p.add_argument(
        "--in-flight", type=int, default=16, help="aio-gated, aio-process: messages in hand"
    )
    p.add_argument(
        "--switch-interval-ms",
        type=float,
        help="grpc.aio shapes: sys.setswitchinterval in the server (default: Python's 5 ms)",
    )
    shapes = ["aio", "aio-gated", "aio-thread", "aio-process", "sync"]
    p.add_argument("--server", choices=[*shapes, "all"], default="all")
    a = p.parse_args(argv)
    for kind in shapes if a.server == "all" else [a.server]:
        args = (a.streams, a.work_us, a.seconds, a.procs, a.window, a.settle, a.in_flight)
        print(json.dumps(run(kind, *args, a.switch_interval_ms)))


if __name__ == "__main__":
    main()
