"""Admission: a bounded queue in front of each pair's owner, the service's one backpressure.

Every Observe message that passed its checks at the edge (the gRPC adapter) is
handed to its pair's queue with :meth:`Admission.submit`. One owner task per pair
takes the messages in the order they came and applies them
(:meth:`avest.state.app.Avest.apply`): it alone folds, refits and, on replicas,
offers rows to the pending log. Nothing else writes a pair's estimator.

- **Backpressure.** The queue holds at most ``depth`` messages. When it is full,
  ``submit`` waits, so the stream that sent the message reads nothing more: its
  client's next messages wait in HTTP/2 flow control and on the client. Nothing
  is refused and nothing acknowledged is lost (a message is acknowledged only once
  it was applied and made durable).
- **Fairness.** Streams waiting for room are let in first come, first served
  (asyncio's queue wakes its putters in order), so a busy stream gets one place in
  the line per message like a light one, and the light worker's message waits
  behind at most one message of each busy stream.
- **Refits at most so often.** A round that is full refits at once unless the
  pair refitted less than ``min_refit_s`` ago; then it stays open, pooling what
  comes, and the owner refits it when the interval is over. Refits and coefficient
  pushes per pair are so bounded whatever the number of workers and their rate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from avest.core.estimator import Batch
from avest_wire.summary import RoundSummary
from avest_wire.v1 import estimator_pb2 as pb

log = logging.getLogger("avest")

#: Messages a pair's queue holds before its senders wait (the default of
#: ``--pair-queue``): a few milliseconds of folding, so a light worker's message
#: waits behind little, while a burst of many workers' rounds is taken whole.
DEFAULT_DEPTH = 64
#: Longest stretch an owner folds before it gives the event loop back (its reads,
#: writes and the other owners go on meanwhile).
HOLD_S = 0.002


@dataclass(slots=True)
class Message:
    """One checked Observe message waiting for its pair's owner."""

    worker: str
    sequence: int
    batch: Batch | RoundSummary
    #: A summary as received (replicas store it as it came), else ``None``.
    received: pb.RoundSummary | None
    #: Resolved with whether the message was new, once applied (or ``False`` when
    #: dropped: a pair deleted or a service draining; never acknowledged then).
    done: asyncio.Future[bool]
    #: A step's stratum per row, or a summary's stratum; ``None`` without strata.
    strata: tuple[str, ...] | str | None = None


#: What the owner calls for each message: returns whether it was new.
Apply = Callable[[Message], Awaitable[bool]]
#: What the owner calls when a held round may refit now.
RefitDue = Callable[[], bool]


