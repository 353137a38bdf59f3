"""A restarted worker that reuses its explicit worker id, against a real server.

Found: a worker sent 100 steps, all acknowledged; it restarted with the same
worker_id and began its sequence at 1 again. The server took the new 100 steps for
duplicates (sequence at or below the watermark it held) and acknowledged them
with the old watermark: 100 acked, 0 applied, nothing logged. Now each stream
opens its worker first and the server answers with what it applied of it; before
its first step goes out, a forwarder continues above that (the default), takes
them for its own (a rerun replay), or fails loudly.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import pytest

from avest.grpc import observe
from avest_client import (
    AsyncEstimatorClient,
    Backoff,
    EstimatorClient,
    Forwarder,
    WorkerIdReusedError,
)
from avest_client.credentials import sync_channel
from avest_client.ledger import Stats
from avest_wire.v1 import estimator_pb2 as pb
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc
from tests.support.rpc import random_step

FAST = Backoff(initial_s=0.02, max_s=0.2)
K = 4
#: Steps each incarnation of the worker sends.
STEPS = 100
WORKER = "host-7:worker-0"


def steps(seed: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        rows = 3
        out.append(
            (
                rng.uniform(-3, 3, (rows, K)).astype(np.float32),
                np.full(rows, K),
                rng.integers(0, K + 1, rows),
            )
        )
    return out


def register(client: EstimatorClient) -> str:
    return client.register("t/reuse", "d/reuse", "draft_model", K).pair_id


def incarnation(client: EstimatorClient, pair_id: str, seed: int, **options: Any) -> Stats:
    """One life of the worker: a new forwarder as ``WORKER`` sends STEPS steps, every
    one acknowledged; its stats."""
    fwd = client.forwarder(pair_id, worker_id=WORKER, backoff=FAST, **options)
    for step in steps(seed):
        fwd.submit(*step)
    assert fwd.flush(timeout=60)
    fwd.close()
    return fwd.stats


def first_incarnation(client: EstimatorClient, pair_id: str) -> None:
    """The worker's first life: 100 steps sent and acknowledged."""
    s = incarnation(client, pair_id, 1)
    assert (s.acked, s.acked_sequence, s.renumbered) == (STEPS, STEPS, 0)
    assert client.pair(pair_id).steps_observed == STEPS


def test_a_restarted_worker_reusing_its_id_has_every_new_step_applied(server, caplog):
    with EstimatorClient(server.grpc_address, timeout=30) as client:
        pair_id = register(client)
        first_incarnation(client, pair_id)
        # The restart: a new forwarder, the same explicit worker id, sequence from 1.
        with caplog.at_level(logging.WARNING, logger="avest_client.forwarder"):
            s = incarnation(client, pair_id, 2)
        assert (s.submitted, s.acked, s.dropped, s.refused) == (STEPS, STEPS, 0, 0)
        # Renumbered above the 100 the pair held: 101..200.
        assert (s.acked_sequence, s.last_sequence) == (2 * STEPS, 2 * STEPS)
        assert client.pair(pair_id).steps_observed == 2 * STEPS
    assert any("continues above it" in r.getMessage() for r in caplog.records)


async def test_the_async_forwarder_continues_above_the_earlier_sender_too(server):
    with EstimatorClient(server.grpc_address, timeout=30) as client:
        pair_id = register(client)
        first_incarnation(client, pair_id)
    async with AsyncEstimatorClient(server.grpc_address, timeout=30) as client:
        fwd = client.forwarder(pair_id, worker_id=WORKER, backoff=FAST)
        for step in steps(2):
            fwd.submit(*step)
        assert await fwd.flush(timeout=60)
        await fwd.close()
        assert (fwd.stats.acked, fwd.stats.acked_sequence) == (STEPS, 2 * STEPS)
        assert (await client.pair(pair_id)).steps_observed == 2 * STEPS


def test_a_forwarder_set_to_fail_fails_loudly_and_applies_nothing(server, caplog):
    with EstimatorClient(server.grpc_address, timeout=30) as client:
        pair_id = register(client)
        first_incarnation(client, pair_id)
        fwd = client.forwarder(pair_id, worker_id=WORKER, backoff=FAST, reused_worker_id="fail")
        for step in steps(2)[:10]:
            fwd.submit(*step)
        with pytest.raises(WorkerIdReusedError, match="already applied sequence 100"):
            fwd.flush(timeout=60)
        assert isinstance(fwd.error, WorkerIdReusedError)
        fwd.submit(*steps(3)[0])  # not queued: the forwarder has stopped
        fwd.close()
        s = fwd.stats
        assert (s.submitted, s.dropped, s.acked, s.sent, s.pending, s.invalid) == (
            10,
            10,
            0,
            0,
            0,
            1,
        )
        assert client.pair(pair_id).steps_observed == STEPS
    assert any(
        r.levelno == logging.ERROR and "already applied sequence 100" in r.getMessage()
        for r in caplog.records
    )


