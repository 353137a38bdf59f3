"""A bounded hand-off of preallocated slots from the step to one consumer thread.

The producer never waits (nor wakes anyone: the consumer polls): ``acquire`` always finds a free slot because the
ring holds ``capacity + 2`` of them (``capacity`` queued, one being consumed,
one being filled), and ``publish`` into a full queue drops the *oldest*
queued slot, returning it to the free list and counting it. Counts are exact:
``published == delivered + dropped + len(queued)`` at all times.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class SlotQueue(Generic[T]):
    def __init__(self, capacity: int, make_slot: Callable[[], T]) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._free: deque[T] = deque(make_slot() for _ in range(capacity + 2))
        self._queued: deque[T] = deque()
        self._busy = 0  # steps handed to the consumer, not yet done with
        self._cond = threading.Condition(threading.Lock())
        self._closed = False
        self.published = 0
        self.delivered = 0
        self.dropped = 0

    # producer -----------------------------------------------------------
    def acquire(self) -> T:
        # deque.pop is atomic; the consumer only appends to the free list
        return self._free.pop()

    def publish(self, slot: T) -> None:
        with self._cond:
            if len(self._queued) >= self.capacity:
                self._free.append(self._queued.popleft())
                self.dropped += 1
            self._queued.append(slot)
            self.published += 1

    def give_back(self, slot: T) -> None:
        """Return an acquired slot unpublished (the producer failed filling it)."""
        with self._cond:
            self._free.append(slot)

    # consumer -----------------------------------------------------------
    def get(self, timeout: float | None = None) -> T | None:
        """The oldest queued slot, or None on timeout / when closed and empty."""
        with self._cond:
            if not self._queued and not self._closed and timeout != 0:
                self._cond.wait(timeout)
            if not self._queued:
                return None
            self._busy += 1
            self.delivered += 1
            return self._queued.popleft()

    def get_nowait(self) -> T | None:
        return self.get(0)

    def recycle(self, slot: T) -> None:
        """The consumer has read ``slot``: the producer may fill it again. The step
        still counts as being consumed until :meth:`done`."""
        self._free.append(slot)  # deque.append is atomic

    def done(self) -> None:
        """The consumer has finished with the step it took last (handed on or failed)."""
        with self._cond:
            self._busy -= 1
            self._cond.notify_all()

    # both ------------------------------------------------------------------
    def wait_idle(self, timeout: float | None = None) -> bool:
        """Until nothing is queued or being consumed; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queued and not self._busy, timeout)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        with self._cond:
            return len(self._queued)
