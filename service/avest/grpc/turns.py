"""Fair turns between Observe streams, and load shedding when they cannot all be served.

Each stream asks for a turn before it applies a step and waits in line; once
per event-loop iteration the line's first ``per_turn`` streams are woken, and
they apply their steps in the next iteration, so no iteration applies more. The
line is ordered by when each stream was last served, so a stream that sends now
and then (a light worker) goes ahead of streams that send flat out. An
iteration of the loop then stays short however many streams are busy, and
everything else on the loop (health, coefficients, acknowledgements, the
store's flushes) gets its turn between.

Turns alone only reorder: offered more steps than it can fold, the service
would let the line grow, and every step, a light worker's included, would wait
behind it for its acknowledgement (and everything the loop does for each open
stream, reads and acknowledgements, grows with it). So the line also sheds,
in the manner of CoDel (Nichols and Jacobson, "Controlling Queue Delay", 2012):

* **Overload** is a standing queue, not a burst: every step granted a turn
  over the last :attr:`Shedding.standing_s` had waited at least
  :attr:`Shedding.target_s` for it (but for streams that do not press: they go
  ahead of the line, and their short wait says nothing of the queue behind them),
  and the line was never empty meanwhile.
* **Who is shed**: while overloaded, a stream that *presses* (it spent longer
  waiting in line for its last turn than it took to ask for the next one: it
  has steps queued behind the one it sends, as a flat-out sender does) and has
  itself waited past the target is refused its turn (:class:`Shed`) instead of
  served. The gRPC adapter holds the stream back for the retry time (1-2 s):
  it reads nothing meanwhile, so the steps its client sends wait in gRPC's flow
  control and then on the client, whose bounded queue decides what to keep.
  Nothing is refused or lost, the stream stays open, and no client needs to know
  (ending the stream instead would make every client reconnect, and a client
  still writing when its call ends sees INTERNAL from grpc, not the service's
  status). A stream that sends one step and waits (a light worker, a worker in
  summary mode) never presses and is never shed. A held-back stream asks again
  after a pause longer than its wait, so it does not press then, and gets one
  step before it can be shed again: while overloaded, each flat-out stream
  folds about one step per retry time.
* **How many**: at most ``per_turn`` streams are shed per turn, on top of the
  ``per_turn`` served, so shedding follows the line, and it stops as soon as a
  granted step waited less than the target.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

#: Steps applied per event-loop iteration, all streams together (the default
#: of ``steps_per_turn``).
STEPS_PER_TURN = 8


@dataclass(frozen=True)
class Shedding:
    """When the line sheds (``target_s`` 0: never)."""

    #: A step that waited this long for its turn was queued, not served. 100 ms
    #: is the default flush interval: a step is acknowledged about one flush
    #: after its turn, so the wait stays within the same order as the ack's own
    #: delay, and well within the one second a light worker's acknowledgement is
    #: allowed next to an overloaded service.
    target_s: float = 0.1
    #: How long the wait must stand above the target to be overload. A refit,
    #: a flush of many pairs or a heavy step holds the loop for tens of
    #: milliseconds (bench/RESULTS.md); half a second of it is no burst.
    standing_s: float = 0.5
    #: How long a shed stream is held back; each time is jittered to [1x, 2x] so
    #: that shed streams do not come back together.
    retry_s: float = 1.0


class Shed(Exception):
    """A turn refused: the service is overloaded and this stream presses."""

    def __init__(self, retry_s: float, waited_s: float) -> None:
        super().__init__(f"overloaded: waited {waited_s:.2f}s for a turn; retry in {retry_s:.1f}s")
        self.retry_s = retry_s
        self.waited_s = waited_s


@dataclass
class Place:
    """A stream's place in the turns: when it was last served and how it waits."""

    #: The turns' clock when this stream was last served (0: never).
    served: int = 0
    #: When its last turn was granted (the turns' time), and how long it had waited for it.
    granted_at: float = 0.0
    waited_s: float = 0.0
    #: When it asked for the turn it now waits for.
    asked_at: float = 0.0
    #: Whether it asked sooner after its last turn than it had waited for that turn.
    presses: bool = False


class Turns:
    def __init__(
        self,
        per_turn: int = STEPS_PER_TURN,
        shedding: Shedding | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_turn = per_turn
        self.shedding = shedding if shedding is not None else Shedding()
        #: The time source (injected by tests).
        self.clock = clock
        self._scheduled = False
        #: (last served, arrival, place, future) of the streams waiting for a turn.
        self._line: list[tuple[int, int, Place, asyncio.Future[None]]] = []
        self._clock = itertools.count(1)
        self._arrivals = itertools.count()
        #: Since when every granted step waited past the target (None: the last one did not).
        self._above_since: float | None = None
        #: Whether the line is shedding now.
        self.overloaded = False
        #: Steps applied (counted when their turn is granted).
        self.granted_total = 0
        #: Turns refused (streams shed) since the start.
        self.shed_total = 0
        #: How long the last granted step waited for its turn, in seconds.
        self.last_wait_s = 0.0

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._next_turn)

    def _overload(self, now: float, waited: float) -> None:
        """Follow the wait of each granted step: overload is a wait that stood
        above the target for the standing time."""
        self.last_wait_s = waited
        if waited < self.shedding.target_s:
            self._above_since = None
            self.overloaded = False
        elif self._above_since is None:
            self._above_since = now
        elif now - self._above_since >= self.shedding.standing_s:
            self.overloaded = True

    def _next_turn(self) -> None:
        """Once per loop iteration: a fresh turn, first to whoever waited longest.

        A woken stream runs in the next iteration, together with the others
        woken here and nothing else granted: a turn taken without waiting in
        line (when the line looked empty) could land in the same iteration as
        the ones woken here and exceed ``per_turn``, so every turn is taken in
        line, at the cost of one loop iteration per step."""
        self._scheduled = False
        granted = shed = 0
        now = self.clock()
        shedding = self.shedding.target_s > 0
        while self._line and granted < self.per_turn:
            _, _, place, waiter = heapq.heappop(self._line)
            if waiter.done():  # a cancelled stream gives up its place
                continue
            waited = now - place.asked_at
            if (
                shedding
                and self.overloaded
                and place.presses
                and waited >= self.shedding.target_s
                and shed < self.per_turn
            ):
                retry = self.shedding.retry_s * random.uniform(1.0, 2.0)
                waiter.set_exception(Shed(retry, waited))
                shed += 1
                self.shed_total += 1
                continue
            if shedding and (place.presses or waited >= self.shedding.target_s):
                # A stream that does not press went ahead of the line: its short
                # wait says nothing of the queue behind it.
                self._overload(now, waited)
            place.granted_at, place.waited_s = now, waited
            waiter.set_result(None)
            granted += 1
        if self._line:
            self._schedule()
        elif self.overloaded or self._above_since is not None:
            self._above_since = None  # an empty line is no standing queue
            self.overloaded = False

    async def take(self, place: Place) -> None:
        """Wait for a turn for the stream at ``place`` (``per_turn`` 0: no limit,
        and each stream still yields after each step). Raises :class:`Shed` when
        the service is overloaded and the stream presses."""
        if self.per_turn > 0:
            now = self.clock()
            place.asked_at = now
            place.presses = place.served > 0 and now - place.granted_at < place.waited_s
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            heapq.heappush(self._line, (place.served, next(self._arrivals), place, waiter))
            self._schedule()
            await waiter
        self.granted_total += 1
        place.served = next(self._clock)
