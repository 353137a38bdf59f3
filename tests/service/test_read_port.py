"""The read port (``--read-address``): GetCoefficients, Score and Budget on a
synchronous gRPC server.

It answers from each pair as last published, on threads of its own, so a caller gets
coefficients, confidences and budgets while the service loop is busy; it follows refits
and deletions, answers as the main port does, and refuses what the main port refuses,
with the same codes and messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from avest.server import BindError
from avest_client import AsyncEstimatorClient, AvestError, Credentials, EstimatorClient
from avest_wire import matrix as wire
from avest_wire.v1 import estimator_pb2 as pb
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc
from tests.support.helpers import held_loop
from tests.support.rpc import observe_request
from tests.support.server import launch

K = 5
WORKER = "worker-token-read"
ADMIN = "admin-token-read"


def _register(stub: pb_grpc.EstimatorServiceStub, **md: Any) -> str:
    key = pb.PairKey(target_model="t", draft_model="d", method="eagle", num_speculative_tokens=K)
    return str(stub.RegisterPair(pb.RegisterPairRequest(key=key), timeout=10, **md).pair_id)


def _get(stub: pb_grpc.EstimatorServiceStub, pair_id: str, **kw: Any) -> pb.Coefficients:
    return stub.GetCoefficients(
        pb.GetCoefficientsRequest(pair_id=pair_id), timeout=kw.pop("timeout", 10), **kw
    ).coefficients


@contextlib.contextmanager
def _both_ports(
    start_server: Callable[..., Any], tmp_path: Path, **overrides: Any
) -> Iterator[Any]:
    """A server with a read port, and a stub on each of its ports: handle, main, read."""
    handle = start_server(tmp_path / "data", read_address="127.0.0.1:0", **overrides)
    with (
        grpc.insecure_channel(handle.grpc_address) as main,
        grpc.insecure_channel(handle.server.read_address) as read,
    ):
        yield handle, pb_grpc.EstimatorServiceStub(main), pb_grpc.EstimatorServiceStub(read)


@pytest.fixture
def ports(start_server: Callable[..., Any], tmp_path: Path) -> Iterator[Any]:
    with _both_ports(start_server, tmp_path, refit_interval=8) as both:
        yield both


def test_the_read_port_serves_the_pairs_coefficients_and_follows_refits(ports: Any) -> None:
    handle, main, read = ports
    pair_id = _register(main)
    assert _get(read, pair_id) == _get(main, pair_id)
    # Steps that refit the pair: the read port serves the new version.
    rows = 8
    for seq in range(1, 6):
        feats = np.full((rows, K), 1.5)
        req = observe_request(pair_id, "w", seq, feats, [K] * rows, [2] * rows)
        responses = main.Observe(iter([req]), timeout=10)
        for _ in responses:
            pass
    refitted = _get(main, pair_id)
    assert refitted.version > 0
    served = _get(read, pair_id)
    assert served == refitted
    # The client, pointed at the read port, reads the same coefficients.
    with EstimatorClient(handle.server.read_address, timeout=10) as client:
        c = client.coefficients(pair_id)
    assert c.version == refitted.version
    assert c.slope == pytest.approx(refitted.slope)
    # Only GetCoefficients, Score, Budget and health are served there.
    with pytest.raises(grpc.RpcError) as info:
        read.ListPairs(pb.ListPairsRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(handle.server.read_address))
    got = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert got.status == health_pb2.HealthCheckResponse.SERVING


def test_update_time_is_the_refits_on_both_ports_not_the_last_observation(
    start_server: Callable[..., Any], tmp_path: Path
) -> None:
    """The contract: ``update_time`` is when the refit or reset that produced the version
    happened. A step that does not refit leaves it where it was, on either port."""
    with _both_ports(start_server, tmp_path, refit_interval=1000) as (handle, main, read):
        pair_id = _register(main)
        before = _get(main, pair_id)
        feats = np.full((4, K), 1.5)
        req = observe_request(pair_id, "w", 1, feats, [K] * 4, [2] * 4)
        for _ in main.Observe(iter([req]), timeout=10):
            pass
        after = _get(main, pair_id)
        assert (after.version, after.round) == (0, 0)  # not refitted
        assert after.update_time == before.update_time
        assert _get(read, pair_id).update_time == before.update_time
    # The pair itself was observed after that time (what the main port served before).
    observed = handle.server.app.registry.pairs[pair_id].updated
    assert observed > before.update_time.ToNanoseconds() / 1e9


def test_the_read_port_refuses_as_the_main_port_does_and_counts_it(ports: Any) -> None:
    handle, main, read = ports
    for stub_request, code in (
        (pb.GetCoefficientsRequest(pair_id="nope"), grpc.StatusCode.NOT_FOUND),
        (pb.GetCoefficientsRequest(pair_id=""), grpc.StatusCode.INVALID_ARGUMENT),
    ):
        errors = []
        for stub in (main, read):
            with pytest.raises(grpc.RpcError) as info:
                stub.GetCoefficients(stub_request, timeout=10)
            errors.append((info.value.code(), info.value.details()))
        assert errors[0] == errors[1], errors
        assert errors[1][0] == code
    garbage = grpc.insecure_channel(handle.server.read_address).unary_unary(
        "/avest.v1.EstimatorService/GetCoefficients"
    )
    with pytest.raises(grpc.RpcError) as info:
        garbage(b"\xff\xff\xff", timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed message" in (info.value.details() or "")
    text = httpx.get(handle.http_url + "/metrics", timeout=10).text
    line = next(
        ln
        for ln in text.splitlines()
        if ln.startswith("avest_refused_batches_total{")
        and 'method="GetCoefficients"' in ln
        and 'reason="malformed"' in ln
    )
    assert float(line.rsplit(" ", 1)[1]) >= 1


def _costs(pair_id: str) -> pb.SetCostCurvesRequest:
    return pb.SetCostCurvesRequest(
        pair_id=pair_id,
        hardware="gpu",
        draft_curve=[pb.CostPoint(size=s, ms=m) for s, m in ((1, 3.0), (64, 4.0), (512, 12.0))],
        verify_curve=[
            pb.CostPoint(size=s, ms=m) for s, m in ((1, 20.0), (64, 20.0), (2048, 900.0))
        ],
    )


def _refit(main: pb_grpc.EstimatorServiceStub, pair_id: str) -> None:
    rng = np.random.default_rng(7)
    for seq in range(1, 6):
        feats = rng.normal(1.0, 2.0, size=(8, K))
        req = observe_request(pair_id, "w", seq, feats, [K] * 8, rng.integers(0, K + 1, 8))
        for _ in main.Observe(iter([req]), timeout=10):
            pass


def test_score_and_budget_on_the_read_port_answer_as_the_main_port_does(ports: Any) -> None:
    handle, main, read = ports
    pair_id = _register(main)
    _refit(main, pair_id)
    main.SetCostCurves(_costs(pair_id), timeout=10)
    assert _get(read, pair_id).version == _get(main, pair_id).version > 0
    feats, rows, k = wire.encode(np.random.default_rng(3).normal(0.5, 2.0, size=(6, K)))
    score = pb.ScoreRequest(pair_id=pair_id, features=feats, rows=rows, k=k)
    scored = [stub.Score(score, timeout=10) for stub in (main, read)]
    assert scored[0] == scored[1] and scored[0].coefficients_version > 0
    for extra in (
        {"features": feats},
        {"confidences": scored[0].confidences},
        {"confidences": scored[0].confidences, "stale_confidences": scored[0].confidences},
    ):
        budget = pb.BudgetRequest(
            pair_id=pair_id, rows=rows, k=k, scheduled_drafts=[K] * rows, hardware="gpu", **extra
        )
        got = [stub.Budget(budget, timeout=10) for stub in (main, read)]
        assert got[0] == got[1], extra
        assert got[0].cost_ms > 0
    # Refused alike: K, an unknown hardware, too many rows, an unknown pair.
    wrong_k = pb.ScoreRequest(pair_id=pair_id, features=feats[: 4 * rows], rows=rows, k=K - 1)
    no_costs = pb.BudgetRequest(
        pair_id=pair_id, rows=rows, k=k, confidences=scored[0].confidences,
        scheduled_drafts=[K] * rows, hardware="tpu",
    )  # fmt: skip
    too_many = pb.ScoreRequest(pair_id=pair_id, rows=handle.settings.max_rows + 1, k=K)
    unknown = pb.ScoreRequest(pair_id="nope", features=feats, rows=rows, k=k)
    for method, request, code in (
        ("Score", wrong_k, grpc.StatusCode.INVALID_ARGUMENT),
        ("Budget", no_costs, grpc.StatusCode.FAILED_PRECONDITION),
        ("Score", too_many, grpc.StatusCode.RESOURCE_EXHAUSTED),
        ("Score", unknown, grpc.StatusCode.NOT_FOUND),
    ):
        errors = []
        for stub in (main, read):
            with pytest.raises(grpc.RpcError) as info:
                getattr(stub, method)(request, timeout=10)
            errors.append((info.value.code(), info.value.details()))
        assert errors[0] == errors[1], (method, errors)
        assert errors[1][0] == code, (method, errors)


def _until_refused(call: Callable[[], Any]) -> tuple[list[grpc.StatusCode], str]:
    """Call until RESOURCE_EXHAUSTED (at most 200 calls): the codes, and its message."""
    codes: list[grpc.StatusCode] = []
    while len(codes) < 200:
        try:
            call()
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            codes.append(exc.code())
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return codes, exc.details() or ""
    return codes, ""


def test_score_and_budget_on_the_read_port_keep_the_pair_rate(
    start_server: Callable[..., Any], tmp_path: Path
) -> None:
    """``--pair-rate`` holds on the read port too, with buckets of its own."""
    with _both_ports(start_server, tmp_path, pair_rate=1.0) as (_, main, read):
        pair_id = _register(main)
        feats, rows, k = wire.encode(np.ones((2, K)))
        score = pb.ScoreRequest(pair_id=pair_id, features=feats, rows=rows, k=k)
        codes, details = _until_refused(lambda: read.Score(score, timeout=10))
        assert codes[0] == grpc.StatusCode.OK and codes[-1] == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert set(codes[:-1]) == {grpc.StatusCode.OK}
        assert f"calls per second for pair {pair_id}" in details
        # GetCoefficients is a lookup: not rated there.
        for _ in range(8):
            _get(read, pair_id)


def test_the_read_port_follows_a_refresh_that_keeps_the_version(ports: Any) -> None:
    """A replica's refresh can bring the same version with another round (a refit the
    refitter rejected): the pair is published again, and the read port says so."""
    handle, main, read = ports
    pair_id = _register(main)
    before = _get(read, pair_id)
    app = handle.server.app

    async def refresh(round_: int) -> None:
        pair = app.registry.pairs[pair_id]
        record = app.registry.snapshot(pair)
        counters = record["arrays"]["counters"].copy()
        counters[1] = round_  # [version, round, steps, steps in round, drafts]
        record["arrays"]["counters"] = counters
        app.registry.refresh(pair, record)

    handle.call(refresh, before.round + 3)
    after = _get(read, pair_id)
    assert (after.version, after.round) == (before.version, before.round + 3)
    assert after == _get(main, pair_id)


def test_the_read_port_keeps_the_client_rate(
    start_server: Callable[..., Any], tmp_path: Path
) -> None:
    """``--rpc-rate`` holds on the read port too, per client address, with the main
    port's message."""
    with _both_ports(start_server, tmp_path, rpc_rate=1.0) as (_, main, read):
        pair_id = _register(main)
        codes, details = _until_refused(lambda: _get(read, pair_id))
        assert codes[0] == grpc.StatusCode.OK and codes[-1] == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert set(codes[:-1]) == {grpc.StatusCode.OK}
        assert "calls per second from this client" in details


