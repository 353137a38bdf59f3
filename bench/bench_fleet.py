"""A fleet of vLLM workers against ``avest serve`` at its default settings, ratios measured in one run.

What users get: the server is started with no flag but its ports and data directory
(no tokens on loopback, the tree's own defaults for everything else: refit interval,
group commit, flow control), and every pair is registered without naming a rule or a
refit interval.
Every worker opens its worker on its own Observe stream (``ObserveRequest.open``) on
its own connection, then sends pre-built K=8 round summaries (100 steps of 256
requests, :mod:`summary_ingest`'s recipe) computed at the coefficients the
registration returned (the server rebases them once it has refitted), and counts the
acknowledgements (``ack.acked_sequence``) and coefficient pushes it gets back.
Reports ratios measured in one run, never assertions; fails loudly (a message and a
non-zero exit) when what it times fails: a summary refused (a stream ending with an
error, one not taken by the server within gRPC's 30 s included unless ``--reopen``
opens it again as the client library would), fewer acknowledgements than summaries
sent at the end (each stream waits while acknowledgements keep coming, and gives up
after 120 s without one), a probe refused, a server or a client process that exits.

Sections (all three unless some are named):

* ``--cpu``: ``--workers`` streams (128) flat out, ``--summaries`` each: summaries
  acknowledged per second (the capacity) and the server process's CPU per summary
  (``/proc/PID/stat``), against the bare ``grpc.aio`` server of ``grpc_floor.py``
  (bytes in, a 40-byte answer out, nothing parsed) taking the same ObserveRequest
  bytes over as many streams; the ratio of the two CPU figures. Also the pair's
  coefficient version and round before and after (refits done), the coefficient
  pushes each stream received, and the protobuf parse of one message in process.
* ``--latency``: at half the capacity (``--rate`` to name another), paced and spread
  over the workers for ``--seconds``: ack p50 / p99 from a summary's write to the ack
  covering it, to set beside the group-commit interval (``--flush-interval-ms``,
  100 ms by default).
* ``--overload``: ``--busy-streams`` (1,000) streams on one pair offering twice the
  capacity together (summaries, or raw B=64 steps with ``--busy-kind raw``, the
  capacity then measured in raw steps first), each holding at most ``--busy-window``
  (16) unacknowledged, so the backlog and the drain after it stay bounded; meanwhile a
  light worker on a pair of its own sends one summary every 0.5 s, each after the last
  one's ack: its first ack and ack p50 / p99, and ``/healthz`` (admin HTTP) and
  ``GetCoefficients`` (of the busy pair) probed every 50 ms. Twice, on a fresh server
  each: every busy stream opened first, then all sending, then the light worker; and
  the light worker starting as the busy streams start opening (each sends once open).

``--baseline-server TREE`` runs the selected sections on TREE's server (a source
checkout, e.g. ``git archive ad9901b | tar -x -C /tmp/base``) and on this checkout's,
in turn, and prints both and their ratio. ``--replicas N`` serves the fleet from N
``avest serve`` processes on one PostgreSQL database of a server started here (each
stream on one of them by its worker id; the probes, the light worker and the
registrations on the first; the server CPU is theirs and PostgreSQL's). ``--busy-loops N`` spins N processes
(``while True: pass``) for the whole run. ``--quick`` shrinks everything to a smoke
run. ``--json`` prints the report as JSON (progress goes to stderr).

Clients run in processes of their own (``--client-procs``, ``--busy-procs``), one
asyncio loop each, so the server and the client can each take one of the machine's
cores; their CPU per summary is reported too, so a reader can see which side limited.

    python bench/bench_fleet.py [--cpu] [--latency] [--overload] [--quick]
        [--baseline-server TREE] [--busy-loops N] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parent.parent
from bench_replicas import postgres_cpu_s, start_postgres  # noqa: E402
from grpc_floor import _cpu_s as cpu_s  # noqa: E402  (bench_ingest.cpu_s, without the service)
from grpc_floor import _serve as floor_serve  # noqa: E402
from serve_proc import Served, serve  # noqa: E402

from avest_client.summary import RoundAccumulator  # noqa: E402
from avest_wire import matrix as wire  # noqa: E402
from avest_wire.messages import summary_to_pb  # noqa: E402
from avest_wire.v1 import estimator_pb2 as pb  # noqa: E402
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc  # noqa: E402
from tests.support.postgres import PostgresCluster  # noqa: E402

OBSERVE = "/avest.v1.EstimatorService/Observe"
FLOOR = "/floor.Floor/Stream"
#: Each worker's channel gets a connection of its own (grpc shares one between the
#: channels of a process to the same target otherwise), as separate vLLM workers have.
CHANNEL = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", 64 << 20)]
#: The server's group-commit interval when ``--flush-interval-ms`` is not given.
DEFAULT_FLUSH_MS = 100
#: Rows of a raw step (``--busy-kind raw``), as ``bench_ingest.py``'s.
RAW_ROWS = 64
SECTIONS = ("cpu", "latency", "overload")


class Failed(Exception):
    """What the benchmark timed failed (the message says what): the run stops."""


@dataclass(frozen=True)
class Config:
    workers: int = 128
    summaries: int = 40
    latency_s: float = 20.0
    rate: float = 0.0
    capacity: float = 0.0
    busy_streams: int = 1000
    busy_kind: str = "summary"
    busy_procs: int = 4
    #: Unacknowledged summaries a busy stream holds at most (it waits for acks beyond):
    #: the backlog an overload builds, and the drain after it, stay bounded.
    busy_window: int = 16
    light_summaries: int = 20
    light_every_s: float = 0.5
    probe_every_s: float = 0.05
    client_procs: int = 1
    open_wait_s: float = 120.0
    settle_s: float = 2.0
    wait_s: float = 120.0
    #: Open a stream again that ends before the server took it (as the client library does).
    reopen: bool = False
    k: int = 8
    flush_interval_ms: int | None = None
    #: More ``avest serve`` flags (the defaults are the point: for tests and probes).
    server_args: tuple[str, ...] = ()
    #: ``avest serve`` processes on one PostgreSQL database (0: one on its SQLite file)
    replicas: int = 0


QUICK: dict[str, Any] = {
    "workers": 16,
    "summaries": 40,
    "latency_s": 3.0,
    "busy_streams": 48,
    "busy_procs": 2,
    "light_summaries": 4,
    "open_wait_s": 20.0,
    "settle_s": 0.5,
    "wait_s": 60.0,
}


def log(msg: str) -> None:
    print(f"[bench_fleet {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- messages ----------------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def message(prefix: bytes, seq: int, body: bytes) -> bytes:
    """``prefix`` (pair and worker, serialized) + ``sequence`` (field 3) + ``body``: the
    serialized ObserveRequest, without building one per message."""
    return prefix + b"\x18" + _varint(seq) + body


def reused() -> tuple[Callable[..., list[Any]], int]:
    """``bench_ingest.make_steps`` and ``summary_ingest.ROUND_STEPS``, imported in this
    process only when called: they import the service (``avest``), which the client
    processes never need, so they keep running while this checkout's service is
    being edited (or measure a baseline tree beside a broken one)."""
    from bench_ingest import make_steps
    from summary_ingest import ROUND_STEPS

    return make_steps, ROUND_STEPS


def summary_bytes(
    k: int, version: int, slope: float, intercepts: Sequence[float], sketch: bool = True
) -> bytes:
    """:func:`summary_ingest.summary_body`'s summary (100 steps of 256 x K drafts), computed
    at the coefficients given: the ObserveRequest's ``k`` and ``summary`` serialized
    (``sketch``: with its calibration sketch, as a worker sends the rounds it is asked to)."""
    make_steps, round_steps = reused()
    acc = RoundAccumulator(k)
    for x, d, a in make_steps(round_steps, 256, k, seed=3):
        acc.add(x, d, a, slope, intercepts)
    s = acc.take(version, slope, intercepts)
    assert s is not None and s.sketch is not None
    if not sketch:
        s = dataclasses.replace(s, sketch=None)
    return bytes(pb.ObserveRequest(k=k, summary=summary_to_pb(s)).SerializeToString())


def raw_step_bytes(k: int, version: int) -> bytes:
    """One raw decode step of B=64 requests (``bench_ingest.py``'s), serialized."""
    make_steps, _ = reused()
    x, d, a = make_steps(1, RAW_ROWS, k, seed=5)[0]
    data, rows, kk = wire.encode(x)
    msg = pb.ObserveRequest(
        features=data, rows=rows, k=kk, num_verified=d.tolist(), num_accepted=a.tolist(),
        coefficients_version=version,
    )  # fmt: skip
    return bytes(msg.SerializeToString())


def parse_us(msg: bytes, n: int = 2000) -> float:
    """CPU µs to parse one ObserveRequest of these bytes in this process (best of three)."""
    best = math.inf
    for _ in range(3):
        t = time.process_time()
        for _ in range(n):
            pb.ObserveRequest.FromString(msg)
        best = min(best, (time.process_time() - t) / n)
    return 1e6 * best


# -- the client processes --------------------------------------------------------------------


@dataclass
class ClientSpec:
    """What one client process sends: ``workers`` streams, one worker each."""

    address: str
    kind: str  # "avest" (opens its worker, reads acks) or "floor" (one answer per message)
    pair_id: str
    workers: list[str]
    body: bytes
    #: The summary without its sketch: sent in the rounds the service does not ask a
    #: sketch of (``WorkerOpened.sketch_every``, as the client library does); empty:
    #: ``body`` always.
    bare: bytes = b""
    #: ``kind == "floor"``: a sketch with one message in this many (the mix avest's
    #: workers sent), there being no service to ask.
    sketch_every: int = 1
    count: int = 0  # per worker, then stop; 0: until told to stop
    rate: float = 0.0  # per worker per second; 0: flat out
    seconds: float = 0.0  # stop writing this long after go; 0: no limit
    wait_s: float = 120.0  # for the acknowledgements after the last write
    reopen: bool = False  # open a stream again that ends before it was taken
    window: int = 0  # at most this many unacknowledged at once (0: no bound)
    index: int = 0


@dataclass
class Shared:
    """Between the parent and its client processes: events, counters, a queue."""

    go: Any
    stop: Any
    close: Any
    opened: Any
    acked: Any
    q: Any

    @classmethod
    def make(cls, go: bool = False) -> Shared:
        ctx = mp.get_context("spawn")
        s = cls(
            ctx.Event(), ctx.Event(), ctx.Event(), ctx.Value("i", 0), ctx.Value("q", 0), ctx.Queue()
        )
        if go:
            s.go.set()
        return s


class _Client:
    """One client process's state (one asyncio loop)."""

    def __init__(self, spec: ClientSpec, shared: Shared) -> None:
        self.spec = spec
        self.shared = shared
        self.opened = 0
        self.caught = 0
        self.all_opened = asyncio.Event()
        self.all_caught = asyncio.Event()
        self.go = asyncio.Event()
        self.close = asyncio.Event()
        self.stopping = False
        self.t_go = 0.0
        self.cpu_go = 0.0
        self.lat: list[float] = []
        self.streams: list[dict[str, Any]] = []
        self.first_write = math.inf
        self.last_ack = 0.0

    async def watch(self) -> None:
        """Mirror the parent's events on this loop (polled: no thread left blocked)."""
        sh = self.shared
        while not sh.go.is_set():
            await asyncio.sleep(0.002)
        self.t_go, self.cpu_go = time.perf_counter(), time.process_time()
        self.go.set()
        while not (sh.stop.is_set() and sh.close.is_set()):
            self.stopping = self.stopping or sh.stop.is_set()
            if sh.close.is_set():
                self.close.set()
            await asyncio.sleep(0.02)
        self.stopping = True
        self.close.set()

    def count_ack(self, n: int, now: float) -> None:
        self.last_ack = max(self.last_ack, now)
        with self.shared.acked.get_lock():
            self.shared.acked.value += n


def _rpc_failure(wid: str, exc: grpc.aio.AioRpcError) -> Failed:
    return Failed(f"stream of {wid}: ended with {exc.code().name}: {exc.details()}")


#: A stream ended before it was taken: gRPC cancels a call the server application has
#: not taken within 30 s (``grpc.server_max_unrequested_time_in_server``), or the
#: connection failed. The client library opens its stream again, with backoff.
REOPEN_CODES = frozenset({grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE})
REOPEN_HINT = (
    " [gRPC cancels a call the server has not taken within 30 s; --reopen opens such a "
    "stream again, with backoff, as the client library does, and counts it]"
)


def _retrieved(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a read cancelled with its call ends with an error


def _task(coro: Any) -> asyncio.Future[Any]:
    task: asyncio.Future[Any] = asyncio.ensure_future(coro)
    task.add_done_callback(_retrieved)
    return task


async def read_within(call: Any, timeout: float) -> Any:
    """``call.read()``, TimeoutError after ``timeout`` seconds."""
    return await asyncio.wait_for(_task(call.read()), timeout)


async def open_worker(
    channel: grpc.aio.Channel,
    pair_id: str,
    wid: str,
    timeout: float,
    reopen: bool,
    st: dict[str, Any],
) -> tuple[Any, pb.WorkerOpened]:
    """An Observe call with ``wid`` opened on it: ``(call, what the server holds of it)``.
    ``reopen``: a call that ends before it was taken is opened again (counted in
    ``st["reopened"]``), with the client library's backoff."""
    attempt = 0
    while True:
        call = channel.stream_stream(
            OBSERVE, request_serializer=None, response_deserializer=pb.ObserveResponse.FromString
        )()
        try:
            opening = pb.ObserveRequest(pair_id=pair_id, worker_id=wid, open=True)
            await call.write(opening.SerializeToString())
            first = await read_within(call, timeout)
        except grpc.aio.AioRpcError as exc:
            call.cancel()
            if not (reopen and exc.code() in REOPEN_CODES):
                raise
            st["reopened"] = st.get("reopened", 0) + 1
            await asyncio.sleep(min(5.0, 0.05 * 2**attempt) * random.uniform(0.5, 1.0))
            attempt += 1
            continue
        if first is grpc.aio.EOF or not first.HasField("opened"):
            raise Failed(f"stream of {wid}: its opening was answered with {first!r}")
        return call, first.opened


async def _stream(c: _Client, wid: str) -> None:
    spec = c.spec
    st: dict[str, Any] = {"worker": wid, "sent": 0, "acked": 0, "pushes": 0, "version": None}
    st["sketched"], every, phase = 0, [max(1, spec.sketch_every)], random.randrange(1 << 20)
    st["phase"], st["reopened"], t_start = "opening", 0, time.perf_counter()
    c.streams.append(st)
    # Replicas: each worker on one of them, by its id, as a fleet behind DNS spreads.
    addresses = spec.address.split(",")
    address = addresses[zlib.crc32(wid.encode()) % len(addresses)]
    channel = grpc.aio.insecure_channel(address, options=CHANNEL)
    call: Any = None
    pending: deque[tuple[int, float]] = deque()
    caught_up = asyncio.Event()
    progress = asyncio.Event()
    writing = [True]
    try:
        t_open = time.perf_counter()
        seq = 0
        if spec.kind == "avest":
            call, opened = await open_worker(
                channel, spec.pair_id, wid, spec.wait_s, spec.reopen, st
            )
            seq = opened.applied_sequence
            every[0] = max(1, opened.sketch_every)
        else:
            call = channel.stream_stream(
                FLOOR, request_serializer=None, response_deserializer=None
            )()
            await asyncio.wait_for(channel.channel_ready(), spec.wait_s)
        st["open_s"] = time.perf_counter() - t_open
        c.opened += 1
        with c.shared.opened.get_lock():
            c.shared.opened.value += 1
        if c.opened == len(spec.workers):
            c.all_opened.set()
        await c.go.wait()
        st["phase"] = "sending"
        prefix = pb.ObserveRequest(pair_id=spec.pair_id, worker_id=wid).SerializeToString()

        async def read() -> None:
            while True:
                resp = await call.read()  # raises the stream's error status
                if resp is grpc.aio.EOF:
                    return
                now = time.perf_counter()
                n = 0
                if spec.kind == "floor":
                    if pending:
                        c.lat.append(now - pending.popleft()[1])
                        n = 1
                elif resp.HasField("ack"):
                    level = resp.ack.acked_sequence
                    while pending and pending[0][0] <= level:
                        c.lat.append(now - pending.popleft()[1])
                        n += 1
                elif resp.HasField("coefficients_update"):
                    st["pushes"] += 1
                    st["version"] = resp.coefficients_update.coefficients.version
                    every[0] = max(1, resp.coefficients_update.sketch_every)
                if n:
                    st["acked"] += n
                    c.count_ack(n, now)
                    progress.set()
                if not writing[0] and not pending:
                    caught_up.set()

        async def write() -> None:
            nonlocal seq
            rate = spec.rate
            t_next = time.perf_counter() + (random.uniform(0, 1 / rate) if rate else 0.0)
            deadline = c.t_go + spec.seconds if spec.seconds else math.inf
            while not (spec.count and st["sent"] >= spec.count):
                if rate:
                    delay = t_next - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    t_next += 1 / rate
                while spec.window and len(pending) >= spec.window and not c.stopping:
                    progress.clear()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(progress.wait(), 0.5)
                if c.stopping or time.perf_counter() >= deadline:
                    break
                seq += 1
                sketched = not spec.bare or (st["sent"] + phase) % every[0] == 0
                st["sketched"] += sketched
                msg = message(prefix, seq, spec.body if sketched else spec.bare)
                now = time.perf_counter()
                c.first_write = min(c.first_write, now)
                pending.append((seq, now))
                st["sent"] += 1
                await call.write(msg)

        reader = _task(read())
        writer = _task(write())
        try:
            await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            if reader.done():
                reader.result()  # its error, if it failed
                raise Failed(f"stream of {wid}: ended (OK) while its worker was still sending")
            writer.result()
            writing[0] = False
            st["phase"] = "waiting for its acknowledgements"
            if not pending:
                caught_up.set()
            # Wait for the acknowledgements while they come: fail after wait_s without one.
            waiter = asyncio.ensure_future(caught_up.wait())
            while True:
                before = st["acked"]
                await asyncio.wait(
                    {reader, waiter}, timeout=spec.wait_s, return_when=asyncio.FIRST_COMPLETED
                )
                if reader.done() or waiter.done() or st["acked"] == before:
                    break
            waiter.cancel()
            if reader.done():
                reader.result()
                if pending:
                    raise Failed(
                        f"stream of {wid}: ended (OK) with {len(pending)} of its "
                        f"{st['sent']} summaries unacknowledged"
                    )
            elif pending:
                raise Failed(
                    f"stream of {wid}: {len(pending)} of its {st['sent']} messages "
                    f"unacknowledged, none for {spec.wait_s:.0f} s after its last write"
                )
            c.caught += 1
            if c.caught == len(spec.workers):
                c.all_caught.set()
            await c.close.wait()
            st["phase"] = "closing"
            if not reader.done():
                await call.done_writing()
                await asyncio.wait_for(reader, spec.wait_s)
            reader.result()
            code = await call.code()
            if code != grpc.StatusCode.OK:
                raise Failed(f"stream of {wid}: ended with {code.name}: {await call.details()}")
        finally:
            for t in (reader, writer):
                t.cancel()
    except grpc.aio.AioRpcError as exc:
        when = f" ({st['phase']}, {time.perf_counter() - t_start:.1f} s after it started)"
        hint = REOPEN_HINT if st["phase"] == "opening" and exc.code() in REOPEN_CODES else ""
        raise Failed(f"{_rpc_failure(wid, exc)}{when}{hint}") from None
    except asyncio.TimeoutError:
        raise Failed(
            f"stream of {wid}: no answer within {spec.wait_s:.0f} s ({st['phase']})"
        ) from None
    finally:
        if call is not None:
            call.cancel()
        await channel.close()


async def _client_async(spec: ClientSpec, shared: Shared) -> None:
    c = _Client(spec, shared)
    watcher = asyncio.ensure_future(c.watch())
    q = shared.q

    async def tell(event: asyncio.Event, tag: str) -> None:
        await event.wait()
        q.put((tag, spec.index, time.perf_counter(), time.process_time() - c.cpu_go))

    tellers = [
        asyncio.ensure_future(tell(c.all_opened, "ready")),
        asyncio.ensure_future(tell(c.all_caught, "acked")),
    ]
    tasks = [asyncio.ensure_future(_stream(c, w)) for w in spec.workers]
    errors: list[str] = []
    pending_tasks: set[asyncio.Future[None]] = set(tasks)
    while pending_tasks:
        done, pending_tasks = await asyncio.wait(pending_tasks, return_when=asyncio.FIRST_EXCEPTION)
        failures = [t.exception() for t in done if t.exception() is not None]
        if failures:
            errors += [str(e) if isinstance(e, Failed) else repr(e) for e in failures]
            for t in pending_tasks:
                t.cancel()
            await asyncio.gather(*pending_tasks, return_exceptions=True)
            break
    cpu = time.process_time() - c.cpu_go if c.go.is_set() else 0.0
    for t in [watcher, *tellers]:
        t.cancel()
    q.put(
        (
            "final",
            spec.index,
            {
                "errors": errors,
                "sent": sum(s["sent"] for s in c.streams),
                "acked": sum(s["acked"] for s in c.streams),
                "streams": c.streams,
                "lat": c.lat,
                "first_write": c.first_write,
                "last_ack": c.last_ack,
                "cpu_s": cpu,
            },
        )
    )


def client_process(spec: ClientSpec, shared: Shared) -> None:
    asyncio.run(_client_async(spec, shared))


class Clients:
    """Client processes started over ``workers``, split as evenly as they go."""

    def __init__(self, spec: ClientSpec, procs: int, shared: Shared) -> None:
        self.shared = shared
        ctx = mp.get_context("spawn")
        procs = max(1, min(procs, len(spec.workers)))
        self.procs = [
            ctx.Process(
                target=client_process,
                args=(replace(spec, workers=spec.workers[i::procs], index=i), shared),
                daemon=True,
            )
            for i in range(procs)
        ]
        for p in self.procs:
            p.start()
        self.finals: dict[int, dict[str, Any]] = {}
        self.seen: dict[str, dict[int, tuple[float, float]]] = {"ready": {}, "acked": {}}

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def cpu(self) -> float:
        total = 0.0
        for pid in self.pids():
            with contextlib.suppress(OSError):
                total += cpu_s(pid)
        return total

    def _fail_on_errors(self) -> None:
        errors = [e for r in self.finals.values() for e in r["errors"]]
        if errors:
            first = "; the first five" if len(errors) > 5 else ""
            raise Failed(f"{len(errors)} stream(s) failed{first}: " + "; ".join(errors[:5]))

    def wait(self, tag: str, timeout: float) -> dict[int, tuple[float, float]]:
        """Every process's ``tag`` message ("ready", "acked" or "final"): ``(when, cpu)``
        by process; Failed when one reports failures, dies, or neither answers nor sees
        an acknowledgement for ``timeout`` seconds (their own give up sooner)."""
        deadline = time.monotonic() + timeout
        n = len(self.procs)
        dead_since: float | None = None
        acked = self.shared.acked.value
        while True:
            if self.shared.acked.value != acked:
                acked = self.shared.acked.value
                deadline = time.monotonic() + timeout
            self._fail_on_errors()
            if tag == "final":
                if len(self.finals) == n:
                    return {}
            else:
                got = self.seen[tag]
                if len(got) == n:
                    return got
                if any(i not in got for i in self.finals):
                    raise Failed(f"a client process reported its end before it was {tag}")
            try:
                self._take(self.shared.q.get(timeout=0.5))
                continue
            except queue.Empty:
                pass
            now = time.monotonic()
            if now > deadline:
                raise Failed(f"client processes not {tag}: nothing for {timeout:.0f} s")
            dead = [
                p
                for i, p in enumerate(self.procs)
                if p.exitcode is not None and i not in self.finals
            ]
            if not dead:
                dead_since = None
            elif dead_since is None:
                dead_since = now
            elif now - dead_since > 5.0:  # its last words would have arrived by now
                raise Failed(f"a client process exited with {dead[0].exitcode} without its report")

    def check(self) -> None:
        """Failed if a process reported failures or exited (its traceback is on stderr)."""
        self._fail_on_errors()
        for i, p in enumerate(self.procs):
            if p.exitcode is not None and i not in self.finals:
                with contextlib.suppress(queue.Empty):  # its report may still be queued
                    while i not in self.finals:
                        self._take(self.shared.q.get(timeout=1.0))
                self._fail_on_errors()
                if i not in self.finals:
                    raise Failed(f"a client process exited with {p.exitcode} without its report")

    def _take(self, msg: tuple[Any, ...]) -> None:
        tag, index = msg[0], msg[1]
        if tag == "final":
            self.finals[index] = msg[2]
        else:
            self.seen[tag][index] = (msg[2], msg[3])

    def results(self, timeout: float) -> dict[str, Any]:
        """Every process's report, merged."""
        self.wait("final", timeout)
        rs = list(self.finals.values())
        return {
            "sent": sum(r["sent"] for r in rs),
            "acked": sum(r["acked"] for r in rs),
            "streams": [s for r in rs for s in r["streams"]],
            "lat": [v for r in rs for v in r["lat"]],
            "first_write": min(r["first_write"] for r in rs),
            "last_ack": max(r["last_ack"] for r in rs),
            "cpu_s": sum(r["cpu_s"] for r in rs),
        }

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(10)


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and of its live descendants (``--grpc-process``'s front)."""
    total = cpu_s(pid)
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError, ValueError):
            total += sum(tree_cpu_s(int(c)) for c in children.read_text().split())
    return total


def _pct(values: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(np.asarray(values) * 1e3, q)), 1) if len(values) else None


def run_clients(
    spec: ClientSpec, procs: int, server_cpu_s: Callable[[], float], wait_s: float
) -> dict[str, Any]:
    """Open every stream, then send (a barrier between): until each worker's summaries
    are acknowledged. The server's CPU from the go to the last acknowledgement."""
    shared = Shared.make()
    clients = Clients(spec, procs, shared)
    try:
        clients.wait("ready", wait_s)
        cpu0 = server_cpu_s()
        shared.go.set()
        acked = clients.wait("acked", wait_s + 30)
        server_cpu = server_cpu_s() - cpu0
        client_cpu_window = sum(v[1] for v in acked.values())
        shared.stop.set()
        shared.close.set()
        res = clients.results(wait_s + 30)
    finally:
        shared.stop.set()
        shared.close.set()
        clients.kill()
    if res["acked"] != res["sent"]:
        raise Failed(f"{res['acked']} acknowledgements for {res['sent']} summaries sent")
    if not res["sent"]:
        raise Failed("nothing was sent")
    n = max(1, res["acked"])
    elapsed = max(1e-9, res["last_ack"] - res["first_write"])
    pushes = [s["pushes"] for s in res["streams"]]
    versions = [s["version"] for s in res["streams"] if s["version"] is not None]
    return {
        "streams": len(res["streams"]),
        "sent": res["sent"],
        "acked": res["acked"],
        "seconds": round(elapsed, 3),
        "acked_per_s": round(res["acked"] / elapsed, 1),
        "server_cpu_us": round(1e6 * server_cpu / n, 1),
        "server_cpu_share": round(server_cpu / elapsed, 3),
        "client_cpu_us": round(1e6 * client_cpu_window / n, 1),
        "client_cpu_share": round(client_cpu_window / elapsed, 3),
        "ack_p50_ms": _pct(res["lat"], 50),
        "ack_p99_ms": _pct(res["lat"], 99),
        "ack_max_ms": _pct(res["lat"], 100),
        "pushes_per_stream_min": min(pushes, default=0),
        "pushes_per_stream_mean": round(float(np.mean(pushes)), 1) if pushes else 0.0,
        "pushes_per_stream_max": max(pushes, default=0),
        "pushed_version_max": max(versions, default=None),
        "reopened": sum(s.get("reopened", 0) for s in res["streams"]),
        "sketched": sum(s.get("sketched", 0) for s in res["streams"]),
    }


# -- the servers -----------------------------------------------------------------------------

#: ``--replicas``: the PostgreSQL server of this run (the tests' harness), a new
#: database for each avest server started.
_postgres: list[tuple[PostgresCluster, Path]] = []


def postgres() -> PostgresCluster:
    """This run's PostgreSQL server, started the first time."""
    if not _postgres:
        started = start_postgres("avest-fleet-pg-")
        if started is None:
            raise Failed("--replicas: PostgreSQL's initdb and pg_ctl are not installed")
        _postgres.append(started)
    return _postgres[0][0]


def stop_postgres() -> None:
    while _postgres:
        cluster, root = _postgres.pop()
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


class Server:
    """``avest serve`` at its defaults (plus ``cfg.server_args``), from ``tree`` or this checkout."""

    def __init__(self, cfg: Config, tree: Path | None, name: str) -> None:
        self.name = name
        self.dir = Path(tempfile.mkdtemp(prefix="avest-fleet-"))
        extra = list(cfg.server_args)
        settings = (tree or ROOT) / "service" / "avest" / "settings.py"
        if "read_address" in settings.read_text():  # trees before the read port have none
            extra += ["--read-address", "127.0.0.1:0"]
        if cfg.flush_interval_ms is not None:
            extra += ["--flush-interval-ms", str(cfg.flush_interval_ms)]
        #: every process serving (``--replicas``: each on the same database)
        self.replicas: list[Served] = []
        self.on_postgres = cfg.replicas > 0
        try:
            if cfg.replicas:
                url = postgres().create_database()
                for i in range(cfg.replicas):
                    flags = [*extra, "--store", url, "--replica-name", f"r{i}"]
                    self.replicas.append(serve(self.dir / f"r{i}", flags, tokens=False, tree=tree))
            else:
                self.replicas.append(serve(self.dir / "data", extra, tokens=False, tree=tree))
        except RuntimeError as exc:
            for started in self.replicas:
                started.stop()
            shutil.rmtree(self.dir, ignore_errors=True)
            raise Failed(f"{name}'s server did not start: {exc}") from None
        #: the one the probes, the light worker and registrations reach
        self.served: Served = self.replicas[0]
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.EstimatorServiceStub(self.channel)

    @property
    def address(self) -> str:
        return self.served.grpc_address

    @property
    def addresses(self) -> str:
        """Every replica's gRPC address, comma-separated: a stream takes one by its worker."""
        return ",".join(r.grpc_address for r in self.replicas)

    def cpu_s(self) -> float:
        """CPU seconds of the serving processes (their fronts included) and, with
        replicas, of PostgreSQL's."""
        own = sum(tree_cpu_s(r.proc.pid) for r in self.replicas)
        return own + (postgres_cpu_s() if self.on_postgres else 0.0)

    def check(self, where: str) -> None:
        """Failed if a server exited."""
        for served in self.replicas:
            rc = served.proc.poll()
            if rc is not None:
                tail = served.output()[-3000:]
                raise Failed(
                    f"{self.name}'s avest serve exited with {rc} during {where}; "
                    f"its log ends:\n{tail}"
                )

    def explain(self, exc: Failed, where: str) -> Failed:
        """``exc``, saying so when the server exited (the likely cause)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.served.proc.wait(timeout=1.0)
        try:
            self.check(where)
        except Failed as exited:
            return Failed(f"{exited}\n(what failed: {exc})")
        said = [
            line
            for line in self.served.output().splitlines()
            if " WARNING " in line or " ERROR " in line or "Traceback" in line
        ]
        if said:
            return Failed(
                f"{exc}\n{self.name}'s server logged (the last ten):\n" + "\n".join(said[-10:])
            )
        return exc

    def register(self, k: int, **labels: str) -> pb.RegisterPairResponse:
        key = pb.PairKey(
            target_model="fleet/target", draft_model="fleet/draft", method="eagle",
            num_speculative_tokens=k, labels=labels,
        )  # fmt: skip
        try:
            return self.stub.RegisterPair(pb.RegisterPairRequest(key=key), timeout=30)
        except grpc.RpcError as exc:
            raise Failed(f"RegisterPair refused: {exc.code().name}: {exc.details()}") from None

    def budgets_on_the_read_port(self, pair_id: str, k: int) -> pb.BudgetRequest | None:
        """Give the pair cost curves and return the Budget request the probe sends to the
        read port; None where there is no read port, or it serves no Budget (older trees)."""
        if not self.served.read_address:
            return None
        curves = pb.SetCostCurvesRequest(
            pair_id=pair_id, hardware="fleet",
            draft_curve=[pb.CostPoint(size=n, ms=2.0 + n / 64) for n in (1, 64, 512)],
            verify_curve=[pb.CostPoint(size=n, ms=15.0 + n / 16) for n in (1, 64, 2048)],
        )  # fmt: skip
        feats, rows, _ = wire.encode(np.random.default_rng(0).normal(1.0, 2.0, (64, k)))
        req = pb.BudgetRequest(
            pair_id=pair_id, features=feats, rows=rows, k=k, scheduled_drafts=[k] * rows,
            hardware="fleet",
        )  # fmt: skip
        with grpc.insecure_channel(self.served.read_address) as channel:
            try:
                self.stub.SetCostCurves(curves, timeout=30)
                pb_grpc.EstimatorServiceStub(channel).Budget(req, timeout=30)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    return None
                raise Failed(f"Budget refused: {exc.code().name}: {exc.details()}") from None
        return req

    def coefficients(self, pair_id: str) -> pb.Coefficients:
        req = pb.GetCoefficientsRequest(pair_id=pair_id)
        try:
            return self.stub.GetCoefficients(req, timeout=30).coefficients
        except grpc.RpcError as exc:
            raise Failed(f"GetCoefficients refused: {exc.code().name}: {exc.details()}") from None

    def metric(self, name: str) -> float | None:
        """A metric's value (its first series) from ``/metrics``, None if it has none."""
        try:
            text = httpx.get(self.served.http_url + "/metrics", timeout=30).text
        except httpx.HTTPError:
            return None
        for line in text.splitlines():
            if line.startswith((name + " ", name + "{")):
                return float(line.rsplit(" ", 1)[1])
        return None

    def buckets(self, name: str) -> dict[float, float] | None:
        """A histogram's cumulative bucket counts by upper bound, None if it has none."""
        try:
            text = httpx.get(self.served.http_url + "/metrics", timeout=30).text
        except httpx.HTTPError:
            return None
        out = {}
        for line in text.splitlines():
            if line.startswith(name + "_bucket{"):
                le = line.split('le="', 1)[1].split('"', 1)[0]
                out[float(le)] = float(line.rsplit(" ", 1)[1])
        return out or None

    def stop(self) -> int:
        """Stop every replica; the first non-zero exit status, else 0."""
        self.channel.close()
        codes = [served.stop() for served in self.replicas]
        shutil.rmtree(self.dir, ignore_errors=True)
        return next((rc for rc in codes if rc), 0)


def body_for(
    reg: pb.RegisterPairResponse, k: int, kind: str = "summary", sketch: bool = True
) -> bytes:
    c = reg.coefficients
    if kind == "raw":
        return raw_step_bytes(k, c.version) if sketch else b""
    return summary_bytes(k, c.version, c.slope, list(c.intercepts), sketch)


def worker_ids(n: int, tag: str) -> list[str]:
    return [f"fleet-{tag}-{i:05d}" for i in range(n)]


def floor_run(
    cfg: Config, msg_body: bytes, pair_id: str, bare: bytes = b"", sketch_every: int = 1
) -> dict[str, Any]:
    """The same messages, streams and client against the bare grpc.aio server (a sketch
    with one summary in ``sketch_every``, the others ``bare``)."""
    ctx = mp.get_context("spawn")
    ports: Any = ctx.Queue()
    proc = ctx.Process(target=floor_serve, args=(ports,), daemon=True)
    proc.start()
    try:
        port = ports.get(timeout=60)
        assert proc.pid is not None
        spec = ClientSpec(
            f"127.0.0.1:{port}", "floor", pair_id, worker_ids(cfg.workers, "floor"), msg_body,
            bare=bare, sketch_every=sketch_every, count=cfg.summaries, wait_s=cfg.wait_s,
        )  # fmt: skip
        res = run_clients(spec, cfg.client_procs, functools.partial(cpu_s, proc.pid), cfg.wait_s)
        if proc.exitcode is not None:
            raise Failed(f"the bare gRPC server exited with {proc.exitcode}")
        return res
    finally:
        proc.kill()
        proc.join(10)


def flat_out(server: Server, cfg: Config, kind: str, label: str) -> dict[str, Any]:
    reg = server.register(cfg.k, section=label)
    body, bare = body_for(reg, cfg.k, kind), body_for(reg, cfg.k, kind, sketch=False)
    before = server.coefficients(reg.pair_id)
    spec = ClientSpec(
        server.addresses, "avest", reg.pair_id, worker_ids(cfg.workers, label), body, bare,
        count=cfg.summaries, wait_s=cfg.wait_s, reopen=cfg.reopen,
    )  # fmt: skip
    res = run_clients(spec, cfg.client_procs, server.cpu_s, cfg.wait_s)
    after = server.coefficients(reg.pair_id)
    server.check(label)
    res.update(
        refit_interval=reg.refit_interval,
        rule=pb.UpdateRule.Name(reg.update_rule),
        version_before=before.version,
        version_after=after.version,
        round_before=before.round,
        round_after=after.round,
        refits=after.round - before.round,
        body_bytes=len(body),
    )
    return res


# -- sections --------------------------------------------------------------------------------


def section_cpu(server: Server, cfg: Config) -> dict[str, Any]:
    log(f"{server.name} cpu: avest, {cfg.workers} streams x {cfg.summaries}")
    load0 = os.getloadavg()[0]
    res = flat_out(server, cfg, "summary", "cpu")
    # the floor gets the same messages: as many with their sketch as avest asked for
    every = max(1, round(res["sent"] / max(1, res["sketched"])))
    log(f"{server.name} cpu: bare gRPC floor, {cfg.workers} streams x {cfg.summaries}")
    reg_probe = server.register(cfg.k, section="floor-body")
    body = body_for(reg_probe, cfg.k)
    one = message(
        pb.ObserveRequest(pair_id=reg_probe.pair_id, worker_id=worker_ids(1, "floor")[0])
        .SerializeToString(), 1, body,
    )  # fmt: skip
    bare = body_for(reg_probe, cfg.k, sketch=False)
    floor = floor_run(cfg, body, reg_probe.pair_id, bare, every)
    res.update(
        sketched_share=round(res["sketched"] / max(1, res["sent"]), 3),
        floor_per_s=floor["acked_per_s"],
        floor_server_cpu_us=floor["server_cpu_us"],
        floor_client_cpu_us=floor["client_cpu_us"],
        floor_messages=floor["acked"],
        parse_us=round(parse_us(one), 1),
        message_bytes=len(one),
        cpu_ratio_to_floor=round(res["server_cpu_us"] / max(1e-9, floor["server_cpu_us"]), 2),
        capacity_ratio_to_floor=round(res["acked_per_s"] / max(1e-9, floor["acked_per_s"]), 3),
        load_avg=[round(load0, 2), round(os.getloadavg()[0], 2)],
    )
    return res


def section_latency(server: Server, cfg: Config, capacity: float) -> dict[str, Any]:
    rate = cfg.rate or capacity / 2
    log(
        f"{server.name} latency: {rate:.0f} summaries/s over {cfg.workers} streams, {cfg.latency_s:.0f} s"
    )
    reg = server.register(cfg.k, section="latency")
    body, bare = body_for(reg, cfg.k), body_for(reg, cfg.k, sketch=False)
    spec = ClientSpec(
        server.addresses, "avest", reg.pair_id, worker_ids(cfg.workers, "lat"), body, bare,
        rate=rate / cfg.workers, seconds=cfg.latency_s, wait_s=cfg.wait_s, reopen=cfg.reopen,
    )  # fmt: skip
    load0 = os.getloadavg()[0]
    res = run_clients(spec, cfg.client_procs, server.cpu_s, cfg.wait_s)
    server.check("latency")
    flush = cfg.flush_interval_ms or DEFAULT_FLUSH_MS
    res.update(
        capacity_per_s=round(capacity, 1),
        offered_per_s=round(rate, 1),
        flush_interval_ms=flush,
        p50_over_flush=round((res["ack_p50_ms"] or 0) / flush, 2),
        p99_over_flush=round((res["ack_p99_ms"] or 0) / flush, 2),
        load_avg=[round(load0, 2), round(os.getloadavg()[0], 2)],
    )
    return res


async def _timed(samples: list[float], fn: Callable[[], Awaitable[None]]) -> None:
    t = time.perf_counter()
    await fn()
    samples.append(time.perf_counter() - t)


async def _probe(
    fn: Callable[[], Awaitable[None]], every_s: float, done: asyncio.Event
) -> list[float]:
    samples: list[float] = []
    t_next = time.perf_counter()
    while not done.is_set():
        await _timed(samples, fn)
        t_next = max(t_next + every_s, time.perf_counter())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(done.wait(), max(0.0, t_next - time.perf_counter()))
    return samples


async def light_and_probes(
    server: Server, light_pid: str, busy_pid: str, body: bytes, cfg: Config, busy_opened: Any,
    budget: pb.BudgetRequest | None,
) -> dict[str, Any]:  # fmt: skip
    """The light worker (one summary every ``light_every_s``, each after the last one's
    ack) with /healthz and GetCoefficients probed every ``probe_every_s`` meanwhile, and
    ``budget`` on the read port where given."""
    done = asyncio.Event()
    http = httpx.AsyncClient(base_url=server.served.http_url, timeout=cfg.wait_s)
    read_address = server.served.read_address
    channels = [grpc.aio.insecure_channel(a) for a in (server.address, read_address) if a]

    async def healthz() -> None:
        try:
            r = await http.get("/healthz")
        except httpx.HTTPError as exc:
            raise Failed(f"/healthz failed: {exc!r}") from None
        if r.status_code != 200:
            raise Failed(f"/healthz answered {r.status_code}: {r.text[:200]}")

    def coefficients(channel: grpc.aio.Channel, where: str) -> Callable[[], Awaitable[None]]:
        stub = pb_grpc.EstimatorServiceStub(channel)

        async def call() -> None:
            try:
                await stub.GetCoefficients(
                    pb.GetCoefficientsRequest(pair_id=busy_pid), timeout=cfg.wait_s
                )
            except grpc.aio.AioRpcError as exc:
                raise Failed(
                    f"GetCoefficients{where} failed: {exc.code().name}: {exc.details()}"
                ) from None

        return call

    async def budget_call() -> None:
        assert budget is not None
        try:
            await pb_grpc.EstimatorServiceStub(channels[-1]).Budget(budget, timeout=cfg.wait_s)
        except grpc.aio.AioRpcError as exc:
            raise Failed(
                f"Budget on the read port failed: {exc.code().name}: {exc.details()}"
            ) from None

    async def light() -> dict[str, Any]:
        wid = "fleet-light"
        channel = grpc.aio.insecure_channel(server.address, options=CHANNEL)
        call: Any = None
        lat: list[float] = []
        opened_at_first_ack = None
        st: dict[str, Any] = {"reopened": 0}
        phase = "opening"
        try:
            t0 = time.perf_counter()
            call, opened = await open_worker(channel, light_pid, wid, cfg.wait_s, cfg.reopen, st)
            phase = "sending"
            open_s = time.perf_counter() - t0
            seq = opened.applied_sequence
            prefix = pb.ObserveRequest(pair_id=light_pid, worker_id=wid).SerializeToString()
            acked = opened.acked_sequence
            for _ in range(cfg.light_summaries):
                tick = time.perf_counter()
                seq += 1
                t = time.perf_counter()
                await call.write(message(prefix, seq, body))
                while acked < seq:
                    resp = await read_within(call, cfg.wait_s)
                    if resp is grpc.aio.EOF:
                        raise Failed(f"light worker: its stream ended before sequence {seq}'s ack")
                    if resp.HasField("ack"):
                        acked = max(acked, resp.ack.acked_sequence)
                lat.append(time.perf_counter() - t)
                if opened_at_first_ack is None:
                    opened_at_first_ack = busy_opened.value
                await asyncio.sleep(max(0.0, tick + cfg.light_every_s - time.perf_counter()))
            await call.done_writing()
            while (await read_within(call, cfg.wait_s)) is not grpc.aio.EOF:
                pass
            code = await call.code()
            if code != grpc.StatusCode.OK:
                raise Failed(f"light worker: its stream ended with {code.name}")
        except grpc.aio.AioRpcError as exc:
            hint = REOPEN_HINT if phase == "opening" and exc.code() in REOPEN_CODES else ""
            raise Failed(f"{_rpc_failure(wid, exc)} ({phase}){hint}") from None
        except asyncio.TimeoutError:
            raise Failed(f"light worker: no answer within {cfg.wait_s:.0f} s ({phase})") from None
        finally:
            done.set()
            if call is not None:
                call.cancel()
            await channel.close()
        return {
            "light_open_ms": round(1e3 * open_s, 1),
            "light_first_ack_ms": round(1e3 * lat[0], 1),
            "light_ack_p50_ms": _pct(lat, 50),
            "light_ack_p99_ms": _pct(lat, 99),
            "light_ack_max_ms": _pct(lat, 100),
            "light_summaries": len(lat),
            "busy_open_at_light_first_ack": opened_at_first_ack,
            "light_reopened": st["reopened"],
        }

    out: dict[str, Any]
    try:
        out, health, coef, *more = await asyncio.gather(
            light(),
            _probe(healthz, cfg.probe_every_s, done),
            *(
                _probe(coefficients(c, where), cfg.probe_every_s, done)
                for c, where in zip(channels, ("", " on the read port"), strict=False)
            ),
            *([_probe(budget_call, cfg.probe_every_s, done)] if budget is not None else []),
        )
        read = more[0] if more else []
        budgets = more[1] if len(more) > 1 else []
    finally:
        done.set()
        await http.aclose()
        for c in channels:
            await c.close()
    samples = (("healthz", health), ("getcoef", coef), ("getcoef_read", read))
    for name, s in (*samples, ("budget_read", budgets)):
        out.update(
            {
                f"{name}_p50_ms": _pct(s, 50),
                f"{name}_p99_ms": _pct(s, 99),
                f"{name}_max_ms": _pct(s, 100),
                f"{name}_probes": len(s),
            }
        )
    return out


def overload_case(
    cfg: Config, tree: Path | None, name: str, capacity: float, while_opening: bool
) -> dict[str, Any]:
    case = "while_opening" if while_opening else "after_open"
    server = Server(cfg, tree, name)
    clients: Clients | None = None
    try:
        if not capacity:
            log(f"{name} overload: measuring the capacity first ({cfg.busy_kind})")
            capacity = flat_out(server, cfg, cfg.busy_kind, "capacity")["acked_per_s"]
        offered = 2 * capacity
        m = cfg.busy_streams
        log(
            f"{name} overload ({case}): {m} busy streams offering {offered:.0f}/s ({cfg.busy_kind})"
        )
        busy = server.register(cfg.k, section="busy")
        budget = server.budgets_on_the_read_port(busy.pair_id, cfg.k)
        light_reg = server.register(cfg.k, section="light")
        light_body = body_for(light_reg, cfg.k)
        # While opening: each busy stream sends once it is open. After: every busy
        # stream opens first, then they all send (the overload lasts as long as the
        # light worker, not as long as a thousand streams take to open).
        shared = Shared.make(go=while_opening)
        spec = ClientSpec(
            server.addresses, "avest", busy.pair_id, worker_ids(m, "busy"),
            body_for(busy, cfg.k, cfg.busy_kind), body_for(busy, cfg.k, cfg.busy_kind, sketch=False),
            rate=offered / m, wait_s=cfg.wait_s, reopen=cfg.reopen, window=cfg.busy_window,
        )  # fmt: skip
        t_start = time.perf_counter()
        clients = Clients(spec, cfg.busy_procs, shared)
        open_s = None
        if while_opening:
            deadline = time.monotonic() + cfg.open_wait_s
            while shared.opened.value < 1 and time.monotonic() < deadline:
                clients.check()
                time.sleep(0.01)
        else:
            clients.wait("ready", cfg.open_wait_s)
            open_s = round(time.perf_counter() - t_start, 2)
            shared.go.set()
            time.sleep(cfg.settle_s)
        clients.check()
        server.check(f"overload ({case})")
        opened_at_start = shared.opened.value
        acked0, cpu0, ccpu0 = shared.acked.value, server.cpu_s(), clients.cpu()
        lag0 = server.buckets(LOOP_LAG)
        write0 = server.buckets(STORE_WRITE)
        pcpu0, t0 = time.process_time(), time.perf_counter()
        out = asyncio.run(
            light_and_probes(
                server, light_reg.pair_id, busy.pair_id, light_body, cfg, shared.opened, budget
            )
        )
        elapsed = time.perf_counter() - t0
        acked1, cpu1, ccpu1 = shared.acked.value, server.cpu_s(), clients.cpu()
        pcpu1 = time.process_time()
        lag = _window_quantiles(lag0, server.buckets(LOOP_LAG), (0.5, 0.99))
        write = _window_quantiles(write0, server.buckets(STORE_WRITE), (0.5, 0.99))
        server.check(f"overload ({case})")
        # Backpressure: messages that waited for room in their pair's queue (an
        # older tree instead shed turns and paced steps; each reads "—" where absent).
        waits = server.metric("avest_backpressure_waits_total")
        shed = server.metric("avest_shed_turns_total")
        paced = server.metric("avest_paced_steps_total")
        log(f"{name} overload ({case}): light worker done; busy streams stop and drain")
        t_stop = time.perf_counter()
        shared.stop.set()
        shared.close.set()
        res = clients.results(cfg.wait_s + 60)
        drain_s = time.perf_counter() - t_stop
        server.check(f"overload ({case})")
        if res["acked"] != res["sent"]:
            raise Failed(f"busy streams: {res['acked']} acknowledgements for {res['sent']} sent")
        out.update(
            case=case,
            busy_kind=cfg.busy_kind,
            busy_window=cfg.busy_window,
            busy_streams=m,
            busy_open=opened_at_start,
            busy_open_s=open_s,
            capacity_per_s=round(capacity, 1),
            offered_per_s=round(offered, 1),
            busy_acked_per_s=round((acked1 - acked0) / elapsed, 1),
            busy_sent=res["sent"],
            busy_reopened=sum(s.get("reopened", 0) for s in res["streams"]),
            busy_acked=res["acked"],
            drain_s=round(drain_s, 1),
            window_s=round(elapsed, 1),
            server_cpu_share=round((cpu1 - cpu0) / elapsed, 3),
            client_cpu_share=round((ccpu1 - ccpu0 + pcpu1 - pcpu0) / elapsed, 3),
            backpressure_waits=waits,
            shed_turns=shed,
            paced_steps=paced,
            loop_lag_p50_s=lag[0],
            loop_lag_p99_s=lag[1],
            store_write_p50_s=write[0],
            store_write_p99_s=write[1],
            load_avg=round(os.getloadavg()[0], 2),
        )
        return out
    except Failed as exc:
        raise server.explain(exc, f"overload ({case})") from None
    finally:
        if clients is not None:
            clients.shared.stop.set()
            clients.shared.close.set()
            clients.kill()
        server.stop()


def run_tree(cfg: Config, tree: Path | None, name: str, sections: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"tree": str(tree) if tree else "this checkout"}
    capacity = cfg.capacity
    if "cpu" in sections or "latency" in sections:
        server = Server(cfg, tree, name)
        try:
            if "cpu" in sections:
                out["cpu"] = section_cpu(server, cfg)
                capacity = capacity or out["cpu"]["acked_per_s"]
            if "latency" in sections:
                if not capacity:
                    log(f"{name} latency: measuring the capacity first")
                    capacity = flat_out(server, cfg, "summary", "capacity")["acked_per_s"]
                out["latency"] = section_latency(server, cfg, capacity)
        except Failed as exc:
            raise server.explain(exc, "cpu/latency") from None
        finally:
            out["exit_status"] = server.stop()
    if "overload" in sections:
        # The capacity of the busy streams' kind: summaries as measured, raw steps anew.
        cap = capacity if cfg.busy_kind == "summary" else 0.0
        out["overload"] = {
            "after_open": overload_case(cfg, tree, name, cap, while_opening=False),
            "while_opening": overload_case(cfg, tree, name, cap, while_opening=True),
        }
    return out


# -- the report ------------------------------------------------------------------------------

ROWS: dict[str, list[tuple[str, str]]] = {
    "cpu": [
        ("streams (one worker each)", "streams"),
        ("summaries acknowledged", "acked"),
        ("update rule, refit interval in force (steps)", "rule_interval"),
        ("summaries sent with their sketch (as avest asked; the floor's alike)", "sketched_share"),
        ("**capacity: acked summaries/s**", "acked_per_s"),
        ("**server CPU µs per summary**", "server_cpu_us"),
        ("bare grpc.aio: messages/s", "floor_per_s"),
        ("bare grpc.aio: server CPU µs per message", "floor_server_cpu_us"),
        ("**server CPU per summary / bare per message**", "cpu_ratio_to_floor"),
        ("acked/s / bare messages/s", "capacity_ratio_to_floor"),
        ("protobuf parse of one message in process, µs", "parse_us"),
        ("server CPU share (cores)", "server_cpu_share"),
        ("client CPU µs per summary (bare: per message)", "client_pair"),
        ("client CPU share (cores)", "client_cpu_share"),
        ("coefficients version before → after", "versions"),
        ("refits done (rounds)", "refits"),
        ("coefficient pushes per stream min / mean / max", "pushes"),
        ("ack p50 / p99 ms (flat out)", "acks"),
        ("streams opened again (--reopen)", "reopened"),
        ("load average before / after", "load_avg"),
    ],
    "latency": [
        ("capacity (acked/s, from cpu)", "capacity_per_s"),
        ("offered summaries/s", "offered_per_s"),
        ("acked summaries/s", "acked_per_s"),
        ("**ack p50 ms**", "ack_p50_ms"),
        ("**ack p99 ms**", "ack_p99_ms"),
        ("ack max ms", "ack_max_ms"),
        ("group-commit interval ms", "flush_interval_ms"),
        ("p50 / interval", "p50_over_flush"),
        ("p99 / interval", "p99_over_flush"),
        ("server CPU µs per summary", "server_cpu_us"),
        ("client CPU µs per summary", "client_cpu_us"),
        ("server / client CPU share (cores)", "shares"),
        ("coefficient pushes per stream (mean)", "pushes_per_stream_mean"),
        ("streams opened again (--reopen)", "reopened"),
        ("load average before / after", "load_avg"),
    ],
    "overload": [
        ("busy streams (kind)", "busy"),
        ("busy streams open when the light worker started", "busy_open"),
        ("seconds for every busy stream to open", "busy_open_s"),
        ("offered (2 x capacity) /s", "offered_per_s"),
        ("busy acked/s meanwhile", "busy_acked_per_s"),
        ("light worker: open ms", "light_open_ms"),
        ("**light worker: first ack ms**", "light_first_ack_ms"),
        ("**light worker: ack p50 ms**", "light_ack_p50_ms"),
        ("**light worker: ack p99 ms**", "light_ack_p99_ms"),
        ("light worker: ack max ms", "light_ack_max_ms"),
        ("busy streams open at its first ack", "busy_open_at_light_first_ack"),
        ("/healthz p50 / **p99** / max ms", "healthz"),
        ("GetCoefficients p50 / **p99** / max ms", "getcoef"),
        ("GetCoefficients on the read port p50 / **p99** / max ms", "getcoef_read"),
        ("Budget (64 rows) on the read port p50 / **p99** / max ms", "budget_read"),
        ("event loop lag p50 / p99 s (bucket bounds)", "loop_lag"),
        ("group commit, snapshot to acks, p50 / p99 s (bucket bounds)", "store_write"),
        ("probes (healthz, GetCoefficients, on the read port, Budget there)", "probes"),
        ("backpressure waits; shed turns, paced steps (older trees)", "shedding"),
        ("server / client CPU share (cores)", "shares"),
        ("busy sent = acked; drain s", "drain"),
        ("streams opened again (busy, light; --reopen)", "reopened"),
    ],
}


#: The service loop's heartbeat lateness (a histogram; trees before it have none).
LOOP_LAG = "avest_event_loop_lag_seconds"
#: The group commit's time, snapshot to acknowledgements (a histogram; trees before it have none).
STORE_WRITE = "avest_store_write_duration_seconds"


def _window_quantiles(
    before: dict[float, float] | None, after: dict[float, float] | None, qs: tuple[float, ...]
) -> list[float | None]:
    """Each quantile of a histogram's observations between two scrapes, as the upper
    bound of the bucket it falls in (None without the histogram or observations)."""
    if not before or not after:
        return [None] * len(qs)
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1]
    if total <= 0:
        return [None] * len(qs)
    return [next(b for b, c in zip(bounds, counts, strict=True) if c >= q * total) for q in qs]


