"""Bytes that are not protobuf: INVALID_ARGUMENT, counted, logged once per interval."""

from __future__ import annotations

import logging

import grpc
import httpx
import pytest

from avest_wire.v1 import estimator_pb2 as pb
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc

#: Not a valid protobuf: a field with wire type 7 (there is none).
GARBAGE = b"\x0f\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"


def raw(channel: grpc.Channel, method: str, streaming: bool = False):  # noqa: ANN201
    path = f"/avest.v1.EstimatorService/{method}"
    if streaming:
        return channel.stream_stream(path, request_serializer=None, response_deserializer=None)
    return channel.unary_unary(path, request_serializer=None, response_deserializer=None)


def refused(server) -> float:  # noqa: ANN001
    text = httpx.get(server.http_url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("avest_refused_batches_total{") and 'reason="malformed"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_garbage_on_observe_ends_the_stream_with_invalid_argument(server) -> None:  # noqa: ANN001
    # Found: the stream ended with status OK, nothing logged or counted.
    with grpc.insecure_channel(server.grpc_address) as channel:
        observe = raw(channel, "Observe", streaming=True)
        with pytest.raises(grpc.RpcError) as err:
            list(observe(iter([GARBAGE]), timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed" in err.value.details()
        # Still serving.
        stub = pb_grpc.EstimatorServiceStub(channel)
        assert list(stub.ListPairs(pb.ListPairsRequest(), timeout=5).pairs) == []
    assert refused(server) == 1


def test_garbage_on_unary_calls_is_refused_and_logged_once(
    server,
    caplog: pytest.LogCaptureFixture,  # noqa: ANN001
) -> None:
    # Found: every bad unary message logged a full traceback (7 MB in 10 s).
    caplog.set_level(logging.INFO)
    with grpc.insecure_channel(server.grpc_address) as channel:
        for method in ("RegisterPair", "Score", "GetPair") * 100:
            with pytest.raises(grpc.RpcError) as err:
                raw(channel, method)(GARBAGE, timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused(server) == 300
    server_logs = [r for r in caplog.records if r.name.startswith(("avest", "grpc"))]
    assert len(server_logs) <= 5, [r.getMessage() for r in server_logs]
    assert not any(r.exc_info for r in server_logs)
