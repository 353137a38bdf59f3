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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from avest.offline.trace import Trace
from avest_client import AsyncForwarder, Backoff
from avest_client.credentials import Credentials, aio_channel
from avest_wire.rules import UPDATE_RULES
from avest_wire.v1 import estimator_pb2 as pb
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc


class ReplayError(RuntimeError):
    """The service refused steps of a replay (they were dropped, not resent)."""


@dataclass
class ReplayResult:
    pair_id: str
    messages: int
    acked: int
    pair: pb.Pair
    #: Steps the pair counted during the replay: the rest were duplicates of steps
    #: already applied (a rerun of the same replay), which the service ignores.
    applied: int = 0


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


def steps_for(trace: Trace, worker: int, workers: int, repeat: int) -> list[slice]:
    """The trace rows one simulated worker sends, a slice per step, in order: its
    forwarder numbers them 1, 2, ... as it queues them."""
    out = []
    for _ in range(repeat):
        for lo, hi in step_bounds(trace):
            chunk = np.array_split(np.arange(lo, hi), workers)[worker]
            if chunk.size:
                out.append(slice(int(chunk[0]), int(chunk[-1]) + 1))
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
    timeout: float = 0.0,
    rate: float = 0.0,
    run_id: str = "",
    retry_s: float = 60.0,
    token: str | None = None,
) -> ReplayResult:
    """Replay ``trace``; ``rate`` caps messages per second per worker (0: no cap).

    Each simulated worker is the client's :class:`~avest_client.AsyncForwarder`, as a
    vLLM worker's is, with a queue that holds its whole share (a replay never drops).
    Worker ids are ``replay:<run_id>:<w>`` with ``run_id`` derived from the trace
    (:func:`default_run_id`) unless given: rerunning the same replay resends the
    same steps under the same ids and sequence numbers, which the service
    recognises. When the service restarts, each forwarder reconnects and resends
    every step above the last acknowledged one; a replay gives up when no worker's
    acknowledgements move for ``retry_s`` seconds, or after ``timeout`` in all (0: no
    limit). ``token``: the bearer token (default ``AVEST_TOKEN``).
    """
    if workers < 1:
        raise ValueError("workers must be >= 1")
    run = run_id or default_run_id(trace, workers, repeat)
    request = pb.RegisterPairRequest(
        key=pair_key(trace), update_rule=UPDATE_RULES[rule], refit_interval=refit_interval
    )
    # AVEST_TOKEN / AVEST_TLS_CA from the environment, as every client reads them.
    credentials = Credentials.resolve(token=token)
    async with aio_channel(address, (), credentials) as channel:
        stub = pb_grpc.EstimatorServiceStub(channel)
        reg = await _retry(lambda: stub.RegisterPair(request, timeout=30), retry_s)
        get = pb.GetPairRequest(pair_id=reg.pair_id)
        before = (await _retry(lambda: stub.GetPair(get, timeout=30), retry_s)).pair
        plans = [steps_for(trace, w, workers, repeat) for w in range(workers)]
        forwarders = [
            AsyncForwarder(
                address,
                reg.pair_id,
                f"replay:{run}:{w}",
                queue_size=max(1, len(plan)),
                k=trace.k,
                credentials=credentials,
                backoff=Backoff(initial_s=0.05, max_s=1.0),
                # A rerun sends the same steps again: those the service applied count once.
                reused_worker_id="resume",
            )
            for w, plan in enumerate(plans)
        ]
        try:
            await asyncio.gather(
                *(
                    _send(trace, f, plan, on_message, rate)
                    for f, plan in zip(forwarders, plans, strict=True)
                )
            )
            await _acknowledged(forwarders, retry_s, timeout)
        finally:
            await asyncio.gather(*(f.close(1.0) for f in forwarders))
        acked = sum(f.stats.acked for f in forwarders)
        pair = (await stub.GetPair(get, timeout=30)).pair
    applied = pair.steps_observed - before.steps_observed
    return ReplayResult(reg.pair_id, sum(len(p) for p in plans), acked, pair, applied)


async def _send(
    trace: Trace,
    fwd: AsyncForwarder,
    plan: list[slice],
    on_message: Callable[[], None],
    rate: float,
) -> None:
    for sl in plan:
        fwd.submit(trace.features[sl], trace.num_verified[sl], trace.num_accepted[sl])
        on_message()
        await asyncio.sleep(1.0 / rate if rate > 0 else 0)


async def _acknowledged(forwarders: list[AsyncForwarder], retry_s: float, timeout: float) -> None:
    """Wait until every forwarder's steps are acknowledged; TimeoutError when the
    acknowledgements stall for ``retry_s`` (or ``timeout`` passes)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout if timeout > 0 else float("inf")
    last, moved = -1, loop.time()
    while True:
        stats = [f.stats for f in forwarders]
        if all(s.pending == 0 for s in stats):
            lost = sum(s.refused + s.dropped for s in stats)
            if lost:
                raise ReplayError(f"replay: the service refused {lost} step(s)")
            return
        acked = sum(s.acked for s in stats)
        if acked != last:
            last, moved = acked, loop.time()
        now = loop.time()
        if now - moved > retry_s or now > end:
            left = sum(s.pending for s in stats)
            raise TimeoutError(
                f"replay: {left} step(s) unacknowledged after {now - moved:.0f}s without "
                f"progress (last error: {forwarders[0].last_error or 'none'})"
            )
        await asyncio.sleep(0.02)


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