def _fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        if v != v:
            return "nan"
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, (list, tuple)):
        return " / ".join(_fmt(x) for x in v)
    return str(v)


#: The probes whose p50 / p99 / max the overload table shows.
PROBED = ("healthz", "getcoef", "getcoef_read", "budget_read")


def _cell(section: str, r: dict[str, Any], key: str) -> Any:
    if key in r:
        return r[key]
    get = r.get
    derived: dict[str, Any] = {
        "rule_interval": f"{get('rule', '?').replace('UPDATE_RULE_', '').lower()}, "
        f"{get('refit_interval')}",
        "client_pair": f"{_fmt(get('client_cpu_us'))} ({_fmt(get('floor_client_cpu_us'))})",
        "versions": f"{get('version_before')} → {get('version_after')}",
        "pushes": [get(f"pushes_per_stream_{q}") for q in ("min", "mean", "max")],
        "acks": [get("ack_p50_ms"), get("ack_p99_ms")],
        "shares": [get("server_cpu_share"), get("client_cpu_share")],
        "busy": f"{get('busy_streams')} ({get('busy_kind')}, at most "
        f"{get('busy_window')} unacknowledged each)",
        **{name: [get(f"{name}_{q}_ms") for q in ("p50", "p99", "max")] for name in PROBED},
        "probes": [get(f"{name}_probes") for name in PROBED],
        "loop_lag": [get("loop_lag_p50_s"), get("loop_lag_p99_s")],
        "store_write": [get("store_write_p50_s"), get("store_write_p99_s")],
        "shedding": f"{_fmt(get('backpressure_waits'))}; "
        f"{_fmt([get('shed_turns'), get('paced_steps')])}",
        "reopened": [get("busy_reopened"), get("light_reopened")],
        "drain": f"{_fmt(get('busy_sent'))} = {_fmt(get('busy_acked'))}; {_fmt(get('drain_s'))}",
    }
    return derived.get(key)


