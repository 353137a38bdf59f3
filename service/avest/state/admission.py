"""Admission: room for the Observe messages the service holds, and each pair's owner.

- **Room** (:class:`Room`, the service's one backpressure). A stream takes room
  before it checks a message it read, and gives it back once the pair's owner has
  applied it, so the service holds at most ``in_flight`` messages checked and not
  applied, whatever the number of streams. A stream without room waits with its one
  message read and reads nothing more: its client's next messages wait in HTTP/2
  flow control and on the client. Nothing is refused, and nothing acknowledged is
  lost (a message is acknowledged only once applied and made durable).
- **Fairness.** Room is given first come, first served, so a busy stream gets one
  place in the line per message like a light one: a light worker's message waits
  behind at most one message of each busy stream.
- **Short turns.** The event loop also reads, writes and accepts new calls; with
  a few messages in hand it never holds more than a few messages' work between two
  of those (bench/loop_latency.py, ``aio-gated``), so new streams open and unary
  calls answer while the owners fold flat out.
- **One owner per pair.** One task per pair takes its messages in the order they
  came and applies them (:meth:`avest.state.app.Avest.apply`): it alone folds,
  refits and, on replicas, offers rows to the pending log. Nothing else writes a
  pair's estimator.
- **Refits at most so often.** A round that is full refits at once unless the
  pair refitted less than ``min_refit_s`` ago; then it stays open, pooling what
  comes, and the owner refits it when the interval is over. Refits and coefficient
  pushes per pair are so bounded whatever the number of workers and their rate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from avest.core.estimator import Batch
from avest_wire.summary import RoundSummary
from avest_wire.v1 import estimator_pb2 as pb

log = logging.getLogger("avest")

#: Messages checked and not yet applied, across every stream (the default of
#: ``--in-flight``). A message passes the loop several times on its way (room, check,
#: its owner, room back), so a few keep the owners busy only if each turn is short:
#: at 1,000 busy streams 16 applied 1,330-1,390 summaries a second where 4 applied
#: 580-1,150 (bench/bench_fleet.py --overload, bench/RESULTS.md); more lengthens the
#: loop's turns, and grpc.aio takes new calls one per turn (bench/loop_latency.py,
#: ``aio-gated``: 2 opened 1,000 streams within 1.9 s, 16 within 9.3 s).
DEFAULT_IN_FLIGHT = 16
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


class Room:
    """Room for ``size`` messages, given first come, first served."""

    def __init__(self, size: int) -> None:
        self.size = max(1, size)
        self.taken = 0
        #: Streams waiting for room, oldest first.
        self._waiting: deque[asyncio.Future[None]] = deque()
        #: Messages that found no room and waited, so far.
        self.waited = 0

    async def take(self) -> None:
        if self.taken < self.size and not self._waiting:
            self.taken += 1
            return
        self.waited += 1
        wait: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(wait)
        try:
            await wait  # handed over by give(): counted in taken already
        except asyncio.CancelledError:
            if wait.done() and not wait.cancelled():
                self.give()  # handed over as the waiter was cancelled: pass it on
            raise

    def give(self, _: object = None) -> None:
        """Give one message's room back (usable as a future's done callback)."""
        while self._waiting:
            wait = self._waiting.popleft()
            if not wait.done():
                wait.set_result(None)
                return
        self.taken -= 1

    @property
    def held(self) -> int:
        """Streams waiting for room now."""
        return sum(1 for wait in self._waiting if not wait.done())


class PairQueue:
    """One pair's queue (bounded by the service's :class:`Room`) and its owner task."""

    def __init__(self, pair_id: str, apply: Apply, refit_due: RefitDue,
                 min_refit_s: float) -> None:  # fmt: skip
        self.pair_id = pair_id
        self.queue: asyncio.Queue[Message | None] = asyncio.Queue()
        self._apply = apply
        self._refit_due = refit_due
        self.min_refit_s = min_refit_s
        #: When the pair last refitted (monotonic); a full round waits until
        #: ``min_refit_s`` after it.
        self.last_refit = -float("inf")
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

    def submit(self, message: Message) -> None:
        self.queue.put_nowait(message)

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
            except asyncio.CancelledError:
                if not message.done.done():  # dropped: never acknowledged, its room back
                    message.done.set_result(False)
                raise
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
    """The service's room for messages, and every pair's queue, made on the pair's
    first message."""

    def __init__(self, in_flight: int = DEFAULT_IN_FLIGHT, min_refit_s: float = 0.0) -> None:
        self.room = Room(in_flight)
        self.min_refit_s = min_refit_s
        self.queues: dict[str, PairQueue] = {}
        #: When pairs without a queue here last refitted (a replica folding the pending
        #: log refits pairs whose messages other replicas received).
        self._refitted_at: dict[str, float] = {}

    def queue(self, pair_id: str, apply: Apply, refit_due: RefitDue) -> PairQueue:
        q = self.queues.get(pair_id)
        if q is None:
            q = self.queues[pair_id] = PairQueue(pair_id, apply, refit_due, self.min_refit_s)
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
            q.drop()

    def close(self) -> None:
        for pair_id in list(self.queues):
            self.forget(pair_id)

    @property
    def full(self) -> bool:
        """Whether streams wait for room now."""
        return self.room.held > 0

    @property
    def waiting(self) -> int:
        """Messages queued in front of every owner."""
        return sum(q.depth for q in self.queues.values())

    @property
    def waited(self) -> int:
        """Messages that found no room and waited for it, so far."""
        return self.room.waited
