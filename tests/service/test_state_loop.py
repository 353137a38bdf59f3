"""The server's two loops: gRPC's does I/O only, the state runs on a loop of its own.

Each test holds the state's loop (a callback that waits on an event) and shows
what gRPC still does meanwhile, then what the state does once let go. A server
with one loop for both would not answer until the hold ended: these tests would
wait for their 20-second deadline and fail.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from avest_wire.v1 import estimator_pb2 as pb
from tests.support.rpc import register_k, stub_for, synthetic_steps
from tests.support.server import ServerHandle

#: Longest a test holds the state's loop (a failing test ends then, not never).
HOLD_S = 30.0


@contextlib.contextmanager
def held(server: ServerHandle) -> Iterator[None]:
    """The state's loop runs nothing else until the block ends."""
    loop = server.server.app.loop
    assert loop is not None
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        release.wait(HOLD_S)

    loop.call_soon_threadsafe(hold)
    assert holding.wait(HOLD_S), "the state's loop never ran the hold"
    try:
        yield
    finally:
        release.set()


def test_the_state_runs_on_a_loop_and_thread_of_its_own(server: ServerHandle) -> None:
    assert server.server.app.loop is not None
    assert server.server.app.loop is not server.loop


def test_grpc_health_answers_while_the_states_loop_is_held(server: ServerHandle) -> None:
    channel = grpc.insecure_channel(server.grpc_address)
    try:
        with held(server):
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=20
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        channel.close()


def test_steps_sent_while_the_state_is_held_are_applied_and_acknowledged_after(
    server: ServerHandle,
) -> None:
    """The stream hands each checked message to the state's loop and waits there for
    room: nothing sent meanwhile is lost, and every step is acknowledged once applied."""
    channel, stub = stub_for(server.grpc_address)
    try:
        pair_id = register_k(stub, 4, 0, refit_interval=10).pair_id
        steps = synthetic_steps(pair_id, "w", 4, 20, seed=1)
        go = threading.Event()

        def messages() -> Iterator[pb.ObserveRequest]:
            for step in steps:
                if step.sequence == 11:
                    go.wait(HOLD_S)  # the second half while the state is held
                yield step

        responses = stub.Observe(messages(), timeout=60)
        acked = 0
        for response in responses:
            acked = max(acked, response.ack.acked_sequence)
            if acked >= 10:
                break
        with held(server):
            go.set()
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=20
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        for response in responses:
            acked = max(acked, response.ack.acked_sequence)
            if acked >= 20:
                break
        assert acked == 20
        pair = stub.GetPair(pb.GetPairRequest(pair_id=pair_id), timeout=20).pair
        assert pair.coefficients.version >= 1  # 20 steps of 8 rows: refitted
        responses.cancel()
    finally:
        channel.close()