def table(section: str, columns: list[tuple[str, dict[str, Any]]], ratio: bool) -> str:
    heads = [name for name, _ in columns] + (["current / baseline"] if ratio else [])
    lines = ["| " + " | ".join(["", *heads]) + " |", "|" + "---|" * (len(heads) + 1)]
    for label, key in ROWS[section]:
        cells = [_cell(section, r, key) for _, r in columns]
        row = [label, *(_fmt(c) for c in cells)]
        if ratio:
            a, b = cells[0], cells[-1]
            num = isinstance(a, (int, float)) and isinstance(b, (int, float)) and a
            row.append(f"{b / a:.2f}" if num else "")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def ratios(base: dict[str, Any], cur: dict[str, Any]) -> dict[str, Any]:
    """current / baseline for the figures that compare."""

    def r(a: Any, b: Any) -> float | None:
        ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and a
        return round(b / a, 3) if ok else None

    out: dict[str, Any] = {}
    if "cpu" in base and "cpu" in cur:
        out["cpu"] = {
            k: r(base["cpu"].get(k), cur["cpu"].get(k))
            for k in ("acked_per_s", "server_cpu_us", "cpu_ratio_to_floor", "client_cpu_us")
        }
    if "latency" in base and "latency" in cur:
        out["latency"] = {
            k: r(base["latency"].get(k), cur["latency"].get(k))
            for k in ("ack_p50_ms", "ack_p99_ms", "server_cpu_us")
        }
    if "overload" in base and "overload" in cur:
        keys = ("light_first_ack_ms", "light_ack_p50_ms", "light_ack_p99_ms", "healthz_p99_ms",
                "getcoef_p99_ms", "busy_acked_per_s")  # fmt: skip
        out["overload"] = {
            case: {k: r(base["overload"][case].get(k), cur["overload"][case].get(k)) for k in keys}
            for case in base["overload"]
        }
    return out


