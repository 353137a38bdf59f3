"""The gRPC port served from a process of its own (``--grpc-process``): the front
process relays every call to the service's servicer, gate and interceptor, and the
status codes, trailing metadata, cancellations, TLS and flow control come through as
an in-process server gives them."""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from avest.core.estimator import Batch, OnlineEstimator
from avest.grpc.relay import READ_AHEAD, RelayServer
from avest_client import AvestError, Credentials, EstimatorClient
from avest_wire import refusal
from avest_wire.v1 import estimator_pb2 as pb
from tests.support.helpers import held_loop, wait_until
from tests.support.live import register
from tests.support.metrics import scrape
from tests.support.metrics import value as metric_value
from tests.support.rpc import observe_request
from tests.support.serve import serve

K = 5


def _front(live) -> RelayServer:  # noqa: ANN001
    front = live.handle.server._grpc
    assert isinstance(front, RelayServer)
    return front


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped) counts as gone
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_worker_streams_through_the_front_and_the_front_exits_with_the_service(
    open_server,  # noqa: ANN001
) -> None:
    live = open_server(grpc_process=True)
    pid = _front(live).pid
    assert pid is not None and pid != os.getpid() and _alive(pid)
    pair_id = register(live, k=K)
    rng = np.random.default_rng(0)
    with EstimatorClient(live.grpc_address, timeout=10) as client:
        forwarder = client.forwarder(pair_id, worker_id="w0", k=K)
        for _ in range(30):
            forwarder.submit(rng.normal(size=(4, K)).astype(np.float32), [K] * 4, [2] * 4)
        assert forwarder.flush(timeout=20)  # every step acknowledged, through the front
        forwarder.close()
        pair = client.pair(pair_id)
        assert pair.steps_observed == 30
        assert client.coefficients(pair_id).version >= 1  # refitted every 10 steps
    channel_health = health_pb2_grpc.HealthStub(live.channel)
    status = channel_health.Check(
        health_pb2.HealthCheckRequest(service="avest.v1.EstimatorService"), timeout=5
    ).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(live.channel)
    listed = next(
        refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    )
    assert "avest.v1.EstimatorService" in {s.name for s in listed.list_services_response.service}
    live.stop()
    assert not _alive(pid)


