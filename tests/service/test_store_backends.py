"""The store contract, over both stores: the SQLite file and a real PostgreSQL database.

Real pairs (a registry, steps observed, refits) are snapshotted into the store,
the store is opened again and loaded, and the restored pairs have the same
coefficients, counts, workers, cost curves and history. A pair deleted is gone.
A write the database refuses half way (a trigger that refuses one worker's row,
in SQLite and in PostgreSQL alike) leaves the previous state whole. The store
format and the release that wrote it are recorded.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from avest import __version__
from avest.core.estimator import make_batch
from avest.state.costs import CostCurves
from avest.state.pairs import Pair, Registry, RuleConfig
from avest.state.store import PairStore
from avest.state.store_format import STORE_FORMAT
from avest.state.stores import open_location
from avest_wire.pair import PairKey
from tests.support.postgres import PostgresCluster
from tests.support.steps import synthetic_steps

K = 4
#: Steps per pair: enough for a few refits at the interval below.
STEPS = 12
REFIT_INTERVAL = 3
CURVES = CostCurves("gpu", ((1, 1.0), (64, 2.0)), ((1, 5.0), (256, 9.0)), 64)
#: The worker whose rows the refusing trigger refuses.
REFUSED_WORKER = "refused-worker"


class Backend:
    """How a test opens a store again and makes its database refuse a row."""

    def __init__(self, location: str, refuse: Callable[[], None]) -> None:
        self.location = location
        self.refuse = refuse

    def open(self) -> PairStore:
        return open_location(self.location, create=True)


def _sqlite_refuse(path: Path) -> Callable[[], None]:
    def refuse() -> None:
        with sqlite3.connect(path) as db:
            db.execute(
                "CREATE TRIGGER refuse_worker BEFORE INSERT ON workers "
                f"WHEN NEW.worker_id = '{REFUSED_WORKER}' "
                "BEGIN SELECT RAISE(ABORT, 'worker refused'); END"
            )

    return refuse


def _postgres_refuse(url: str) -> Callable[[], None]:
    def refuse() -> None:
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "CREATE FUNCTION refuse_worker() RETURNS trigger AS $$ BEGIN "
                f"IF NEW.worker_id = '{REFUSED_WORKER}' THEN "
                "RAISE EXCEPTION 'worker refused'; END IF; RETURN NEW; END $$ "
                "LANGUAGE plpgsql"
            )
            conn.execute(
                "CREATE TRIGGER refuse_worker BEFORE INSERT ON workers "
                "FOR EACH ROW EXECUTE FUNCTION refuse_worker()"
            )

    return refuse


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "sqlite":
        path = tmp_path / "avest.sqlite3"
        yield Backend(str(path), _sqlite_refuse(path))
    else:
        cluster: PostgresCluster = request.getfixturevalue("postgres_cluster")
        url = cluster.create_database()
        yield Backend(url, _postgres_refuse(url))


def _observed_pairs(registry: Registry, seed: int) -> list[Pair]:
    """Two pairs, each fed by two workers through refits, one with cost curves."""
    pairs = []
    for i, draft in enumerate(("eagle-a", "eagle-b")):
        pair, _ = registry.register(PairKey.of("target", draft, "eagle", K), "tracking")
        for seq, (x, d, a) in enumerate(synthetic_steps(STEPS, k=K, seed=seed + i), start=1):
            pair.observe(f"w{seq % 2}", seq, make_batch(x, d, a, K))
        pairs.append(pair)
    pairs[0].set_costs(CURVES)
    return pairs


def _state(pair: Pair) -> dict[str, Any]:
    c = pair.estimator.coefficients
    return {
        "version": pair.estimator.version,
        "steps": pair.estimator.steps,
        "slope": c.slope,
        "intercepts": list(c.intercepts),
        "workers": dict(pair.applied),
        "history": [(h.version, h.round, h.outcome) for h in pair.history],
        "costs": sorted(pair.costs),
    }


def _registry() -> Registry:
    return Registry(RuleConfig(refit_interval=REFIT_INTERVAL))


def _restored(store: PairStore) -> dict[str, dict[str, Any]]:
    loaded = store.load()
    assert loaded.quarantined == {}
    registry = _registry()
    return {r["id"]: _state(registry.restore(r)) for r in loaded.records}


def test_pairs_written_come_back_the_same_after_reopening(backend: Backend) -> None:
    registry = _registry()
    pairs = _observed_pairs(registry, seed=1)
    assert all(p.estimator.version > 1 for p in pairs), "the steps refit every pair"
    store = backend.open()
    assert store.found_format == 0  # a new store
    store.write([registry.snapshot(p) for p in pairs])
    store.close()

    again = backend.open()
    assert again.found_format == STORE_FORMAT
    assert _restored(again) == {p.id: _state(p) for p in pairs}
    again.close()


def test_a_deleted_pair_is_gone_and_the_others_stay(backend: Backend) -> None:
    registry = _registry()
    gone, kept = _observed_pairs(registry, seed=2)
    store = backend.open()
    store.write([registry.snapshot(p) for p in (gone, kept)])
    store.delete(gone.id)
    store.close()

    again = backend.open()
    assert _restored(again) == {kept.id: _state(kept)}
    assert again.history(gone.id) == []
    again.close()


def test_a_write_the_database_refuses_half_way_leaves_the_previous_state(
    backend: Backend,
) -> None:
    registry = _registry()
    first, second = _observed_pairs(registry, seed=3)
    store = backend.open()
    store.write([registry.snapshot(p) for p in (first, second)])
    before = _restored(store)
    store.close()
    backend.refuse()

    store = backend.open()
    # The first pair moves on (its rows come first in the write); the second pair's
    # new worker is refused by the database: the whole write must be undone.
    more = synthetic_steps(REFIT_INTERVAL, k=K, seed=4)
    for seq, (x, d, a) in enumerate(more, start=STEPS + 1):
        first.observe("w0", seq, make_batch(x, d, a, K))
    x, d, a = more[0]
    second.observe(REFUSED_WORKER, 1, make_batch(x, d, a, K))
    assert _state(first) != before[first.id]
    records = [registry.snapshot(first), registry.snapshot(second)]
    with pytest.raises(Exception, match="worker refused"):
        store.write(records)
    for pair, record in zip((first, second), records, strict=True):
        registry.unsnapshot(pair, record)  # as the service does: still to be written
    assert _restored(store) == before  # the same connection, after the failure
    store.close()

    again = backend.open()
    assert _restored(again) == before
    # The store takes writes again once the refused row is not in them.
    second.applied.pop(REFUSED_WORKER)
    record = registry.snapshot(first)
    again.write([record])
    assert _restored(again)[first.id] == _state(first)
    again.close()


def test_the_store_format_and_the_release_are_recorded(backend: Backend) -> None:
    store = backend.open()
    store.close()
    if backend.location.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(backend.location) as conn:
            meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    else:
        with sqlite3.connect(backend.location) as db:
            meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
            assert db.execute("PRAGMA user_version").fetchone()[0] == STORE_FORMAT
    assert meta["format"] == str(STORE_FORMAT)
    assert meta["written_by"] == __version__
    again = backend.open()
    assert again.found_format == STORE_FORMAT
    again.close()


def test_restored_arrays_are_the_written_ones(backend: Backend) -> None:
    """Beyond the summary figures: every array of the snapshot, bit for bit."""
    registry = _registry()
    pairs = _observed_pairs(registry, seed=5)
    records = [registry.snapshot(p) for p in pairs]
    store = backend.open()
    store.write(records)
    loaded = {r["id"]: r for r in store.load().records}
    store.close()
    for r in records:
        got = loaded[r["id"]]["arrays"]
        assert set(got) == set(r["arrays"])
        for name, value in r["arrays"].items():
            np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_the_default_store_needs_no_postgresql_driver(tmp_path: Path) -> None:
    """``avest serve`` on embedded defaults (SQLite in --data-dir) starts and stores
    pairs with psycopg unimportable: nothing of PostgreSQL is loaded for it."""
    code = (
        "import asyncio, sys\n"
        "sys.modules['psycopg'] = None\n"
        "from avest.settings import Settings\n"
        "from avest.state.app import Avest\n"
        "from avest_wire.pair import PairKey\n"
        "async def main():\n"
        f"    app = Avest(Settings(data_dir={str(tmp_path)!r}).state_config())\n"
        "    await app.start()\n"
        "    app.register(PairKey.of('t', 'd', 'eagle', 4))\n"
        "    await app.close()\n"
        "    print(type(app.store).__name__, len(app.registry.pairs))\n"
        "asyncio.run(main())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["Store", "1"]
    assert (tmp_path / "avest.sqlite3").is_file()