class PairQueue:
    """One pair's bounded queue and its owner task."""

    def __init__(self, pair_id: str, depth: int, apply: Apply, refit_due: RefitDue,
                 min_refit_s: float) -> None:  # fmt: skip
        self.pair_id = pair_id
        self.queue: asyncio.Queue[Message | None] = asyncio.Queue(maxsize=max(1, depth))
        self._apply = apply
        self._refit_due = refit_due
        self.min_refit_s = min_refit_s
        #: When the pair last refitted (monotonic); a full round waits until
        #: ``min_refit_s`` after it.
        self.last_refit = -float("inf")
        #: Messages that found the queue full and waited for room.
        self.waited = 0
        #: Senders waiting for room now.
        self.held = 0
        self._getter: asyncio.Future[Message | None] | None = None
        #: Workers whose message failed to apply, with its sequence: their later
        #: messages already queued are refused too (applying them would skip the
        #: failed one, which a resend could then never fill), until the worker sends
        #: that sequence or an earlier one again.
        self._failed: dict[str, int] = {}
        self._task = asyncio.create_task(self._run(), name=f"avest-owner-{pair_id[:12]}")

    def may_refit(self) -> bool:
        """Whether a full round may refit now (the owner asks before each message)."""
        return time.monotonic() - self.last_refit >= self.min_refit_s

    def refitted(self) -> None:
        self.last_refit = time.monotonic()

    async def submit(self, message: Message) -> None:
        if not self.queue.full():
            self.queue.put_nowait(message)
            return
        self.waited += 1
        self.held += 1
        try:
            await self.queue.put(message)
        finally:
            self.held -= 1

    async def _next(self) -> Message | None:
        """The next message; in between, a round held past its length refits once
        its interval is over. (The wait for a message with a timeout keeps its
        getter across turns: a getter cancelled by a timeout could lose a message.)"""
        while True:
            wait = self.last_refit + self.min_refit_s - time.monotonic()
            if wait <= 0 and self._refit_due():
                continue  # refitted: ask again with the new time
            if self._getter is None:
                if wait <= 0 or not self.queue.empty():
                    return await self.queue.get()
                self._getter = asyncio.ensure_future(self.queue.get())
            done, _ = await asyncio.wait({self._getter}, timeout=wait if wait > 0 else None)
            if done:
                getter, self._getter = self._getter, None
                return getter.result()

    async def _run(self) -> None:
        held_since = time.monotonic()
        while True:
            # A queue that is never empty never suspends the owner: give the loop
            # back after HOLD_S of folding, so its reads and writes go on.
            if time.monotonic() - held_since >= HOLD_S:
                await asyncio.sleep(0)
                held_since = time.monotonic()
            message = await self._next()
            if message is None:
                return
            failed = self._failed.get(message.worker)
            if failed is not None:
                if message.sequence > failed:
                    if not message.done.done():
                        message.done.set_exception(
                            RuntimeError(f"step {failed} of this worker failed to apply")
                        )
                    continue
                del self._failed[message.worker]  # resent from the failed one on
            try:
                new = await self._apply(message)
            except Exception as exc:
                self._failed[message.worker] = message.sequence
                if not message.done.done():
                    message.done.set_exception(exc)
                continue
            if not message.done.done():
                message.done.set_result(new)

    def drop(self) -> None:
        """Stop the owner: what waits in the queue is dropped, never acknowledged."""
        while not self.queue.empty():
            message = self.queue.get_nowait()
            if message is not None and not message.done.done():
                message.done.set_result(False)
        if self._getter is not None:
            self._getter.cancel()
        self._task.cancel()

    @property
    def depth(self) -> int:
        return self.queue.qsize()


class Admission:
    """Every pair's queue, made on the pair's first message."""

    def __init__(self, depth: int = DEFAULT_DEPTH, min_refit_s: float = 0.0) -> None:
        self.depth = depth
        self.min_refit_s = min_refit_s
        self.queues: dict[str, PairQueue] = {}
        #: When pairs without a queue here last refitted (a replica folding the pending
        #: log refits pairs whose messages other replicas received).
        self._refitted_at: dict[str, float] = {}
        #: Waits of queues that are gone (deleted pairs), so the total only grows.
        self._waited_before = 0

    def queue(self, pair_id: str, apply: Apply, refit_due: RefitDue) -> PairQueue:
        q = self.queues.get(pair_id)
        if q is None:
            q = self.queues[pair_id] = PairQueue(
                pair_id, self.depth, apply, refit_due, self.min_refit_s
            )
        return q

    def may_refit(self, pair_id: str) -> bool:
        q = self.queues.get(pair_id)
        if q is not None:
            return q.may_refit()
        at = self._refitted_at.get(pair_id)
        return at is None or time.monotonic() - at >= self.min_refit_s

    def refitted(self, pair_id: str) -> None:
        q = self.queues.get(pair_id)
        if q is not None:
            q.refitted()
        else:
            self._refitted_at[pair_id] = time.monotonic()

    def forget(self, pair_id: str) -> None:
        self._refitted_at.pop(pair_id, None)
        q = self.queues.pop(pair_id, None)
        if q is not None:
            self._waited_before += q.waited
            q.drop()

    def close(self) -> None:
        for pair_id in list(self.queues):
            self.forget(pair_id)

    @property
    def full(self) -> bool:
        """Whether some pair's senders wait for room in its queue now."""
        return any(q.held for q in self.queues.values())

    @property
    def waiting(self) -> int:
        """Messages queued in front of every owner."""
        return sum(q.depth for q in self.queues.values())

    @property
    def waited(self) -> int:
        """Messages that found their pair's queue full and waited for room, so far."""
        return self._waited_before + sum(q.waited for q in self.queues.values())
