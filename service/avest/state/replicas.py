"""Replicas: several ``avest serve`` processes on one PostgreSQL database.

Every process whose store is PostgreSQL is a replica; one alone is a set of one.

- **Any replica takes any stream.** A round summary, raw step or command it
  receives is appended to the ``pending`` log (one row each, unique per worker
  and sequence) by its group commit, and acknowledged once that transaction has
  committed: nothing acknowledged lives in one process's memory only.
- **One replica at a time refits a pair**: the one holding the pair's advisory
  lock (:class:`~avest.state.postgres.Leadership`; PostgreSQL releases it when
  that replica's session ends, so a replica that dies hands its pairs over). It
  folds the pair's pending rows in the order they were stored, through the same
  code one process runs (:meth:`Avest.observe`: judging each worker, refits), and
  writes the snapshot and deletes the rows it folded in one transaction: a row is
  folded exactly once, by whichever refitter commits it. A refitter that took a
  pair over reads it from the store first.
- **Raw steps are forwarded, not folded where they arrive.** Folding them at the
  receiving replica would need each replica's round sums rebased and merged at
  every refit and would split each worker's evidence, which robust pooling judges
  whole; as rows of one log they are folded as one process folds them, so N
  replicas give one replica's coefficients. The cost is the refitter's CPU: pairs
  are spread over the replicas (each takes at most its share), not one pair's
  steps.
- **Every replica learns of a new version** by ``LISTEN``/``NOTIFY`` (and, should
  a notification be lost, by polling each pair's revision every
  :data:`LEASE_EVERY_S`), reads the pair and pushes it to its streams.
- **Admin changes** (cost curves, reset, releasing a worker) are rows of the same
  log, applied by the refitter in order with the steps.

Everything here runs on the event loop except the PostgreSQL calls: the refitting
session's on a thread of its own, the store's on the store's thread, the
listener's on a third.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import math
import secrets
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import numpy as np

from avest.core.estimator import Batch
from avest.state.costs import CostCurves
from avest.state.errors import Unavailable
from avest.state.pairs import Pair, Registry
from avest.state.postgres import (
    PAIRS_CHANNEL,
    PENDING_CHANNEL,
    Leadership,
    PostgresStore,
    StoreWriteRefused,
    listen,
    lock_key,
)
from avest.state.store import StoreUnreadable
from avest.state.store_format import npz_bytes
from avest_wire.messages import summary_from_checked_pb, summary_to_pb
from avest_wire.summary import RoundSummary
from avest_wire.v1 import estimator_pb2 as pb

log = logging.getLogger("avest")
T = TypeVar("T")

#: How often a refitter folds the pending rows of its pairs that have some (each
#: fold writes the pair's snapshot once, however many rows it folds): the longest
#: a summary waits in the log before it counts (its acknowledgement does not wait).
FOLD_EVERY_S = 0.25
#: How often every pair a replica refits is looked at for pending rows, notified
#: or not (a notification lost while the listener reconnected).
SWEEP_EVERY_S = 10.0
#: How often a replica records its heartbeat, takes pairs nobody refits (a
#: replica that died: its sessions' locks are gone at once) and reads the
#: revisions it missed. Fail-over takes at most about this long.
LEASE_EVERY_S = 1.0
#: A replica whose heartbeat is older than this is not counted in the shares.
LIVE_S = 5.0
#: Pending rows folded per transaction: a refit transaction stays short (the
#: snapshot is written once per this many rows), and a backlog is folded in turns.
FOLD_ROWS = 512
#: Rows appended to the pending log per transaction: a backlog (an outage's, or a fleet
#: sending more than the replica stores) goes in chunks, each acknowledged as it
#: commits. A pair sending little waits for the chunk being written and its own
#: (:class:`PendingRows`): a few hundred rows keep that within a fraction of a second
#: under load, and a transaction still carries enough rows for its commit to matter
#: little.
APPEND_ROWS = 256
#: Bytes received and not yet in the pending log, past which streams wait (no step
#: read from them) until a write makes room: PostgreSQL unreachable holds the
#: steps on the workers, not in this process's memory.
MAX_QUEUED_BYTES = 64 << 20
#: The worker id of admin-change rows: no worker has it (ids are 1 byte or more).
COMMANDS = ""
#: A step's stratum per row, a summary's stratum, or None (as ``Avest.submit`` takes them).
Strata = Sequence[str] | str | None
#: The kinds of pending rows.
SUMMARY, STEP, COSTS, RESET, RELEASE = "summary", "step", "costs", "reset", "release"


def encode(
    batch: Batch | RoundSummary,
    message: pb.RoundSummary | None = None,
    strata: tuple[str, ...] | str | None = None,
) -> tuple[str, bytes]:
    """A step or round summary as a pending row's kind and payload (``message``: the
    summary as received, stored as it came rather than encoded again; ``strata``: a
    step's per row, or the summary's, as :meth:`Avest.submit` takes them)."""
    if isinstance(batch, RoundSummary):
        if message is None:
            message = summary_to_pb(batch)
            if isinstance(strata, str):
                message.stratum = strata
        return SUMMARY, message.SerializeToString()
    arrays = {"features": batch.features, "observed": batch.observed, "accepted": batch.accepted}
    if strata is not None:
        # Names hold no control character: a newline separates them.
        arrays["strata"] = np.frombuffer("\n".join(strata).encode(), dtype=np.uint8)
    return STEP, npz_bytes(arrays)


def decode(kind: str, payload: bytes, k: int) -> Batch | RoundSummary:
    """A pending row as the replica that received it checked it: not checked again."""
    return decode_stratified(kind, payload, k)[0]


def decode_stratified(
    kind: str, payload: bytes, k: int
) -> tuple[Batch | RoundSummary, tuple[str, ...] | str | None]:
    """:func:`decode` with the row's strata (None: a row without strata)."""
    if kind == SUMMARY:
        msg = pb.RoundSummary.FromString(payload)
        return summary_from_checked_pb(msg, k), msg.stratum or None
    with np.load(io.BytesIO(payload), allow_pickle=False) as npz:
        batch = Batch(npz["features"], npz["observed"], npz["accepted"])
        if "strata" not in npz.files:
            return batch, None
        names = npz["strata"].tobytes().decode()
    rows = batch.features.shape[0]
    return batch, tuple(names.split("\n")) if rows else ()


