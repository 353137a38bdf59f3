"""Heavy steps are folded off the event loop: health and coefficients answer
while one is being folded, and the result is the same as folding on the loop."""

from __future__ import annotations

import contextlib
import queue
import threading
from types import SimpleNamespace
from typing import Any

import grpc
import httpx
import numpy as np
import pytest

from avest.core.estimator import Batch, OnlineEstimator
from avest_wire.v1 import estimator_pb2 as pb
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc
from tests.support.rpc import random_step, register_named

K = 8
HEAVY_ROWS = 2048  # 16,384 cells: heavy at fold_thread_cells=16384


def _register(stub: pb_grpc.EstimatorServiceStub, name: str = "t") -> str:
    return register_named(stub, name, K, refit_interval=3)


def _step(pid: str, worker: str, seq: int, rows: int) -> pb.ObserveRequest:
    return random_step(pid, worker, seq, rows, K, seed=seq * 1000 + rows)


def _next_ack(acks) -> int:  # noqa: ANN001
    for resp in acks:
        if resp.HasField("ack"):
            return int(resp.ack.acked_sequence)
    raise AssertionError("the stream ended without an acknowledgement")


@contextlib.contextmanager
def _heavy_step_held(start_server, data, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN001, ANN202
    """A server folding heavy steps on threads, one pair, a stream that sent a light step
    (acknowledged) and then a heavy one whose fold is held: yields while it is held, until
    ``held.release`` is set (or 20 s pass, so a service folding on its loop fails instead
    of hanging). ``held.calls``: the pair's steps when each heavy fold began."""
    release, folding = threading.Event(), threading.Event()
    apply = OnlineEstimator.apply
    calls: list[int] = []

    def held_apply(self: OnlineEstimator, batch: Batch, *args: Any):  # noqa: ANN202
        if batch.features.shape[0] == HEAVY_ROWS:
            calls.append(self.steps)
            folding.set()
            release.wait(20)
        return apply(self, batch, *args)

    monkeypatch.setattr(OnlineEstimator, "apply", held_apply)
    handle = start_server(data, fold_thread_cells=HEAVY_ROWS * K)
    with grpc.insecure_channel(handle.grpc_address) as channel:
        stub = pb_grpc.EstimatorServiceStub(channel)
        pid = _register(stub)
        sends: queue.Queue[pb.ObserveRequest | None] = queue.Queue()
        acks = stub.Observe(iter(sends.get, None), timeout=60)
        sends.put(_step(pid, "w", 1, 4))
        assert _next_ack(acks) == 1
        sends.put(_step(pid, "w", 2, HEAVY_ROWS))
        assert folding.wait(20)
        yield SimpleNamespace(
            handle=handle, stub=stub, pid=pid, sends=sends, acks=acks, release=release, calls=calls
        )


def test_health_and_coefficients_answer_while_a_heavy_step_is_folded(
    start_server, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:  # noqa: ANN001
    with _heavy_step_held(start_server, tmp_path / "data", monkeypatch) as h:
        try:
            # While the heavy step is being folded:
            coefficients = h.stub.GetCoefficients(
                pb.GetCoefficientsRequest(pair_id=h.pid), timeout=10
            )
            healthz = httpx.get(h.handle.http_url + "/healthz", timeout=10)
            pair = h.stub.GetPair(pb.GetPairRequest(pair_id=h.pid), timeout=10).pair
            still_folding = not h.release.is_set()
        finally:
            h.release.set()
        assert still_folding
        assert healthz.status_code == 200
        assert coefficients.coefficients.version >= 1
        assert pair.steps_observed == 1  # the pair as it was before the step, not halfway
        assert _next_ack(h.acks) == 2
        h.sends.put(None)
        list(h.acks)
        assert h.stub.GetPair(pb.GetPairRequest(pair_id=h.pid)).pair.steps_observed == 2


def _run(start_server, data, cells: int) -> pb.Pair:  # noqa: ANN001
    handle = start_server(data, fold_thread_cells=cells)
    with grpc.insecure_channel(handle.grpc_address) as channel:
        stub = pb_grpc.EstimatorServiceStub(channel)
        pid = _register(stub)
        # Two workers on two streams, heavy and light steps mixed: refits in between.
        one = [_step(pid, "a", s, HEAVY_ROWS if s % 2 else 16) for s in range(1, 9)]
        two = [_step(pid, "b", s, 16 if s % 2 else HEAVY_ROWS) for s in range(1, 9)]
        results: list[list[pb.ObserveResponse]] = []
        threads = [
            threading.Thread(target=lambda m=m: results.append(list(stub.Observe(iter(m)))))
            for m in (one, two)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        pair = stub.GetPair(pb.GetPairRequest(pair_id=pid)).pair
    handle.stop()
    return pair


def test_steps_folded_on_threads_count_once_each(start_server, tmp_path) -> None:  # noqa: ANN001
    threaded = _run(start_server, tmp_path / "a", HEAVY_ROWS * K)
    on_loop = _run(start_server, tmp_path / "b", 0)
    assert threaded.steps_observed == on_loop.steps_observed == 16
    assert threaded.drafts_observed == on_loop.drafts_observed
    assert threaded.coefficients.round == on_loop.coefficients.round
    assert threaded.calibration.count == on_loop.calibration.count
    assert np.isfinite(threaded.coefficients.slope)


def test_a_pair_reset_while_its_heavy_step_is_folded_folds_it_again(
    start_server, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:  # noqa: ANN001
    with _heavy_step_held(start_server, tmp_path / "data", monkeypatch) as h:
        try:
            reset = httpx.post(
                f"{h.handle.http_url}/v1/pairs/{h.pid}/reset",
                headers={"Authorization": f"Bearer {h.handle.settings.admin_token}"},
                timeout=10,
            )
        finally:
            h.release.set()
        assert reset.status_code == 200, reset.text
        assert _next_ack(h.acks) == 2
        h.sends.put(None)
        list(h.acks)
        pair = h.stub.GetPair(pb.GetPairRequest(pair_id=h.pid)).pair
    # Folded on a copy from before the reset (1 step), then again on the reset pair
    # (0 steps): the step counts once, on what the pair is now.
    assert h.calls == [1, 0]
    assert pair.steps_observed == 1
