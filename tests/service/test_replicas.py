"""Replicas on one PostgreSQL database (:mod:`avest.state.replicas`), each a real
``avest serve`` process on a real PostgreSQL server.

- Three replicas with the workers spread across them give one replica's
  coefficients, raw steps and round summaries alike, and every replica serves them.
- The refitting replica killed (SIGKILL) with acknowledged rows not yet folded: the
  other takes the pair over, nothing acknowledged is lost and nothing is counted
  twice (the same coefficients as one replica given the same messages in the same
  order, resends included).
- PostgreSQL stopped for ten seconds: no step sent meanwhile is acknowledged
  (``/readyz`` 503; the receiving replica's ``avest_queue_depth`` counts them, the
  other's does not), and everything is once it is back.
"""

from __future__ import annotations

import math
import signal
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest

from avest_wire.v1 import estimator_pb2 as pb
from tests.support.helpers import wait_until
from tests.support.postgres import PostgresCluster, import_psycopg

import_psycopg()
from avest.core.estimator import make_batch  # noqa: E402
from avest.core.model import Coefficients  # noqa: E402
from avest.core.summary import summarise  # noqa: E402
from avest_wire.messages import summary_to_pb  # noqa: E402
from tests.support.replicas import (  # noqa: E402
    WAIT_S,
    gauge,
    get_pair,
    pair_on_replicas,
    pending_rows,
    refitted,
    refitter,
    refitter_and_other,
    register,
    replicas,
    send,
    settled,
)
from tests.support.rpc import HeldStream, register_k, stub_for, synthetic_steps  # noqa: E402
from tests.support.serve import Served  # noqa: E402
from tests.support.server import launch  # noqa: E402

pytestmark = pytest.mark.slow

K = 4
STEPS = 30
WORKERS = 3
#: Refit every 10 steps: each worker's messages span several refits.
REFIT_INTERVAL = 10
QUEUE_DEPTH = "avest_queue_depth"