Row = tuple[str, str, int, str, bytes]


class PendingRows:
    """Rows received and not yet in the pending log, ``(pair, worker, sequence, kind,
    payload)``: a first-in-first-out lane per pair, written each pair's oldest in turn
    (:meth:`take`). A pair sending little so waits for one write, not behind the
    backlog of a pair sending flat out; each pair's rows keep their order (its commands
    among its steps). Rows taken stay counted until :meth:`stored` (or :meth:`put_back`
    when their write failed)."""

    def __init__(self) -> None:
        self.lanes: dict[str, deque[Row]] = {}
        #: Rows, steps and summaries among them (not commands), and payload bytes held.
        self.rows = 0
        self.steps = 0
        self.bytes = 0

    def __len__(self) -> int:
        return self.rows

    def append(self, row: Row) -> None:
        self.lanes.setdefault(row[0], deque()).append(row)
        self._count(row, 1)

    def take(self, limit: int) -> list[Row]:
        """Up to ``limit`` rows, one of each pair's in turn, out of their lanes."""
        chunk: list[Row] = []
        while len(chunk) < limit and self.lanes:
            for pair_id in list(self.lanes):
                lane = self.lanes[pair_id]
                chunk.append(lane.popleft())
                if not lane:
                    del self.lanes[pair_id]
                if len(chunk) == limit:
                    break
        return chunk

    def put_back(self, chunk: list[Row]) -> None:
        """Rows :meth:`take` gave whose write failed: first again in their lanes."""
        for row in reversed(chunk):
            self.lanes.setdefault(row[0], deque()).appendleft(row)

    def stored(self, chunk: list[Row]) -> None:
        for row in chunk:
            self._count(row, -1)

    def drop(self, pair_id: str) -> None:
        """The pair is gone: its rows not yet taken are not written."""
        for row in self.lanes.pop(pair_id, ()):
            self._count(row, -1)

    def _count(self, row: Row, sign: int) -> None:
        self.rows += sign
        self.steps += sign * (row[1] != COMMANDS)
        self.bytes += sign * len(row[4])


