"""A group commit runs to its end even when the caller that started it is cancelled.

An Observe stream flushes as it ends; when its client goes away the stream's
task is cancelled, possibly while that flush is writing. The snapshot it took
then still covers other workers' steps: abandoning it half way would leave
them written but never marked durable, and never acknowledged. A real
:class:`~avest.state.app.Avest` over a real SQLite store whose ``write`` is
held until the test lets it go.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

import numpy as np

from avest.core.estimator import make_batch
from avest.settings import Settings
from avest.state.app import Avest
from avest.state.store import Store
from avest_wire.pair import PairKey

K = 4


class HeldStore(Store):
    """Writes wait for ``release`` once ``hold`` is set."""

    def __init__(self, path: Any) -> None:
        super().__init__(path)
        self.hold = False
        self.writing = threading.Event()
        self.release = threading.Event()

    def write(self, records: list[dict[str, Any]]) -> None:
        if self.hold:
            self.writing.set()
            self.release.wait(30)
        super().write(records)


def _batch(rng: np.random.Generator) -> Any:
    return make_batch(rng.normal(1, 2, (8, K)), np.full(8, K), rng.integers(0, K + 1, 8), K)


async def _run(tmp_path) -> None:  # noqa: ANN001
    settings = Settings(data_dir=str(tmp_path), refit_interval=1000, flush_interval_ms=3_600_000)
    store = HeldStore(settings.database)
    app = Avest(settings.state_config(), store)
    await app.start()
    durable_calls: list[list[tuple[str, str, int]]] = []
    app.hooks.durable.append(durable_calls.append)
    pair, _ = app.register(PairKey.of("t", "d", "eagle", K))
    # Let the group-commit loop's own flush (woken by the registration) pass,
    # so that the flush held below is the one this test starts and cancels.
    await asyncio.sleep(0.05)
    await app.flush()
    rng = np.random.default_rng(0)
    for seq in (1, 2, 3):
        app.observe(pair, "other-worker", seq, _batch(rng))
    app.observe(pair, "leaving", 1, _batch(rng))

    store.hold = True
    caller = asyncio.create_task(app.flush())  # the leaving stream's last flush
    while not store.writing.is_set():
        await asyncio.sleep(0.001)
    caller.cancel()  # its client went away mid-write
    await asyncio.sleep(0.01)
    store.release.set()
    with contextlib.suppress(asyncio.CancelledError):
        await caller
    # The next flush waits for the one under way: after it, everything is durable.
    await app.flush()
    assert pair.durable == {"other-worker": 3, "leaving": 1}
    raised = [r for call in durable_calls for r in call]
    assert (pair.id, "other-worker", 3) in raised and (pair.id, "leaving", 1) in raised
    assert not pair.dirty and not pair.changed_workers
    await app.close()

    again = Avest(settings.state_config(), Store(settings.database))
    await again.start()
    assert again.registry.pairs[pair.id].applied == {"other-worker": 3, "leaving": 1}
    await again.close()


def test_a_cancelled_flush_still_marks_its_snapshot_durable(tmp_path):
    asyncio.run(_run(tmp_path))


async def _timed(tmp_path) -> str:  # noqa: ANN001
    from prometheus_client import generate_latest

    from avest.metrics.registry import Metrics

    settings = Settings(data_dir=str(tmp_path), refit_interval=1000, flush_interval_ms=3_600_000)
    store = HeldStore(settings.database)
    app = Avest(settings.state_config(), store)
    metrics = Metrics(app)
    await app.start()
    pair, _ = app.register(PairKey.of("t", "d", "eagle", K))
    await asyncio.sleep(0.05)
    await app.flush()
    before = generate_latest(metrics.registry).decode()
    app.observe(pair, "w", 1, _batch(np.random.default_rng(1)))
    store.hold = True
    flush = asyncio.create_task(app.flush())
    while not store.writing.is_set():
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.3)  # the store takes its time: the ack waits for it
    store.release.set()
    await flush
    after = generate_latest(metrics.registry).decode()
    await app.close()
    return before + "\n--\n" + after


def _sample(text: str, name: str) -> float:
    return float(next(ln for ln in text.splitlines() if ln.startswith(name + " ")).split()[1])


def test_the_group_commits_time_is_in_its_histogram(tmp_path):
    before, after = asyncio.run(_timed(tmp_path)).split("\n--\n")
    name = "avest_store_write_duration_seconds"
    assert _sample(after, name + "_count") == _sample(before, name + "_count") + 1
    assert _sample(after, name + "_sum") - _sample(before, name + "_sum") >= 0.3
    # The held write is counted above 0.25 s, not below it.
    below = name + '_bucket{le="0.25"}'
    assert _sample(after, below) == _sample(before, below)
