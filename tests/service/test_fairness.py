"""Fair turns: a light worker next to many busy streams is not starved.

Counted, not timed: how many busy-stream steps the service applies between the
light worker's send and the moment its step is applied (wall time on a loaded
machine says little; the count says how many turns the busy streams got first).
"""

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


def _light_worker_waits(start_server, data, **settings) -> tuple[list[int], list[int]]:  # noqa: ANN001
    """Busy steps applied while each light step waited: until it was applied, and
    until it was acknowledged."""
    # Turns alone: pacing (its own tests in test_shedding) would hold the busy streams.
    handle = start_server(data, flush_interval_ms=10, pace_after_ms=0, **settings)
    registry = handle.server.app.registry
    with grpc.insecure_channel(handle.grpc_address) as channel:
        stub = pb_grpc.EstimatorServiceStub(channel)

        busy_pid, light_pid = register_named(stub, "busy", K), register_named(stub, "light", K)
        busy_pair = registry.pairs[busy_pid]
        # When the light worker's step is applied: the busy steps applied by then.
        applied_at: dict[int, int] = {}

        def on_observed(pair, rows, labelled) -> None:  # noqa: ANN001
            if pair.id == light_pid:
                applied_at[pair.applied["light"]] = busy_pair.estimator.steps

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
                before = busy_pair.estimator.steps
                sends.put(_step(light_pid, "light", seq))
                while True:
                    resp = next(acks)
                    if resp.HasField("ack") and resp.ack.acked_sequence >= seq:
                        break
                to_ack.append(busy_pair.estimator.steps - before)
                to_apply.append(applied_at[seq] - before)
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


def test_a_light_worker_next_to_fifty_busy_streams_is_not_starved(start_server, tmp_path) -> None:  # noqa: ANN001
    """Without fair turns (``steps_per_turn=0``, the old behaviour) every busy stream
    applies one step per loop iteration, so a light step waits a whole round of them
    (about 50). With them it goes ahead of the streams served more recently and waits
    a few turns of 8 (16-37 seen), plus the turns that pass while its message travels.
    Both are measured in one run, so the load of the machine weighs on both alike."""
    off = _light_worker_waits(start_server, tmp_path / "off", steps_per_turn=0)
    on = _light_worker_waits(start_server, tmp_path / "on")
    assert _median(off[0]) >= BUSY_STREAMS * 3 // 4, off
    assert _median(on[0]) < _median(off[0]), (on, off)
