"""Heavy steps folded off the event loop.

A raw step of ``fold_thread_cells`` draft cells or more (2 MiB of features is
8192 rows x K = 64: about half a second of numpy) is folded on a worker thread
into a copy of its pair's estimator, which takes the estimator's place once
done. numpy releases the interpreter lock, so health, coefficients, pushes and
other pairs' owners keep going meanwhile; readers and snapshots see the pair
as it was before the step, never halfway through it. The pair's owner
(:mod:`avest.state.admission`) waits for the fold, so its other steps keep
their order.
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

    def heavy(self, batch: Batch | RoundSummary) -> bool:
        return (
            isinstance(batch, Batch) and self.cells > 0 and int(batch.features.size) >= self.cells
        )

    async def fold(
        self, estimator: OnlineEstimator, batch: Batch, may_refit: bool = True
    ) -> Folded:
        """``batch`` folded into a copy of ``estimator`` on a worker thread."""
        into = copy.deepcopy(estimator)

        def apply() -> Folded:
            stats = into.contribution(batch)
            return into, into.apply(batch, stats, may_refit), stats

        return await asyncio.get_running_loop().run_in_executor(self._threads, apply)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