def test_refusals_keep_their_codes_details_and_trailing_metadata(open_server) -> None:  # noqa: ANN001
    live = open_server(grpc_process=True, worker_token="w-token")
    meta = (("authorization", "Bearer w-token"),)
    with pytest.raises(grpc.RpcError) as err:
        live.stub.GetCoefficients(pb.GetCoefficientsRequest(pair_id="nope"), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        live.stub.GetCoefficients(
            pb.GetCoefficientsRequest(pair_id="nope"), timeout=5, metadata=meta
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in err.value.details()
    # A step of an unknown pair, in sequence 7: refused with the sequence as data.
    bad = observe_request("nope", "w", 7, np.zeros((1, K), np.float32), [K], [1])
    with pytest.raises(grpc.RpcError) as err:
        list(live.stub.Observe(iter([bad]), timeout=5, metadata=meta))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert refusal.refused_sequence_from(err.value.trailing_metadata()) == 7
    # A message that does not parse.
    raw = live.channel.stream_stream("/avest.v1.EstimatorService/Observe")
    with pytest.raises(grpc.RpcError) as err:
        list(raw(iter([b"\xff\xff\xff"]), timeout=5, metadata=meta))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # A method nobody serves.
    with pytest.raises(grpc.RpcError) as err:
        live.channel.unary_unary("/avest.v1.EstimatorService/Nothing")(b"", timeout=5)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_the_front_answers_get_coefficients_itself_from_what_the_service_published(
    open_server,  # noqa: ANN001
) -> None:
    live = open_server(grpc_process=True, worker_token="w-token", admin_token="a-token")
    meta = (("authorization", "Bearer w-token"),)
    # RegisterPair is relayed; its answer comes after the front's copy has the pair.
    pair_id = live.stub.RegisterPair(
        pb.RegisterPairRequest(
            key=pb.PairKey(
                target_model="t", draft_model="d", method="eagle", num_speculative_tokens=K
            ),
            update_rule=pb.UPDATE_RULE_RECURSIVE,
            refit_interval=10,
        ),
        timeout=10,
        metadata=meta,
    ).pair_id
    get = live.stub.GetCoefficients
    first = get(pb.GetCoefficientsRequest(pair_id=pair_id), timeout=10, metadata=meta)
    assert first.coefficients.pair_id == pair_id and first.coefficients.version == 0
    # A refit, through the front: the next answer has its coefficients.
    rng = np.random.default_rng(1)
    with EstimatorClient(
        live.grpc_address, timeout=10, credentials=Credentials(token="w-token")
    ) as client:
        forwarder = client.forwarder(pair_id, worker_id="w0", k=K)
        for _ in range(12):
            forwarder.submit(rng.normal(size=(4, K)).astype(np.float32), [K] * 4, [2] * 4)
        assert forwarder.flush(timeout=20)
        forwarder.close()
    pair = live.handle.server.app.registry.pairs[pair_id]
    assert pair.estimator.version >= 1
    assert wait_until(
        lambda: (
            get(
                pb.GetCoefficientsRequest(pair_id=pair_id), timeout=10, metadata=meta
            ).coefficients.version
            == pair.estimator.version
        )
    )
    with held_loop(live.handle):
        # Nothing runs on the service's loop: only the front can answer these.
        now = get(pb.GetCoefficientsRequest(pair_id=pair_id), timeout=10, metadata=meta)
        assert now.coefficients.version == pair.estimator.version
        assert list(now.coefficients.intercepts) == pytest.approx(
            list(pair.coefficients.intercepts)
        )
        with pytest.raises(grpc.RpcError) as err:
            get(pb.GetCoefficientsRequest(pair_id=pair_id), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            get(pb.GetCoefficientsRequest(pair_id="nope"), timeout=10, metadata=meta)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in err.value.details()
        raw = live.channel.unary_unary("/avest.v1.EstimatorService/GetCoefficients")
        with pytest.raises(grpc.RpcError) as err:
            raw(b"\xff\xff\xff", timeout=10, metadata=meta)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # A relayed call waits for the loop.
        with pytest.raises(grpc.RpcError) as err:
            live.stub.GetPair(pb.GetPairRequest(pair_id=pair_id), timeout=1.0, metadata=meta)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    # Each answer is in the service's RPC metrics and refusals, as the main port's are.
    def counted(code: str) -> float:
        return metric_value(
            scrape(live), "avest_rpc_duration_seconds_count", method="GetCoefficients", code=code
        )

    assert wait_until(lambda: counted("OK") >= 3)
    assert counted("UNAUTHENTICATED") == 1 and counted("NOT_FOUND") == 1
    assert counted("INVALID_ARGUMENT") == 1
    # A pair deleted is gone from the front's copy too.
    deleted = httpx.delete(
        f"{live.http_url}/v1/pairs/{pair_id}",
        timeout=10,
        headers={"authorization": "Bearer a-token"},
    )
    assert deleted.status_code in (200, 204), deleted.text

    def gone() -> bool:
        try:
            get(pb.GetCoefficientsRequest(pair_id=pair_id), timeout=10, metadata=meta)
        except grpc.RpcError as e:
            return e.code() == grpc.StatusCode.NOT_FOUND
        return False

    assert wait_until(gone)


def test_a_stream_the_client_cancels_ends_its_handler(open_server) -> None:  # noqa: ANN001
    live = open_server(grpc_process=True)
    pair_id = register(live, k=K)
    service = live.handle.server.service
    held: queue.Queue[pb.ObserveRequest | None] = queue.Queue()

    def requests() -> Iterator[pb.ObserveRequest]:
        while (item := held.get()) is not None:
            yield item

    call = live.stub.Observe(requests(), timeout=30)
    held.put(pb.ObserveRequest(pair_id=pair_id, worker_id="w", open=True))
    assert next(call).WhichOneof("event") == "opened"
    assert service.open_streams == 1 and (pair_id, "w") in service.owners
    call.cancel()
    held.put(None)
    assert wait_until(lambda: service.open_streams == 0, timeout=10)
    assert (pair_id, "w") not in service.owners  # the worker id is free again


def test_a_full_pair_queue_stops_reading_the_stream(
    open_server,  # noqa: ANN001
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While the pair's owner is behind (every fold takes 5 ms), the service holds at
    most READ_AHEAD of a stream's requests that its handler has not taken; the rest
    waits with the sender, and nothing is lost."""
    apply = OnlineEstimator.apply

    def slow_apply(self: OnlineEstimator, batch: Batch, *args: Any):  # noqa: ANN202
        time.sleep(0.005)
        return apply(self, batch, *args)

    monkeypatch.setattr(OnlineEstimator, "apply", slow_apply)
    live = open_server(grpc_process=True, pair_queue=2)
    pair_id = register(live, k=K)
    front = _front(live)
    steps = 200

    def requests() -> Iterator[pb.ObserveRequest]:
        x = np.zeros((1, K), np.float32)
        for seq in range(1, steps + 1):
            yield observe_request(pair_id, "w", seq, x, [K], [1])

    call = live.stub.Observe(requests(), timeout=60)
    reader = threading.Thread(target=lambda: list(call), daemon=True)
    reader.start()
    held = []
    while reader.is_alive() and len(held) < 200:
        held.append(live.handle.call(_held, front))
        time.sleep(0.005)
    assert max(held) >= 1  # the service did hold some ahead of the handler
    assert max(held) <= READ_AHEAD
    reader.join(30)
    assert not reader.is_alive()
    assert wait_until(
        lambda: live.stub.GetPair(pb.GetPairRequest(pair_id=pair_id)).pair.steps_observed == steps,
        timeout=30,
    )


async def _held(front: RelayServer) -> int:
    """Requests the service holds that no handler has taken yet."""
    return sum(len(c.requests.queue) for c in front.host.calls.values())


def test_tls_through_the_front(start_server, tmp_path, pki: Path) -> None:  # noqa: ANN001
    handle = start_server(
        tmp_path / "data",
        grpc_process=True,
        tls_cert=str(pki / "server.crt"),
        tls_key=str(pki / "server.key"),
        tls_client_ca=str(pki / "ca.crt"),
    )
    with (
        EstimatorClient(handle.grpc_address, timeout=3, tls_ca=str(pki / "ca.crt")) as client,
        pytest.raises(AvestError),  # no client certificate: no handshake
    ):
        client.pairs()
    creds = Credentials(
        tls_ca=str(pki / "ca.crt"),
        tls_cert=str(pki / "client.crt"),
        tls_key=str(pki / "client.key"),
    )
    with EstimatorClient(handle.grpc_address, timeout=5, credentials=creds) as client:
        reg = client.register("t", "d", "eagle", K)
        assert [p.pair_id for p in client.pairs()] == [reg.pair_id]


def test_the_service_stops_when_its_front_dies(open_server) -> None:  # noqa: ANN001
    live = open_server(grpc_process=True)
    pid = _front(live).pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: live.handle.server._stopped.is_set(), timeout=15)
    assert live.handle.server.failed


def test_avest_serve_exits_with_an_error_when_its_front_dies(tmp_path: Path) -> None:
    served = serve(tmp_path / "data", "--grpc-process")
    try:
        children = Path(f"/proc/{served.proc.pid}/task/{served.proc.pid}/children")
        front = int(children.read_text().split()[0])
        os.kill(front, signal.SIGKILL)
        assert served.proc.wait(timeout=30) == 1
        assert "the gRPC front process exited" in served.output()
    finally:
        served.stop()
