"""What each save writes: only pairs that changed, and of each only what changed.

A real :class:`~avest.state.app.Avest` over a real SQLite store; the store's
``write`` is observed to see the records each group commit carries. A restart
from the same file must still restore every history entry and cost curve.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from avest.core.estimator import make_batch
from avest.settings import Settings
from avest.state.app import Avest
from avest.state.costs import CostCurves
from avest.state.store import Store
from avest_wire.pair import PairKey

K = 4
CURVES = CostCurves("gpu", ((1, 1.0), (64, 2.0)), ((1, 5.0), (256, 9.0)), 64)


class RecordingStore(Store):
    def __init__(self, path: Any) -> None:
        super().__init__(path)
        self.writes: list[list[dict[str, Any]]] = []

    def write(self, records: list[dict[str, Any]]) -> None:
        super().write(records)
        self.writes.append(records)


def _batch(rng: np.random.Generator) -> Any:
    return make_batch(rng.normal(1, 2, (8, K)), np.full(8, K), rng.integers(0, K + 1, 8), K)


async def _run(tmp_path) -> None:  # noqa: ANN001
    settings = Settings(
        data_dir=str(tmp_path),
        default_rule="vllm",
        refit_interval=3,
        flush_interval_ms=3_600_000,
        min_refit_interval_ms=0,  # every full round refits as it fills
    )
    store = RecordingStore(settings.database)
    app = Avest(settings.state_config(), store)
    await app.start()
    rng = np.random.default_rng(0)
    busy, _ = app.register(PairKey.of("t", "busy", "eagle", K))
    idle, _ = app.register(PairKey.of("t", "idle", "eagle", K))
    busy.set_costs(CURVES)
    for seq in range(1, 7):  # registration and two refits: three history entries
        app.observe(busy, "w", seq, _batch(rng))
    await app.flush()
    (first,) = store.writes[-1:]
    by_id = {r["id"]: r for r in first}
    assert set(by_id) == {busy.id, idle.id}  # both new
    assert len(by_id[busy.id]["history"]) == len(busy.history) == 3
    assert [c["hardware"] for c in by_id[busy.id]["costs"]] == ["gpu"]

    # One more step, no refit: only the busy pair, its arrays, no history, no costs.
    app.observe(busy, "w", 7, _batch(rng))
    await app.flush()
    (second,) = store.writes[-1:]
    assert [r["id"] for r in second] == [busy.id]
    assert second[0]["history"] == [] and second[0]["costs"] == []
    # Nothing changed: nothing written.
    n = len(store.writes)
    await app.flush()
    assert len(store.writes) == n
    # A refit and new curves: just those.
    for seq in (8, 9):
        app.observe(busy, "w", seq, _batch(rng))
    busy.set_costs(CostCurves("gpu", ((1, 1.5),), ((1, 6.0),), 64))
    await app.flush()
    (third,) = store.writes[-1:]
    assert [h["outcome"] for h in third[0]["history"]] == [busy.history[-1].outcome]
    assert third[0]["costs"][0]["draft"] == [(1, 1.5)]
    history = [(h.version, h.round) for h in busy.history]
    await app.close()

    # Restart: every entry and the latest curves come back.
    again = Avest(settings.state_config(), Store(settings.database))
    await again.start()
    back = again.registry.pairs[busy.id]
    assert [(h.version, h.round) for h in back.history] == history
    assert back.costs["gpu"].draft == ((1, 1.5),)
    assert back.unsaved_history == 0 and not back.unsaved_costs
    await again.close()


def test_saves_write_only_what_changed(tmp_path):
    asyncio.run(_run(tmp_path))
