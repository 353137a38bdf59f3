"""A live server for the admin HTTP and metrics tests: an in-process server with a gRPC
stub and an HTTP client (the ``live`` and ``open_server`` fixtures), and pair
registration."""

from __future__ import annotations

from collections.abc import Iterable

import grpc
import httpx

from avest.offline.trace import Trace
from avest_wire.v1 import estimator_pb2 as pb
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc
from tests.support.rpc import observe_request
from tests.support.server import ServerHandle
from tests.support.traces import Step, trace_steps

#: The admin token of the live servers.
TOKEN = "s3cret"

#: Their settings unless a test overrides them: a refit every 10 steps and a 10 ms
#: flush (a few steps show a refit and a save), a 2 s drain (restarts stay quick).
LIVE_SETTINGS: dict[str, object] = {
    "refit_interval": 10,
    "flush_interval_ms": 10,
    "admin_token": TOKEN,
    "grace_s": 2.0,
}


class Live:
    """A started server (a :class:`~tests.support.server.ServerHandle`) with a gRPC stub
    and an HTTP client."""

    def __init__(self, handle: ServerHandle) -> None:
        self.handle = handle
        self.grpc_address = handle.grpc_address
        self.http_url = handle.http_url
        self.channel = grpc.insecure_channel(self.grpc_address)
        self.stub = pb_grpc.EstimatorServiceStub(self.channel)
        self.http = httpx.Client(base_url=self.http_url, timeout=10)

    def close(self) -> None:
        self.http.close()
        self.channel.close()

    def stop(self) -> None:
        self.close()
        self.handle.stop()


def register(
    live: Live,
    k: int = 5,
    refit_interval: int = 10,
    *,
    target: str = "target-model",
    rule: int = pb.UPDATE_RULE_RECURSIVE,
    **labels: str,
) -> str:
    resp = live.stub.RegisterPair(
        pb.RegisterPairRequest(
            key=pb.PairKey(
                target_model=target,
                draft_model="draft-model",
                method="eagle",
                num_speculative_tokens=k,
                labels=labels,
            ),
            update_rule=rule,
            refit_interval=refit_interval,
        ),
        timeout=10,
    )
    return str(resp.pair_id)


def observe_requests(
    steps: Iterable[Step], pair_id: str, worker: str = "w0", first: int = 1
) -> list[pb.ObserveRequest]:
    """One Observe message per decode step ``(features, num_verified, num_accepted)``,
    numbered from ``first``."""
    return [observe_request(pair_id, worker, first + i, *step) for i, step in enumerate(steps)]


def messages(
    trace: Trace, pair_id: str, worker: str = "w0", first: int = 1
) -> list[pb.ObserveRequest]:
    """The trace's decode steps as Observe messages, numbered from ``first``."""
    return observe_requests(trace_steps(trace), pair_id, worker, first)


def observe(live: Live, msgs: list[pb.ObserveRequest]) -> int:
    """Stream ``msgs`` on one Observe call; the highest acknowledged sequence."""
    acked = 0
    for resp in live.stub.Observe(iter(msgs), timeout=60):
        if resp.HasField("ack"):
            acked = max(acked, resp.ack.acked_sequence)
    return acked
