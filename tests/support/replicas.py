"""Replicas for the tests: several ``avest serve`` processes on one PostgreSQL database.

:func:`replicas` starts ``n`` of them (``--store URL --replica-name rN``), each a
subprocess (:func:`tests.support.serve.serve`), so that one can be killed
(SIGKILL, SIGSTOP) like a node lost; :func:`refitter` says which one refits a pair
(the ``avest_replica_pairs_refitted`` gauge of each); :func:`settled` waits until
every replica serves the pair at one version with nothing left pending.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import psycopg

from avest_wire.v1 import estimator_pb2 as pb
from tests.support.helpers import wait_until
from tests.support.postgres import PostgresCluster
from tests.support.rpc import observe_all, stub_for
from tests.support.serve import Served, serve

#: Seconds allowed for a condition on a loaded machine (never a measured duration).
WAIT_S = 90.0


@contextlib.contextmanager
def replicas(url: str, n: int, root: Path, *args: str) -> Iterator[list[Served]]:
    """``n`` replicas on the database at ``url`` (data directories under ``root``),
    refitting each round as it fills (``--min-refit-interval-ms 0``, unless ``args``
    set it), so their refits match a replay of the same messages through the core."""
    if "--min-refit-interval-ms" not in args:
        args = ("--min-refit-interval-ms", "0", *args)
    started: list[Served] = []
    try:
        for i in range(n):
            started.append(
                serve(
                    root / f"r{i}", "--store", url, "--replica-name", f"r{i}", *args, timeout=WAIT_S
                )
            )
        yield started
    finally:
        for replica in started:
            replica.stop()


def register(replica: Served, k: int, refit_interval: int) -> str:
    """Register the pair of ``k`` positions on a replica (as each worker does on the
    one it reaches); its id."""
    key = pb.PairKey(
        target_model="target", draft_model="draft", method="draft_model", num_speculative_tokens=k
    )
    channel, stub = stub_for(replica.grpc_address)
    try:
        request = pb.RegisterPairRequest(key=key, refit_interval=refit_interval)
        return str(stub.RegisterPair(request, timeout=30).pair_id)
    finally:
        channel.close()


def send(replica: Served, msgs: list[pb.ObserveRequest]) -> int:
    """Stream ``msgs`` to a replica; the highest sequence acknowledged."""
    channel, stub = stub_for(replica.grpc_address)
    try:
        return int(observe_all(stub, msgs)[0])
    finally:
        channel.close()


@contextlib.contextmanager
def pair_on_replicas(
    cluster: PostgresCluster, root: Path, n: int, k: int, refit_interval: int, *args: str
) -> Iterator[tuple[str, list[Served], str]]:
    """``n`` replicas on a new database of ``cluster``, the pair registered on each:
    ``(url, replicas, pair id)``."""
    url = cluster.create_database()
    with replicas(url, n, root, *args) as group:
        pair_id = register(group[0], k, refit_interval)
        for replica in group[1:]:
            assert register(replica, k, refit_interval) == pair_id
        yield url, group, pair_id


def get_pair(replica: Served, pair_id: str) -> pb.Pair:
    channel, stub = stub_for(replica.grpc_address)
    try:
        return stub.GetPair(pb.GetPairRequest(pair_id=pair_id), timeout=30).pair
    finally:
        channel.close()


def pending_rows(url: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM pending").fetchone()
    return int(row[0]) if row else 0


def gauge(replica: Served, name: str) -> float:
    """A series without labels from the replica's metrics (0 when absent)."""
    for line in replica.metrics_text().splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[-1])
    return 0.0


def refitted(replica: Served) -> int:
    """How many pairs the replica refits, from its metrics."""
    return int(gauge(replica, "avest_replica_pairs_refitted"))


def refitter_and_other(group: list[Served]) -> tuple[Served, Served]:
    """The replica that refits (the one pair of) a group of two, and the other."""
    lead = refitter(group)
    return lead, next(r for r in group if r is not lead)


def refitter(group: list[Served]) -> Served:
    """The replica that refits (the one pair of) the group, once one does."""
    found: list[Served] = []
    assert wait_until(
        lambda: (
            bool(found.extend(r for r in group if r.proc.poll() is None and refitted(r)))
            or bool(found)
        ),
        WAIT_S,
        0.1,
    ), "no replica refits the pair"
    return found[0]


def settled(url: str, group: list[Served], pair_id: str, steps: int) -> list[pb.Pair]:
    """Wait until nothing is pending and every replica serves the pair with ``steps``
    folded, at one version; the pair as each replica serves it."""

    def done() -> bool:
        if pending_rows(url):
            return False
        seen = [get_pair(r, pair_id) for r in group]
        return (
            all(p.steps_observed == steps for p in seen)
            and len({p.coefficients.version for p in seen}) == 1
        )

    assert wait_until(done, WAIT_S, 0.1), [
        (p.steps_observed, p.coefficients.version) for p in (get_pair(r, pair_id) for r in group)
    ]
    return [get_pair(r, pair_id) for r in group]
