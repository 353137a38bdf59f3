"""Stream a recorded trace into a running service as simulated workers.

Each trace step's rows are split among ``workers`` concurrent Observe
streams (one message per worker per step; with one worker, one message per
trace step, so the service ends with exactly the coefficients of the core's
replay). Nothing is dropped: a replay is a load generator and a test
harness, not a decode loop, so it waits for flow control instead. Worker ids
and sequence numbers are stable across reruns and a replay resumes after the
service restarts, so a rerun after a crash counts nothing twice.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from avest.offline.trace import Trace
from avest_client.credentials import Credentials, aio_channel
from avest_wire import matrix as wire
from avest_wire.rules import UPDATE_RULES
from avest_wire.v1 import estimator_pb2 as pb
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc


@dataclass
class ReplayResult:
    pair_id: str
    messages: int
    acked: int
    pair: pb.Pair


def pair_key(trace: Trace) -> pb.PairKey:
    """The pair a trace was recorded on, with its sampling as labels."""
    meta = trace.meta
    labels = {n: str(meta[n]) for n in ("temperature", "top_p") if n in meta}
    return pb.PairKey(
        target_model=str(meta.get("target", "unknown")),
        draft_model=str(meta.get("draft", "unknown")),
        method=str(meta.get("method", "")),
        num_speculative_tokens=trace.k,
        labels=labels,
    )


def step_bounds(trace: Trace) -> list[tuple[int, int]]:
    starts = np.concatenate(([0], np.flatnonzero(np.diff(trace.step)) + 1, [trace.rows]))
    return [(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:], strict=True)]


def messages_for(
    trace: Trace, pair_id: str, worker: int, workers: int, worker_id: str, repeat: int
) -> list[pb.ObserveRequest]:
    """The Observe messages one simulated worker sends, in order."""
    out = []
    seq = 0
    for _ in range(repeat):
        for lo, hi in step_bounds(trace):
            chunk = np.array_split(np.arange(lo, hi), workers)[worker]
            if chunk.size == 0:
                continue
            sl = slice(int(chunk[0]), int(chunk[-1]) + 1)
            data, rows, k = wire.encode(trace.features[sl])
            seq += 1
            out.append(
                pb.ObserveRequest(
                    pair_id=pair_id,
                    worker_id=worker_id,
                    sequence=seq,
                    features=data,
                    rows=rows,
                    k=k,
                    num_verified=trace.num_verified[sl].tolist(),
                    num_accepted=trace.num_accepted[sl].tolist(),
                )
            )
    return out


def default_run_id(trace: Trace, workers: int, repeat: int) -> str:
    """A run id fixed by the trace's content and the split: a rerun of the same
    replay reuses its worker ids and sequence numbers, so the service counts
    nothing twice."""
    h = hashlib.sha256()
    for a in (trace.features, trace.num_verified, trace.num_accepted, trace.step):
        h.update(np.ascontiguousarray(a).tobytes())
    h.update(f"{workers}:{repeat}".encode())
    return h.hexdigest()[:12]


#: Stream failures a replay waits out and resumes after (the service restarting).
RETRYABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
)


async def replay(
    address: str,
    trace: Trace,
    workers: int = 1,
    rule: str = "",
    refit_interval: int = 0,
    repeat: int = 1,
    on_message: Callable[[], None] = lambda: None,
    timeout: float = 600.0,
    rate: float = 0.0,
    run_id: str = "",
    retry_s: float = 60.0,
) -> ReplayResult:
    """Replay ``trace``; ``rate`` caps messages per second per worker (0: no cap).

    Worker ids are ``replay:<run_id>:<w>`` with ``run_id`` derived from the trace
    (:func:`default_run_id`) unless given: rerunning the same replay resends the
    same steps under the same ids and sequence numbers, which the service
    recognises. When a stream fails (the service restarts), the worker
    reconnects for up to ``retry_s`` seconds, registers the pair again and
    resends every step above the last acknowledged one.
    """
    if workers < 1:
        raise ValueError("workers must be >= 1")
    run = run_id or default_run_id(trace, workers, repeat)
    request = pb.RegisterPairRequest(
        key=pair_key(trace), update_rule=UPDATE_RULES[rule], refit_interval=refit_interval
    )
    # AVEST_TOKEN / AVEST_TLS_CA from the environment, as every client reads them.
    async with aio_channel(address, (), Credentials.resolve()) as channel:
        stub = pb_grpc.EstimatorServiceStub(channel)
        reg = await _retry(lambda: stub.RegisterPair(request, timeout=30), retry_s)
        plans = [
            messages_for(trace, reg.pair_id, w, workers, f"replay:{run}:{w}", repeat)
            for w in range(workers)
        ]
        counted: set[int] = set()

        async def worker(msgs: list[pb.ObserveRequest]) -> int:
            acked = 0
            give_up = asyncio.get_running_loop().time() + retry_s

            async def requests(start: int) -> AsyncIterator[pb.ObserveRequest]:
                for m in msgs[start:]:
                    yield m
                    if id(m) not in counted:
                        counted.add(id(m))
                        on_message()
                    if rate > 0:
                        await asyncio.sleep(1.0 / rate)

            while True:
                try:
                    async for resp in stub.Observe(requests(acked), timeout=timeout):
                        if resp.HasField("ack"):
                            acked = max(acked, int(resp.ack.acked_sequence))
                    if acked >= len(msgs):
                        return acked
                except grpc.aio.AioRpcError as exc:
                    if exc.code() not in RETRYABLE:
                        raise
                if asyncio.get_running_loop().time() > give_up:
                    raise TimeoutError(
                        f"replay: {len(msgs) - acked} step(s) of a worker unacknowledged "
                        f"after {retry_s:g}s of retries"
                    )
                await asyncio.sleep(0.2)
                await _retry(lambda: stub.RegisterPair(request, timeout=30), retry_s)

        acks = await asyncio.gather(*(worker(m) for m in plans))
        pair = (await stub.GetPair(pb.GetPairRequest(pair_id=reg.pair_id), timeout=30)).pair
    return ReplayResult(reg.pair_id, sum(len(p) for p in plans), sum(acks), pair)


async def _retry(call: Callable[[], Any], retry_s: float) -> Any:
    """``await call()``, retried while the service is unreachable (up to ``retry_s``)."""
    give_up = asyncio.get_running_loop().time() + retry_s
    while True:
        try:
            return await call()
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in RETRYABLE or asyncio.get_running_loop().time() > give_up:
                raise
        await asyncio.sleep(0.2)
