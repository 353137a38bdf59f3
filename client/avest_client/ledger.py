"""Delivery bookkeeping of one forwarder: sequence numbers, queue, acks, resends.

:class:`Ledger` is pure (no I/O, no threads of its own, one lock): the
transports (a thread with its own event loop for the sync client, a task for
the asyncio client) drive it, and the tests drive it directly.

Every step submitted gets the next sequence number (1, 2, ...) and lives in
one of two bounded deques until it is acknowledged, dropped or refused:

* ``queue``: waiting to be written on the current stream. Bounded by
  ``queue_size``; when full, :meth:`submit` drops the oldest waiting step.
* ``inflight``: written on the current stream, not yet acknowledged. Bounded
  by ``max_unacked``; when :meth:`next_to_send` would exceed it, the oldest
  in-flight step is dropped (it was delivered once and is most likely
  applied; it only loses its resend protection).

An acknowledgement watermark removes every step at or below it from both
deques. When a stream ends, :meth:`rewind` moves the in-flight steps back in
front of the queue (in order, trimmed to ``queue_size`` by dropping the
oldest) so they are resent before anything new. A step the server refused
(:meth:`refuse`) is discarded and never sent again.

Counters are exact: ``submitted == acked + dropped + refused + pending``
at every moment (``pending`` = steps in either deque).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any


@dataclass
class Step:
    """One decode step waiting for its acknowledgement."""

    sequence: int
    #: Transport payload (for the forwarders: the encoded arrays, later the message).
    payload: Any
    #: Times written to a stream.
    attempts: int = 0
    #: Cached wire message, built on first send.
    message: Any = None


@dataclass(frozen=True)
class Stats:
    """Exact counters of a forwarder (a consistent snapshot)."""

    #: Steps given to ``submit`` and accepted into the queue (sequence numbers assigned).
    submitted: int = 0
    #: Step messages written to a stream, resends included.
    sent: int = 0
    #: Writes that were resends of a step already written on an earlier stream.
    resent: int = 0
    #: Distinct steps covered by an acknowledgement.
    acked: int = 0
    #: Steps discarded locally (queue or in-flight bound), never acknowledged.
    dropped: int = 0
    #: Steps the server refused (INVALID_ARGUMENT / NOT_FOUND); dropped, never resent.
    refused: int = 0
    #: Steps refused locally by ``submit`` (bad shapes or dtypes); not counted in ``submitted``.
    invalid: int = 0
    #: Streams opened after the first one.
    reconnects: int = 0
    #: Steps still held (queued or in flight).
    pending: int = 0
    #: Highest sequence number acknowledged by the server.
    acked_sequence: int = 0
    #: Last sequence number assigned.
    last_sequence: int = 0
    #: Steps renumbered above the sequence an earlier sender of the same worker id
    #: left applied (:meth:`Ledger.continue_above`).
    renumbered: int = 0


#: What the ledger adds to as it goes; the rest of :class:`Stats` is read off its deques
#: and sequence numbers when a snapshot is taken.
_COUNTED = (
    "submitted", "sent", "resent", "acked", "dropped", "refused", "invalid", "reconnects",
    "renumbered",
)  # fmt: skip


class Ledger:
    """Sequence numbers, bounded queue and in-flight window, ack watermark (thread-safe)."""

    def __init__(self, queue_size: int = 1024, max_unacked: int | None = None) -> None:
        if queue_size < 1:
            raise ValueError("queue_size must be >= 1")
        self.queue_size = int(queue_size)
        self.max_unacked = int(max_unacked if max_unacked is not None else queue_size)
        if self.max_unacked < 1:
            raise ValueError("max_unacked must be >= 1")
        self._lock = threading.Lock()
        self._queue: deque[Step] = deque()
        self._inflight: deque[Step] = deque()
        self._next = 1
        self._watermark = 0
        self._count = dict.fromkeys(_COUNTED, 0)

    # -- producer side ------------------------------------------------------

    def submit(self, payload: Any) -> int:
        """Queue a step; drops the oldest waiting one when full. Returns its sequence."""
        with self._lock:
            seq = self._next
            self._next += 1
            if len(self._queue) >= self.queue_size:
                self._queue.popleft()
                self._count["dropped"] += 1
            self._queue.append(Step(seq, payload))
            self._count["submitted"] += 1
            return seq

    def count_invalid(self) -> None:
        with self._lock:
            self._count["invalid"] += 1

    # -- sender side ----------------------------------------------------------

    def next_to_send(self) -> Step | None:
        """The next step to write on the current stream (moved to in-flight), or None."""
        with self._lock:
            if not self._queue:
                return None
            step = self._queue.popleft()
            if len(self._inflight) >= self.max_unacked:
                self._inflight.popleft()
                self._count["dropped"] += 1
            self._inflight.append(step)
            if step.attempts:
                self._count["resent"] += 1
            step.attempts += 1
            self._count["sent"] += 1
            return step

    def has_unsent(self) -> bool:
        with self._lock:
            return bool(self._queue)

    def ack(self, watermark: int) -> int:
        """Apply an acknowledgement watermark; returns how many steps it released.

        An old watermark still releases steps it covers that were queued after it
        came: a sender that reuses a worker id (a rerun replay) resends steps the
        service already holds, and the service acknowledges each with the
        watermark it gave before.
        """
        with self._lock:
            watermark = max(watermark, self._watermark)
            self._watermark = watermark
            released = 0
            for dq in (self._inflight, self._queue):
                while dq and dq[0].sequence <= watermark:
                    dq.popleft()
                    released += 1
            self._count["acked"] += released
            return released

    def refuse(self, sequence: int | None) -> bool:
        """Discard the step the server refused (``None``: the oldest in flight).

        Returns whether a held step was discarded.
        """
        with self._lock:
            for dq in (self._inflight, self._queue):
                for i, step in enumerate(dq):
                    if sequence is None or step.sequence == sequence:
                        del dq[i]
                        self._count["refused"] += 1
                        return True
                    if sequence is not None and step.sequence > sequence:
                        break
            return False

    def rewind(self) -> int:
        """A stream ended: in-flight steps go back in front of the queue (to be resent).

        Keeps at most ``queue_size`` steps waiting, dropping the oldest.
        Returns how many steps were moved back.
        """
        with self._lock:
            moved = len(self._inflight)
            self._inflight.extend(self._queue)
            self._queue, self._inflight = self._inflight, deque()
            while len(self._queue) > self.queue_size:
                self._queue.popleft()
                self._count["dropped"] += 1
            return moved

    def _first_held(self) -> int:
        return self._queue[0].sequence if self._queue else self._next

    def first_held(self) -> int:
        """The sequence of the oldest queued step, or of the next one to be assigned."""
        with self._lock:
            return self._first_held()

    def never_sent(self) -> bool:
        """Whether no step was ever written to a stream."""
        with self._lock:
            return self._count["sent"] == 0

    def continue_above(self, applied: int) -> int:
        """Renumber every held step, and the ones to come, above ``applied`` (the
        sequence an earlier sender of the same worker id left applied), in order and
        with the same gaps; returns how far they moved (0: all were above already).

        Only before any step was written (:meth:`never_sent`): steps of this
        ledger are then new to the service, never duplicates of applied ones.
        """
        with self._lock:
            if self._count["sent"]:
                raise RuntimeError("steps were sent: their sequence numbers are taken")
            first = self._first_held()
            if applied < first:
                return 0
            shift = applied + 1 - first
            for step in self._queue:
                step.sequence += shift
                if step.message is not None:
                    step.message.sequence = step.sequence
            self._next += shift
            self._count["renumbered"] += len(self._queue)
            return shift

    def abandon(self) -> int:
        """Drop every held step (counted in ``dropped``); returns how many."""
        with self._lock:
            n = len(self._queue) + len(self._inflight)
            self._queue.clear()
            self._inflight.clear()
            self._count["dropped"] += n
            return n

    def count_reconnect(self) -> None:
        with self._lock:
            self._count["reconnects"] += 1

    # -- inspection -----------------------------------------------------------

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._queue) + len(self._inflight)

    @property
    def watermark(self) -> int:
        return self._watermark

    def sequences(self) -> tuple[list[int], list[int]]:
        """``(in_flight, queued)`` sequence numbers, oldest first."""
        with self._lock:
            return [s.sequence for s in self._inflight], [s.sequence for s in self._queue]

    def stats(self) -> Stats:
        with self._lock:
            return Stats(
                **self._count,
                pending=len(self._queue) + len(self._inflight),
                acked_sequence=self._watermark,
                last_sequence=self._next - 1,
            )
