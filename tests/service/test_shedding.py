"""Load shedding on a real server: an overloaded service holds back the streams
that press (turns) and paces a crowd on a saturated loop (pacing), a light worker
next to them goes on being acknowledged, nothing is refused or lost, and /metrics
shows it.

The overload is made, not hoped for: every fold sleeps 5 ms (the service folds
at most 200 steps a second, however fast the machine), and 24 streams each send
20 steps a second, so a step waits about 24 x 5 ms for its turn, past a 20 ms
target, and the loop comes round to its lag probe tens of milliseconds late. Each
mechanism is tested with the other off."""

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
from avest.grpc import pacing
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
    live = open_server(steps_per_turn=2, shed_after_ms=20, pace_after_ms=0)
    pid = register_named(live.stub, "shed", K, refit_interval=50)
    yield live, pid


def _wait(cond, timeout: float = 60.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_an_overloaded_service_holds_back_streams_that_press_and_loses_nothing(
    overloaded,  # noqa: ANN001
) -> None:
    live, pid = overloaded
    rng = np.random.default_rng(0)
    light_pid = register_named(live.stub, "light", K, refit_interval=50)
    light = Forwarder(live.grpc_address, light_pid, worker_id="light", k=K).start()
    busy = Forwarder(live.grpc_address, pid, worker_id="busy", k=K).start()
    busy_steps = 100
    try:
        with _Floods(live.grpc_address, pid, FLOOD_S) as floods:
            # The floods build a standing line: the service sheds (the overloaded
            # gauge is 1 only until the held-back streams have shortened the line).
            assert _wait(lambda: value(scrape(live), "avest_shed_turns_total") > 0)
            # A worker with a backlog joins them.
            for _ in range(busy_steps):
                busy.submit(rng.uniform(-3, 3, (2, K)), np.full(2, K), rng.integers(0, K + 1, 2))
            # The light worker: one step, then its acknowledgement, ten times.
            for i in range(10):
                light.submit(rng.uniform(-3, 3, (1, K)), [K], [i % (K + 1)])
                assert light.flush(timeout=60), light.last_error
        # The floods are gone: the line empties and the service is no longer overloaded.
        assert _wait(lambda: value(scrape(live), "avest_overloaded") == 0.0)
        assert busy.flush(timeout=120), busy.last_error
        busy_reconnects = busy.stats.reconnects
    finally:
        light.close()
        busy.close()
    # Held back, never refused: every flood stream ran to its end, the busy worker's
    # stream was never ended, and all of its steps and the light worker's were applied.
    assert floods.ends == ["OK"] * FLOODS
    assert busy_reconnects == 0
    workers = live.http.get(f"/v1/pairs/{pid}/workers").json()["workers"]
    assert next(w for w in workers if w["worker_id"] == "busy")["steps"] == busy_steps
    light_pair = live.stub.GetPair(pb.GetPairRequest(pair_id=light_pid)).pair
    assert light_pair.steps_observed == 10
    samples = scrape(live)
    assert value(samples, "avest_refused_batches_total", method="Observe", reason="other") == 0


def test_without_a_target_nothing_is_shed(open_server, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    _slow_folds(monkeypatch)
    live = open_server(steps_per_turn=2, shed_after_ms=0, pace_after_ms=0)
    pid = register_named(live.stub, "shed", K, refit_interval=50)
    with _Floods(live.grpc_address, pid, 3.0) as floods:
        pass
    assert floods.ends == ["OK"] * FLOODS
    samples = scrape(live)
    assert value(samples, "avest_shed_turns_total") == 0
    assert value(samples, "avest_overloaded") == 0
    assert value(samples, "avest_paced_steps_total") == 0
    assert value(samples, "avest_stream_step_cap") == 0


def test_a_crowd_on_a_saturated_loop_is_paced_and_loses_nothing(
    open_server,  # noqa: ANN001
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Turns' shedding off: the loop lags, each flood stream is held to a cap of
    steps per second and stays open, nothing is refused, and the light worker's
    steps are all applied and acknowledged. The floods are then killed: a paced
    stream drains its client's backlog at the cap, which would take minutes."""
    _slow_folds(monkeypatch)
    # The folds sleep, so the loop's thread is off the CPU while the loop lags: the
    # guard against a machine's lag (tested in test_pacing) is set aside here.
    monkeypatch.setattr(pacing, "BUSY", 0.0)
    live = open_server(steps_per_turn=8, shed_after_ms=0, pace_after_ms=5)
    pid = register_named(live.stub, "paced", K, refit_interval=50)
    light_pid = register_named(live.stub, "light", K, refit_interval=50)
    light = Forwarder(live.grpc_address, light_pid, worker_id="light", k=K).start()
    rng = np.random.default_rng(1)
    seen: list[dict[str, float]] = []

    def paced() -> bool:
        samples = scrape(live)
        seen.append(
            {
                "cap": value(samples, "avest_stream_step_cap"),
                "paced": value(samples, "avest_paced_steps_total"),
                "open": value(samples, "avest_open_streams"),
            }
        )
        return seen[-1]["cap"] > 0 and seen[-1]["paced"] > 0 and seen[-1]["open"] >= FLOODS

    try:
        with _Floods(live.grpc_address, pid, FLOOD_S * 6) as floods:
            assert _wait(paced), seen[-3:]
            # The cap is a share of what the streams sent: below 20 steps a second each.
            assert 0 < seen[-1]["cap"] < 20, seen[-1]
            for i in range(3):
                light.submit(rng.uniform(-3, 3, (1, K)), [K], [i % (K + 1)])
                assert light.flush(timeout=60), light.last_error
            # Held, not ended: paced all this time, every flood stream is still open.
            assert paced(), seen[-1]
            floods.kill()
    finally:
        light.close()
    samples = scrape(live)
    assert value(samples, "avest_shed_turns_total") == 0
    assert live.stub.GetPair(pb.GetPairRequest(pair_id=light_pid)).pair.steps_observed == 3
    assert value(samples, "avest_refused_batches_total", method="Observe", reason="other") == 0
