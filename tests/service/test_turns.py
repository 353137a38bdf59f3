"""Fair turns (:class:`avest.grpc.turns.Turns`) on an event loop of their own.

The loop counts its own iterations (``_run_once`` is asyncio's one pass over
the ready callbacks), so each applied step is tagged with the iteration it ran
in, exactly, whatever the order of callbacks within an iteration and however
loaded the machine is."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TypeVar

from avest.grpc.turns import Place, Shed, Shedding, Turns

T = TypeVar("T")
#: These tests are about order and counts: no shedding (its own tests are below).
NEVER = Shedding(target_s=0.0)


class _CountingLoop(asyncio.SelectorEventLoop):
    iteration = 0

    def _run_once(self) -> None:
        self.iteration += 1
        super()._run_once()  # type: ignore[misc]


def _run(main: Callable[[], Awaitable[T]]) -> T:
    loop = _CountingLoop()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


def _iteration() -> int:
    loop = asyncio.get_running_loop()
    assert isinstance(loop, _CountingLoop)
    return loop.iteration


async def _streams(turns: Turns, busy: int, rounds: int) -> tuple[Counter[int], list[str], int]:
    """``busy`` streams taking turns flat out, and a light one that asks once,
    after they are all under way: steps applied per loop iteration, the order in
    which steps were granted, and how many had been granted when the light one asked."""
    order: list[str] = []
    asked = [-1]
    per_iteration: Counter[int] = Counter()

    async def stream(name: str, steps: int) -> None:
        place = Place()
        for _ in range(steps):
            if name == "light":
                asked[0] = len(order)
            await turns.take(place)
            per_iteration[_iteration()] += 1
            order.append(name)
            await asyncio.sleep(0)

    async def light() -> None:
        await asyncio.sleep(0.01)
        await stream("light", 1)

    await asyncio.gather(*(stream(f"b{i}", rounds) for i in range(busy)), light())
    return per_iteration, order, asked[0]


def test_at_most_per_turn_steps_per_iteration_and_the_light_stream_goes_first() -> None:
    per_iteration, order, asked = _run(lambda: _streams(Turns(4, NEVER), busy=40, rounds=20))
    assert max(per_iteration.values()) <= 4
    assert len(order) == 40 * 20 + 1
    assert asked > 40  # it asked once the busy ones were under way
    # It went ahead of the 40 waiting busy streams (within two turns of 4),
    # not behind a step of each.
    assert order.index("light") - asked <= 2 * 4


def test_streams_arriving_after_a_turn_was_handed_out_wait_for_the_next_one() -> None:
    """Streams that start in the same iteration as the line's turn is handed
    out (their timers fire then) and find the line empty still wait: the
    iteration already holds the steps woken for it."""

    async def main() -> Counter[int]:
        turns = Turns(4, NEVER)
        per_iteration: Counter[int] = Counter()

        async def stream(steps: int, delay: float) -> None:
            await asyncio.sleep(delay)
            place = Place()
            for _ in range(steps):
                await turns.take(place)
                per_iteration[_iteration()] += 1
                await asyncio.sleep(0)

        # Waves of streams: each wave drains the line while the next arrives.
        await asyncio.gather(
            *(stream(1 + i % 3, 0.002 * (i // 4)) for i in range(64)),
        )
        return per_iteration

    per_iteration = _run(main)
    assert sum(per_iteration.values()) == sum(1 + i % 3 for i in range(64))
    assert max(per_iteration.values()) <= 4


def test_no_limit_at_zero() -> None:
    per_iteration, order, _ = _run(lambda: _streams(Turns(0, NEVER), busy=20, rounds=50))
    assert len(order) == 20 * 50 + 1
    # Every ready stream applies a step each iteration: one iteration is as long
    # as a step of every busy stream.
    assert max(per_iteration.values()) >= 20


# -- shedding -------------------------------------------------------------------------------
#
# The turns' clock is a counter the test moves: each step "costs" ``step_s`` of it,
# so a stream's wait in line is exactly the steps granted before it, whatever the
# machine's speed.


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def _overloaded_line(
    turns: Turns, clock: _Clock, busy: int, light_every: int, steps: int, step_s: float
) -> dict[str, list[str]]:
    """``busy`` streams that send flat out (and stop once shed) and a light one that
    sends a step after every ``light_every`` granted steps and waits for its turn
    meanwhile: what became of each step, per stream ("ok" or "shed")."""
    outcome: dict[str, list[str]] = {}
    granted = [0]

    async def take(name: str, place: Place) -> bool:
        try:
            await turns.take(place)
        except Shed:
            outcome[name].append("shed")
            return False
        outcome[name].append("ok")
        granted[0] += 1
        clock.now += step_s  # applying the step takes this long
        return True

    async def busy_stream(name: str) -> None:
        outcome[name] = []
        place = Place()
        for _ in range(steps):
            if not await take(name, place):
                return
            await asyncio.sleep(0)

    async def light() -> None:
        outcome["light"] = []
        place = Place()
        while any(
            len(v) < steps and (not v or v[-1] == "ok") for k, v in outcome.items() if k != "light"
        ):
            start = granted[0]
            while granted[0] < start + light_every:
                await asyncio.sleep(0)
                if not any(
                    len(v) < steps and (not v or v[-1] == "ok")
                    for k, v in outcome.items()
                    if k != "light"
                ):
                    return
            clock.now += light_every * step_s  # it sent after a pause
            await take("light", place)

    await asyncio.gather(*(busy_stream(f"b{i}") for i in range(busy)), light())
    return outcome


def test_an_overloaded_line_sheds_the_streams_that_press_and_never_the_light_one() -> None:
    clock = _Clock()
    turns = Turns(2, Shedding(target_s=0.1, standing_s=0.5, retry_s=1.0), clock=clock)
    # 30 flat-out streams at 10 ms a step: each waits about 30 steps (0.3 s) for its turn.
    outcome = _run(
        lambda: _overloaded_line(turns, clock, busy=30, light_every=20, steps=200, step_s=0.01)
    )
    shed = [name for name, v in outcome.items() if "shed" in v]
    assert "light" not in shed
    assert outcome["light"].count("ok") >= 5
    # Enough were shed to bring the wait back to the target, and no more: the
    # others wait about (streams left) x 10 ms, and finished every step.
    left = [name for name in outcome if name not in shed and name != "light"]
    assert len(left) >= 1 and len(left) * 0.01 <= 0.1 + 2 * 0.01
    assert all(outcome[name] == ["ok"] * 200 for name in left)
    # None before the wait had stood above the target for the standing time: every
    # stream had 0.5 s of turns first (at 30 streams and 10 ms, about two steps each).
    assert all(outcome[name].index("shed") >= 1 for name in shed)
    assert turns.shed_total == len(shed)


def test_a_line_that_keeps_up_or_a_short_burst_sheds_nothing() -> None:
    for busy, step_s in ((5, 0.01), (30, 0.001)):  # waits of about 50 ms and 30 ms
        clock = _Clock()
        turns = Turns(2, Shedding(target_s=0.1, standing_s=0.5), clock=clock)
        outcome = _run(partial(_overloaded_line, turns, clock, busy, 20, 100, step_s))
        assert turns.shed_total == 0
        assert all(v.count("ok") == len(v) for v in outcome.values())
        assert not turns.overloaded
    # A burst: waits above the target (0.3 s) for less than the standing time
    # (30 streams x 10 steps x 10 ms is 3 s of steps).
    clock = _Clock()
    turns = Turns(2, Shedding(target_s=0.1, standing_s=5.0), clock=clock)
    _run(lambda: _overloaded_line(turns, clock, busy=30, light_every=20, steps=10, step_s=0.01))
    assert turns.shed_total == 0


def test_target_zero_never_sheds() -> None:
    clock = _Clock()
    turns = Turns(2, Shedding(target_s=0.0), clock=clock)
    outcome = _run(
        lambda: _overloaded_line(turns, clock, busy=30, light_every=20, steps=100, step_s=0.01)
    )
    assert turns.shed_total == 0
    assert all("shed" not in v for v in outcome.values())