class Host(Protocol):
    """What a replica's part needs of the service that made it (the state's
    :class:`~avest.state.app.Avest`)."""

    registry: Registry
    #: The last store error while it lasts, and the failures by operation.
    store_error: str
    store_errors: dict[str, int]

    def observe(
        self, pair: Pair, worker: str, seq: int, batch: Batch | RoundSummary, *, strata: Strata
    ) -> bool: ...

    def adopt(self, record: dict[str, Any]) -> Pair: ...

    def forget(self, pair: Pair, why: str) -> None: ...

    def saved(self, pair: Pair, record: dict[str, Any]) -> None: ...

    def mark_durable(self, raised: list[tuple[str, str, int]]) -> None: ...

    def store_failed(self, operation: str, exc: BaseException) -> None: ...

    def flush_soon(self) -> None: ...

    async def in_store(self, call: Callable[..., T], *args: Any) -> T: ...


class Replication:
    """This replica's part: its pending log writes, the pairs it refits, and what it
    learns of the others'. Made and started by :class:`~avest.state.app.Avest`."""

    def __init__(self, app: Host, store: PostgresStore, name: str) -> None:
        self.app = app
        self.store = store
        self.name = name
        self.started = time.time()
        self.leadership = Leadership(store, name)
        self._session = ThreadPoolExecutor(max_workers=1, thread_name_prefix="avest-lead")
        #: Pairs this replica refits (holds the lock of).
        self.led: set[str] = set()
        #: Pairs to read from the store before anything else (taken over, or a
        #: refit whose write failed: memory may be ahead of the store).
        self.stale: set[str] = set()
        #: Pairs another replica wrote with new coefficients (read at once), and
        #: pairs it wrote with only their counters moved (read at the next sweep).
        self.outdated: set[str] = set()
        self.lagging: set[str] = set()
        #: Rows received and not yet stored.
        self.queue = PendingRows()
        #: ``(pair, worker) -> `` the highest sequence received here.
        self.received: dict[tuple[str, str], int] = {}
        #: Pairs registered here and not yet stored.
        self.new: set[str] = set()
        #: Replicas alive at the last heartbeat.
        self.live = 1
        #: ``lock key -> `` the replica refitting the pairs of that key, as of the last
        #: lease pass.
        self.refitters: dict[int, str] = {}
        #: Pending rows this replica folded, rows it could not decode (dropped), and
        #: reads or folds of one pair that failed (retried).
        self.folded_rows = 0
        self.undecodable_rows = 0
        self.pair_errors = 0
        #: Set while the bytes of :attr:`queue` are under the bound.
        self._room = asyncio.Event()
        self._room.set()

        self._wake = asyncio.Event()
        self._lease_due = 0.0
        #: Pairs refitted here with rows pending (notified), and when folds and the
        #: sweep of every pair refitted here are next due.
        self.due: set[str] = set()
        self._fold_due = 0.0
        self._sweep_due = 0.0
        self._stop = threading.Event()
        self._listener: threading.Thread | None = None
        self._loop_task: asyncio.Task[None] | None = None

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()

        def deliver(channel: str, payload: str) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._notified, channel, payload)

        self._listener = threading.Thread(
            target=listen, args=(self.store, deliver, self._stop), name="avest-listen", daemon=True
        )
        self._listener.start()
        self.app.store_errors.setdefault("refit", 0)
        await self._lease()
        self._loop_task = asyncio.create_task(self._run(), name="avest-replica")

    async def close(self) -> None:
        """Fold what is pending of the pairs led here, hand them over, and leave."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        for pid in sorted(self.led):
            try:
                await self._fold(pid)
            except Exception as exc:
                log.warning("pair %s: last fold before leaving failed: %s", pid, exc)
        with contextlib.suppress(Exception):
            await self._in_session(self.leadership.leave)
        self.led.clear()
        await self._in_session(self.leadership.close)
        self._session.shutdown(wait=True)
        self._stop.set()

    def leads(self, pair: Pair) -> bool:
        return pair.id in self.led

    def refitter(self, pair: Pair) -> str:
        """The replica refitting the pair ("" while none does)."""
        return self.name if pair.id in self.led else self.refitters.get(lock_key(pair.id), "")

    @property
    def backlog(self) -> int:
        """Steps and round summaries received here and not yet handed to the
        pending log's write (so not yet acknowledged); admin changes left out."""
        return self.queue.steps

    # -- what the service receives ---------------------------------------------

    def offer(
        self,
        pair: Pair,
        worker: str,
        seq: int,
        batch: Batch | RoundSummary,
        message: pb.RoundSummary | None = None,
        strata: tuple[str, ...] | str | None = None,
    ) -> bool:
        """Queue a step or summary for the pending log; False for one already received
        (folded, stored or queued). ``message``: the summary as received (with its
        stratum); ``strata``: a step's per row."""
        key = (pair.id, worker)
        known = max(
            self.received.get(key, 0), pair.durable.get(worker, 0), pair.applied.get(worker, 0)
        )
        if seq <= known:
            return False
        self.received[key] = seq
        self._queue((pair.id, worker, seq, *encode(batch, message, strata)))
        return True

    def _queue(self, row: Row) -> None:
        self.queue.append(row)
        if self.queue.bytes > MAX_QUEUED_BYTES:
            self._room.clear()

    async def room(self) -> None:
        """Wait while the rows not yet in the pending log are over their bound."""
        await self._room.wait()

    def forget(self, pair_id: str) -> None:
        """The pair is gone (deleted): drop what this replica holds of it."""
        self.queue.drop(pair_id)
        if self.queue.bytes <= MAX_QUEUED_BYTES:
            self._room.set()
        for key in [k for k in self.received if k[0] == pair_id]:
            del self.received[key]
        for held in (self.led, self.stale, self.new, self.due, self.outdated, self.lagging):
            held.discard(pair_id)

    def command(self, pair: Pair, kind: str, payload: dict[str, Any] | None = None) -> None:
        """Queue an admin change for the pair's refitter, which applies it in order
        (a random sequence: unique among the replicas' commands)."""
        body = json.dumps(payload or {}).encode()
        self._queue((pair.id, COMMANDS, secrets.randbits(62) + 1, kind, body))
        self.app.flush_soon()

    def set_costs(self, pair: Pair, curves: CostCurves) -> None:
        pair.set_costs(curves)  # served here at once; stored by the refitter
        self.command(pair, COSTS, curves.as_dict())

    async def watermark(self, pair: Pair, worker: str) -> tuple[int, int]:
        """What the replicas hold of a worker: ``(applied, acknowledged)``, both the
        highest sequence stored (folded or pending) or received here."""
        try:
            stored = await self.app.in_store(self.store.watermark, pair.id, worker)
        except Exception as exc:  # unreachable: the worker opens again later
            raise Unavailable(
                f"pair {pair.id}: what the replicas hold of worker {worker!r} cannot be read "
                f"now ({type(exc).__name__}); open it again shortly"
            ) from exc
        durable = max(stored, pair.durable.get(worker, 0))
        pair.durable[worker] = durable
        return max(durable, self.received.get((pair.id, worker), 0)), durable

    async def flush(self) -> None:
        """Store the pairs registered here and the rows received, each chunk of rows
        acknowledged as it commits."""
        new = [p for p in (self.app.registry.pairs.get(i) for i in sorted(self.new)) if p]
        if new:
            records = [self.app.registry.snapshot(p) for p in new]
            created = await self.app.in_store(self.store.create, records)
            self.new.difference_update(r["id"] for r in records)
            for pair in new:
                if pair.id in created:
                    pair.revision = created[pair.id]
                else:
                    self.stale.add(pair.id)  # another replica stored it first: take its state
                    self.outdated.add(pair.id)
            self._lease_due = 0.0
            self._wake.set()
        while self.queue.lanes:
            rows = self.queue.take(APPEND_ROWS)
            try:
                await self.app.in_store(self.store.append_pending, rows, self.name)
            except BaseException:
                self.queue.put_back(rows)
                raise
            self.queue.stored(rows)
            if self.queue.bytes <= MAX_QUEUED_BYTES:
                self._room.set()
            self.app.mark_durable(self._stored(rows))

    def _stored(self, rows: list[Row]) -> list[tuple[str, str, int]]:
        """The rows are in the pending log: the watermarks they raise (acknowledged)."""
        raised: dict[tuple[str, str], int] = {}
        for pid, worker, seq, _, _ in rows:
            pair = self.app.registry.pairs.get(pid)
            if pair is None or worker == COMMANDS:
                continue
            if seq > pair.durable.get(worker, 0):
                pair.durable[worker] = seq
                raised[(pid, worker)] = seq
            if self.received.get((pid, worker), 0) <= seq:
                self.received.pop((pid, worker), None)  # the pair's watermark covers it
        return [(pid, worker, seq) for (pid, worker), seq in raised.items()]

    # -- what the replicas share ---------------------------------------------------

    def _notified(self, channel: str, payload: str) -> None:
        if channel == PENDING_CHANNEL:
            if payload in self.led:
                self.due.add(payload)  # folded at the next fold time, with what comes meanwhile
            return
        if channel == PAIRS_CHANNEL and payload.startswith("-"):
            pair = self.app.registry.pairs.get(payload[1:])
            if pair is not None:
                self.led.discard(pair.id)
                self.app.forget(pair, "deleted")
            return
        if channel == PAIRS_CHANNEL:
            pid, _, version = payload.partition(" ")
            if pid not in self.led:
                self._written(pid, int(version or -1))
        else:  # (re)connected: notifications may have been missed
            self._lease_due = self._sweep_due = 0.0
        self._wake.set()

    async def _each(self, pid: str, step: Callable[[str], Awaitable[Any]]) -> None:
        """One pair's read or fold: a failure that is the pair's own (its rows do not
        decode, its snapshot another write overtook) is logged and the pair tried
        again, and the other pairs go on; PostgreSQL unreachable stops the pass."""
        try:
            await step(pid)
        except (StoreWriteRefused, StoreUnreadable):
            raise
        except Exception as exc:
            self.stale.add(pid)
            if pid in self.led:
                self.due.add(pid)
            self.pair_errors += 1
            log.warning("replica %s: pair %s: %s: %s; read again and retried",
                        self.name, pid, type(exc).__name__, exc)  # fmt: skip

    def _written(self, pid: str, version: int) -> None:
        """Another replica wrote the pair: read it now if its coefficients moved (or it
        is new here), at the next sweep if only its counters did."""
        pair = self.app.registry.pairs.get(pid)
        if pair is None or version != pair.estimator.version:
            self.outdated.add(pid)
        else:
            self.lagging.add(pid)

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=FOLD_EVERY_S)
            self._wake.clear()
            try:
                if time.monotonic() >= self._lease_due:
                    await self._lease()
                for pid in sorted(self.outdated - self.led):
                    self.outdated.discard(pid)
                    await self._each(pid, self._read)
                now = time.monotonic()
                if now >= self._sweep_due:
                    self._sweep_due = now + SWEEP_EVERY_S
                    self.due |= self.led
                    for pid in sorted(self.lagging - self.led):
                        await self._each(pid, self._read)
                    self.lagging.clear()
                if now >= self._fold_due:
                    self._fold_due = now + FOLD_EVERY_S
                    for pid in sorted(self.due & self.led):
                        self.due.discard(pid)
                        await self._each(pid, self._fold)
                    self.due &= self.led
                if self.app.store_error.startswith("store refit"):
                    log.warning("replica %s: refits resumed", self.name)
                    self.app.store_error = ""
            except Exception as exc:
                self.due |= self.led  # fold them again (each reads the store first)
                self.app.store_failed("refit", exc)
                log.warning("replica %s: %s; retrying", self.name, self.app.store_error)
                self._lease_due = 0.0
                await asyncio.sleep(FOLD_EVERY_S)

    async def _lease(self) -> None:
        """Heartbeat; read pairs stored or changed elsewhere; take the pairs nobody
        refits up to this replica's share, and hand over those beyond it."""
        self._lease_due = time.monotonic() + LEASE_EVERY_S
        if not self.leadership.alive():
            if self.led:
                log.warning("replica %s lost its session: refits %d pair(s) no more",
                            self.name, len(self.led))  # fmt: skip
            self.led.clear()
            await self._in_session(self.leadership.connect)
        self.live = await self._in_session(self.leadership.heartbeat, self.started, LIVE_S)
        registry = self.app.registry.pairs
        # Pairs known stored before the read: one the read lacks was deleted since.
        stored = {pid for pid, pair in registry.items() if pair.revision > 0}
        revisions = await self.app.in_store(self.store.revisions)
        for pid in sorted(stored - set(revisions)):
            if pid not in registry:
                continue
            self.led.discard(pid)
            self.app.forget(registry[pid], "deleted")
        for pid, (revision, version) in sorted(revisions.items()):
            pair = registry.get(pid)
            if pair is None:
                await self._read(pid)
            elif pid not in self.led and revision != pair.revision:
                self._written(pid, version)
        share = math.ceil(len(revisions) / self.live)
        start = hash(self.name) % max(1, len(revisions))
        order = sorted(revisions)
        self.refitters = await self._in_session(self.leadership.refitters)
        # Locks this session holds for no pair it refits (a pair deleted meanwhile)
        # go, or the pair registered again under that key would have no refitter.
        mine = {key for key, name in self.refitters.items() if name == self.name}
        for key in sorted(mine - {lock_key(pid) for pid in self.led}):
            await self._in_session(self.leadership.unlock_key, key)
            del self.refitters[key]
        free = {pid for pid in order if lock_key(pid) not in self.refitters}
        for pid in order[start:] + order[:start]:
            if len(self.led) >= share:
                break
            if pid not in free:
                continue
            if await self._in_session(self.leadership.try_lock, pid):
                self.led.add(pid)
                self.stale.add(pid)
                self.due.add(pid)
                self.refitters[lock_key(pid)] = self.name
                log.info("replica %s refits pair %s", self.name, pid)
        for pid in sorted(self.led)[share:]:
            await self._fold(pid)
            self.led.discard(pid)
            await self._in_session(self.leadership.unlock, pid)
            log.info("replica %s hands pair %s over", self.name, pid)

    async def _read(self, pid: str) -> Pair | None:
        """Take the stored state of a pair: a new one, or a newer one."""
        record, revision = await self.app.in_store(self.store.load_pair, pid)
        pair = self.app.registry.pairs.get(pid)
        if record is None:
            if pair is not None and pair.revision > 0:
                self.led.discard(pid)
                self.app.forget(pair, "deleted")
            return None
        if pair is None:
            pair = self.app.adopt(record)
        else:
            self.app.registry.refresh(pair, record)
        pair.revision = revision
        return pair

    async def _fold(self, pid: str) -> None:
        """Fold the pair's pending rows and write the result (one transaction)."""
        if pid in self.stale:
            self.stale.discard(pid)
            if await self._read(pid) is None:
                return
        pair = self.app.registry.pairs.get(pid)
        if pair is None:
            return
        rows = await self._in_session(self.leadership.pending, pid, FOLD_ROWS)
        for _, worker, seq, kind, payload in rows:
            try:
                self._apply(pair, worker, seq, kind, payload)
            except Exception as exc:  # stored by an older or newer release: say so, go on
                self.undecodable_rows += 1
                log.error("pair %s: pending %s of %s dropped: %s", pid, kind, worker, exc)
        # A round held open by --min-refit-interval-ms refits once it is over; until
        # then the pair is folded again at each fold time (FOLD_EVERY_S).
        if pair.estimator.round_full:
            if self.app.admission.may_refit(pid):
                self.app.refit_held(pair)
            else:
                self.due.add(pid)
        if not rows and not pair.dirty:
            return
        record = self.app.registry.snapshot(pair)
        pair.dirty = False
        try:
            revision = await self._in_session(
                self.leadership.commit, record, [r[0] for r in rows], pair.revision
            )
        except BaseException:
            self.app.registry.unsnapshot(pair, record)
            self.stale.add(pid)  # memory is ahead of the store: read it again first
            self.due.add(pid)
            raise
        if not revision:
            self.app.forget(pair, "deleted")
            return
        self.folded_rows += len(rows)
        pair.revision = revision
        self.app.saved(pair, record)
        if len(rows) == FOLD_ROWS:  # more to fold: at once
            self.due.add(pid)
            self._fold_due = 0.0
            self._wake.set()

    def _apply(self, pair: Pair, worker: str, seq: int, kind: str, payload: bytes) -> None:
        if kind in (SUMMARY, STEP):
            batch, strata = decode_stratified(kind, payload, pair.k)
            self.app.observe(pair, worker, seq, batch, strata=strata)
        elif kind == COSTS:
            pair.set_costs(CostCurves.from_dict(json.loads(payload)))
        elif kind == RESET:
            pair.reset()
        elif kind == RELEASE:
            with contextlib.suppress(KeyError, ValueError):  # gone, or released already
                pair.workers.release(json.loads(payload)["worker"])
        else:
            raise ValueError(f"unknown kind {kind!r}")

    async def _in_session(self, call: Callable[..., T], *args: Any) -> T:
        """Run a call on the session's thread. A caller cancelled meanwhile (the
        service closing) still waits for it to end: a commit under way is never
        abandoned half-known, so what follows reads what it wrote."""
        done = asyncio.get_running_loop().run_in_executor(self._session, call, *args)
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await done
            raise
