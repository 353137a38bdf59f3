"""The workers seen sending to a pair: last summary, coefficients version, drafts.

One :class:`WorkerTable` per pair, updated on the event loop as steps and
summaries are applied (duplicates are not counted). It is bounded: past
``capacity`` workers the one seen longest ago is forgotten (and counted in
``forgotten``), so a fleet whose worker ids change with every restart cannot
grow it without end. It is kept in memory only: after a restart it fills
again as workers send.

Each step or summary is judged before it is folded (:meth:`WorkerTable.judge`,
the statistics of :mod:`avest.core.quarantine`): the worker's recent evidence
is scored against the other workers in good standing; a worker beyond the
margin is quarantined (its data is scored and counted, not folded) until its
score comes back within the margin or an admin releases it; a worker in good
standing has its share of each round bounded. The table keeps the evidence of
the workers in good standing summed (``pool``), so a judgement costs O(K)
whatever the fleet. Quarantine is kept in memory like the rest of the table:
after a restart every worker starts in good standing and is scored afresh.

Metrics read :meth:`WorkerTable.top`: the ``limit`` most recently seen
workers by id, everything else folded into one ``other`` row, so the number
of series per pair stays bounded whatever the fleet.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from avest.core.quarantine import (
    MIN_RATE_DRAFTS,
    NO_REFERENCE,
    QUARANTINE_Z,
    RELEASE_Z,
    STRIKES,
    Evidence,
    Reference,
    RoundShare,
    reference,
    score,
)
from avest.core.stats import RoundStats
from avest_wire.summary import RoundSummary

#: Workers remembered per pair.
DEFAULT_CAPACITY = 4096
#: The row that folds every worker beyond a metric's limit.
OTHER = "other"
#: A worker's standing: its data is folded (``ok``) or scored only (``quarantined``).
OK = "ok"
QUARANTINED = "quarantined"


@dataclass
class WorkerSeen:
    """What a pair knows of one worker."""

    worker_id: str
    first_seen: float
    last_seen: float
    #: ``summary`` when its last message was a round summary, else ``raw``.
    mode: str = "raw"
    summaries: int = 0
    #: Round summaries that carried their calibration sketch (the service asks for
    #: one in fewer rounds as more of a pair's workers stream: ``--sketched-workers``).
    sketches: int = 0
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
    #: ``ok`` or ``quarantined`` (:mod:`avest.core.quarantine`).
    state: str = OK
    #: Its last score against the other workers (``None`` before it could be judged).
    score: float | None = None
    #: Times quarantined, and the steps and drafts scored but not folded meanwhile.
    quarantines: int = 0
    quarantined_steps: int = 0
    quarantined_drafts: int = 0
    #: Messages held back beyond the margin before a quarantine, and their steps.
    held: int = 0
    held_steps: int = 0
    #: Messages in a row beyond the margin, signed by the side (+: more accepted).
    strikes: int = 0
    #: When it was last quarantined or released (Unix time).
    state_since: float | None = None

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
        #: Refits (and resets) of the pair seen, and rounds' worth of steps a round
        #: held open pooled past its length: the clock evidence decays by.
        self.clock = 0
        #: Refits (and resets) alone: a worker's share of a round is bounded per refit.
        self.rounds = 0
        #: Each worker's recent evidence and its share of the open round.
        self._evidence: dict[str, Evidence] = {}
        self._shares: dict[str, RoundShare] = {}
        #: The evidence of every worker in good standing, summed, and the residual
        #: rates of those with enough of it (what the reference is made of).
        self.pool = Evidence()
        self._rates: dict[str, float] = {}
        self._reference: Reference = NO_REFERENCE
        #: What the reference was computed at: the refits seen and the workers with
        #: a rate (``_members`` moves when one enters or leaves); -1 forces anew.
        self._reference_at = (-1, -1)
        self._members = 0
        #: Information ``a, c`` pooled into the open round and into the last one ``[2, K]``.
        self._round_info: np.ndarray | None = None
        self._last_round_info: np.ndarray | None = None
        self.quarantined = 0
        #: Steps scored but not folded, over every worker (forgotten ones too).
        self.quarantined_steps = 0
        #: Moves whenever a worker's standing changes (for the metrics' cache).
        self.changes = 0

    def __len__(self) -> int:
        return len(self._rows)

    def _touch(self, worker: str, now: float) -> WorkerSeen:
        row = self._rows.get(worker)
        if row is None:
            row = self._rows[worker] = WorkerSeen(worker, now, now)
            while len(self._rows) > self.capacity:
                _, gone = self._rows.popitem(last=False)
                self._forget(gone)
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
        row.sketches += summary.sketch is not None
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

    # -- standing ---------------------------------------------------------------

    def tick(self) -> None:
        """The pair refitted or was reset: evidence ages by one refit, a new round opens."""
        self.clock += 1
        self.rounds += 1
        self._last_round_info, self._round_info = self._round_info, None

    def age(self) -> None:
        """A round held open by the refit interval pooled another round's worth of
        steps: evidence ages as by a refit, the round (and each worker's share of
        it) stays open."""
        self.clock += 1

    def judge(
        self,
        worker: str,
        stats: RoundStats,
        steps: int,
        round_key: object,
        seen: RoundStats | None = None,
    ) -> RoundStats | None:
        """Score ``worker``'s step or summary and decide: the statistics to fold
        (bounded to the worker's share of the round ``round_key``), or ``None``
        while the worker is quarantined.

        ``stats``: its round statistics at the coefficients in force, covering
        ``steps`` decode steps; ``seen``: the same scored at the coefficients the
        worker held (a summary's sums as sent), what its score is made of.
        """
        seen = stats if seen is None else seen
        row = self._touch(worker, time.time())
        own = self._evidence.setdefault(worker, Evidence(clock=self.clock)).at(self.clock)
        good = row.state == OK
        own.add(seen)
        if good:
            self.pool.at(self.clock).add(seen)
            self._rate(worker, own)
        ref = self.reference()
        if ref.judges:
            z = score(own, ref)
            row.score = z
            # A quarantine needs a majority in good standing to judge against.
            majority = 2 * (self.quarantined + 1) < len(self._rows)
            if good and abs(z) > QUARANTINE_Z and majority:
                side = 1 if z > 0 else -1
                row.strikes = row.strikes + side if row.strikes * side > 0 else side
                if abs(row.strikes) >= STRIKES:
                    self._set(row, QUARANTINED)
                    good = False
                else:
                    row.held += 1
                    row.held_steps += steps
                    return None
            elif good:
                row.strikes = 0
            elif abs(z) < RELEASE_Z:
                self._set(row, OK)
                good = True
        if not good:
            row.quarantined_steps += steps
            row.quarantined_drafts += int(round(float(stats.n.sum())))
            self.quarantined_steps += steps
            return None
        share = self._shares.get(worker)
        if share is None:
            share = self._shares[worker] = RoundShare(stats.k)
        shape = (2, stats.k)
        last = self._last_round_info
        pooled = last if last is not None and last.shape == shape else np.zeros(shape)
        kept = share.bound(stats, (self.rounds, round_key), pooled)
        if self._round_info is None or self._round_info.shape != shape:
            self._round_info = np.zeros(shape)
        self._round_info[0] += kept.a
        self._round_info[1] += kept.c
        return kept

    def reference(self) -> Reference:
        """What workers are judged against now: recomputed once per refit, after a
        worker's standing changed and, while it cannot judge yet, when a worker's
        rate enters or leaves it. Not at each round a held round ages the evidence
        by: that decays every worker alike and leaves their rates as they are, and
        a recomputation visits every worker (it was O(workers) per summary in a
        fleet whose every summary fills a round)."""
        at = self._reference_at
        if at[0] != self.rounds or (not self._reference.judges and at[1] != self._members):
            for w in list(self._rates):
                if self._evidence[w].at(self.clock).drafts < MIN_RATE_DRAFTS:
                    del self._rates[w]
                    self._members += 1
            self._reference = reference(list(self._rates.values()), self.pool.at(self.clock))
            self._reference_at = (self.rounds, self._members)
        return self._reference

    def _rate(self, worker: str, own: Evidence) -> None:
        if own.drafts >= MIN_RATE_DRAFTS:
            if worker not in self._rates:
                self._members += 1
            self._rates[worker] = own.residual / own.drafts
        elif self._rates.pop(worker, None) is not None:
            self._members += 1

    def release(self, worker: str) -> WorkerSeen:
        """An admin's release: back in good standing with its evidence forgotten
        (judged afresh on what it sends next). ``KeyError`` for an unknown worker,
        ``ValueError`` when it is not quarantined."""
        row = self._rows.get(worker)
        if row is None:
            raise KeyError(worker)
        if row.state != QUARANTINED:
            raise ValueError(f"worker {worker!r} is not quarantined")
        self._evidence[worker] = Evidence(clock=self.clock)
        self._set(row, OK)
        row.score = None
        return replace(row)

    def _set(self, row: WorkerSeen, state: str) -> None:
        """Move ``row`` to ``state``, its evidence into or out of the pool."""
        own = self._evidence.setdefault(row.worker_id, Evidence(clock=self.clock)).at(self.clock)
        pool = self.pool.at(self.clock)
        if state == QUARANTINED:
            self.pool = pool.plus(own, -1.0)
            self._rates.pop(row.worker_id, None)
            self.quarantined += 1
            row.quarantines += 1
        else:
            self.pool = pool.plus(own)
            self._rate(row.worker_id, own)
            self.quarantined -= 1
        self._shares.pop(row.worker_id, None)
        self._reference_at = (-1, -1)
        row.state = state
        row.state_since = time.time()
        row.strikes = 0
        self.changes += 1

    def _forget(self, row: WorkerSeen) -> None:
        own = self._evidence.pop(row.worker_id, None)
        self._shares.pop(row.worker_id, None)
        if self._rates.pop(row.worker_id, None) is not None:
            self._members += 1
        if row.state == QUARANTINED:
            self.quarantined -= 1
            self.changes += 1
        elif own is not None:
            self.pool = self.pool.at(self.clock).plus(own.at(self.clock), -1.0)

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
            if r.state == QUARANTINED:
                other.state = QUARANTINED
            other.quarantines += r.quarantines
            other.quarantined_steps += r.quarantined_steps
            other.quarantined_drafts += r.quarantined_drafts
            other.held += r.held
            other.held_steps += r.held_steps
            other.summaries += r.summaries
            other.sketches += r.sketches
            other.raw_steps += r.raw_steps
            other.steps += r.steps
            other.drafts += r.drafts
            other.lag = max(other.lag, r.lag)
            if r.version is not None:
                other.version = (
                    r.version if other.version is None else min(other.version, r.version)
                )
        return [*head, other]
