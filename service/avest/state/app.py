"""The service application: pairs, persistence and notifications.

:class:`Avest` is what the gRPC and HTTP adapters share. It owns the
:class:`~avest.state.pairs.Registry`, writes snapshots to the
:class:`~avest.state.store.PairStore` on a thread of its own (group commit: every
``flush_interval_ms`` and right after each refit; the store is the SQLite file
or a PostgreSQL database, :mod:`avest.state.stores`), and tells listeners when
batches become durable (so Observe streams can acknowledge them) and when
coefficients change (so streams and watchers get the update).

Everything here runs on the event loop thread except the store writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from avest.core.estimator import Batch
from avest.core.rules import Refit
from avest.state.admission import Admission, Message
from avest.state.config import StateConfig
from avest.state.folds import Folded, Folds
from avest.state.pairs import Pair, Registry, RuleConfig
from avest.state.recording import Recording
from avest.state.schedules import Schedules
from avest.state.store import PairStore
from avest.state.stores import open_configured
from avest_wire.pair import PairKey
from avest_wire.summary import RoundSummary
from avest_wire.v1 import estimator_pb2 as pb

if TYPE_CHECKING:
    from avest.state.costs import CostCurves
    from avest.state.replicas import Replication

log = logging.getLogger("avest")
T = TypeVar("T")

#: Draft positions (sum of K) per write transaction: two K = 64 pairs (each takes
#: tens of milliseconds to snapshot and compress) or about twenty-five K = 5 pairs.
CHUNK_POSITIONS = 128
#: How often idle workers and pairs are looked for.
MAINTAIN_EVERY_S = 10.0
#: Wait at least this long between retries of a failed write.
RETRY_S = 0.5


@dataclass
class Hooks:
    """Callbacks the adapters and metrics attach to (all on the loop thread)."""

    #: ``(pair)`` after a pair is registered or restored.
    registered: list[Callable[[Pair], None]] = field(default_factory=list)
    #: ``(pair, refit, seconds)`` after each refit.
    refit: list[Callable[[Pair, Refit, float], None]] = field(default_factory=list)
    #: ``(pair)`` whenever a pair's coefficients change (refit, reset, restore).
    coefficients: list[Callable[[Pair], None]] = field(default_factory=list)
    #: ``([(pair_id, worker, sequence), ...])`` after a snapshot is durable: the
    #: workers whose acknowledged watermark it raised, and the new watermarks.
    durable: list[Callable[[list[tuple[str, str, int]]], None]] = field(default_factory=list)
    #: ``(pair, rows, labelled)`` after each applied batch.
    observed: list[Callable[[Pair, int, int], None]] = field(default_factory=list)
    #: ``(pair, why)`` after a pair is removed ("deleted", "retired").
    removed: list[Callable[[Pair, str], None]] = field(default_factory=list)
    #: ``(pairs, seconds)`` after each chunk of the group commit is durable: its pairs,
    #: and the seconds from their snapshot to their acknowledgements.
    written: list[Callable[[int, float], None]] = field(default_factory=list)


class Avest:
    def __init__(self, config: StateConfig, store: PairStore | None = None) -> None:
        self.config = config
        self.registry = Registry(
            RuleConfig(config.default_rule, config.refit_interval, config.forgetting, config.prior),
            max_pairs=config.max_pairs,
        )
        if store is None:
            store = open_configured(config)
        self.store = store
        #: What catches a lost store: the state file beside SQLite, ``meta`` in PostgreSQL.
        self.state_file = store.guard(config.data_dir)
        self.hooks = Hooks()
        #: Pairs whose stored state failed to load: ``id -> reason`` (kept aside).
        self.quarantined: dict[str, str] = {}
        #: The last store error while it lasts ("" once a write succeeds again).
        self.store_error = ""
        #: Store errors by operation (write, delete), for the metrics.
        self.store_errors: dict[str, int] = {"write": 0, "delete": 0}
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="avest-store")
        #: Heavy steps, folded on worker threads.
        self.folds = Folds(config.fold_thread_cells)
        #: Each pair's bounded queue and its owner, which applies what streams send.
        self.admission = Admission(config.pair_queue, config.min_refit_s)
        #: Each pair's draft-length schedule per hardware label, the latest kept.
        self.schedules = Schedules()
        self._flush_now = asyncio.Event()
        #: One write at a time: a caller waiting on flush() also waits for the
        #: write already under way, so "after flush" means "durable".
        self._flush_lock = asyncio.Lock()
        self._flusher: asyncio.Task[None] | None = None
        self._closed = False
        self._maintained = time.time()
        #: Callbacks telling whether a pair is in use (open streams), for retirement.
        self.usage: list[Callable[[Pair], bool]] = []
        self.ready = False
        #: Set by the server when it starts draining: /readyz answers 503 from then on.
        self.draining = False
        #: Pair id -> the recording of its raw steps in progress or finished (admin API).
        self.recordings: dict[str, Recording] = {}
        #: This replica's part when the store is shared (PostgreSQL), else None.
        self.replication: Replication | None = None

    # -- lifecycle ----------------------------------------------------------

    async def start(self) -> None:
        """Restore every pair from the store, then start the group-commit loop.

        The store is checked first, and damage it can repair is repaired (SQLite:
        :meth:`~avest.state.store.Store.load_at_start`). A pair whose own stored
        state cannot be read, fails its checksum or does not decode is quarantined
        (kept aside in the store, reported) and the others serve; so do the pairs set
        aside at earlier starts stay aside, until an admin deletes them. A store
        whose damage cannot be repaired is rebuilt from the readable pairs, nothing
        written into the damaged file first. A pair whose rows the disk refuses to
        read (an I/O error) is not served either, and nothing is set aside for it:
        its rows are read again at the next start.
        """
        loop = asyncio.get_running_loop()
        if self.store.backup is not None:
            log.warning(
                "store migrated from format %d; the previous file is kept as %s",
                self.store.found_format,
                self.store.backup,
            )
        load = getattr(self.store, "load_at_start", self.store.load)
        loaded = await loop.run_in_executor(self._writer, load)
        if loaded.repaired:
            log.warning("store repaired at start: %s", loaded.repaired)
        problems = dict(loaded.quarantined)
        for record in loaded.records:
            try:
                pair = self.registry.restore(record)
            except Exception as exc:  # a snapshot that decodes but does not restore
                problems[record["id"]] = f"{type(exc).__name__}: {exc}"
                continue
            self._attach(pair)
            log.info("restored pair %s at version %d", pair.id, pair.estimator.version)
        for pid, why in loaded.unreadable.items():
            self.quarantined[pid] = why
            log.error("pair %s not served: %s; its rows are left as they are", pid, why)
        for pid, why in loaded.set_aside.items():
            self.quarantined[pid] = why
            log.warning("pair %s stays set aside until an admin deletes it (%s)", pid, why)
        # While the disk refuses reads, damage cannot be told from it: nothing is set aside.
        settle = not loaded.unreadable
        damaged = loaded.damaged if settle else ""
        for pid, reason in problems.items():
            self.quarantined[pid] = reason
            log.error("pair %s quarantined (%s); the other pairs serve", pid, reason)
            if damaged or not settle:
                continue  # nothing written into a file about to be set aside
            try:
                kept = await loop.run_in_executor(self._writer, self.store.quarantine, pid, reason)
            except Exception as exc:  # the disk, not the file: its rows stay where they are
                log.error("pair %s stays in the store as it is: %s", pid, exc)
                continue
            if not kept:
                damaged = f"the rows of pair {pid} cannot be removed"
        if damaged:
            good = [r for r in loaded.records if r["id"] not in problems]
            aside = await loop.run_in_executor(self._writer, self.store.rebuild, good, problems)
            log.error(
                "store damaged (%s): rebuilt from the %d readable pair(s); the damaged file "
                "is kept, unchanged, as %s",
                damaged,
                len(good),
                aside,
            )
        held = len(self.registry.pairs) + len(self.quarantined)
        self.state_file.check_loaded(held, self.config.allow_empty_store)
        self.state_file.check_unrecorded(
            held, self.config.refuse_empty_store, self.config.allow_empty_store
        )
        self.state_file.record(len(self.registry.pairs))
        if getattr(self.store, "replicated", False):
            from avest.state.replicas import Replication

            # Unique per process: two replicas of one name would take each other's
            # session for their own (and end it).
            name = self.config.replica_name or f"{socket.gethostname()}-{os.getpid()}"
            self.replication = Replication(self, self.store, name)  # type: ignore[arg-type]
            await self.replication.start()
            log.info("replica %s: %d pair(s), refits %d of them",
                     name, len(self.registry.pairs), len(self.replication.led))  # fmt: skip
        self._flusher = asyncio.create_task(self._flush_loop(), name="avest-flush")
        self.ready = True

    async def close(self, deadline: float | None = None) -> None:
        """Final snapshot of what changed (by ``deadline``, a monotonic time), then close.

        Only dirty pairs are written, in chunks, and no chunk starts after the
        deadline: steps left unwritten were never acknowledged, so their
        workers resend them to the next process.
        """
        if self._closed:
            return
        self._closed = True
        self.ready = False
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
        try:
            await self.flush(deadline=deadline)
        except Exception as exc:  # one line: what the store said (a traceback adds nothing)
            log.error(
                "final snapshot failed (%s); unacknowledged steps will be resent",
                self.store_error or f"{type(exc).__name__}: {exc}",
            )
        if self.replication is not None:
            await self.replication.close()
        await asyncio.get_running_loop().run_in_executor(self._writer, self.store.close)
        self._writer.shutdown(wait=True)
        self.folds.close()
        self.admission.close()

    # -- operations ---------------------------------------------------------

    def register(self, key: PairKey, rule: str = "", refit_interval: int = 0) -> tuple[Pair, bool]:
        """The key's pair, registered if new. A pair set aside at start (its stored
        state unreadable) is refused (:class:`~avest.state.errors.Conflict`): it is
        not registered again, empty, over what the store keeps of it."""
        why = self.quarantined.get(key.pair_id)
        if why is not None and key.pair_id not in self.registry.pairs:
            from avest.state.errors import Conflict

            if why.startswith("store I/O error"):
                raise Conflict(
                    "pair_id",
                    f"pair {key.pair_id} is not served: the disk refused to read its stored "
                    f"state ({why}). It is not registered again, empty, over that state: "
                    "restart once the disk reads again, or have an admin delete the pair "
                    f"(DELETE /v1/pairs/{key.pair_id}) to begin it afresh",
                )
            raise Conflict(
                "pair_id",
                f"pair {key.pair_id} is set aside (quarantined at start: {why}). It is not "
                "registered again, empty, until an admin deletes it (DELETE "
                f"/v1/pairs/{key.pair_id}, or DeletePair), which drops what the store kept "
                "of it",
            )
        pair, created = self.registry.register(key, rule, refit_interval)
        if created:
            self._attach(pair)
            if self.replication is not None:
                self.replication.new.add(pair.id)
            self._flush_now.set()
        return pair, created

    async def submit(
        self,
        pair: Pair,
        worker: str,
        seq: int,
        batch: Batch | RoundSummary,
        message: pb.RoundSummary | None = None,
        strata: tuple[str, ...] | str | None = None,
    ) -> asyncio.Future[bool]:
        """Hand a checked step or round summary to its pair's owner
        (:mod:`avest.state.admission`); waits while the pair's queue is full. The
        future resolves with whether it was new, once applied. ``strata``: a step's
        stratum per row or a summary's stratum (docs/strata.md), None without."""
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        queue = self.admission.queue(
            pair.id, lambda m: self._apply(pair, m), lambda: self.refit_held(pair)
        )
        await queue.submit(Message(worker, seq, batch, message, done, strata))
        return done

    async def _apply(self, pair: Pair, m: Message) -> bool:
        """What the pair's owner does with one message: :meth:`observe`, with a heavy
        step folded off the event loop (:mod:`avest.state.folds`). A step folded
        while its pair was reset is folded again; one whose pair was deleted, or
        that comes while the service drains, is dropped (never acknowledged: its
        worker resends it).

        Replicas: the step goes to the pending log, folded by the pair's refitter
        (``m.received``: a summary as received, stored as it came)."""
        worker, seq, batch, strata = m.worker, m.sequence, m.batch, m.strata
        if self.draining or self.registry.pairs.get(pair.id) is not pair:
            return False
        if self.replication is not None:
            await self.replication.room()
            return self.replication.offer(pair, worker, seq, batch, m.received, strata)
        if not self.folds.heavy(batch):
            return self.observe(pair, worker, seq, batch, strata=strata)
        if seq <= pair.applied.get(worker, -1) or not isinstance(batch, Batch):
            return self.observe(pair, worker, seq, batch, strata=strata)  # a duplicate
        before = pair.estimator
        mark = (before.version, before.steps)
        folded = await self.folds.fold(before, batch, self.admission.may_refit(pair.id))
        if self.draining or self.registry.pairs.get(pair.id) is not pair:
            return False
        if pair.estimator is not before or (before.version, before.steps) != mark:
            # reset meanwhile: fold again
            return self.observe(pair, worker, seq, batch, strata=strata)
        return self.observe(pair, worker, seq, batch, folded, strata)

    def observe(
        self,
        pair: Pair,
        worker: str,
        seq: int,
        batch: Batch | RoundSummary,
        folded: Folded | None = None,
        strata: Sequence[str] | str | None = None,
    ) -> bool:
        """Apply one validated step or round summary (``strata``: its strata, see
        :meth:`submit`); returns whether it was new.
        A round it fills refits now unless the pair refitted less than
        ``min_refit_s`` ago (then :meth:`refit_held` refits it later)."""
        t0 = time.perf_counter()
        may_refit = self.admission.may_refit(pair.id)
        applied, refit = pair.observe(worker, seq, batch, folded, may_refit, strata)
        if not applied:
            return False
        if isinstance(batch, Batch):
            recording = self.recordings.get(pair.id)
            if recording is not None:
                recording.offer(batch)
            rows = int(batch.features.shape[0])
            for hook in self.hooks.observed:
                hook(pair, rows, batch.labelled)
        if refit is not None:
            self._refitted(pair, refit, time.perf_counter() - t0)
        return True

    def refit_held(self, pair: Pair) -> bool:
        """Refit the pair's round held open by the refit interval, if any."""
        if self.draining or self.registry.pairs.get(pair.id) is not pair:
            return False
        t0 = time.perf_counter()
        refit = pair.refit_held()
        if refit is None:
            return False
        self._refitted(pair, refit, time.perf_counter() - t0)
        return True

    def _refitted(self, pair: Pair, refit: Refit, elapsed: float) -> None:
        self.admission.refitted(pair.id)
        for refit_hook in self.hooks.refit:
            refit_hook(pair, refit, elapsed)
        self._flush_now.set()

    def reset(self, pair: Pair) -> None:
        if self.replication is not None:
            self.replication.command(pair, "reset")
            return
        pair.reset()
        self._flush_now.set()

    def set_costs(self, pair: Pair, curves: CostCurves) -> None:
        if self.replication is not None:
            self.replication.set_costs(pair, curves)
        else:
            pair.set_costs(curves)

    def release(self, pair: Pair, worker: str) -> Any:
        """Return a quarantined worker to the fit (its row in the worker table)."""
        row = pair.workers.release(worker)
        if self.replication is not None:
            self.replication.command(pair, "release", {"worker": worker})
        return row

    async def watermark(self, pair: Pair, worker: str) -> tuple[int, int]:
        """What the pair holds of a worker: ``(applied, acknowledged)`` sequences."""
        if self.replication is not None:
            return await self.replication.watermark(pair, worker)
        durable = pair.durable.get(worker, 0)
        return max(pair.applied.get(worker, 0), durable), durable

    def adopt(self, record: dict[str, Any]) -> Pair:
        """Register a pair another replica stored."""
        pair = self.registry.restore(record)
        self._attach(pair)
        return pair

    def forget(self, pair: Pair, why: str) -> None:
        """Drop a pair from memory (deleted, retired; or deleted by another replica)."""
        if self.registry.pairs.get(pair.id) is not pair:
            return
        self.registry.remove(pair)
        self.admission.forget(pair.id)
        self.schedules.forget(pair.id)
        if self.replication is not None:
            self.replication.forget(pair.id)
        pair.watchers.clear()
        for hook in self.hooks.removed:
            hook(pair, why)
        log.info("pair %s %s", pair.id, why)

    def flush_soon(self) -> None:
        self._flush_now.set()

    async def in_store(self, call: Callable[..., T], *args: Any) -> T:
        """Run a store call on the store's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._writer, call, *args)

    async def discard(self, pair_id: str) -> str | None:
        """Delete what the store keeps of a pair set aside at start (an admin's
        decision): its id registers afresh afterwards. Returns why it was set aside,
        or None when it was not; when the store refuses, nothing changes and the
        error rises."""
        why = self.quarantined.get(pair_id)
        if why is None:
            return None
        async with self._flush_lock:
            try:
                await self.in_store(self.store.delete, pair_id)
            except Exception as exc:
                self.store_failed("delete", exc)
                raise
            del self.quarantined[pair_id]
        log.warning("pair %s, set aside at start (%s), deleted by an admin", pair_id, why)
        return why

    async def remove(self, pair: Pair, why: str = "deleted") -> None:
        """Delete a pair: its stored rows, then the registry entry, its streams and
        watchers and its metric series (hooks). Its id may be registered again, from
        the cold start. When the store refuses, nothing changes and the error rises."""
        async with self._flush_lock:
            try:
                await asyncio.get_running_loop().run_in_executor(
                    self._writer, self.store.delete, pair.id
                )
            except Exception as exc:
                self.store_failed("delete", exc)
                raise
            self.forget(pair, why)
            self.state_file.record(len(self.registry.pairs))

    def _attach(self, pair: Pair) -> None:
        pair.watchers.append(self._coefficients_changed)
        for hook in self.hooks.registered:
            hook(pair)

    def _coefficients_changed(self, pair: Pair) -> None:
        for hook in self.hooks.coefficients:
            hook(pair)

    # -- persistence --------------------------------------------------------

    async def flush(self, force: bool = False, deadline: float | None = None) -> None:
        """Write every dirty pair, then mark its batches durable (:meth:`_flush`).

        The write runs to its end even when the caller is cancelled (an Observe
        stream whose client went away flushes as it ends): a snapshot taken
        and abandoned half way would leave its workers' steps written but never
        marked durable, and never acknowledged.
        """
        task = asyncio.ensure_future(self._flush(force, deadline))
        task.add_done_callback(_retrieve)
        await asyncio.shield(task)

    async def _flush(self, force: bool = False, deadline: float | None = None) -> None:
        """Write every dirty pair, then mark its batches durable.

        Only pairs that changed are written, and of each only what changed: the
        estimator's arrays, the workers that moved, and history entries and cost
        curves not yet saved.

        Pairs are written in chunks (one transaction each, about
        :data:`CHUNK_POSITIONS` draft positions), so that acknowledgements flow
        chunk by chunk and a drain never waits behind a long write: once the
        server drains, only its own flush (with a ``deadline``, a monotonic time
        no chunk starts after) goes on.
        """
        async with self._flush_lock:
            if self.replication is not None:
                # Replicas write the log; each pair's refitter writes the pair.
                started = time.perf_counter()
                pending = bool(self.replication.queue or self.replication.new)
                try:
                    await self.replication.flush()
                except Exception as exc:
                    self.store_failed("write", exc)
                    raise
                if pending:
                    for hook in self.hooks.written:
                        hook(0, time.perf_counter() - started)
                if self.store_error.startswith("store write"):
                    log.warning("store writes resumed after: %s", self.store_error)
                    self.store_error = ""
                return
            pairs = [p for p in self.registry.pairs.values() if p.dirty or force]
            for n, chunk in enumerate(_chunks(pairs)):
                if deadline is None and self.draining:
                    return  # the final snapshot, bounded by the grace period, takes over
                if deadline is not None and time.monotonic() >= deadline:
                    left = sum(len(c) for c in _chunks(pairs)[n:])
                    log.warning(
                        "grace period over: %d pair(s) not written; their workers resend "
                        "the unacknowledged steps",
                        left,
                    )
                    return
                await self._write(chunk)

    async def _write(self, pairs: list[Pair]) -> None:
        if not pairs:
            return
        started = time.perf_counter()
        records: list[dict[str, Any]] = []
        for pair in pairs:
            records.append(self.registry.snapshot(pair))
            pair.dirty = False
        try:
            await asyncio.get_running_loop().run_in_executor(
                self._writer, self.store.write, records
            )
        except Exception as exc:
            for pair, record in zip(pairs, records, strict=True):
                self.registry.unsnapshot(pair, record)
            self.store_failed("write", exc)
            raise
        if self.store_error:
            log.warning("store writes resumed after: %s", self.store_error)
        self.store_error = ""
        raised: list[tuple[str, str, int]] = []
        for pair, record in zip(pairs, records, strict=True):
            raised += pair.saved(record)
        self.state_file.record(len(self.registry.pairs))
        self.mark_durable(raised)
        for hook in self.hooks.written:
            hook(len(pairs), time.perf_counter() - started)

    def saved(self, pair: Pair, record: dict[str, Any]) -> None:
        """A snapshot of the pair another path wrote (a replica's refit) is durable."""
        self.mark_durable(pair.saved(record))

    def mark_durable(self, raised: list[tuple[str, str, int]]) -> None:
        """``(pair, worker, sequence)`` watermarks now durable: acknowledge them."""
        if raised:
            for hook in self.hooks.durable:
                hook(raised)

    def store_failed(self, operation: str, exc: BaseException) -> None:
        self.store_errors[operation] = self.store_errors.get(operation, 0) + 1
        self.store_error = f"store {operation} failed: {type(exc).__name__}: {exc}"

    async def _flush_loop(self) -> None:
        interval = self.config.flush_interval_ms / 1000.0
        reported = ""  # the store error last logged
        loop = asyncio.get_running_loop()
        due = loop.time() + interval
        while True:
            # One group commit per interval from the start of the last, not from its
            # end: a step applied as a write begins waits at most the interval plus
            # the next write, not two writes and the interval.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._flush_now.wait(), timeout=max(0.0, due - loop.time()))
            self._flush_now.clear()
            due = loop.time() + interval
            if self.draining:
                return  # the server's final snapshot, bounded by the grace period, takes over
            try:
                await self.flush()
                await self._maintain()
                reported = ""
            except Exception as exc:  # keep serving; the pairs stay dirty and retry
                # Once per error, not at every retry (avest_store_errors_total counts them):
                # a full disk would otherwise log a line every RETRY_S until it is freed.
                said = self.store_error or str(exc)
                if said != reported:
                    log.warning("%s; retrying (acks wait until a write succeeds)", said)
                    reported = said
                await asyncio.sleep(max(interval, RETRY_S))

    async def _maintain(self) -> None:
        """Prune idle workers' records and retire idle pairs (both optional settings)."""
        now = time.time()
        if now - self._maintained < MAINTAIN_EVERY_S:
            return
        self._maintained = now
        worker_ttl = self.config.worker_ttl_s
        if worker_ttl > 0:
            pruned = sum(
                len(p.prune_workers(now - worker_ttl)) for p in self.registry.pairs.values()
            )
            if pruned:
                log.info("pruned %d idle worker record(s)", pruned)
        pair_ttl = self.config.pair_ttl_s
        if pair_ttl > 0:
            for pair in list(self.registry.pairs.values()):
                if self.replication is not None and not self.replication.leads(pair):
                    continue  # its refitter retires it
                if pair.updated < now - pair_ttl and not self.in_use(pair):
                    await self.remove(pair, "retired")

    def in_use(self, pair: Pair) -> bool:
        """Whether an open stream is sending steps for the pair (set by the gRPC adapter)."""
        return any(check(pair) for check in self.usage)


def _retrieve(task: asyncio.Future[None]) -> None:
    """Collect a flush's outcome when its caller was cancelled (the flush loop or the
    next caller reports a failing store; nothing is logged as never retrieved)."""
    if not task.cancelled():
        task.exception()


def _chunks(pairs: list[Pair]) -> list[list[Pair]]:
    out: list[list[Pair]] = []
    size = CHUNK_POSITIONS
    for pair in pairs:
        if size + pair.k > CHUNK_POSITIONS:
            out.append([])
            size = 0
        out[-1].append(pair)
        size += pair.k
    return out
