"""Replicas on one PostgreSQL: round summaries per second with 1, 2 and 3 replicas, in one run.

A PostgreSQL server of its own (the tests' harness: ``initdb`` in a temporary
folder, Debian's ``postgresql``), a fresh database per replica count, ``--pairs``
pairs at K = ``--k``, each with ``--workers`` workers; pair ``p``'s workers stream
to replica ``p mod n``, every worker writing five summaries (100 steps of 256 x K
drafts each, scored at version 0 so every one is rebased) back to back, flat out.

Reported per replica count: summaries acknowledged per second (in PostgreSQL's
pending log), summaries folded per second (until the log is empty, every pair
refitted), both as ratios to one replica measured in the same run, and the CPU
spent per summary by the replicas, by PostgreSQL and by the load generator (the
three share this machine's cores: the per-summary CPU, not the rate, is what
sizes a deployment; see docs/replicas.md, "Sizing replicas").

    python bench/bench_replicas.py [--replicas 1,2,3] [--pairs 6] [--workers 40] [--k 8]
                                   [--refit-interval 100] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_ingest import cpu_s  # noqa: E402
from summary_ingest import ingest, summary_body  # noqa: E402

from avest_wire.v1 import estimator_pb2 as pb  # noqa: E402
from tests.support.postgres import PostgresCluster, find_bindir  # noqa: E402
from tests.support.replicas import pending_rows, replicas  # noqa: E402
from tests.support.rpc import stub_for  # noqa: E402
from tests.support.serve import Served, serve  # noqa: E402

#: Seconds a run may take to fold its log before it is reported as unfinished.
FOLD_WAIT_S = 600.0


def postgres_cpu_s() -> float:
    """CPU seconds of every PostgreSQL process on this machine so far, with those of
    the backends that ended (counted in their parent's children's time)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() == "postgres":
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                total += sum(int(f) for f in fields[11:15]) / tick
        except (OSError, ValueError, IndexError):
            continue
    return total


def start_postgres(prefix: str) -> tuple[PostgresCluster, Path] | None:
    """A PostgreSQL server of its own in a new temporary folder (the tests' harness),
    started, and the folder; ``None`` where PostgreSQL is not installed."""
    bindir = find_bindir()
    if bindir is None:
        return None
    root = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(root, 0o777)  # the cluster runs as nobody when this runs as root
    cluster = PostgresCluster(bindir, root / "pg")
    cluster.root.mkdir()
    os.chmod(cluster.root, 0o777)
    cluster.start()
    return cluster, root


def _register(address: str, k: int, n: int) -> str:
    channel, stub = stub_for(address)
    try:
        key = pb.PairKey(
            target_model="target", draft_model="draft", method="draft_model",
            num_speculative_tokens=k, labels={"n": str(n)},
        )  # fmt: skip
        return str(stub.RegisterPair(pb.RegisterPairRequest(key=key), timeout=60).pair_id)
    finally:
        channel.close()


async def _load(targets: list[tuple[str, str]], body: bytes, workers: int) -> list[dict[str, Any]]:
    return list(
        await asyncio.gather(
            *(ingest(address, pid, body, workers, 4, 0.0, 0.0) for address, pid in targets)
        )
    )


@contextlib.contextmanager
def _group(
    cluster: PostgresCluster, root: Path, n: int, refit: int
) -> Iterator[tuple[list[Served], str]]:
    """``n`` replicas on a new database, or (``n`` = 0) one process on its SQLite file."""
    if n == 0:
        with serve(root / "sqlite", "--refit-interval", str(refit), timeout=120) as one:
            yield [one], ""
        return
    url = cluster.create_database()
    with replicas(url, n, root / f"n{n}", "--refit-interval", str(refit)) as group:
        yield group, url


def _pending(url: str) -> int:
    return pending_rows(url) if url else 0


def run(cluster: PostgresCluster, root: Path, n: int, a: argparse.Namespace) -> dict[str, Any]:
    body = summary_body(a.k)
    with _group(cluster, root, n, a.refit_interval) as (group, url):
        n = max(n, 1)
        targets = []
        for p in range(a.pairs):
            address = group[p % n].grpc_address
            targets.append((address, _register(address, a.k, p)))
        time.sleep(2.0)  # the replicas share out the pairs (one lease pass)
        pids = [r.proc.pid for r in group]
        cpu0 = (sum(map(cpu_s, pids)), postgres_cpu_s(), cpu_s(os.getpid()))
        t0 = time.perf_counter()
        results = asyncio.run(_load(targets, body, a.workers))
        acked_s = time.perf_counter() - t0
        deadline = time.monotonic() + FOLD_WAIT_S
        while _pending(url) and time.monotonic() < deadline:
            time.sleep(0.05)
        folded_s = time.perf_counter() - t0
        left = _pending(url)
        cpu1 = (sum(map(cpu_s, pids)), postgres_cpu_s(), cpu_s(os.getpid()))
    acked = sum(int(r["summaries"]) for r in results)
    us = [(b - c) / max(acked, 1) * 1e6 for b, c in zip(cpu1, cpu0, strict=True)]
    return {
        "replicas": n if url else "SQLite",
        "summaries": acked,
        "unacked": sum(int(r["unacked"]) for r in results),
        "pending_left": left,
        "acked_per_s": acked / acked_s,
        "folded_per_s": (acked - left) / folded_s,
        "ack_p99_ms": max(float(r["ack_p99_ms"]) for r in results),
        "replica_cpu_us": us[0],
        "postgres_cpu_us": us[1],
        "client_cpu_us": us[2],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", default="0,1,2,3", help="0: one process on SQLite")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--workers", type=int, default=40, help="per pair")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument(
        "--refit-interval",
        type=int,
        default=100,
        help="the replicas' --refit-interval: 100 (the default) refits once per summary",
    )
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    started = start_postgres("avest-bench-replicas-")
    if started is None:
        sys.exit("PostgreSQL's initdb and pg_ctl are not installed (Debian: postgresql)")
    cluster, root = started
    try:
        rows = [run(cluster, root, int(n), a) for n in a.replicas.split(",")]
    finally:
        cluster.stop()
    base = next((r for r in rows if r["replicas"] == 1), rows[0])
    for row in rows:
        row["acked_ratio"] = row["acked_per_s"] / base["acked_per_s"]
        row["folded_ratio"] = row["folded_per_s"] / base["folded_per_s"]
    if a.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{a.pairs} pairs x {a.workers} workers, K={a.k}, refit every {a.refit_interval} "
          "steps, 5 summaries per worker, flat out; "
          f"{os.cpu_count()} cores shared by replicas, PostgreSQL and the load")  # fmt: skip
    print("| replicas | acked/s | ratio | folded/s | ratio | ack p99 ms | CPU µs per summary: "
          "replicas / PostgreSQL / load | left |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['replicas']} | {r['acked_per_s']:.0f} | {r['acked_ratio']:.2f} | "
            f"{r['folded_per_s']:.0f} | {r['folded_ratio']:.2f} | {r['ack_p99_ms']:.0f} | "
            f"{r['replica_cpu_us']:.0f} / {r['postgres_cpu_us']:.0f} / {r['client_cpu_us']:.0f} | "
            f"{r['pending_left'] + r['unacked']} |"
        )


if __name__ == "__main__":
    main()
