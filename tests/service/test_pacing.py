"""Pacing (:class:`avest.grpc.pacing.Pacing`) driven by hand: the loop's lag and CPU
are given tick by tick on an injected clock, and the streams' steps arrive when the
test says, so each decision of the cap is checked exactly."""

from __future__ import annotations

import pytest

from avest.grpc import pacing
from avest.grpc.pacing import Pace, Pacing

TARGET = 0.05


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class _Loop:
    """A pacing and the loop it watches: ``window`` passes one window of ticks, each
    with the lag and CPU share given, while ``streams`` streams send ``rate`` steps a
    second each. A held stream reads its next step only once its hold is over (what
    its client sent meanwhile waits), as an Observe stream does."""

    def __init__(self) -> None:
        self.clock = _Clock()
        self.cpu = 0.0
        self.pacing = Pacing(target_s=TARGET, clock=self.clock, cpu=lambda: self.cpu)
        self.paces: dict[int, Pace] = {}
        self.holds: dict[int, list[float]] = {}
        #: Per stream: when its client sends its next step, and when it is read.
        self.sent: dict[int, float] = {}
        self.read: dict[int, float] = {}

    def step(self, stream: int) -> float:
        hold = self.pacing.hold_s(self.paces.setdefault(stream, Pace()))
        self.holds.setdefault(stream, []).append(hold)
        return hold

    def window(
        self,
        lags: list[float] | float,
        busy: float = 1.0,
        streams: int = 0,
        rate: float = 0.0,
    ) -> None:
        ticks = round(pacing.WINDOW_S / pacing.TICK_S)
        lag_list = lags if isinstance(lags, list) else [lags] * ticks
        for s in range(streams):
            self.sent.setdefault(s, self.clock.t + s / (streams * rate))
            self.read.setdefault(s, self.sent[s])
        for lag in lag_list:
            end = self.clock.t + pacing.TICK_S
            while streams and rate:
                s = min(range(streams), key=lambda i: self.read[i])
                at = self.read[s]
                if at >= end:
                    break
                self.clock.t = at
                hold = self.step(s)
                self.sent[s] += 1.0 / rate
                self.read[s] = max(self.sent[s], at + hold)
            self.clock.t = end
            self.cpu += busy * pacing.TICK_S
            self.pacing.tick(lag)


@pytest.fixture
def loop() -> _Loop:
    return _Loop()


def test_a_crowd_on_a_lagging_busy_loop_is_capped_below_its_mean_rate(loop: _Loop) -> None:
    loop.window(0.0, streams=20, rate=4)  # a window of reference, the loop keeping up
    assert loop.pacing.cap is None
    loop.window(0.2, streams=20, rate=4)
    assert loop.pacing.cap == pytest.approx(pacing.DECREASE * 4, rel=0.05)


def test_a_stream_under_the_cap_is_never_held_and_one_above_it_waits(loop: _Loop) -> None:
    loop.window(0.2, streams=20, rate=4)
    cap = loop.pacing.cap
    assert cap is not None
    loop.holds.clear()
    before = loop.pacing.paced_total
    # A light stream: one step, then another well after 1 / cap.
    assert loop.step(100) == 0.0
    loop.clock.t += 1.5 / cap
    assert loop.step(100) == 0.0
    # A heavy one: two steps at once; the second waits 1 / cap after the first.
    assert loop.step(200) == 0.0
    assert loop.step(200) == pytest.approx(1.0 / cap)
    # And a third, right after, waits for the one before it.
    assert loop.step(200) == pytest.approx(2.0 / cap)
    assert loop.pacing.paced_total == before + 2


def test_few_streams_are_never_paced(loop: _Loop) -> None:
    for _ in range(5):
        loop.window(0.5, streams=pacing.MIN_STREAMS - 1, rate=20)
    assert loop.pacing.cap is None
    assert all(h == 0.0 for holds in loop.holds.values() for h in holds)


def test_a_loop_that_lags_while_its_thread_waits_for_the_cpu_is_not_paced(loop: _Loop) -> None:
    """The machine's other processes hold the cores: the loop lags, but its thread
    ran for a fifth of the time; pacing its streams would not help."""
    for _ in range(5):
        loop.window(0.5, busy=0.2, streams=40, rate=4)
    assert loop.pacing.cap is None


def test_one_long_tick_is_no_saturation(loop: _Loop) -> None:
    """A refit or a flush holds the loop once: one tick late of ten moves no median."""
    ticks = round(pacing.WINDOW_S / pacing.TICK_S)
    for _ in range(5):
        loop.window([0.4] + [0.001] * (ticks - 1), streams=40, rate=4)
    assert loop.pacing.cap is None


def test_the_cap_falls_while_the_loop_lags_never_below_the_floor(loop: _Loop) -> None:
    loop.window(0.2, streams=20, rate=4)
    caps = [loop.pacing.cap]
    for _ in range(30):
        loop.window(0.2, streams=20, rate=4)
        caps.append(loop.pacing.cap)
    assert caps[1] == pytest.approx(pacing.DECREASE * caps[0])
    assert all(
        a is not None and b is not None and b <= a for a, b in zip(caps, caps[1:], strict=False)
    )
    assert caps[-1] == pacing.FLOOR


def test_between_the_target_and_its_half_the_cap_stays(loop: _Loop) -> None:
    loop.window(0.2, streams=20, rate=4)
    cap = loop.pacing.cap
    loop.window(TARGET * 0.75, streams=20, rate=4)
    assert loop.pacing.cap == cap


def test_the_cap_rises_once_the_loop_keeps_up_and_is_lifted_once_nobody_is_held(
    loop: _Loop,
) -> None:
    loop.window(0.2, streams=20, rate=4)
    cap = loop.pacing.cap
    assert cap is not None
    # The loop keeps up while the streams still send above the cap: the cap rises
    # each window, and stays on while any stream is held (their clients' backlog
    # comes through at the cap).
    loop.window(0.001, streams=20, rate=4)
    assert loop.pacing.cap == pytest.approx(cap * pacing.INCREASE)
    held: list[bool] = []
    while loop.pacing.cap is not None and len(held) < 100:
        before = loop.pacing.paced_total
        loop.window(0.001, streams=20, rate=4)
        held.append(loop.pacing.paced_total > before)
    assert loop.pacing.cap is None
    release = round(pacing.RELEASE_S / pacing.WINDOW_S)
    assert any(held), "the backlog was held"
    assert not any(held[-release:])
    last_held = max(i for i, h in enumerate(held) if h)
    assert len(held) - 1 - last_held >= release


def test_a_loop_that_lags_again_before_the_release_keeps_its_cap(loop: _Loop) -> None:
    loop.window(0.2, streams=20, rate=1)
    for _ in range(round(pacing.RELEASE_S / pacing.WINDOW_S) - 2):
        loop.window(0.001, streams=20, rate=1)
    loop.window(0.2, streams=20, rate=1)
    for _ in range(round(pacing.RELEASE_S / pacing.WINDOW_S) - 2):
        loop.window(0.001, streams=20, rate=1)
    assert loop.pacing.cap is not None


def test_without_a_target_the_watch_ends_at_once() -> None:
    import asyncio

    asyncio.run(asyncio.wait_for(Pacing(target_s=0.0).watch(), timeout=5))
