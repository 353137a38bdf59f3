"""The service application: pairs, persistence and notifications.

:class:`Avest` is what the gRPC and HTTP adapters share. It owns the
:class:`~avest.state.pairs.Registry`, writes snapshots to the
:class:`~avest.state.store.Store` on a thread of its own (group commit: every
``flush_interval_ms`` and right after each refit), and tells listeners when
batches become durable (so Observe streams can acknowledge them) and when
coefficients change (so streams and watchers get the update).

Everything here runs on the event loop thread except the store writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from avest.core.estimator import Batch
from avest.core.rules import Refit
from avest.settings import Settings
from avest.state.pairs import Pair, PairKey, Registry, RuleConfig
from avest.state.store import Store

log = logging.getLogger("avest")


@dataclass
class Hooks:
    """Callbacks the adapters and metrics attach to (all on the loop thread)."""

    #: ``(pair)`` after a pair is registered or restored.
    registered: list[Callable[[Pair], None]] = field(default_factory=list)
    #: ``(pair, refit, seconds)`` after each refit.
    refit: list[Callable[[Pair, Refit, float], None]] = field(default_factory=list)
    #: ``(pair)`` whenever a pair's coefficients change (refit, reset, restore).
    coefficients: list[Callable[[Pair], None]] = field(default_factory=list)
    #: ``(pair_ids)`` after a snapshot covering those pairs is durable.
    durable: list[Callable[[set[str]], None]] = field(default_factory=list)
    #: ``(pair, rows, labelled)`` after each applied batch.
    observed: list[Callable[[Pair, int, int], None]] = field(default_factory=list)


class Avest:
    def __init__(self, settings: Settings, store: Store | None = None) -> None:
        self.settings = settings
        self.registry = Registry(
            RuleConfig(
                settings.default_rule, settings.refit_interval, settings.forgetting, settings.prior
            ),
            max_pairs=settings.max_pairs,
        )
        self.store = store if store is not None else Store(settings.database)
        self.hooks = Hooks()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="avest-store")
        self._flush_now = asyncio.Event()
        #: One write at a time: a caller waiting on flush() also waits for the
        #: write already under way, so "after flush" means "durable".
        self._flush_lock = asyncio.Lock()
        self._flusher: asyncio.Task[None] | None = None
        self._closed = False
        self.ready = False
        #: Set by the server when it starts draining: /readyz answers 503 from then on.
        self.draining = False

    # -- lifecycle ----------------------------------------------------------

    async def start(self) -> None:
        """Restore every pair from the store, then start the group-commit loop."""
        records = await asyncio.get_running_loop().run_in_executor(self._writer, self.store.load)
        for record in records:
            pair = self.registry.restore(record)
            self._attach(pair)
            log.info("restored pair %s at version %d", pair.id, pair.estimator.version)
        self._flusher = asyncio.create_task(self._flush_loop(), name="avest-flush")
        self.ready = True

    async def close(self) -> None:
        """Final snapshot of everything, then close the store."""
        if self._closed:
            return
        self._closed = True
        self.ready = False
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
        await self.flush(force=True)
        await asyncio.get_running_loop().run_in_executor(self._writer, self.store.close)
        self._writer.shutdown(wait=True)

    # -- operations ---------------------------------------------------------

    def register(self, key: PairKey, rule: str = "", refit_interval: int = 0) -> tuple[Pair, bool]:
        pair, created = self.registry.register(key, rule, refit_interval)
        if created:
            self._attach(pair)
            self._flush_now.set()
        return pair, created

    def observe(self, pair: Pair, worker: str, seq: int, batch: Batch) -> bool:
        """Apply one validated step; returns whether it was new (not a duplicate)."""
        t0 = time.perf_counter()
        applied, refit = pair.observe(worker, seq, batch)
        if not applied:
            return False
        rows = int(batch.features.shape[0])
        for hook in self.hooks.observed:
            hook(pair, rows, batch.labelled)
        if refit is not None:
            elapsed = time.perf_counter() - t0
            for refit_hook in self.hooks.refit:
                refit_hook(pair, refit, elapsed)
            self._flush_now.set()
        return True

    def reset(self, pair: Pair) -> None:
        pair.reset()
        self._flush_now.set()

    def _attach(self, pair: Pair) -> None:
        pair.watchers.append(self._coefficients_changed)
        for hook in self.hooks.registered:
            hook(pair)

    def _coefficients_changed(self, pair: Pair) -> None:
        for hook in self.hooks.coefficients:
            hook(pair)

    # -- persistence --------------------------------------------------------

    async def flush(self, force: bool = False) -> None:
        """Write every dirty pair in one transaction, then mark its batches durable.

        Only pairs that changed are written, and of each only what changed: the
        estimator's arrays, plus history entries and cost curves not yet saved."""
        async with self._flush_lock:
            await self._flush(force)

    async def _flush(self, force: bool) -> None:
        pairs = [p for p in self.registry.pairs.values() if p.dirty or force]
        if not pairs:
            return
        records: list[dict[str, Any]] = []
        for pair in pairs:
            records.append(self.registry.snapshot(pair))
            pair.dirty = False
        await asyncio.get_running_loop().run_in_executor(self._writer, self.store.write, records)
        for pair, record in zip(pairs, records, strict=True):
            pair.saved(record)
            for worker, seq in record["applied"].items():
                if seq > pair.durable.get(worker, 0):
                    pair.durable[worker] = seq
        ids = {p.id for p in pairs}
        for hook in self.hooks.durable:
            hook(ids)

    async def _flush_loop(self) -> None:
        interval = self.settings.flush_interval_ms / 1000.0
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._flush_now.wait(), timeout=interval)
            self._flush_now.clear()
            try:
                await self.flush()
            except Exception:  # keep serving; the pairs stay dirty and retry
                log.exception("snapshot write failed")
                for pair in self.registry.pairs.values():
                    pair.dirty = True
                await asyncio.sleep(interval)