def test_the_read_port_answers_while_the_service_loop_isheld_loop(ports: Any) -> None:
    handle, main, read = ports
    pair_id = _register(main)
    expected = _get(main, pair_id)
    with held_loop(handle):
        # The main port's handlers run on the held loop: its call cannot finish.
        with pytest.raises(grpc.RpcError) as info:
            _get(main, pair_id, timeout=1.0)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert _get(read, pair_id, timeout=10) == expected
        # Score and Budget there compute from the published model: no loop needed.
        feats, rows, k = wire.encode(np.ones((2, K)))
        scored = read.Score(
            pb.ScoreRequest(pair_id=pair_id, features=feats, rows=rows, k=k), timeout=10
        )
        assert scored.coefficients_version == expected.version
        with pytest.raises(grpc.RpcError) as info:  # no cost curves: refused, not waiting
            read.Budget(
                pb.BudgetRequest(
                    pair_id=pair_id, rows=rows, k=k, features=feats, scheduled_drafts=[K] * 2,
                    hardware="gpu",
                ),
                timeout=10,
            )  # fmt: skip
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_client_given_the_read_address_reads_there_and_writes_to_the_main_port(
    ports: Any,
) -> None:
    handle, _, _ = ports
    main, read = handle.grpc_address, handle.server.read_address
    feats = np.ones((2, K))
    with EstimatorClient(main, read_address=read, timeout=10) as client:
        pair_id = client.register("t", "d", "eagle", K).pair_id
        client.set_cost_curves(
            pair_id, [(1, 3.0), (64, 5.0)], [(1, 20.0), (256, 90.0)], hardware="gpu"
        )
        with held_loop(handle):
            # The loop is held: only the read port can answer these.
            assert client.coefficients(pair_id).pair_id == pair_id
            conf, _ = client.score(pair_id, feats)
            assert conf.shape == (2, K)
            assert (
                client.budget(
                    pair_id, feats, [K, K], 0, 2, hardware="gpu", from_features=True
                ).budget
                >= 0
            )
            with pytest.raises(AvestError) as info:  # everything else goes to the main port
                client.pair(pair_id, timeout=1.0)
            assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED

    async def asynchronous() -> None:
        async with AsyncEstimatorClient(main, read_address=read, timeout=10) as aclient:
            assert (await aclient.coefficients(pair_id)).pair_id == pair_id
            conf, _ = await aclient.score(pair_id, feats)
            assert conf.shape == (2, K)

    with held_loop(handle):
        asyncio.run(asynchronous())


