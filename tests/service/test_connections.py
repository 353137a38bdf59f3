"""Connections: idle sockets are closed, a capped listener still answers probes,
and one busy stream does not starve another."""

from __future__ import annotations

import contextlib
import socket
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from avest_wire.v1 import estimator_pb2 as pb
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc
from tests.support.rpc import register_named, zero_step

pytestmark = pytest.mark.slow


def _closed_by_peer(s: socket.socket) -> bool:
    """Whether the service closed it (what it sent before, like HTTP/2 settings, is read)."""
    s.setblocking(False)
    try:
        while s.recv(65536):
            pass
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def _grpc_health(address: str, timeout: float = 1.0) -> bool:
    try:
        with grpc.insecure_channel(address) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout
            )
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False


def _fresh_health(address: str, timeout: float = 2.0) -> bool:
    """The gRPC health check on a connection of its own (channels in one process
    otherwise share a connection to the same address)."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    try:
        with grpc.insecure_channel(address, options=options) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout
            )
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False


def test_idle_sockets_are_closed_and_probes_still_answer(start_server, tmp_path) -> None:  # noqa: ANN001
    # Found: sockets that connect and send nothing were kept forever; enough of
    # them stopped both gRPC and HTTP.
    handle = start_server(
        tmp_path / "data", max_connections=20, handshake_timeout_s=1.0, idle_timeout_s=2.0
    )
    host, hport = handle.grpc_address.rsplit(":", 1)[0], int(handle.http_url.rsplit(":", 1)[1])
    gport = int(handle.grpc_address.rsplit(":", 1)[1])
    idle = []
    for port in (gport, hport):
        for _ in range(60):
            s = socket.create_connection((host, port), timeout=5)
            idle.append(s)
    try:
        # HTTP: a new connection takes the place of an idle one at once.
        t0 = time.monotonic()
        assert httpx.get(handle.http_url + "/healthz", timeout=2).status_code == 200
        http_wait = time.monotonic() - t0
        # gRPC: answered once the idle ones time out (1 s here).
        deadline = time.monotonic() + 10
        while not _grpc_health(handle.grpc_address) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _grpc_health(handle.grpc_address)
        assert http_wait < 1.5
        # Every idle socket was closed by the service.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            open_ = [s for s in idle if not _closed_by_peer(s)]
            if not open_:
                break
            time.sleep(0.2)
        ports = sorted({s.getpeername()[1] for s in open_})
        assert not open_, (
            f"{len(open_)} of {len(idle)} idle sockets still open on {ports}, grpc {gport}"
        )
    finally:
        for s in idle:
            with contextlib.suppress(OSError):
                s.close()


def test_a_busy_stream_does_not_starve_a_light_one(server) -> None:  # noqa: ANN001
    """A stream with thousands of queued steps and a light worker on another pair:
    the light worker's steps are acknowledged while the heavy one is still sending."""
    k, rows = 4, 64
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = pb_grpc.EstimatorServiceStub(channel)

        heavy_pid, light_pid = register_named(stub, "heavy", k), register_named(stub, "light", k)

        def msg(pid: str, worker: str, seq: int) -> pb.ObserveRequest:
            return zero_step(pid, worker, seq, k, rows)

        heavy_total = 20_000
        heavy = stub.Observe(iter(msg(heavy_pid, "heavy", s) for s in range(1, heavy_total + 1)))
        time.sleep(0.3)  # the heavy stream is under way
        t0 = time.monotonic()
        for s in range(1, 6):
            acks = list(stub.Observe(iter([msg(light_pid, "light", s)]), timeout=30))
            assert acks[-1].ack.acked_sequence == s
        light_s = time.monotonic() - t0
        heavy_done = stub.GetPair(pb.GetPairRequest(pair_id=heavy_pid)).pair.steps_observed
        heavy.cancel()
    # The light worker finished while the heavy stream still had steps to send.
    assert heavy_done < heavy_total, (heavy_done, light_s)


def test_at_the_cap_silent_sockets_give_way_to_a_client(start_server, tmp_path) -> None:  # noqa: ANN001
    # At the connection cap, sockets that hold places and send nothing are closed
    # by grpcio's own handshake timeout; a new client then gets in, and a client
    # that finished its handshake before keeps working.
    handle = start_server(
        tmp_path / "data", max_connections=16, handshake_timeout_s=2.0, idle_timeout_s=300.0
    )
    host, gport = handle.grpc_address.rsplit(":", 1)
    worker = grpc.insecure_channel(handle.grpc_address)
    stub = pb_grpc.EstimatorServiceStub(worker)
    stub.ListPairs(pb.ListPairsRequest(), timeout=10)
    idle = [socket.create_connection((host, int(gport)), timeout=5) for _ in range(30)]
    try:
        answered = False
        deadline = time.monotonic() + 30.0  # the 2 s timeout, with room for a busy machine
        while not answered and time.monotonic() < deadline:
            answered = _fresh_health(handle.grpc_address)
            if not answered:
                time.sleep(0.3)
        assert answered
        closed = sum(_closed_by_peer(s) for s in idle)
        assert closed >= 30 - 16, closed
        stub.ListPairs(pb.ListPairsRequest(), timeout=10)
    finally:
        worker.close()
        for s in idle:
            with contextlib.suppress(OSError):
                s.close()
