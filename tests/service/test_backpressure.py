"""Backpressure on a real server: a pair whose owner cannot keep up fills its bounded
queue, the streams sending to it are read no further until there is room (their
senders wait in HTTP/2 flow control), a light worker next to them goes on being
acknowledged, nothing is refused or lost, and /metrics shows it.

The overload is made, not hoped for: every fold sleeps 5 ms (the service folds
at most 200 steps a second, however fast the machine), and 24 streams each send
20 steps a second into one pair, 2.4 times what it folds."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import queue
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from avest.core.estimator import Batch, OnlineEstimator
from avest_client import Forwarder
from avest_wire.v1 import estimator_pb2 as pb
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc
from tests.support.live import Live
from tests.support.metrics import scrape, value
from tests.support.rpc import random_step, register_named

K = 4
FOLD_S = 0.005
FLOODS = 24
#: How long the floods send, and how often each sends a step: 24 x 20 steps a
#: second offered, 2.4 times what the service folds. (Not flat out: what a held
#: back stream sends waits in gRPC's flow control, and a flat-out sender fills a
#: window of hundreds of steps that would take minutes to fold at 5 ms a step.)
FLOOD_S = 10.0
FLOOD_EVERY_S = 0.05


def _slow_folds(monkeypatch: pytest.MonkeyPatch) -> None:
    apply = OnlineEstimator.apply

    def slow_apply(self: OnlineEstimator, batch: Batch, *args: Any):  # noqa: ANN202
        time.sleep(FOLD_S)
        return apply(self, batch, *args)

    monkeypatch.setattr(OnlineEstimator, "apply", slow_apply)


def _flood_process(address: str, pid: str, seconds: float, out: Any) -> None:
    """``FLOODS`` raw streams sending flat out for ``seconds``; puts how each ended
    ("OK" or the status code's name). In a process of its own: the service under
    test must not share its interpreter."""

    async def one(w: int) -> str:
        deadline = time.monotonic() + seconds

        async def gen() -> AsyncIterator[pb.ObserveRequest]:
            seq = 0
            while time.monotonic() < deadline:
                seq += 1
                yield random_step(pid, f"flood-{w}", seq, 2, K, seed=seq)
                await asyncio.sleep(FLOOD_EVERY_S)

        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.EstimatorServiceStub(channel)
            try:
                async for _ in stub.Observe(gen(), timeout=seconds + 60):
                    pass
            except grpc.aio.AioRpcError as exc:
                return exc.code().name
        return "OK"

    async def main() -> list[str]:
        return list(await asyncio.gather(*(one(w) for w in range(FLOODS))))

    out.put(asyncio.run(main()))


class _Floods:
    def __init__(self, address: str, pid: str, seconds: float) -> None:
        ctx = mp.get_context("spawn")
        self._out = ctx.Queue()
        self._proc = ctx.Process(
            target=_flood_process, args=(address, pid, seconds, self._out), daemon=True
        )
        self.ends: list[str] = []

    def __enter__(self) -> _Floods:
        self._proc.start()
        return self

    def kill(self) -> None:
        """End the floods at once, their backlog unsent (``ends`` stays empty)."""
        self._proc.kill()
        self._proc.join(30)

    def __exit__(self, *exc: object) -> None:
        if not self._proc.is_alive():
            return
        with contextlib.suppress(queue.Empty):
            self.ends = self._out.get(timeout=FLOOD_S + 120)
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()


@pytest.fixture
def overloaded(open_server, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Live, str]]:  # noqa: ANN001
    _slow_folds(monkeypatch)
    live = open_server(pair_queue=4)
    pid = register_named(live.stub, "busy", K, refit_interval=50)
    yield live, pid


def _wait(cond, timeout: float = 60.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_a_pair_that_cannot_keep_up_holds_its_streams_back_and_loses_nothing(
    overloaded,  # noqa: ANN001
) -> None:
    live, pid = overloaded
    rng = np.random.default_rng(0)
    light_pid = register_named(live.stub, "light", K, refit_interval=50)
    light = Forwarder(live.grpc_address, light_pid, worker_id="light", k=K).start()
    # A light worker of the busy pair itself: it takes its place in the same line.
    beside = Forwarder(live.grpc_address, pid, worker_id="beside", k=K).start()
    busy = Forwarder(live.grpc_address, pid, worker_id="backlog", k=K).start()
    busy_steps = 100
    seen: list[dict[str, float]] = []

    def held() -> bool:
        samples = scrape(live)
        seen.append(
            {
                "overloaded": value(samples, "avest_overloaded"),
                "waits": value(samples, "avest_backpressure_waits_total"),
                "queued": value(samples, "avest_admission_queued"),
            }
        )
        return seen[-1]["overloaded"] == 1.0 and seen[-1]["waits"] > 0

    try:
        with _Floods(live.grpc_address, pid, FLOOD_S) as floods:
            # The floods fill the pair's queue: its senders wait for room.
            assert _wait(held), seen[-3:]
            # The queue never holds more than its bound.
            assert max(s["queued"] for s in seen) <= 4, seen
            # A worker with a backlog joins them.
            for _ in range(busy_steps):
                busy.submit(rng.uniform(-3, 3, (2, K)), np.full(2, K), rng.integers(0, K + 1, 2))
            # The light workers: one step, then its acknowledgement, five times each.
            for i in range(5):
                light.submit(rng.uniform(-3, 3, (1, K)), [K], [i % (K + 1)])
                beside.submit(rng.uniform(-3, 3, (1, K)), [K], [i % (K + 1)])
                assert light.flush(timeout=60), light.last_error
                assert beside.flush(timeout=60), beside.last_error
        # The floods are gone: the queue empties and the service is no longer overloaded.
        assert _wait(lambda: value(scrape(live), "avest_overloaded") == 0.0)
        assert busy.flush(timeout=120), busy.last_error
        reconnects = busy.stats.reconnects + beside.stats.reconnects
    finally:
        light.close()
        beside.close()
        busy.close()
    # Held back, never refused: every flood stream ran to its end, the other workers'
    # streams were never ended, and all of their steps were applied.
    assert floods.ends == ["OK"] * FLOODS
    assert reconnects == 0
    workers = {
        w["worker_id"]: w for w in live.http.get(f"/v1/pairs/{pid}/workers").json()["workers"]
    }
    assert workers["backlog"]["steps"] == busy_steps
    assert workers["beside"]["steps"] == 5
    light_pair = live.stub.GetPair(pb.GetPairRequest(pair_id=light_pid)).pair
    assert light_pair.steps_observed == 5
    samples = scrape(live)
    assert value(samples, "avest_refused_batches_total", method="Observe", reason="other") == 0
    assert value(samples, "avest_admission_queued") == 0


def test_a_pair_that_keeps_up_holds_nobody_back(open_server) -> None:  # noqa: ANN001
    live = open_server()
    pid = register_named(live.stub, "calm", K, refit_interval=50)
    with _Floods(live.grpc_address, pid, 2.0) as floods:
        pass
    assert floods.ends == ["OK"] * FLOODS
    samples = scrape(live)
    assert value(samples, "avest_overloaded") == 0
    assert value(samples, "avest_backpressure_waits_total") == 0
