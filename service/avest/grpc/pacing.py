"""Pacing: while the event loop is saturated, a cap on each Observe stream's steps per
second; a stream that sends less than the cap is never held.

Turns (:mod:`avest.grpc.turns`) order the steps waiting to be folded and shed the
streams that press. A crowd of streams that each send now and then never presses
and builds no line, yet together they can offer more than the service folds: a
thousand workers, each well within any sane per-stream limit, twice what one
process folds. What they cost is spent before any turn (reading each step, writing
each acknowledgement, on the one event loop), and everything on the loop waits
behind it in arrival order. Measured (``bench/bench_abuse.py overload``, pacing
off): the loop at a whole core, /healthz answered in 176 ms (p50), a light worker's
acknowledgement in 413 ms, and a stream opened among the crowd in 351 ms; paced, in
20 ms, 268 ms and 55 ms.

So the loop's own lag is watched: a timer that should fire every :data:`TICK_S`
fires late by the time the loop took to come round to it. A window of
:data:`WINDOW_S` whose median lag is above :attr:`Pacing.target_s` is a saturated
loop (a refit, a flush or a heavy step holds the loop for tens of milliseconds,
once, and moves one tick, not the median; a crowd holds it for good). The streams
then get a cap, set once per window in the manner of AIMD (TCP's congestion
control):

* when saturation begins, the cap is :data:`DECREASE` times the mean rate of the
  streams that sent in the window (what each one gets now, a little less), and
  each further saturated window it falls by :data:`DECREASE` again;
* each window whose median lag is below half the target, it rises by
  :data:`INCREASE` (in between it stays); it is lifted once the loop has kept up
  so, with no stream above the cap, for :data:`RELEASE_S`;
* never below :data:`FLOOR`: a paced stream still has a step folded every
  ``1 / FLOOR`` seconds, acknowledged within a shim's "sidecar lost" timeout (5 s);
* only while the loop's thread is on the CPU for at least :data:`BUSY` of the
  window (a loop that lags while its thread waits for the machine's cores is not
  slowed by its streams, and pacing them would not help), and for pacing to begin,
  with at least :data:`MIN_STREAMS` streams sending in the window: a few streams
  share the loop through their turns.

A stream whose step comes sooner than ``1 / cap`` after its last one let through
is held: that step waits, read but not folded, and what its client sends meanwhile
waits in gRPC's flow control and then on the client, whose bounded queue decides
what to keep. Nothing is refused or lost and the stream stays open (the same
back-pressure as the turns' shedding). A worker that sends less than the cap (a
light worker, a worker in summary mode sending a round every few seconds) is never
held, and with the crowd paced the loop comes round to its step promptly.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

#: How often the lag is measured, seconds: the tick itself costs a few microseconds.
TICK_S = 0.1
#: How often the cap is set, seconds: ten ticks, and long enough for a stream that
#: sends one step a second to count in the mean.
WINDOW_S = 1.0
#: The cap's factor per window while the loop lags: the first cut takes a fifth off
#: what each stream gets, and a loop still lagging cuts again a second later.
DECREASE = 0.8
#: The cap's factor per window once the loop keeps up: slower than the cut, so the
#: cap settles near what the loop folds instead of swinging around it.
INCREASE = 1.1
#: How long the loop must keep up, with no stream above the cap, before the cap is
#: lifted, seconds.
RELEASE_S = 10.0
#: The lowest cap, steps per second per stream (one step every 4 s).
FLOOR = 0.25
#: The share of a window the loop's thread must have spent on the CPU for its lag to
#: count as its own: below, the lag is the machine's (other processes on its cores).
BUSY = 0.5
#: The fewest streams sending in a window for pacing to begin.
MIN_STREAMS = 16


@dataclass
class Pace:
    """One stream's pacing: when its last step was let through, and the window it
    last sent in."""

    let_through: float = float("-inf")
    window: int = -1


class Pacing:
    """The loop's lag and the cap it sets (``target_s`` 0: never pace)."""

    def __init__(
        self,
        target_s: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
        cpu: Callable[[], float] = time.thread_time,
    ) -> None:
        self.target_s = target_s
        #: The time source, and the CPU time of the loop's thread (injected by tests).
        self.clock = clock
        self.cpu = cpu
        #: Steps per second each stream may send (``None``: no cap).
        self.cap: float | None = None
        #: How late the last tick fired, seconds.
        self.lag_s = 0.0
        #: Steps held back since the start.
        self.paced_total = 0
        #: Windows in a row whose lag stayed below half the target and held no step.
        self._free = 0
        #: This window: its number, when it began, its ticks' lags, steps and streams sending.
        self._window = 0
        self._window_start = clock()
        self._window_cpu = cpu()
        self._lags: list[float] = []
        self._steps = 0
        self._streams = 0
        self._held = 0

    def tick(self, lag_s: float) -> None:
        """One measurement of the loop's lag; closes the window once it is over."""
        self.lag_s = lag_s
        self._lags.append(lag_s)
        now = self.clock()
        if now - self._window_start >= WINDOW_S:
            cpu_s = self.cpu()
            busy = (cpu_s - self._window_cpu) / max(now - self._window_start, 1e-9)
            self._close_window(now, busy)
            self._window_cpu = cpu_s

    def _close_window(self, now: float, busy: float) -> None:
        # The window's median lag: a refit or a flush that holds the loop once moves
        # one tick, not the median; a loop that lags for half the window does. And a
        # loop that lags while its thread used little CPU waits for the machine (other
        # processes on its cores), not for its streams: pacing them would not help.
        lag = statistics.median(self._lags) if self._lags else 0.0
        self._free = self._free + 1 if lag < self.target_s / 2 and not self._held else 0
        if lag > self.target_s and busy >= BUSY:
            if self.cap is not None:
                self.cap = max(FLOOR, DECREASE * self.cap)
            elif self._streams >= MIN_STREAMS:
                mean = self._steps / max(now - self._window_start, 1e-9) / self._streams
                self.cap = max(FLOOR, DECREASE * mean)
        elif lag < self.target_s / 2 and self.cap is not None:
            self.cap *= INCREASE
            if self._free * WINDOW_S >= RELEASE_S:
                self.cap = None
        self._window += 1
        self._window_start = now
        self._lags.clear()
        self._steps = self._streams = self._held = 0

    def hold_s(self, pace: Pace) -> float:
        """A stream's step has arrived: how long it waits before it is folded (0: at
        once). Counts the step in the window, and as held when it waits."""
        now = self.clock()
        if pace.window != self._window:
            pace.window = self._window
            self._streams += 1
        self._steps += 1
        hold = 0.0
        if self.cap is not None:
            hold = max(0.0, pace.let_through + 1.0 / self.cap - now)
            if hold > 0.0:
                self.paced_total += 1
                self._held += 1
        pace.let_through = now + hold
        return hold

    async def watch(self) -> None:
        """Measure the lag every :data:`TICK_S` until cancelled (``target_s`` 0:
        return at once)."""
        if self.target_s <= 0:
            return
        while True:
            start = time.monotonic()
            await asyncio.sleep(TICK_S)
            self.tick(max(0.0, time.monotonic() - start - TICK_S))
