"""An Observe stream's outgoing queue holds one coefficients update per pair and
one ack per worker, however many refits and flushes happen before its client reads;
a pair's updates go at most once per push interval, the latest when it is over."""

from __future__ import annotations

import asyncio
import collections
from types import SimpleNamespace

import pytest

from avest.grpc.limits import StreamLimits
from avest.grpc.observe import ObserveStream
from avest_wire.v1 import estimator_pb2 as pb


def _stream(
    durable: dict[str, int], push_every_s: float = 0.0, streaming: int = 0
) -> ObserveStream:
    pair = SimpleNamespace(durable=durable)
    host = SimpleNamespace(
        app=SimpleNamespace(registry=SimpleNamespace(pairs={"p": pair})),
        limits=StreamLimits(max_rows=1, pair_rate=0.0, push_every_s=push_every_s),
        streaming=collections.Counter({"p": streaming}),
        updates={},
    )
    return ObserveStream(host, None, None)  # type: ignore[arg-type]


def _drain(stream: ObserveStream) -> list[pb.ObserveResponse]:
    out = []
    while not stream.out.empty():
        msg = stream.out.get_nowait()
        assert msg is not None
        out.append(stream._response(msg))
    return out


def test_unsent_updates_and_acks_are_replaced_by_newer_ones() -> None:
    async def run() -> None:
        durable = {"w": 0}
        stream = _stream(durable)
        stream.pairs.add("p")
        stream.acked[("p", "w")] = 0
        for version in range(1, 1001):
            stream.coefficients("p", pb.Coefficients(pair_id="p", version=version))
            durable["w"] = version
            stream.durable("p", "w", version)
        assert stream.out.qsize() == 2
        sent = _drain(stream)
        assert sent[0].coefficients_update.coefficients.version == 1000
        assert sent[1].ack.acked_sequence == 1000
        # Once sent, the next ones queue again, in order.
        stream.coefficients("p", pb.Coefficients(pair_id="p", version=1001))
        durable["w"] = 1001
        stream.durable("p", "w", 1001)
        again = _drain(stream)
        assert [r.WhichOneof("event") for r in again] == ["coefficients_update", "ack"]
        assert again[0].coefficients_update.coefficients.version == 1001
        assert again[1].ack.acked_sequence == 1001
        # A pair the stream does not send for gets nothing.
        stream.coefficients("q", pb.Coefficients(pair_id="q", version=1))
        assert stream.out.empty()

    asyncio.run(run())


@pytest.mark.parametrize(
    ("push_every_s", "streaming", "interval"),
    [(0.2, 0, 0.2), (0.0, 200, 0.2)],  # set, or from the pair's 200 workers streaming
)
def test_a_pairs_updates_go_at_most_once_per_push_interval_the_latest(
    push_every_s: float, streaming: int, interval: float
) -> None:
    async def run() -> None:
        stream = _stream({}, push_every_s=push_every_s, streaming=streaming)
        stream.pairs.add("p")
        loop = asyncio.get_running_loop()
        # The first goes at once.
        stream.coefficients("p", pb.Coefficients(pair_id="p", version=1))
        assert [r.coefficients_update.coefficients.version for r in _drain(stream)] == [1]
        sent_at = loop.time()
        # Refits within the interval: nothing queued until it is over, then the latest.
        for version in range(2, 12):
            stream.coefficients("p", pb.Coefficients(pair_id="p", version=version))
        assert stream.out.empty()
        msg = await asyncio.wait_for(stream.out.get(), timeout=30)
        assert loop.time() - sent_at >= interval * 0.99
        assert msg is not None
        assert stream._response(msg).coefficients_update.coefficients.version == 11
        assert stream.out.empty()

    asyncio.run(run())


def test_a_pairs_pushes_a_second_stay_bounded_as_its_streams_grow() -> None:
    limits = StreamLimits(max_rows=1, pair_rate=0.0)  # 1,000 pushes a second per pair
    assert [limits.push_every(w) for w in (1, 100, 1000, 4000)] == [0.001, 0.1, 1.0, 4.0]
    for workers in (1, 100, 1000, 4000):  # every refit's (10 a second at most) or fewer
        assert workers * min(10.0, 1 / limits.push_every(workers)) <= 1000
    # the operator's interval, when longer, and no bound at all
    assert StreamLimits(max_rows=1, pair_rate=0.0, push_every_s=2.0).push_every(1000) == 2.0
    unbounded = StreamLimits(max_rows=1, pair_rate=0.0, pair_pushes_per_s=0)
    assert unbounded.push_every(10**6) == 0.0


def test_one_push_message_serves_every_stream_of_a_refit() -> None:
    async def run() -> None:
        one, two = _stream({}), _stream({})
        two.service = one.service  # one service, two streams
        coefficients = pb.Coefficients(pair_id="p", version=3)
        sent = []
        for stream in (one, two):
            stream.pairs.add("p")
            stream.coefficients("p", coefficients)
            sent += _drain(stream)
        assert len(sent) == 2 and sent[0] is sent[1]
        assert sent[0].coefficients_update.coefficients.version == 3

    asyncio.run(run())