def test_a_rerun_resumes_and_counts_nothing_twice(server):
    with EstimatorClient(server.grpc_address, timeout=30) as client:
        pair_id = register(client)
        first_incarnation(client, pair_id)
        # The same steps again under the same id (a replay run twice).
        s = incarnation(client, pair_id, 1, reused_worker_id="resume")
        assert (s.acked, s.renumbered) == (STEPS, 0)
        assert client.pair(pair_id).steps_observed == STEPS
    with pytest.raises(ValueError, match="reused_worker_id"):
        Forwarder(server.grpc_address, pair_id, reused_worker_id="ignore")


def test_the_server_answers_an_opening_before_applying_and_logs_unopened_duplicates(server, caplog):
    with EstimatorClient(server.grpc_address, timeout=30) as client:
        pair_id = register(client)
        first_incarnation(client, pair_id)
    channel = sync_channel(server.grpc_address, (), None)
    stub = pb_grpc.EstimatorServiceStub(channel)
    try:
        opening = pb.ObserveRequest(pair_id=pair_id, worker_id=WORKER, open=True)
        (resp,) = list(stub.Observe(iter([opening]), timeout=30))
        assert resp.WhichOneof("event") == "opened"
        o = resp.opened
        assert (o.pair_id, o.worker_id, o.applied_sequence, o.acked_sequence) == (
            pair_id, WORKER, STEPS, STEPS,
        )  # fmt: skip
        # A new worker: nothing held.
        (resp,) = list(stub.Observe(iter([pb.ObserveRequest(
            pair_id=pair_id, worker_id="new", open=True)]), timeout=30))  # fmt: skip
        assert (resp.opened.applied_sequence, resp.opened.acked_sequence) == (0, 0)
        # An opening that carries a step, or names an unknown pair, is refused.
        for bad, code in (
            (pb.ObserveRequest(pair_id=pair_id, worker_id=WORKER, open=True, sequence=3),
             grpc.StatusCode.INVALID_ARGUMENT),
            (pb.ObserveRequest(pair_id="nope", worker_id=WORKER, open=True),
             grpc.StatusCode.NOT_FOUND),
        ):  # fmt: skip
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Observe(iter([bad]), timeout=30))
            assert err.value.code() == code and "opening worker" in err.value.details()
        # A sender that does not open (as a 0.1.0 client) restarting at 1: its step is
        # ignored as before, and the server says so.
        with caplog.at_level(logging.WARNING, logger="avest.grpc"):
            observe._stale._last.clear()
            acks = list(stub.Observe(iter([random_step(pair_id, WORKER, 1, 3, K, 5)]), timeout=30))
        assert [a.ack.acked_sequence for a in acks] == [STEPS]
        assert any("never acknowledged it" in r.getMessage() for r in caplog.records)
    finally:
        channel.close()
    with EstimatorClient(server.grpc_address, timeout=30) as client:
        assert client.pair(pair_id).steps_observed == STEPS


def test_against_a_server_without_the_opening_the_forwarder_sends_as_before(server, monkeypatch):
    """A server before the opening (0.1.0) takes it for a step numbered 0 and refuses it:
    the forwarder then sends its steps without opening, and loses none."""

    async def as_steps(requests: AsyncIterator[pb.ObserveRequest]):  # noqa: ANN202
        async for req in requests:
            req.open = False  # the field unknown: a step with sequence 0
            yield req

    init = observe.ObserveStream.__init__

    def old_init(self, service, requests, context):  # noqa: ANN001, ANN202
        init(self, service, as_steps(requests), context)

    monkeypatch.setattr(observe.ObserveStream, "__init__", old_init)
    with EstimatorClient(server.grpc_address, timeout=30) as client:
        pair_id = register(client)
        fwd = client.forwarder(pair_id, backoff=FAST)
        for step in steps(1):
            fwd.submit(*step)
        assert fwd.flush(timeout=60)
        fwd.close()
        s = fwd.stats
        # The refused opening ended the first stream; the next one carried the steps.
        assert (s.acked, s.refused, s.dropped, s.resent) == (STEPS, 0, 0, 0)
        assert s.reconnects >= 1
        assert client.pair(pair_id).steps_observed == STEPS
