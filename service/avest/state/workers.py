"""The workers seen sending to a pair: last summary, coefficients version, drafts.

One :class:`WorkerTable` per pair, updated on the event loop as steps and
summaries are applied (duplicates are not counted). It is bounded: past
``capacity`` workers the one seen longest ago is forgotten (and counted in
``forgotten``), so a fleet whose worker ids change with every restart cannot
grow it without end. It is kept in memory only: after a restart it fills
again as workers send.

Metrics read :meth:`WorkerTable.top`: the ``limit`` most recently seen
workers by id, everything else folded into one ``other`` row, so the number
of series per pair stays bounded whatever the fleet.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

from avest_wire.summary import RoundSummary

#: Workers remembered per pair.
DEFAULT_CAPACITY = 4096
#: The row that folds every worker beyond a metric's limit.
OTHER = "other"


@dataclass
class WorkerSeen:
    """What a pair knows of one worker."""

    worker_id: str
    first_seen: float
    last_seen: float
    #: ``summary`` when its last message was a round summary, else ``raw``.
    mode: str = "raw"
    summaries: int = 0
    raw_steps: int = 0
    #: Decode steps covered (summaries' steps plus raw steps).
    steps: int = 0
    #: Labelled drafts (summaries' drafts plus raw steps' labelled drafts).
    drafts: int = 0
    #: Coefficients version of the last summary, and how many versions it was behind.
    version: int | None = None
    lag: int = 0
    last_summary: float | None = None
    #: Steps and drafts of the last summary.
    last_steps: int = 0
    last_drafts: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


class WorkerTable:
    """Workers by id, most recently seen last; at most ``capacity`` of them."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._rows: OrderedDict[str, WorkerSeen] = OrderedDict()
        self.forgotten = 0

    def __len__(self) -> int:
        return len(self._rows)

    def _touch(self, worker: str, now: float) -> WorkerSeen:
        row = self._rows.get(worker)
        if row is None:
            row = self._rows[worker] = WorkerSeen(worker, now, now)
            while len(self._rows) > self.capacity:
                self._rows.popitem(last=False)
                self.forgotten += 1
        else:
            self._rows.move_to_end(worker)
        row.last_seen = now
        return row

    def summary(self, worker: str, summary: RoundSummary, lag: int) -> None:
        now = time.time()
        row = self._touch(worker, now)
        row.mode = "summary"
        row.summaries += 1
        row.steps += summary.steps
        row.drafts += summary.drafts
        row.version, row.lag = summary.version, max(0, lag)
        row.last_summary = now
        row.last_steps, row.last_drafts = summary.steps, summary.drafts

    def raw(self, worker: str, labelled: int) -> None:
        row = self._touch(worker, time.time())
        row.mode = "raw"
        row.raw_steps += 1
        row.steps += 1
        row.drafts += labelled

    def rows(self) -> list[WorkerSeen]:
        """Every remembered worker, most recently seen first (copies)."""
        return [replace(r) for r in reversed(self._rows.values())]

    def top(self, limit: int) -> list[WorkerSeen]:
        """The ``limit`` most recently seen workers, then one ``other`` row folding the rest.

        ``other`` sums counts, keeps the largest lag and the latest times; its
        version is the oldest one among the folded workers.
        """
        rows = self.rows()
        head, tail = rows[:limit], rows[limit:]
        if not tail:
            return head
        other = WorkerSeen(OTHER, min(r.first_seen for r in tail), max(r.last_seen for r in tail))
        other.mode = "mixed"
        for r in tail:
            other.summaries += r.summaries
            other.raw_steps += r.raw_steps
            other.steps += r.steps
            other.drafts += r.drafts
            other.lag = max(other.lag, r.lag)
            if r.version is not None:
                other.version = (
                    r.version if other.version is None else min(other.version, r.version)
                )
        return [*head, other]
