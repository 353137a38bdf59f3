"""Fair turns (:class:`avest.grpc.turns.Turns`) on an event loop of their own.

The loop counts its own iterations (``_run_once`` is asyncio's one pass over
the ready callbacks), so each applied step is tagged with the iteration it ran
in, exactly, whatever the order of callbacks within an iteration and however
loaded the machine is."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TypeVar

from avest.grpc.turns import Turns

T = TypeVar("T")


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
        served = 0
        for _ in range(steps):
            if name == "light":
                asked[0] = len(order)
            served = await turns.take(served)
            per_iteration[_iteration()] += 1
            order.append(name)
            await asyncio.sleep(0)

    async def light() -> None:
        await asyncio.sleep(0.01)
        await stream("light", 1)

    await asyncio.gather(*(stream(f"b{i}", rounds) for i in range(busy)), light())
    return per_iteration, order, asked[0]


def test_at_most_per_turn_steps_per_iteration_and_the_light_stream_goes_first() -> None:
    per_iteration, order, asked = _run(lambda: _streams(Turns(4), busy=40, rounds=20))
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
        turns = Turns(4)
        per_iteration: Counter[int] = Counter()

        async def stream(steps: int, delay: float) -> None:
            await asyncio.sleep(delay)
            served = 0
            for _ in range(steps):
                served = await turns.take(served)
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
    per_iteration, order, _ = _run(lambda: _streams(Turns(0), busy=20, rounds=50))
    assert len(order) == 20 * 50 + 1
    # Every ready stream applies a step each iteration: one iteration is as long
    # as a step of every busy stream.
    assert max(per_iteration.values()) >= 20
