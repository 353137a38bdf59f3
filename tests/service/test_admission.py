"""The refit interval: at the default, a pair refits at most once a second, however many
workers send and however fast; a round that fills sooner stays open, pooling what comes,
and its owner refits it once the interval is over, with no further message needed.
Pushes follow the refits, the latest version per stream, at most once per push interval
on each stream."""

from __future__ import annotations

import threading
import time

from avest_wire.v1 import estimator_pb2 as pb
from tests.support.rpc import observe_all, register_named, stub_for, synthetic_steps

K = 4
WORKERS = 4
STEPS = 100
#: A refit interval long next to the burst's few hundred milliseconds, in seconds.
GATE_S = 1.0


def _burst(address: str, pid: str) -> tuple[list[int], list[list[int]], float]:
    """Every worker sends its steps on a stream of its own, all at once: the acked
    sequences, the coefficient versions each stream was pushed, and how long it took."""
    acked = [0] * WORKERS
    pushed: list[list[int]] = [[] for _ in range(WORKERS)]

    def one(w: int) -> None:
        channel, stub = stub_for(address)
        with channel:
            msgs = synthetic_steps(pid, f"w{w}", K, STEPS, seed=w)
            acked[w], pushed[w] = observe_all(stub, msgs)

    started = time.monotonic()
    threads = [threading.Thread(target=one, args=(w,)) for w in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return acked, pushed, time.monotonic() - started


def _version(stub, pid: str) -> int:  # noqa: ANN001
    return stub.GetCoefficients(pb.GetCoefficientsRequest(pair_id=pid)).coefficients.version


def test_refits_do_not_grow_with_the_workers(start_server, tmp_path) -> None:  # noqa: ANN001
    """400 steps pooled at 10 steps a round would be 40 refits; at most one a second
    is a few. The last full round is refitted by its owner once the interval is over."""
    handle = start_server(tmp_path / "d", min_refit_interval_ms=GATE_S * 1000)
    channel, stub = stub_for(handle.grpc_address)
    with channel:
        pid = register_named(stub, "pooled", K, refit_interval=10)
        start = _version(stub, pid)
        acked, pushed, took = _burst(handle.grpc_address, pid)
        assert acked == [STEPS] * WORKERS  # nothing refused or lost
        after = _version(stub, pid)
        # At most one refit at once, then one per interval.
        assert after - start <= 2 + took / GATE_S, (after, start, took)
        # Each stream was pushed the versions in order, none twice.
        for versions in pushed:
            assert versions == sorted(set(versions))
        # No further message: the held round is refitted once the interval is over.
        deadline = time.monotonic() + 10 * GATE_S
        while _version(stub, pid) == after and time.monotonic() < deadline:
            time.sleep(0.05)
        held = _version(stub, pid)
        assert held == after + 1
        pair = stub.GetPair(pb.GetPairRequest(pair_id=pid)).pair
        assert pair.steps_observed == WORKERS * STEPS
        # Nothing left to refit: the version stays.
        time.sleep(2 * GATE_S)
        assert _version(stub, pid) == held


def test_at_zero_every_full_round_refits_at_once_and_pushes_stay_paced(
    start_server,  # noqa: ANN001
    tmp_path,  # noqa: ANN001
) -> None:
    """Every full round refits at once (40 refits), but each stream is pushed at most
    once per push interval: the versions in order, none twice."""
    handle = start_server(tmp_path / "d", min_refit_interval_ms=0, push_interval_ms=GATE_S * 1000)
    channel, stub = stub_for(handle.grpc_address)
    with channel:
        pid = register_named(stub, "pooled", K, refit_interval=10)
        start = _version(stub, pid)
        acked, pushed, took = _burst(handle.grpc_address, pid)
        assert acked == [STEPS] * WORKERS
        # The recursive and tracking rules warm up on short rounds: 40 rounds or more.
        assert _version(stub, pid) - start >= WORKERS * STEPS // 10
    for versions in pushed:
        assert versions, "a stream was never pushed"
        assert versions == sorted(set(versions))
        assert len(versions) <= 2 + took / GATE_S, (versions, took)


def test_a_failed_message_holds_back_its_workers_later_ones() -> None:
    """A worker's message that fails to apply fails the messages of that worker already
    queued behind it (applying them would skip it, and its resend would then be a
    duplicate, lost); another worker's go on; the worker's resend applies in order."""
    import asyncio

    from avest.state.admission import Message, PairQueue

    async def run() -> tuple[list[tuple[str, int]], list[str]]:
        applied: list[tuple[str, int]] = []
        release = asyncio.Event()
        broken = {("a", 2)}

        async def apply(m: Message) -> bool:
            if (m.worker, m.sequence) == ("a", 1):
                await release.wait()  # the queue fills behind it
            if (m.worker, m.sequence) in broken:
                raise RuntimeError("a bug")
            applied.append((m.worker, m.sequence))
            return True

        q = PairQueue("p", 16, apply, lambda: False, 0.0)
        loop = asyncio.get_running_loop()

        def message(worker: str, seq: int) -> Message:
            return Message(worker, seq, None, None, loop.create_future())  # type: ignore[arg-type]

        sent = [message(w, s) for w, s in (("a", 1), ("a", 2), ("b", 1), ("a", 3), ("b", 2))]
        for m in sent:
            await q.submit(m)
        release.set()
        outcomes = []
        for m in sent:
            try:
                await m.done
                outcomes.append("ok")
            except RuntimeError as exc:
                outcomes.append(str(exc))
        broken.clear()  # the fault is gone: the worker resends from the failed one
        resent = [message("a", 2), message("a", 3)]
        for m in resent:
            await q.submit(m)
        assert [await m.done for m in resent] == [True, True]
        q.drop()
        return applied, outcomes

    applied, outcomes = asyncio.run(run())
    assert outcomes == ["ok", "a bug", "ok", "step 2 of this worker failed to apply", "ok"]
    assert applied == [("a", 1), ("b", 1), ("b", 2), ("a", 2), ("a", 3)]
