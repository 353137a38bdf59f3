"""The steps on their way from the shim to the client forwarder.

Until the pair is registered there is no forwarder: steps (raw step tuples
and round summaries) wait here, in order, in a buffer of the forwarder's
capacity that drops the oldest when full. :meth:`Handoff.attach` moves them
into the new forwarder, in order, before anything submitted after it.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from avest_client._stream import StratumSummary
from avest_client.forwarder import Forwarder
from avest_wire.summary import RoundSummary


class Handoff:
    """The pre-registration buffer and the forwarder that follows it."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        self._held: deque[Any] = deque()  # step tuples and round summaries
        self._closed = False
        #: The client forwarder, once attached.
        self.forwarder: Forwarder | None = None
        #: Items offered (steps and summaries), whoever took them.
        self.received = 0
        #: Items the buffer dropped (the oldest, when full).
        self.dropped = 0
        #: Items still held when the sink closed.
        self.unsent_at_close = 0

    def offer(self, item: Any) -> Forwarder | None:
        """Hold ``item`` while there is no forwarder (None), else return the forwarder
        to give it to. One caller thread (the shim's forwarder, or its summary sender)."""
        self.received += 1
        fwd = self.forwarder
        if fwd is None:
            with self._lock:
                fwd = self.forwarder
                if fwd is None:
                    if len(self._held) >= self._capacity:
                        self._held.popleft()
                        self.dropped += 1
                    self._held.append(item)
        return fwd

    def attach(self, fwd: Forwarder) -> bool:
        """Move what is held into ``fwd`` and send through it from now; False if closed."""
        with self._lock:
            if self._closed:
                return False
            # In order, before anything submitted after this point.
            while self._held:
                item = self._held.popleft()
                if isinstance(item, RoundSummary):
                    fwd.submit_summary(item)
                elif isinstance(item, StratumSummary):
                    fwd.submit_summary(item.summary, item.stratum)
                else:
                    fwd.submit(*item)
            self.forwarder = fwd
        return True

    def shut(self) -> None:
        """Attach no forwarder from now. Takes no lock: safe in a forked child,
        where a lock the parent held at the fork stays held."""
        self._closed = True

    def drain(self) -> Forwarder | None:
        """Drop what is held (it counts as unsent at close); the forwarder, if any."""
        with self._lock:
            self.unsent_at_close = len(self._held)
            self._held.clear()
            return self.forwarder

    @property
    def empty(self) -> bool:
        return not self._held

    def held(self) -> int:
        with self._lock:
            return len(self._held)
