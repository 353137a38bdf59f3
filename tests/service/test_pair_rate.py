"""The per-pair rate: calls and steps naming one pair, from every client together."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from avest_wire.v1 import estimator_pb2 as pb
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc
from tests.support.rpc import observe_request, register_named
from tests.support.server import ADMIN

pytestmark = pytest.mark.slow

K = 4
RATE = 40.0


def _register(stub: pb_grpc.EstimatorServiceStub, name: str) -> str:
    return register_named(stub, name, K)


def _step(pid: str, worker: str, seq: int) -> pb.ObserveRequest:
    return observe_request(pid, worker, seq, np.zeros((2, K)), [K, K], [1, 2])


def test_many_clients_hammering_one_pair_are_bounded(start_server, tmp_path) -> None:  # noqa: ANN001
    # The per-address limit is off: only the pair's own rate stands in the way.
    handle = start_server(tmp_path / "data", rpc_rate=0.0, pair_rate=RATE)
    channels = [grpc.insecure_channel(handle.grpc_address) for _ in range(8)]
    try:
        stubs = [pb_grpc.EstimatorServiceStub(c) for c in channels]
        hot, quiet = _register(stubs[0], "hot"), _register(stubs[0], "quiet")
        codes: list[grpc.StatusCode] = []
        t0 = time.monotonic()
        for i in range(240):
            try:
                stubs[i % len(stubs)].GetCoefficients(
                    pb.GetCoefficientsRequest(pair_id=hot), timeout=10
                )
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())
                assert "calls per second for pair" in (exc.details() or "")
        elapsed = time.monotonic() - t0
        assert set(codes) == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
        # A burst of one second's worth, then the rate: however many clients.
        assert codes.count(grpc.StatusCode.OK) <= RATE + RATE * elapsed + 1
        # Deleting the hammered pair is never refused for its rate.
        stubs[0].DeletePair(pb.DeletePairRequest(pair_id=hot), metadata=ADMIN, timeout=10)
        # Another pair is untouched by the hot one's limit.
        stubs[1].GetCoefficients(pb.GetCoefficientsRequest(pair_id=quiet), timeout=10)

        # Observe messages are not counted against the rate: a stream faster than the
        # pair's owner waits for room in its queue (backpressure), and is not refused.
        acks = list(
            stubs[2].Observe(iter([_step(quiet, "w", s) for s in range(1, 201)]), timeout=60)
        )
        assert acks[-1].ack.acked_sequence == 200
        assert stubs[0].GetPair(pb.GetPairRequest(pair_id=quiet)).pair.steps_observed == 200
    finally:
        for c in channels:
            c.close()


def test_the_pair_rate_is_off_at_zero(start_server, tmp_path) -> None:  # noqa: ANN001
    handle = start_server(tmp_path / "data", rpc_rate=0.0, pair_rate=0.0)
    with grpc.insecure_channel(handle.grpc_address) as channel:
        stub = pb_grpc.EstimatorServiceStub(channel)
        pid = _register(stub, "free")
        for _ in range(300):
            stub.GetCoefficients(pb.GetCoefficientsRequest(pair_id=pid), timeout=10)