def report(result: dict[str, Any]) -> str:
    servers: dict[str, dict[str, Any]] = result["servers"]
    ratio = len(servers) == 2
    s = result["settings"]
    flags = list(s["server_args"])
    if s["flush_interval_ms"] is not None:
        flags += ["--flush-interval-ms", str(s["flush_interval_ms"])]
    parts = [
        f"# avest fleet benchmark ({'quick' if s['quick'] else 'full'}; {s['cpus']} CPUs; "
        f"{s['busy_loops']} busy loops beside it; grpcio {s['grpcio']}; Python {s['python']})",
        "",
        "Server at its default settings"
        + (f" but {' '.join(flags)}" if flags else "")
        + (
            f", as {s['replicas']} replicas on one PostgreSQL database (each worker on one; "
            "the probes and the light worker on the first; server CPU includes PostgreSQL's)"
            if s.get("replicas")
            else ""
        )
        + "; ratios within this run. "
        + ", ".join(f"{n}: {v['tree']}" for n, v in servers.items()),
    ]
    if "cpu" in s["sections"]:
        parts += [
            "",
            f"## cpu: {s['workers']} workers flat out, {s['summaries']} K={s['k']} summaries each",
        ]
        parts.append(table("cpu", [(n, v["cpu"]) for n, v in servers.items() if "cpu" in v], ratio))
    if "latency" in s["sections"]:
        parts += ["", "## latency: half the capacity, paced over the workers"]
        parts.append(table("latency", [(n, v["latency"]) for n, v in servers.items()], ratio))
    if "overload" in s["sections"]:
        for case, title in (("after_open", "light worker once the busy streams are open"),
                            ("while_opening", "light worker while the busy streams open")):  # fmt: skip
            parts += ["", f"## overload, {title}"]
            cols = [(n, v["overload"][case]) for n, v in servers.items()]
            parts.append(table("overload", cols, ratio))
    if ratio:
        parts += ["", "Ratios (current / baseline): " + json.dumps(result["ratios"])]
    return "\n".join(parts)