def _summaries(pair_id: str, worker: str, seed: int) -> list[pb.ObserveRequest]:
    """A worker's round summaries, each of 5 steps scored at the cold start (the
    refitter moves each to the coefficients in force)."""
    rng = np.random.default_rng(seed)
    at = Coefficients.cold_start(K)
    out = []
    for seq in range(1, STEPS // 5 + 1):
        batches = []
        for _ in range(5):
            d = rng.integers(0, K + 1, size=8)
            b = make_batch(
                rng.normal(0.0, 2.0, size=(8, K)),
                d,
                np.minimum(d, rng.integers(0, K + 1, size=8)),
                K,
            )
            batches.append((b.features, b.observed, b.accepted))
        summary = summarise(batches, at, version=0)
        out.append(
            pb.ObserveRequest(
                pair_id=pair_id, worker_id=worker, sequence=seq, summary=summary_to_pb(summary)
            )
        )
    return out


def _messages(pair_id: str, mode: str, worker: int) -> list[pb.ObserveRequest]:
    if mode == "raw":
        return synthetic_steps(pair_id, f"w{worker}", K, STEPS, seed=worker)
    return _summaries(pair_id, f"w{worker}", seed=worker)


def _close(a: pb.Pair, b: pb.Pair) -> None:
    assert a.coefficients.version == b.coefficients.version
    assert a.steps_observed == b.steps_observed
    assert a.drafts_observed == b.drafts_observed
    assert math.isclose(a.coefficients.slope, b.coefficients.slope, rel_tol=1e-9, abs_tol=1e-12)
    np.testing.assert_allclose(
        list(a.coefficients.intercepts), list(b.coefficients.intercepts), rtol=1e-9, atol=1e-12
    )


def _fleet(url: str, root: Path, n: int, mode: str) -> list[pb.Pair]:
    """Workers one after the other, worker w on replica w mod n, every message
    acknowledged before the next worker sends (so the log's order is the same
    whatever ``n``); the pair as every replica serves it once all is folded."""
    with replicas(url, n, root) as group:
        pair_id = ""
        steps = 0
        for w in range(WORKERS):
            replica = group[w % n]
            pair_id = register(replica, K, REFIT_INTERVAL)
            msgs = _messages(pair_id, mode, w)
            assert send(replica, msgs) == len(msgs)
            steps += STEPS
        return settled(url, group, pair_id, steps)


@pytest.mark.parametrize("mode", ["raw", "summary"])
def test_three_replicas_give_one_replicas_coefficients(
    tmp_path: Path, postgres_cluster: PostgresCluster, mode: str
) -> None:
    one = _fleet(postgres_cluster.create_database(), tmp_path / "one", 1, mode)
    three = _fleet(postgres_cluster.create_database(), tmp_path / "three", 3, mode)
    assert one[0].coefficients.version >= STEPS * WORKERS // REFIT_INTERVAL
    for served in three:  # every replica serves the refitter's coefficients
        _close(served, one[0])


def _reference(url: str, root: Path, order: list[list[pb.ObserveRequest]], steps: int) -> pb.Pair:
    with replicas(url, 1, root) as (replica,):
        register(replica, K, REFIT_INTERVAL)
        for msgs in order:
            assert send(replica, msgs) == msgs[-1].sequence
        return settled(url, [replica], msgs[0].pair_id, steps)[0]


def _two_replicas(cluster: PostgresCluster, tmp_path: Path):  # noqa: ANN202
    """A pair of K positions on two replicas: ``(url, group, pair_id)``."""
    return pair_on_replicas(cluster, tmp_path / "pair", 2, K, REFIT_INTERVAL)


def test_a_killed_refitter_hands_its_pair_over_losing_nothing(
    tmp_path: Path, postgres_cluster: PostgresCluster
) -> None:
    with _two_replicas(postgres_cluster, tmp_path) as (url, group, pair_id):
        lead, other = refitter_and_other(group)
        w0 = synthetic_steps(pair_id, "w0", K, 2 * STEPS, seed=0)
        w1 = synthetic_steps(pair_id, "w1", K, 2 * STEPS, seed=1)
        assert send(lead, w0[:STEPS]) == STEPS
        assert send(other, w1[:STEPS]) == STEPS
        settled(url, group, pair_id, 2 * STEPS)
        # The refitter stops folding (its session, and its lock, live on) ...
        lead.proc.send_signal(signal.SIGSTOP)
        assert send(other, w1[STEPS:]) == 2 * STEPS
        assert pending_rows(url) == STEPS  # acknowledged, not folded
        # ... and dies mid-round.
        killed = time.monotonic()
        lead.proc.kill()
        lead.proc.wait(WAIT_S)
        # Its worker reconnects to the other replica and resends everything it has
        # (the first half was acknowledged already; an unknowing resend is harmless).
        assert send(other, w0) == 2 * STEPS
        (after,) = settled(url, [other], pair_id, 4 * STEPS)
        print(f"\nfail-over: the pair folded again {time.monotonic() - killed:.2f} s after SIGKILL")
        assert refitted(other) == 1
    # The same messages in the same order, once each, on one replica.
    order = [w0[:STEPS], w1[:STEPS], w1[STEPS:], w0]
    _close(
        after, _reference(postgres_cluster.create_database(), tmp_path / "ref", order, 4 * STEPS)
    )


def test_postgresql_stopped_for_ten_seconds_holds_the_acks_and_loses_nothing(
    tmp_path: Path, postgres_cluster: PostgresCluster
) -> None:
    with _two_replicas(postgres_cluster, tmp_path) as (url, group, pair_id):
        steps = synthetic_steps(pair_id, "w0", K, 2 * STEPS, seed=0)
        assert send(group[0], steps[:STEPS]) == STEPS
        settled(url, group, pair_id, STEPS)
        with HeldStream(group[1].grpc_address, steps[STEPS:], 2 * STEPS) as held:
            with postgres_cluster.outage():
                stopped = time.monotonic()
                held.start()
                ready = f"{group[1].http_url}/readyz"
                assert wait_until(lambda: httpx.get(ready, timeout=10).status_code == 503, WAIT_S)
                # Received by group[1], not stored: its backlog, not the other's.
                assert wait_until(lambda: gauge(group[1], QUEUE_DEPTH) == STEPS, WAIT_S)
                assert gauge(group[0], QUEUE_DEPTH) == 0
                time.sleep(max(0.0, 10.0 - (time.monotonic() - stopped)))
                assert [seq for seq in held.acked() if seq > STEPS] == []  # none acknowledged
            resumed = time.monotonic()
            assert held.done.wait(WAIT_S), held.acks
        assert wait_until(lambda: gauge(group[1], QUEUE_DEPTH) == 0, WAIT_S)
        print(f"\nacknowledged again {held.acks[-1][0] - resumed:.2f} s after PostgreSQL was back")
        settled(url, group, pair_id, 2 * STEPS)
        for replica in group:
            assert wait_until(
                lambda r=replica: httpx.get(f"{r.http_url}/readyz", timeout=10).status_code == 200,
                WAIT_S,
            )


def test_a_worker_opened_on_another_replica_learns_what_the_replicas_hold_of_it(
    tmp_path: Path, postgres_cluster: PostgresCluster
) -> None:
    """The watermark comes from PostgreSQL, not from the replica's copy (here the
    refitter is stopped: no replica's copy has folded anything); the worker table is
    the refitter's, and another replica says which one that is."""
    with pair_on_replicas(postgres_cluster, tmp_path / "pair", 3, K, REFIT_INTERVAL) as (
        url,
        group,
        pair_id,
    ):
        lead = refitter(group)
        first, second = (r for r in group if r is not lead)
        lead.proc.send_signal(signal.SIGSTOP)
        try:
            assert send(first, synthetic_steps(pair_id, "w0", K, STEPS, seed=0)) == STEPS
            channel, stub = stub_for(second.grpc_address)
            try:
                opening = pb.ObserveRequest(pair_id=pair_id, worker_id="w0", open=True)
                (opened,) = [r.opened for r in stub.Observe(iter([opening]), timeout=60)]
            finally:
                channel.close()
        finally:
            lead.proc.send_signal(signal.SIGCONT)
        assert (opened.applied_sequence, opened.acked_sequence) == (STEPS, STEPS)
        settled(url, group, pair_id, STEPS)

        # Each replica reads who refits what at its lease passes (each second).
        def named() -> str:
            got = httpx.get(f"{second.http_url}/v1/pairs/{pair_id}", timeout=10).json()
            return str(got["refitter"])

        assert wait_until(lambda: named() == lead_name(lead), WAIT_S), named()
        refused = httpx.get(f"{second.http_url}/v1/pairs/{pair_id}/workers", timeout=10)
        assert refused.status_code == 409 and lead_name(lead) in refused.json()["detail"]
        table = httpx.get(f"{lead.http_url}/v1/pairs/{pair_id}/workers", timeout=10).json()
        assert [w["worker_id"] for w in table["workers"]] == ["w0"]


def lead_name(replica: Served) -> str:
    """A replica's name (``--replica-name``, as :func:`replicas` gives them)."""
    for line in replica.metrics_text().splitlines():
        if line.startswith("avest_replica_info{"):
            return line.split('replica="', 1)[1].split('"', 1)[0]
    raise AssertionError("no avest_replica_info")


ADMIN_TOKEN = "admin-token-for-replicas"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def _versions(group: list[Served], pair_id: str) -> set[int]:
    return {get_pair(r, pair_id).coefficients.version for r in group}


def test_admin_changes_on_any_replica_reach_every_replica(
    tmp_path: Path, postgres_cluster: PostgresCluster
) -> None:
    """Cost curves and a reset sent to a replica that does not refit the pair are
    applied by its refitter and served everywhere; a deletion there removes the pair
    from every replica, and registering it again starts it afresh."""
    with pair_on_replicas(
        postgres_cluster, tmp_path / "pair", 2, K, REFIT_INTERVAL, "--admin-token", ADMIN_TOKEN
    ) as (url, group, pair_id):
        lead, other = refitter_and_other(group)
        assert send(other, synthetic_steps(pair_id, "w0", K, STEPS, seed=0)) == STEPS
        (before, _) = settled(url, group, pair_id, STEPS)
        channel, stub = stub_for(other.grpc_address)
        try:
            stub.SetCostCurves(
                pb.SetCostCurvesRequest(
                    pair_id=pair_id,
                    hardware="h200",
                    draft_curve=[pb.CostPoint(size=1, ms=1.0), pb.CostPoint(size=64, ms=1.5)],
                    verify_curve=[pb.CostPoint(size=1, ms=5.0), pb.CostPoint(size=64, ms=6.0)],
                    cudagraph_capture_limit=64,
                ),
                timeout=30,
            )
        finally:
            channel.close()
        base = f"{lead.http_url}/v1/pairs/{pair_id}"
        assert wait_until(
            lambda: httpx.get(base, timeout=10).json()["cost_curve_hardware"] == ["h200"], WAIT_S
        )
        reset = httpx.post(f"{other.http_url}/v1/pairs/{pair_id}/reset", headers=ADMIN, timeout=10)
        assert reset.status_code == 200, reset.text
        target = before.coefficients.version + 1
        assert wait_until(lambda: _versions(group, pair_id) == {target}, WAIT_S)
        assert {get_pair(r, pair_id).steps_observed for r in group} == {0}

        gone = httpx.delete(f"{other.http_url}/v1/pairs/{pair_id}", headers=ADMIN, timeout=10)
        assert gone.status_code == 200, gone.text
        for replica in group:
            assert wait_until(
                lambda r=replica: (
                    httpx.get(f"{r.http_url}/v1/pairs/{pair_id}", timeout=10).status_code == 404
                ),
                WAIT_S,
            )
        # Registered again: a new pair from the cold start, refitted and served.
        assert register(lead, K, REFIT_INTERVAL) == pair_id
        register(other, K, REFIT_INTERVAL)
        assert send(other, synthetic_steps(pair_id, "w1", K, STEPS, seed=1)) == STEPS
        after = settled(url, group, pair_id, STEPS)
        # The same refits from the cold start as the pair's first life.
        assert after[0].coefficients.version == before.coefficients.version


def _queued(srv: Any) -> float:
    """The rows an in-process server holds for the pending log (its queue depth)."""
    text = httpx.get(f"{srv.http_url}/metrics", timeout=10).text
    (line,) = [x for x in text.splitlines() if x.startswith(QUEUE_DEPTH + " ")]
    return float(line.split()[-1])


def test_what_a_replica_cannot_store_waits_on_the_workers_past_its_bound(
    tmp_path: Path, postgres_cluster: PostgresCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL down: a replica keeps what it received up to its bound (here one
    step's bytes), then reads no more from its streams; everything is acknowledged
    once PostgreSQL is back."""
    import avest.state.replicas as replicas_module

    url = postgres_cluster.create_database()
    with launch(tmp_path / "data", store=url) as srv:
        channel, stub = stub_for(srv.grpc_address)
        try:
            pair_id = register_k(stub, K, 0).pair_id
        finally:
            channel.close()
        steps = synthetic_steps(pair_id, "w0", K, STEPS, seed=0)
        monkeypatch.setattr(replicas_module, "MAX_QUEUED_BYTES", 1)
        with HeldStream(srv.grpc_address, steps, STEPS) as held:
            with postgres_cluster.outage():
                held.start()
                assert wait_until(lambda: _queued(srv) >= 1, WAIT_S)
                time.sleep(2.0)  # the stream's other steps are not read meanwhile
                assert _queued(srv) == 1 and held.acked() == []
            assert held.done.wait(WAIT_S), held.acks


def test_a_pair_sending_little_goes_in_the_next_pending_write_not_behind_a_backlog(
    tmp_path: Path, postgres_cluster: PostgresCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL down while one pair's worker queues a backlog and another pair's one
    step: once back, the pending log is written two rows at a time (``APPEND_ROWS``
    here), and the first write takes one row of each pair, each pair's rows in order."""
    import avest.state.replicas as replicas_module
    from avest.state.postgres import PostgresStore

    written: list[list[tuple[str, str, int]]] = []
    append = PostgresStore.append_pending

    def recorded(self: PostgresStore, rows: list[Any], replica: str) -> None:
        append(self, rows, replica)
        written.append([(r[0], r[1], r[2]) for r in rows])

    monkeypatch.setattr(PostgresStore, "append_pending", recorded)
    monkeypatch.setattr(replicas_module, "APPEND_ROWS", 2)
    busy_steps = 6
    url = postgres_cluster.create_database()
    with launch(tmp_path / "data", store=url) as srv:
        channel, stub = stub_for(srv.grpc_address)
        try:
            busy, light = (register_k(stub, K, n).pair_id for n in (0, 1))
        finally:
            channel.close()
        backlog = synthetic_steps(busy, "w-busy", K, busy_steps, seed=0)
        one = synthetic_steps(light, "w-light", K, 1, seed=1)
        with (
            HeldStream(srv.grpc_address, backlog, busy_steps) as held,
            HeldStream(srv.grpc_address, one, 1) as little,
        ):
            with postgres_cluster.outage():
                held.start()
                assert wait_until(lambda: _queued(srv) == busy_steps, WAIT_S)
                little.start()
                assert wait_until(lambda: _queued(srv) == busy_steps + 1, WAIT_S)
            assert little.done.wait(WAIT_S) and held.done.wait(WAIT_S), (little.acks, held.acks)
    assert written[0] == [(busy, "w-busy", 1), (light, "w-light", 1)]
    stored = [row for rows in written for row in rows]
    assert [seq for pid, _, seq in stored if pid == busy] == list(range(1, busy_steps + 1))


def test_a_killed_replica_s_pairs_go_to_the_survivor_beyond_its_share(
    tmp_path: Path, postgres_cluster: PostgresCluster
) -> None:
    """Two replicas refitting a pair each: one killed, the other refits both (its
    share grows as soon as the dead one's session is gone) and folds what is sent."""
    url = postgres_cluster.create_database()
    with replicas(url, 2, tmp_path / "pairs") as group:
        ids = [register(group[0], k, REFIT_INTERVAL) for k in (K, K + 1)]
        for k in (K, K + 1):
            register(group[1], k, REFIT_INTERVAL)
        assert wait_until(lambda: [refitted(r) for r in group] == [1, 1], WAIT_S, 0.1)
        dead, survivor = group
        killed = time.monotonic()
        dead.proc.kill()
        dead.proc.wait(WAIT_S)
        assert wait_until(lambda: refitted(survivor) == 2, WAIT_S, 0.05)
        print(f"\nthe survivor refits both pairs {time.monotonic() - killed:.2f} s after SIGKILL")
        for k, pair_id in zip((K, K + 1), ids, strict=True):
            assert send(survivor, synthetic_steps(pair_id, "w", k, STEPS, seed=k)) == STEPS
            settled(url, [survivor], pair_id, STEPS)


def test_a_worker_opened_while_postgresql_is_down_is_told_to_come_back(
    tmp_path: Path, postgres_cluster: PostgresCluster
) -> None:
    """Its watermark cannot be read: UNAVAILABLE (retry), not a fault of the service."""
    url = postgres_cluster.create_database()
    with launch(tmp_path / "data", store=url) as srv:
        channel, stub = stub_for(srv.grpc_address)
        try:
            pair_id = register_k(stub, K, 0).pair_id
            opening = pb.ObserveRequest(pair_id=pair_id, worker_id="w0", open=True)
            with postgres_cluster.outage(), pytest.raises(grpc.RpcError) as refused:
                list(stub.Observe(iter([opening]), timeout=WAIT_S))
        finally:
            channel.close()
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
    assert "open it again" in refused.value.details()


def test_the_refitting_replica_refits_a_pair_at_most_once_per_interval(
    tmp_path: Path, postgres_cluster: PostgresCluster
) -> None:
    """Refits do not grow with the messages a replica folds. The first full round
    refits at once (version 1); every round that fills within the minimum refit
    interval after it stays open, pooling, and is refitted once the interval is over,
    with no message to prompt it (version 2): with an interval longer than the test,
    never. Every message is folded either way."""
    assert STEPS // REFIT_INTERVAL >= 3  # rounds that fill
    for interval_ms, versions in (("600000", {1}), ("20000", {2})):
        with pair_on_replicas(
            postgres_cluster,
            tmp_path / interval_ms,
            2,
            K,
            REFIT_INTERVAL,
            "--min-refit-interval-ms",
            interval_ms,
        ) as (url, group, pair_id):
            _, other = refitter_and_other(group)
            assert send(other, synthetic_steps(pair_id, "w0", K, STEPS, seed=0)) == STEPS
            settled(url, group, pair_id, STEPS)
            assert wait_until(lambda v=versions: _versions(group, pair_id) == v, WAIT_S), (
                interval_ms,
                _versions(group, pair_id),
            )


def test_every_replicas_read_port_serves_the_refitters_coefficients(
    tmp_path: Path, postgres_cluster: PostgresCluster
) -> None:
    """Steps sent to one replica: once folded, both replicas' read ports
    (``--read-address``) serve the coefficients the refitter stored."""
    url = postgres_cluster.create_database()
    with replicas(url, 2, tmp_path, "--read-address", "127.0.0.1:0") as group:
        pair_id = register(group[0], K, REFIT_INTERVAL)
        register(group[1], K, REFIT_INTERVAL)
        msgs = synthetic_steps(pair_id, "w0", K, STEPS, seed=5)
        assert send(group[0], msgs) == len(msgs)
        served = settled(url, group, pair_id, STEPS)[0].coefficients
        assert served.version >= STEPS // REFIT_INTERVAL

        def read(replica: Served) -> pb.Coefficients:
            channel, stub = stub_for(replica.read_address)
            try:
                request = pb.GetCoefficientsRequest(pair_id=pair_id)
                return stub.GetCoefficients(request, timeout=30).coefficients
            finally:
                channel.close()

        for replica in group:
            assert replica.read_address
            assert wait_until(lambda r=replica: read(r).version == served.version, WAIT_S, 0.1)
            got = read(replica)
            assert got.slope == served.slope
            assert list(got.intercepts) == list(served.intercepts)
