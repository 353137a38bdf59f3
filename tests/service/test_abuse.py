"""Abuse with valid access: sequence jumps, worker id collisions, call rates, and
the contract's size limits. Each refusal leaves the state untouched."""

from __future__ import annotations

import queue
import threading

import grpc
import httpx
import numpy as np
import pytest

from avest_client import AvestError, EstimatorClient
from avest_wire.v1 import estimator_pb2 as pb
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc
from tests.support.rpc import zero_step
from tests.support.server import ADMIN

K = 4


def step(pair_id: str, worker: str, seq: int) -> pb.ObserveRequest:
    return zero_step(pair_id, worker, seq, K, rows=4)


def register(stub: pb_grpc.EstimatorServiceStub, **key: object) -> str:
    fields: dict[str, object] = dict(
        target_model="t", draft_model="d", method="eagle", num_speculative_tokens=K
    )
    fields.update(key)
    return str(
        stub.RegisterPair(pb.RegisterPairRequest(key=pb.PairKey(**fields)), timeout=5).pair_id
    )


def refusal(call, request, **kw):  # noqa: ANN001, ANN003, ANN201
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=10, **kw)
    return err.value.code(), err.value.details()


@pytest.fixture
def stub(server):  # noqa: ANN001, ANN201
    with grpc.insecure_channel(server.grpc_address) as channel:
        yield pb_grpc.EstimatorServiceStub(channel)


