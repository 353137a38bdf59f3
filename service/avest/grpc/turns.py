"""Fair turns between Observe streams.

Each stream asks for a turn before it applies a step and waits in line; once
per event-loop iteration the line's first :data:`STEPS_PER_TURN` streams are
woken, and they apply their steps in the next iteration, so no iteration
applies more. The line is ordered by when each stream was last served, so a
stream that sends now and then (a light worker) goes ahead of streams that
send flat out. An iteration of the loop then stays
short however many streams are busy, and everything else on the loop (health,
coefficients, acknowledgements, the store's flushes) gets its turn between.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools

#: Steps applied per event-loop iteration, all streams together (the default
#: of ``steps_per_turn``).
STEPS_PER_TURN = 8


class Turns:
    def __init__(self, per_turn: int = STEPS_PER_TURN) -> None:
        self.per_turn = per_turn
        self._scheduled = False
        #: (last served, arrival, future) of the streams waiting for a turn.
        self._line: list[tuple[int, int, asyncio.Future[None]]] = []
        self._clock = itertools.count(1)
        self._arrivals = itertools.count()
        #: Steps applied (counted when their turn is granted).
        self.granted_total = 0

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._next_turn)

    def _next_turn(self) -> None:
        """Once per loop iteration: a fresh turn, first to whoever waited longest.

        A woken stream runs in the next iteration, together with the others
        woken here and nothing else granted: a turn taken without waiting in
        line (when the line looked empty) could land in the same iteration as
        the ones woken here and exceed ``per_turn``, so every turn is taken in
        line, at the cost of one loop iteration per step."""
        self._scheduled = False
        granted = 0
        while self._line and granted < self.per_turn:
            _, _, waiter = heapq.heappop(self._line)
            if not waiter.done():  # a cancelled stream gives up its place
                waiter.set_result(None)
                granted += 1
        if self._line:
            self._schedule()

    async def take(self, last_served: int) -> int:
        """Wait for a turn; ``last_served`` is what this returned to the stream
        last time (0 at first). Returns the stream's new "last served".
        ``per_turn`` 0: no limit (each stream still yields after each step)."""
        if self.per_turn > 0:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            heapq.heappush(self._line, (last_served, next(self._arrivals), waiter))
            self._schedule()
            await waiter
        self.granted_total += 1
        return next(self._clock)
