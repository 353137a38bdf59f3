"""Pair lifecycle: DeletePair and DELETE /v1/pairs/{id} remove a pair everywhere (state,
streams, metric series, stored rows); idle pairs retire after a TTL; idle workers'
records are pruned, and persistence writes only the workers that changed."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest

from avest.state import app as app_module
from avest_wire.v1 import estimator_pb2 as pb
from tests.support.live import TOKEN
from tests.support.rpc import observe_all, register_k, stub_for, synthetic_steps
from tests.support.server import launch

pytestmark = pytest.mark.slow

#: gRPC metadata with the admin token (deletion and cost curves are admin actions).
ADMIN_MD = (("authorization", f"Bearer {TOKEN}"),)


def _rows(db: Path, pair_id: str) -> dict[str, int]:
    with sqlite3.connect(db) as c:
        return {
            table: c.execute(
                f"SELECT COUNT(*) FROM {table} WHERE {'id' if table == 'pairs' else 'pair_id'} = ?",
                (pair_id,),
            ).fetchone()[0]
            for table in ("pairs", "snapshots", "workers", "coefficient_history", "cost_curves")
        }


def _series(http_url: str, pair_id: str) -> list[str]:
    text = httpx.get(f"{http_url}/metrics", timeout=10).text
    return [line for line in text.splitlines() if f'pair="{pair_id}"' in line]


@pytest.mark.parametrize("via", ["grpc", "http"])
def test_deleting_a_pair_removes_it_everywhere(tmp_path, via):
    data = tmp_path / "data"
    srv = launch(data, admin_token=TOKEN)
    try:
        channel, stub = stub_for(srv.grpc_address)
        gone = register_k(stub, 6, 0)
        kept = register_k(stub, 6, 1)
        for n, reg in enumerate((gone, kept)):
            observe_all(stub, synthetic_steps(reg.pair_id, "w", 6, 25, seed=n))
        stub.SetCostCurves(
            pb.SetCostCurvesRequest(
                pair_id=gone.pair_id,
                draft_curve=[pb.CostPoint(size=1, ms=1.0)],
                verify_curve=[pb.CostPoint(size=1, ms=2.0)],
            ),
            metadata=ADMIN_MD,
        )
        srv.call(srv.server.app.flush)
        assert all(_rows(data / "avest.sqlite3", gone.pair_id).values())
        assert _series(srv.http_url, gone.pair_id)
        watch = stub.WatchCoefficients(pb.WatchCoefficientsRequest(pair_id=gone.pair_id))
        first = next(watch)
        assert first.coefficients.pair_id == gone.pair_id
        ended = threading.Event()
        threading.Thread(target=lambda: (list(watch), ended.set()), daemon=True).start()

        if via == "grpc":
            last = stub.DeletePair(
                pb.DeletePairRequest(pair_id=gone.pair_id), metadata=ADMIN_MD
            ).pair
            assert last.pair_id == gone.pair_id and last.steps_observed == 25
        else:
            url = f"{srv.http_url}/v1/pairs/{gone.pair_id}"
            assert httpx.delete(url, timeout=10).status_code == 401
            bad = {"Authorization": "Bearer nope"}
            assert httpx.delete(url, headers=bad, timeout=10).status_code == 401  # unknown token
            ok = {"Authorization": f"Bearer {TOKEN}"}
            r = httpx.delete(url, headers=ok, timeout=10)
            assert r.status_code == 200 and r.json()["observed_steps"] == 25
            assert httpx.delete(url, headers=ok, timeout=10).status_code == 404

        assert ended.wait(10)  # its watchers' streams ended
        ids = {p.pair_id for p in stub.ListPairs(pb.ListPairsRequest()).pairs}
        assert ids == {kept.pair_id}
        assert _series(srv.http_url, gone.pair_id) == []
        assert _series(srv.http_url, kept.pair_id)
        assert set(_rows(data / "avest.sqlite3", gone.pair_id).values()) == {0}
        with pytest.raises(grpc.RpcError) as refused:
            observe_all(stub, synthetic_steps(gone.pair_id, "w", 6, 1, seed=5))
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as missing:
            stub.DeletePair(pb.DeletePairRequest(pair_id=gone.pair_id), metadata=ADMIN_MD)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        # The key registers again as a new pair, from the cold start.
        again = register_k(stub, 6, 0)
        assert again.pair_id == gone.pair_id and again.created
        assert again.coefficients.version == 0 and again.coefficients.slope == 0.5
        channel.close()
    finally:
        srv.stop()
    # And a restart does not bring back the deleted state.
    srv = launch(data)
    try:
        channel, stub = stub_for(srv.grpc_address)
        pair = stub.GetPair(pb.GetPairRequest(pair_id=gone.pair_id)).pair
        assert pair.steps_observed == 0 and not pair.cost_curve_hardware
        channel.close()
    finally:
        srv.stop()


def test_idle_pairs_retire_after_the_ttl(tmp_path, monkeypatch):
    monkeypatch.setattr(app_module, "MAINTAIN_EVERY_S", 0.0)
    srv = launch(tmp_path / "data", pair_ttl_s=0.5)
    try:
        channel, stub = stub_for(srv.grpc_address)
        idle = register_k(stub, 4, 0)
        busy = register_k(stub, 4, 1)
        observe_all(stub, synthetic_steps(idle.pair_id, "w", 4, 3, seed=1))
        # ``busy`` keeps an open stream: in use, never retired while it is open.
        stop = threading.Event()

        def requests():
            yield from synthetic_steps(busy.pair_id, "w", 4, 1, seed=2)
            stop.wait(30)

        stream = stub.Observe(requests())
        threading.Thread(target=_drain, args=(stream,), daemon=True).start()
        deadline = time.monotonic() + 15
        ids = {idle.pair_id, busy.pair_id}
        while idle.pair_id in ids and time.monotonic() < deadline:
            time.sleep(0.05)
            ids = {p.pair_id for p in stub.ListPairs(pb.ListPairsRequest()).pairs}
        assert ids == {busy.pair_id}
        time.sleep(1.0)  # well past the TTL: the pair with an open stream stays
        assert {p.pair_id for p in stub.ListPairs(pb.ListPairsRequest()).pairs} == {busy.pair_id}
        stop.set()
        channel.close()
    finally:
        srv.stop()


def test_idle_workers_are_pruned_and_writes_carry_only_changed_workers(tmp_path, monkeypatch):
    monkeypatch.setattr(app_module, "MAINTAIN_EVERY_S", 0.0)
    data = tmp_path / "data"
    db = data / "avest.sqlite3"
    srv = launch(data, worker_ttl_s=3600.0, refit_interval=100000)
    try:
        channel, stub = stub_for(srv.grpc_address)
        reg = register_k(stub, 4, 0)
        step = synthetic_steps(reg.pair_id, "w", 4, 1, seed=1)[0]
        many = []
        for n in range(3000):
            m = pb.ObserveRequest()
            m.CopyFrom(step)
            m.worker_id = f"worker-{n:05d}-{'x' * 40}"
            many.append(m)
        observe_all(stub, many)
        app = srv.server.app

        def wal_bytes_for_one_more_step() -> int:
            with sqlite3.connect(db) as c:
                c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            more = pb.ObserveRequest()
            more.CopyFrom(step)
            more.worker_id, more.sequence = "worker-00007-" + "x" * 40, 2
            observe_all(stub, [more])
            return Path(f"{db}-wal").stat().st_size

        # One step of one worker rewrites that worker's record, not 3,000 of them
        # (about 150 kB as one JSON object).
        assert wal_bytes_for_one_more_step() < 64 * 1024
        with sqlite3.connect(db) as c:
            assert c.execute("SELECT COUNT(*) FROM workers").fetchone()[0] == 3000
        # Idle past the TTL and fully acknowledged: pruned, in memory and on disk.
        srv.call(_age_workers, app, reg.pair_id)
        srv.call(app.flush)
        pair = app.registry.get(reg.pair_id)
        assert set(pair.applied) == {"worker-00007-" + "x" * 40}
        with sqlite3.connect(db) as c:
            assert c.execute("SELECT COUNT(*) FROM workers").fetchone()[0] == 1
        channel.close()
    finally:
        srv.stop()


def _drain(stream) -> None:
    with contextlib.suppress(grpc.RpcError):  # the test closes the channel
        list(stream)


async def _age_workers(app, pair_id: str) -> None:
    pair = app.registry.get(pair_id)
    for worker in pair.seen:
        if not worker.startswith("worker-00007-"):
            pair.seen[worker] -= 7200.0
    await app._maintain()
