"""Heavy steps folded off the event loop.

A raw step of ``fold_thread_cells`` draft cells or more (2 MiB of features is
8192 rows x K = 64: about half a second of numpy) is folded on a worker thread
into a copy of its pair's estimator, which takes the estimator's place once
done. numpy releases the interpreter lock, so health, coefficients, pushes and
other streams keep their turns meanwhile; readers and snapshots see the pair
as it was before the step, never halfway through it. While a heavy step is
folded, the pair's other steps wait for it (per-pair order).
"""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor

from avest.core.estimator import Batch, OnlineEstimator
from avest.core.rules import Refit
from avest.core.stats import RoundStats
from avest_wire.summary import RoundSummary

#: A heavy step folded: the estimator copy it was folded into, the refit it
#: closed (if any) and the step's round statistics as folded.
Folded = tuple[OnlineEstimator, Refit | None, RoundStats]


class Folds:
    def __init__(self, cells: int, threads: int = 2) -> None:
        #: Steps of at least this many cells are heavy (0: none is).
        self.cells = cells
        self._threads = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="avest-fold")
        #: Per pair: held while one of its heavy steps is folded.
        self._locks: dict[str, asyncio.Lock] = {}

    def heavy(self, batch: Batch | RoundSummary) -> bool:
        return (
            isinstance(batch, Batch) and self.cells > 0 and int(batch.features.size) >= self.cells
        )

    def busy(self, pair_id: str) -> asyncio.Lock | None:
        """The pair's lock while a heavy step of it is being folded, else ``None``."""
        lock = self._locks.get(pair_id)
        return lock if lock is not None and lock.locked() else None

    def lock(self, pair_id: str) -> asyncio.Lock:
        lock = self._locks.get(pair_id)
        if lock is None:
            lock = self._locks[pair_id] = asyncio.Lock()
        return lock

    async def fold(self, estimator: OnlineEstimator, batch: Batch) -> Folded:
        """``batch`` folded into a copy of ``estimator`` on a worker thread (the
        caller holds the pair's :meth:`lock`)."""
        into = copy.deepcopy(estimator)

        def apply() -> Folded:
            stats = into.contribution(batch)
            return into, into.apply(batch, stats), stats

        return await asyncio.get_running_loop().run_in_executor(self._threads, apply)

    def forget(self, pair_id: str) -> None:
        self._locks.pop(pair_id, None)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
