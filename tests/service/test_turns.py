"""Fair turns (:class:`avest.grpc.turns.Turns`) on an event loop of their own."""

from __future__ import annotations

import asyncio

from avest.grpc.turns import Turns


async def _streams(turns: Turns, busy: int, rounds: int) -> tuple[list[int], list[str], int]:
    """``busy`` streams taking turns flat out, and a light one that asks once,
    after they are all under way: steps granted per loop iteration, the order in
    which steps were granted, and how many had been granted when the light one asked."""
    order: list[str] = []
    asked = [-1]
    per_iteration: list[int] = []
    counted = 0

    async def stream(name: str, steps: int) -> None:
        served = 0
        for _ in range(steps):
            if name == "light":
                asked[0] = len(order)
            served = await turns.take(served)
            order.append(name)
            await asyncio.sleep(0)

    async def light() -> None:
        await asyncio.sleep(0.01)
        await stream("light", 1)

    async def count() -> None:
        nonlocal counted
        while True:
            per_iteration.append(len(order) - counted)
            counted = len(order)
            await asyncio.sleep(0)

    counter = asyncio.create_task(count())
    await asyncio.gather(*(stream(f"b{i}", rounds) for i in range(busy)), light())
    counter.cancel()
    return per_iteration, order, asked[0]


def test_at_most_per_turn_steps_per_iteration_and_the_light_stream_goes_first() -> None:
    per_iteration, order, asked = asyncio.run(_streams(Turns(4), busy=40, rounds=20))
    assert max(per_iteration) <= 4
    assert len(order) == 40 * 20 + 1
    assert asked > 40  # it asked once the busy ones were under way
    # It went ahead of the 40 waiting busy streams (within two turns of 4),
    # not behind a step of each.
    assert order.index("light") - asked <= 2 * 4


def test_no_limit_at_zero() -> None:
    per_iteration, order, _ = asyncio.run(_streams(Turns(0), busy=20, rounds=50))
    assert len(order) == 20 * 50 + 1
    # Every ready stream applies a step each iteration: one iteration is as long
    # as a step of every busy stream.
    assert max(per_iteration) >= 20
