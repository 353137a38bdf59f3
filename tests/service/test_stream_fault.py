"""A fault of the service inside an Observe stream ends it with INTERNAL and a log
line with the traceback, not with OK as if the service had closed it; the step
is not acknowledged, and a client resends it on its next stream."""

from __future__ import annotations

import logging

import grpc
import pytest

from avest.state.pairs import Pair
from avest_wire.v1 import estimator_pb2 as pb
from tests.support.rpc import random_step, register_named


def test_a_fault_while_applying_a_step_ends_the_stream_with_internal(
    live, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:  # noqa: ANN001
    pid = register_named(live.stub, "fault", 4, refit_interval=10)
    observe = Pair.observe

    def failing(self: Pair, worker: str, seq: int, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if seq == 2:
            raise RuntimeError("a bug")
        return observe(self, worker, seq, *args, **kwargs)

    monkeypatch.setattr(Pair, "observe", failing)
    steps = [random_step(pid, "w", s, 2, 4, seed=s) for s in (1, 2, 3)]
    with (
        caplog.at_level(logging.ERROR, logger="avest.grpc"),
        pytest.raises(grpc.RpcError) as err,
    ):
        list(live.stub.Observe(iter(steps), timeout=30))
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "resend" in err.value.details()
    assert any("RuntimeError: a bug" in (r.exc_text or "") for r in caplog.records)
    # The step before the fault was applied; the faulty one and the one after were not.
    assert live.stub.GetPair(pb.GetPairRequest(pair_id=pid)).pair.steps_observed == 1
    # Resent once the fault is gone, they are applied.
    monkeypatch.setattr(Pair, "observe", observe)
    list(live.stub.Observe(iter(steps), timeout=30))
    assert live.stub.GetPair(pb.GetPairRequest(pair_id=pid)).pair.steps_observed == 3
