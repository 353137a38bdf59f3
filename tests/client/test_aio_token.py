"""The asyncio client carries its token on every kind of call, streams included.

Against a real server that requires a worker token: before the fix the token
went out on unary calls only (``grpc.aio`` files an interceptor under the first
call kind it implements), so every asyncio stream, and with it ``avest
replay``, was refused with UNAUTHENTICATED.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest

from avest.commands.cli import main
from avest.offline.trace import write_trace
from avest_client.aio import AsyncEstimatorClient
from avest_client.credentials import Credentials, aio_channel
from avest_wire.v1 import estimator_pb2 as pb
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc
from tests.support.rpc import messages_for
from tests.support.traces import make_synthetic_trace

WORKER = "worker-token-aio"
ADMIN = "admin-token-aio"
K = 3


@pytest.fixture
def guarded(start_server, tmp_path):  # noqa: ANN001, ANN201
    return start_server(tmp_path / "data", worker_token=WORKER, admin_token=ADMIN, refit_interval=5)


def observe_request(pair_id: str, worker_id: str) -> pb.ObserveRequest:
    """One step of a synthetic trace, as ``avest replay`` sends it."""
    trace = make_synthetic_trace(steps=1, requests=2, k=K)
    return messages_for(trace, pair_id, 0, 1, worker_id, 1)[0]


async def stream_unary_status(channel: grpc.aio.Channel, requests: Any) -> grpc.StatusCode:
    """The status of Observe called as a stream-unary method (raw bytes both ways)."""
    call = channel.stream_unary("/avest.v1.EstimatorService/Observe")
    try:
        await call(requests, timeout=10)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def test_every_asyncio_call_kind_carries_the_token(guarded) -> None:  # noqa: ANN001
    address = guarded.grpc_address
    async with AsyncEstimatorClient(address, timeout=10, token=WORKER) as client:
        reg = await client.register("t", "d", "eagle", K)  # unary-unary
        # unary-stream: the first version of the pair's coefficients.
        watch = client.watch(reg.pair_id, timeout=10)
        first = await watch.__anext__()
        watch.cancel()
        assert first.version >= 0

    async with aio_channel(address, (), Credentials(token=WORKER)) as channel:
        stub = pb_grpc.EstimatorServiceStub(channel)

        # stream-stream: a step goes in and is acknowledged.
        async def one_step():  # noqa: ANN202
            yield observe_request(reg.pair_id, "aio-token-worker")

        acked = 0
        async for resp in stub.Observe(one_step(), timeout=10):
            if resp.HasField("ack"):
                acked = max(acked, resp.ack.acked_sequence)
                break
        assert acked == 1

        # stream-unary (no such RPC in the service: Observe called that way,
        # with no requests): whatever the outcome, the access check passed.
        async def nothing():  # noqa: ANN202
            return
            yield

        assert await stream_unary_status(channel, nothing()) != grpc.StatusCode.UNAUTHENTICATED

    # The same stream without the token is refused: the server does check.
    async with aio_channel(address, (), Credentials()) as channel:
        assert await stream_unary_status(channel, nothing()) == grpc.StatusCode.UNAUTHENTICATED


def test_avest_replay_with_a_worker_token(guarded, tmp_path, monkeypatch, capsys) -> None:  # noqa: ANN001
    path = tmp_path / "small.npz"
    write_trace(path, make_synthetic_trace(steps=12, requests=4, k=K))
    monkeypatch.setenv("AVEST_TOKEN", WORKER)
    args = ["replay", str(path), "--address", guarded.grpc_address, "--workers", "2", "--json"]
    assert main([*args, "--retry-s", "5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["messages"] == 24
    assert out["steps_observed"] == 24  # one step per worker message
    assert out["drafts_observed"] > 0