def test_a_deleted_pair_is_gone_from_the_read_port(start_server, tmp_path: Path) -> None:  # noqa: ANN001
    handle = start_server(tmp_path / "data", read_address="127.0.0.1:0", admin_token=ADMIN)
    admin = (("authorization", f"Bearer {ADMIN}"),)
    with (
        grpc.insecure_channel(handle.grpc_address) as m,
        grpc.insecure_channel(handle.server.read_address) as r,
    ):
        main, read = pb_grpc.EstimatorServiceStub(m), pb_grpc.EstimatorServiceStub(r)
        pair_id = _register(main, metadata=admin)
        assert _get(read, pair_id, metadata=admin).pair_id == pair_id
        main.DeletePair(pb.DeletePairRequest(pair_id=pair_id), metadata=admin, timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            _get(read, pair_id, metadata=admin)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_the_read_port_takes_the_same_tokens_and_tls(
    start_server: Callable[..., Any], tmp_path: Path, pki: Path
) -> None:
    handle = start_server(
        tmp_path / "data",
        read_address="127.0.0.1:0",
        worker_token=WORKER,
        admin_token=ADMIN,
        tls_cert=str(pki / "server.crt"),
        tls_key=str(pki / "server.key"),
        tls_client_ca=str(pki / "ca.crt"),
    )
    creds = Credentials(
        token=WORKER,
        tls_ca=str(pki / "ca.crt"),
        tls_cert=str(pki / "client.crt"),
        tls_key=str(pki / "client.key"),
    )
    with EstimatorClient(handle.grpc_address, timeout=10, credentials=creds) as client:
        pair_id = client.register("t", "d", "eagle", K).pair_id
    read = handle.server.read_address
    with EstimatorClient(read, timeout=10, credentials=creds) as client:
        assert client.coefficients(pair_id).pair_id == pair_id
    no_token = Credentials(
        tls_ca=str(pki / "ca.crt"),
        tls_cert=str(pki / "client.crt"),
        tls_key=str(pki / "client.key"),
    )
    with EstimatorClient(read, timeout=10, credentials=no_token) as client:
        with pytest.raises(AvestError) as err:
            client.coefficients(pair_id)
        assert "token is required" in str(err.value)
    with EstimatorClient(read, timeout=3, token=WORKER) as client, pytest.raises(AvestError):
        client.coefficients(pair_id)  # plaintext: the handshake fails


def test_a_taken_read_address_is_one_clear_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(BindError, match=r"read port, --read-address"):
            launch(tmp_path / "data", read_address=address)


def test_a_stopped_server_ends_its_read_port_and_metrics_threads(
    start_server: Callable[..., Any], tmp_path: Path
) -> None:
    """The read port's threads and the metrics render thread end with the server (they
    were left behind, one set per server a test process started)."""
    before = {t.ident for t in threading.enumerate()}
    with _both_ports(start_server, tmp_path) as (handle, main, read):
        pair_id = _register(main)
        assert _get(read, pair_id).pair_id == pair_id
        assert httpx.get(f"{handle.http_url}/metrics", timeout=30).status_code == 200
        ours = [
            t
            for t in threading.enumerate()
            if t.ident not in before and t.name.startswith(("avest-reads", "avest-metrics"))
        ]
        assert {t.name.split("_")[0] for t in ours} == {"avest-reads", "avest-metrics"}
        handle.stop()
    for t in ours:
        t.join(30)
    assert not [t.name for t in ours if t.is_alive()]
