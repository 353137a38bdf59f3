"""Fairness: a light worker next to many busy streams is not starved.

Its pair's queue lets streams in first come, first served, so a light worker's
step waits behind at most one step of each busy stream (and the queue's own
bound), whether it sends to its own pair or to the busy one. Counted, not timed:
how many busy-stream steps the service applies between the light worker's send
and the moment its step is applied (wall time on a loaded machine says little;
the count says how many steps went first)."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time

import grpc
import pytest

from avest_wire.v1 import estimator_pb2 as pb
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc
from tests.support.rpc import flood, register_named, zero_step

pytestmark = pytest.mark.slow

K, ROWS = 4, 8
BUSY_STREAMS = 50
#: Messages the pair's queue holds.
DEPTH = 8
LIGHT_STEPS = 20


def _step(pid: str, worker: str, seq: int) -> pb.ObserveRequest:
    return zero_step(pid, worker, seq, K, rows=ROWS)


def _busy(address: str, pid: str, streams: int, seconds: float) -> None:
    """``streams`` Observe streams sending as fast as flow control lets them."""
    import asyncio

    async def one(w: int) -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.EstimatorServiceStub(channel)
            await flood(stub, _step(pid, f"busy-{w}", 1), seconds)

    async def main() -> None:
        await asyncio.gather(*(one(w) for w in range(streams)))

    asyncio.run(main())


def _light_worker_waits(start_server, data, same_pair: bool) -> tuple[list[int], list[int]]:  # noqa: ANN001
    """Busy steps applied while each light step waited: until it was applied, and
    until it was acknowledged."""
    handle = start_server(data, flush_interval_ms=10, pair_queue=DEPTH)
    registry = handle.server.app.registry
    with grpc.insecure_channel(handle.grpc_address) as channel:
        stub = pb_grpc.EstimatorServiceStub(channel)

        busy_pid = register_named(stub, "busy", K)
        light_pid = busy_pid if same_pair else register_named(stub, "light", K)
        busy_pair = registry.pairs[busy_pid]
        # When the light worker's step is applied: the busy steps applied by then.
        applied_at: dict[int, int] = {}

        def on_observed(pair, rows, labelled) -> None:  # noqa: ANN001
            if pair.id == light_pid and "light" in pair.applied:
                applied_at.setdefault(pair.applied["light"], busy_pair.estimator.steps)

        handle.server.app.hooks.observed.append(on_observed)
        proc = mp.get_context("spawn").Process(
            target=_busy, args=(handle.grpc_address, busy_pid, BUSY_STREAMS, 60.0), daemon=True
        )
        proc.start()
        try:
            # Every busy stream under way.
            deadline = time.monotonic() + 30
            while len(busy_pair.applied) < BUSY_STREAMS and time.monotonic() < deadline:
                time.sleep(0.1)
            assert len(busy_pair.applied) == BUSY_STREAMS
            sends: queue.Queue[pb.ObserveRequest | None] = queue.Queue()
            acks = stub.Observe(iter(sends.get, None), timeout=60)
            to_apply, to_ack = [], []
            for seq in range(1, LIGHT_STEPS + 1):
                before = busy_pair.estimator.steps - same_pair * (seq - 1)
                sends.put(_step(light_pid, "light", seq))
                while True:
                    resp = next(acks)
                    if resp.HasField("ack") and resp.ack.acked_sequence >= seq:
                        break
                after = busy_pair.estimator.steps - same_pair * seq
                to_ack.append(after - before)
                to_apply.append(applied_at[seq] - same_pair * seq - before)
            sends.put(None)
            for _ in acks:
                pass
        finally:
            proc.terminate()
            proc.join(10)
    assert len(to_ack) == LIGHT_STEPS  # nothing refused, nothing lost
    return to_apply, to_ack


def _median(waits: list[int]) -> int:
    waited = sorted(waits[1:])  # the first also waited for its stream to open
    return waited[len(waited) // 2]


@pytest.mark.parametrize("same_pair", [False, True], ids=["own-pair", "busy-pair"])
def test_a_light_worker_next_to_fifty_busy_streams_is_not_starved(
    start_server,  # noqa: ANN001
    tmp_path,  # noqa: ANN001
    same_pair: bool,
) -> None:
    """Its own pair: its owner is idle, so the busy steps applied meanwhile are what the
    busy owner folds while the light step travels and is read (tens). The busy pair:
    it waits in the same line, behind at most one step of each busy stream plus the
    queue (50 + 8), and the steps folded while it travels. Starving it would take
    thousands (the busy streams fold thousands of steps a second here)."""
    to_apply, to_ack = _light_worker_waits(start_server, tmp_path / "data", same_pair)
    bound = 2 * (BUSY_STREAMS + DEPTH)
    assert _median(to_apply) <= bound, to_apply
    assert _median(to_ack) <= bound + 200, to_ack  # plus a group commit's worth