def test_a_sequence_far_ahead_of_a_worker_is_refused(stub) -> None:  # noqa: ANN001
    pid = register(stub)
    acks = list(stub.Observe(iter([step(pid, "real", s) for s in (1, 2, 3)]), timeout=10))
    assert acks[-1].ack.acked_sequence == 3
    # The attack: 2^64 - 1 under the real worker's id, so its later steps look old.
    code, details = refusal(
        lambda r, **kw: list(stub.Observe(iter([r]), **kw)), step(pid, "real", 2**64 - 1)
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "sequence" in details
    # The real worker's next step is applied, not dropped as a duplicate.
    list(stub.Observe(iter([step(pid, "real", 4)]), timeout=10))
    pair = stub.GetPair(pb.GetPairRequest(pair_id=pid), timeout=5).pair
    assert pair.steps_observed == 4


def test_a_worker_id_in_use_by_an_open_stream_is_refused(server, stub) -> None:  # noqa: ANN001
    pid = register(stub)
    held: queue.Queue[pb.ObserveRequest | None] = queue.Queue()

    def requests():  # noqa: ANN202
        while (item := held.get()) is not None:
            yield item

    first = stub.Observe(requests(), timeout=30)
    responses: list[pb.ObserveResponse] = []
    reader = threading.Thread(target=lambda: responses.extend(first), daemon=True)
    reader.start()
    held.put(step(pid, "shared", 1))
    # Wait until the first stream holds the id (its step is acknowledged).
    with EstimatorClient(server.grpc_address, timeout=5) as client:
        for _ in range(200):
            if client.pair(pid).steps_observed == 1:
                break
            threading.Event().wait(0.02)
    code, details = refusal(
        lambda r, **kw: list(stub.Observe(iter([r]), **kw)), step(pid, "shared", 2)
    )
    assert code == grpc.StatusCode.ALREADY_EXISTS and "worker id collision" in details
    held.put(None)
    reader.join(10)
    # Nothing of the intruder was applied; once the first stream is gone the id is free.
    assert stub.GetPair(pb.GetPairRequest(pair_id=pid)).pair.steps_observed == 1
    list(stub.Observe(iter([step(pid, "shared", 2)]), timeout=10))
    assert stub.GetPair(pb.GetPairRequest(pair_id=pid)).pair.steps_observed == 2


def test_the_client_reports_a_worker_id_collision(server, stub) -> None:  # noqa: ANN001
    pid = register(stub)
    from avest_client.errors import from_rpc_error

    class Collided(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.ALREADY_EXISTS

        def details(self) -> str:
            return "worker id collision: ..."

    err = from_rpc_error(Collided(), "Observe")
    assert type(err).__name__ == "WorkerIdCollisionError" and isinstance(err, AvestError)
    # Two forwarders with one explicit worker id: the second is told so.
    with EstimatorClient(server.grpc_address, timeout=5) as client:
        x = np.zeros((2, K), dtype=np.float32)
        one = client.forwarder(pid, worker_id="twin", k=K)
        one.submit(x, [K, K], [1, 1])
        assert one.flush(timeout=10)
        two = client.forwarder(pid, worker_id="twin", k=K)
        two.submit(x, [K, K], [1, 1])
        for _ in range(300):
            if two._session.collisions:
                break
            threading.Event().wait(0.02)
        assert two._session.collisions >= 1
        assert "worker id collision" in two._session.last_error
        one.close()
        assert two.flush(timeout=15)  # the id is free again: it goes through


def test_unary_calls_over_the_client_rate_are_refused(start_server, tmp_path) -> None:  # noqa: ANN001
    handle = start_server(tmp_path / "data", rpc_rate=20.0)
    with grpc.insecure_channel(handle.grpc_address) as channel:
        stub = pb_grpc.EstimatorServiceStub(channel)
        codes = []
        for _ in range(60):
            try:
                stub.ListPairs(pb.ListPairsRequest(), timeout=5)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
    assert codes[:10] == [grpc.StatusCode.OK] * 10  # a burst is fine
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}


def test_a_step_with_labels_inconsistent_with_its_counts_is_refused(stub) -> None:  # noqa: ANN001
    pid = register(stub)
    bad = step(pid, "w", 1)
    bad.num_accepted[:] = [K + 1] * bad.rows  # more accepted than verified
    code, details = refusal(lambda r, **kw: list(stub.Observe(iter([r]), **kw)), bad)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "num_accepted" in details
    assert stub.GetPair(pb.GetPairRequest(pair_id=pid)).pair.steps_observed == 0


# -- the contract's limits ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"target_model": "m" * 1_000_000}, "target_model"),
        ({"draft_model": "d" * 300}, "draft_model"),
        ({"method": ""}, "method"),
        ({"method": "x" * 65}, "method"),
        ({"labels": {f"l{i}": "v" for i in range(5000)}}, "labels"),
        ({"labels": {"workload": "v" * 129}}, "labels"),
    ],
)
def test_pair_keys_beyond_the_limits_are_refused(stub, fields, field) -> None:  # noqa: ANN001
    key = dict(target_model="t", draft_model="d", method="eagle", num_speculative_tokens=K)
    key.update(fields)
    code, details = refusal(stub.RegisterPair, pb.RegisterPairRequest(key=pb.PairKey(**key)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field)
    assert len(details) < 200  # the id is not echoed whole
    assert list(stub.ListPairs(pb.ListPairsRequest()).pairs) == []


def test_worker_ids_over_128_bytes_are_refused(stub) -> None:  # noqa: ANN001
    pid = register(stub)
    long_id = "\U0001f600" * 128  # 128 characters, 512 bytes
    code, details = refusal(
        lambda r, **kw: list(stub.Observe(iter([r]), **kw)), step(pid, long_id, 1)
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "worker_id" in details
    assert len(details) < 300
    assert stub.GetPair(pb.GetPairRequest(pair_id=pid)).pair.steps_observed == 0


def test_unknown_pair_ids_are_echoed_short(stub) -> None:  # noqa: ANN001
    code, details = refusal(stub.GetPair, pb.GetPairRequest(pair_id="p" * 100_000))
    assert code == grpc.StatusCode.NOT_FOUND and len(details) < 200


def test_cost_curves_beyond_the_limits_are_refused(stub) -> None:  # noqa: ANN001
    pid = register(stub)

    def curves(points: int = 2, ms: float = 1.0, hardware: str = "") -> pb.SetCostCurvesRequest:
        return pb.SetCostCurvesRequest(
            pair_id=pid,
            hardware=hardware,
            draft_curve=[pb.CostPoint(size=i + 1, ms=ms) for i in range(points)],
            verify_curve=[pb.CostPoint(size=i + 1, ms=ms) for i in range(points)],
        )

    code, details = refusal(stub.SetCostCurves, curves(points=100_000), metadata=ADMIN)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "points" in details
    code, details = refusal(stub.SetCostCurves, curves(ms=1e300), metadata=ADMIN)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "ms" in details
    stored = []
    for i in range(2000):
        try:
            stub.SetCostCurves(curves(hardware=f"gpu-{i}"), timeout=5, metadata=ADMIN)
            stored.append(i)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "hardware" in exc.details()
            break
    assert len(stored) == 16
    # Replacing a known label is still fine at the limit.
    stub.SetCostCurves(curves(hardware="gpu-0", ms=2.0), timeout=5, metadata=ADMIN)
    hw = stub.GetPair(pb.GetPairRequest(pair_id=pid)).pair.cost_curve_hardware
    assert len(hw) == 16


def test_largest_keys_keep_listings_small(server, stub) -> None:  # noqa: ANN001
    # Found: 20 pairs with 1 MB keys made /metrics and /v1/pairs 70 MB and
    # ListPairs failed for everyone. Keys at the limit keep them small.
    for i in range(20):
        register(
            stub,
            target_model=f"{i:03d}" + "t" * 253,
            draft_model="d" * 256,
            method="m" * 64,
            labels={f"{j:02d}" + "k" * 62: "v" * 128 for j in range(16)},
        )
    assert len(stub.ListPairs(pb.ListPairsRequest(), timeout=10).pairs) == 20
    metrics = httpx.get(server.http_url + "/metrics", timeout=10)
    pairs = httpx.get(server.http_url + "/v1/pairs", timeout=10)
    assert len(metrics.content) < 4_000_000 and len(pairs.content) < 1_000_000