# -- main ------------------------------------------------------------------------------------


def spin() -> None:
    while True:
        pass


def run(cfg: Config, sections: Sequence[str], baseline: Path | None = None,
        busy_loops: int = 0, quick: bool = False) -> dict[str, Any]:  # fmt: skip
    """Run the ``sections`` on the baseline tree's server (if any), then this checkout's.
    Raises :class:`Failed` when what it times fails."""
    reused()  # now, not halfway through the run
    ctx = mp.get_context("spawn")
    spinners = [ctx.Process(target=spin, daemon=True) for _ in range(busy_loops)]
    for p in spinners:
        p.start()
    try:
        servers: dict[str, dict[str, Any]] = {}
        if baseline is not None:
            servers["baseline"] = run_tree(cfg, baseline, "baseline", sections)
        servers["current"] = run_tree(cfg, None, "current", sections)
    finally:
        for p in spinners:
            p.kill()
            p.join(10)
    result: dict[str, Any] = {
        "settings": {
            **asdict(cfg),
            "sections": list(sections),
            "quick": quick,
            "busy_loops": busy_loops,
            "cpus": os.cpu_count(),
            "grpcio": grpc.__version__,
            "python": platform.python_version(),
        },
        "servers": servers,
    }
    if baseline is not None:
        result["ratios"] = ratios(servers["baseline"], servers["current"])
    return result


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for name in SECTIONS:
        ap.add_argument(f"--{name}", action="store_true", help=f"run the {name} section")
    ap.add_argument("--quick", action="store_true", help="a smoke run (under a minute a server)")
    ap.add_argument("--baseline-server", type=Path, metavar="TREE",
                    help="also run on this source tree's server, first")  # fmt: skip
    ap.add_argument("--busy-loops", type=int, default=0, metavar="N",
                    help="spin N processes beside the run")  # fmt: skip
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    d = Config()
    ap.add_argument("--workers", type=int, help=f"workers (streams), default {d.workers}")
    ap.add_argument("--summaries", type=int, help=f"per worker flat out, default {d.summaries}")
    ap.add_argument("--seconds", type=float, help=f"latency run, default {d.latency_s}")
    ap.add_argument("--rate", type=float, help="latency: offered/s (default half the capacity)")
    ap.add_argument("--capacity", type=float, help="skip measuring it: summaries/s")
    ap.add_argument("--busy-streams", type=int, help=f"overload, default {d.busy_streams}")
    ap.add_argument("--busy-kind", choices=["summary", "raw"], help="what the busy streams send")
    ap.add_argument("--busy-window", type=int,
                    help=f"unacknowledged per busy stream at most, default {d.busy_window}")  # fmt: skip
    ap.add_argument("--busy-procs", type=int, help=f"processes for them, default {d.busy_procs}")
    ap.add_argument("--light-summaries", type=int, help=f"default {d.light_summaries}")
    ap.add_argument(
        "--client-procs", type=int, help=f"cpu/latency clients, default {d.client_procs}"
    )
    ap.add_argument("--flush-interval-ms", type=int, help="pass it to the server (default: not)")
    ap.add_argument("--reopen", action="store_true",
                    help="open a stream again that ends before the server took it (gRPC cancels "
                    "a call not taken within 30 s), as the client library does, and count it; "
                    "without it such a stream fails the run")  # fmt: skip
    ap.add_argument("--replicas", type=int,
                    help="N avest serve processes on one PostgreSQL database (started here), "
                    "each worker on one of them by its id; default 0: one process on SQLite")  # fmt: skip
    ap.add_argument("--server-arg", action="append", default=[], metavar="FLAG",
                    help="one more avest serve flag, as --server-arg=--flag=value (repeatable; "
                    "off the defaults, which are the point)")  # fmt: skip
    args = ap.parse_args(argv)
    # Killed (a timeout): stop the servers and clients this run started on the way out.
    was = signal.signal(signal.SIGTERM, lambda *_: sys.exit("bench_fleet: terminated"))
    sections = [s for s in SECTIONS if getattr(args, s)] or list(SECTIONS)
    cfg = Config(**QUICK) if args.quick else Config()
    overrides = {
        "workers": args.workers, "summaries": args.summaries, "latency_s": args.seconds,
        "rate": args.rate, "capacity": args.capacity, "busy_streams": args.busy_streams,
        "busy_kind": args.busy_kind, "busy_procs": args.busy_procs,
        "busy_window": args.busy_window,
        "light_summaries": args.light_summaries, "client_procs": args.client_procs,
        "flush_interval_ms": args.flush_interval_ms,
        "server_args": tuple(args.server_arg) or None,
        "reopen": args.reopen or None, "replicas": args.replicas,
    }  # fmt: skip
    cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    if args.baseline_server is not None and not (args.baseline_server / "service").is_dir():
        raise SystemExit(f"bench_fleet: {args.baseline_server} is not a source tree (no service/)")
    try:
        result = run(cfg, sections, args.baseline_server, args.busy_loops, args.quick)
    except Failed as exc:
        raise SystemExit(f"bench_fleet: FAILED: {exc}") from None
    finally:
        stop_postgres()
        signal.signal(signal.SIGTERM, was)
    print(json.dumps(result, indent=2) if args.json else report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
