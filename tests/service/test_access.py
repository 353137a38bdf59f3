"""Who may do what: tokens, roles, TLS, exposure, against a live server.

Each test here is a finding of the security review: on the code before
tokens existed, an outsider could read pair ids, stream fake steps and
overwrite cost curves, and admin actions were open when no token was set.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from avest.server import Server
from avest.settings import Settings
from avest_client import AvestError, EstimatorClient
from avest_wire.v1 import estimator_pb2 as pb
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc
from tests.support.rpc import observe_request

WORKER = "worker-token-123"
ADMIN = "admin-token-456"
K = 5


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def key() -> pb.PairKey:
    return pb.PairKey(target_model="t", draft_model="d", method="eagle", num_speculative_tokens=K)


def step(pair_id: str, worker: str, seq: int, accept: int = K) -> pb.ObserveRequest:
    rows = 8
    return observe_request(
        pair_id, worker, seq, np.full((rows, K), -3.0), [K] * rows, [accept] * rows
    )


def coefficients(stub: pb_grpc.EstimatorServiceStub, pair_id: str) -> pb.Coefficients:
    return stub.GetCoefficients(
        pb.GetCoefficientsRequest(pair_id=pair_id), metadata=bearer(WORKER), timeout=5
    ).coefficients


@pytest.fixture
def guarded(start_server, tmp_path):  # noqa: ANN001, ANN201
    handle = start_server(
        tmp_path / "data", worker_token=WORKER, admin_token=ADMIN, refit_interval=5
    )
    with grpc.insecure_channel(handle.grpc_address) as channel:
        yield handle, pb_grpc.EstimatorServiceStub(channel)


def test_an_outsider_without_a_token_cannot_poison_a_pair(guarded) -> None:  # noqa: ANN001
    handle, stub = guarded
    pid = stub.RegisterPair(
        pb.RegisterPairRequest(key=key()), metadata=bearer(WORKER), timeout=5
    ).pair_id
    before = coefficients(stub, pid)

    # No token: nothing to read, nothing to write.
    for call, request in (
        (stub.ListPairs, pb.ListPairsRequest()),
        (stub.GetPair, pb.GetPairRequest(pair_id=pid)),
        (stub.RegisterPair, pb.RegisterPairRequest(key=key())),
    ):
        with pytest.raises(grpc.RpcError) as err:
            call(request, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Observe(iter([step(pid, "w", s) for s in range(1, 200)]), timeout=5))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # A wrong token is no better.
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Observe(iter([step(pid, "w", 1)]), timeout=5, metadata=bearer("guess")))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # Cost curves: no token, nothing written.
    curves = pb.SetCostCurvesRequest(
        pair_id=pid,
        draft_curve=[pb.CostPoint(size=1, ms=1.0)],
        verify_curve=[pb.CostPoint(size=1, ms=1.0)],
    )
    with pytest.raises(grpc.RpcError) as err:
        stub.SetCostCurves(curves, timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    after = coefficients(stub, pid)
    assert (after.version, after.slope, list(after.intercepts)) == (
        before.version,
        before.slope,
        list(before.intercepts),
    )
    info = stub.GetPair(pb.GetPairRequest(pair_id=pid), metadata=bearer(WORKER)).pair
    assert info.steps_observed == 0 and list(info.cost_curve_hardware) == []

    # The tokens do work: the worker streams and adds the curves its hardware
    # measured (again, unchanged, after a reconnect); replacing them with others
    # takes the admin token.
    acks = list(stub.Observe(iter([step(pid, "w", s) for s in (1, 2)]), metadata=bearer(WORKER)))
    assert acks and acks[-1].ack.acked_sequence == 2
    stub.SetCostCurves(curves, timeout=5, metadata=bearer(WORKER))
    stub.SetCostCurves(curves, timeout=5, metadata=bearer(WORKER))
    cheaper = pb.SetCostCurvesRequest(
        pair_id=pid,
        draft_curve=[pb.CostPoint(size=1, ms=1.0)],
        verify_curve=[pb.CostPoint(size=1, ms=100.0)],
    )
    with pytest.raises(grpc.RpcError) as err:
        stub.SetCostCurves(cheaper, timeout=5, metadata=bearer(WORKER))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "needs the admin token" in (err.value.details() or "")
    stub.SetCostCurves(cheaper, timeout=5, metadata=bearer(ADMIN))

    # Counted: refused by reason.
    metrics = httpx.get(handle.http_url + "/metrics").text
    assert 'avest_refused_batches_total{method="ListPairs",reason="unauthenticated"} 1.0' in metrics
    assert (
        'avest_refused_batches_total{method="SetCostCurves",reason="permission_denied"} 1.0'
        in metrics
    )


def test_http_reads_need_a_token_health_and_metrics_do_not(guarded) -> None:  # noqa: ANN001
    handle, stub = guarded
    pid = stub.RegisterPair(
        pb.RegisterPairRequest(key=key()), metadata=bearer(WORKER), timeout=5
    ).pair_id
    with httpx.Client(base_url=handle.http_url, timeout=10) as http:
        assert http.get("/v1/pairs").status_code == 401
        assert (
            http.get(f"/v1/pairs/{pid}", headers={"Authorization": "Bearer x"}).status_code == 401
        )
        r = http.get("/v1/pairs", headers={"Authorization": f"Bearer {WORKER}"})
        assert r.status_code == 200 and [p["id"] for p in r.json()["pairs"]] == [pid]
        assert (
            http.get("/v1/pairs", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
        )
        for path in ("/healthz", "/readyz", "/metrics"):
            assert http.get(path).status_code == 200
            # A scraper that sends a token (ServiceMonitor) is served too.
            assert http.get(path, headers={"Authorization": f"Bearer {WORKER}"}).status_code == 200
        reset = f"/v1/pairs/{pid}/reset"
        r = http.post(reset, headers={"Authorization": f"Bearer {WORKER}"})
        assert r.status_code == 403 and "admin" in r.json()["detail"]
        assert http.post(reset, headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
    with grpc.insecure_channel(handle.grpc_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1


def test_admin_actions_are_refused_when_no_admin_token_is_configured(
    start_server,
    tmp_path,  # noqa: ANN001
) -> None:
    handle = start_server(tmp_path / "data", admin_token="")
    with EstimatorClient(handle.grpc_address, token="anything") as client:
        reg = client.register("t", "d", "eagle", K)
        client.set_cost_curves(reg.pair_id, [(1, 1.0)], [(1, 1.0)])  # the first: a worker's
        with pytest.raises(AvestError, match="needs the admin token") as err:
            client.set_cost_curves(reg.pair_id, [(1, 1.0)], [(1, 2.0)])
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert type(err.value).__name__ == "PermissionDeniedError"
    # Workers stay open on loopback when no worker token is set (released clients).
    with EstimatorClient(handle.grpc_address) as client:
        assert client.register("t", "d", "eagle", K).pair_id == reg.pair_id


def test_the_client_takes_its_token_from_the_environment(
    guarded,
    monkeypatch,  # noqa: ANN001
) -> None:
    handle, _ = guarded
    with EstimatorClient(handle.grpc_address, timeout=5) as client:
        with pytest.raises(AvestError) as err:
            client.pairs()
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    monkeypatch.setenv("AVEST_TOKEN", WORKER)
    with EstimatorClient(handle.grpc_address, timeout=5) as client:
        reg = client.register("t", "d", "eagle", K)
        fwd = client.forwarder(reg.pair_id, worker_id="env-worker", k=K)
        x = np.full((4, K), -2.0, dtype=np.float32)
        for _ in range(3):
            fwd.submit(x, [K] * 4, [1] * 4)
        assert fwd.flush(timeout=10)
        assert client.pair(reg.pair_id).steps_observed == 3


def test_a_public_bind_without_a_worker_token_is_refused(tmp_path: Path) -> None:
    base = dict(data_dir=str(tmp_path), http_address="127.0.0.1:0", admin_token=ADMIN)
    exposed = Server(Settings(grpc_address="0.0.0.0:0", **base))
    with pytest.raises(PermissionError, match="worker token"):
        exposed.check_exposure()
    Server(Settings(grpc_address="0.0.0.0:0", insecure=True, **base)).check_exposure()
    Server(Settings(grpc_address="0.0.0.0:0", worker_token=WORKER, **base)).check_exposure()
    Server(Settings(grpc_address="[::1]:0", **base)).check_exposure()


def test_the_role_tables() -> None:
    from avest.policy.access import WORKER_METHODS, Access, Role, grpc_role, http_role

    methods = pb.DESCRIPTOR.services_by_name["EstimatorService"].methods_by_name
    for name in methods:
        full = f"/avest.v1.EstimatorService/{name}"
        expected = Role.WORKER if full in WORKER_METHODS else Role.ADMIN
        assert grpc_role(full) == expected
    # Workers add the curves of a new hardware label; replacing needs admin (servicer).
    assert grpc_role("/avest.v1.EstimatorService/SetCostCurves") == Role.WORKER
    # Anything not listed, including RPCs added later, is admin.
    assert grpc_role("/avest.v1.EstimatorService/DeletePair") == Role.ADMIN
    assert http_role("DELETE", "/v1/pairs/x") == Role.ADMIN
    assert http_role("GET", "/v1/pairs/x") == Role.WORKER
    assert http_role("GET", "/metrics") == Role.OPEN
    access = Access(worker_token="", admin_token=ADMIN)
    assert access.check(Role.WORKER, None) is None  # open without a worker token
    assert access.check(Role.ADMIN, f"Bearer {ADMIN}") is None
    assert access.check(Role.WORKER, f"bearer {ADMIN}") is None  # admin passes worker checks
    denied = access.check(Role.ADMIN, None)
    assert denied is not None and denied.unauthenticated


# -- TLS ---------------------------------------------------------------------------------


def test_tls_on_grpc_and_http_with_mutual_tls(start_server, tmp_path, pki: Path) -> None:  # noqa: ANN001
    handle = start_server(
        tmp_path / "data",
        worker_token=WORKER,
        admin_token=ADMIN,
        tls_cert=str(pki / "server.crt"),
        tls_key=str(pki / "server.key"),
        tls_client_ca=str(pki / "ca.crt"),
    )
    address = handle.grpc_address
    # Plaintext, or TLS without a client certificate: no connection.
    with (
        EstimatorClient(address, timeout=3, token=WORKER) as client,
        pytest.raises(AvestError),  # UNAVAILABLE: the handshake fails
    ):
        client.pairs()
    with (
        EstimatorClient(address, timeout=3, token=WORKER, tls_ca=str(pki / "ca.crt")) as client,
        pytest.raises(AvestError),
    ):
        client.pairs()
    from avest_client import Credentials

    creds = Credentials(
        token=WORKER,
        tls_ca=str(pki / "ca.crt"),
        tls_cert=str(pki / "client.crt"),
        tls_key=str(pki / "client.key"),
    )
    with EstimatorClient(address, timeout=5, credentials=creds) as client:
        reg = client.register("t", "d", "eagle", K)
        assert [p.pair_id for p in client.pairs()] == [reg.pair_id]
    url = f"https://{handle.server.http_address}"
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    ctx.load_cert_chain(str(pki / "client.crt"), str(pki / "client.key"))
    with httpx.Client(verify=ctx, timeout=10) as http:
        assert http.get(url + "/healthz").status_code == 200
        r = http.get(url + "/v1/pairs", headers={"Authorization": f"Bearer {WORKER}"})
        assert r.status_code == 200 and len(r.json()["pairs"]) == 1
    with pytest.raises(httpx.HTTPError):
        httpx.get(
            url + "/healthz",
            verify=ssl.create_default_context(cafile=str(pki / "ca.crt")),
            timeout=5,
        )
