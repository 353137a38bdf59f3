"""Which step a refusal names travels as data (trailing metadata), beside the text.

Against a real server: the refusal of a bad step carries its sequence number
in the status's trailing metadata and, unchanged, in the text that 0.1
clients read; the sync and asyncio forwarders drop the step that entry names
without reading the text; against a server that sends the text only (as 0.1
does) they read the text.
"""

from __future__ import annotations

import re

import grpc
import numpy as np
import pytest

from avest_client import AsyncEstimatorClient, Backoff, EstimatorClient, _stream
from avest_client.credentials import sync_channel
from avest_wire import refusal
from avest_wire.v1 import estimator_pb2 as pb
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc

FAST = Backoff(initial_s=0.02, max_s=0.2)
K = 4
#: The bad step goes out as this sequence number, between good ones.
BAD = 6
TOTAL = 10


def good_step(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = 3
    verified = np.full(rows, K)
    return (
        rng.uniform(-3, 3, (rows, K)).astype(np.float32),
        verified,
        rng.integers(0, K + 1, rows),
    )


def steps() -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``TOTAL`` steps; step ``BAD`` has K + 1 columns, which the server refuses."""
    rng = np.random.default_rng(7)
    out = [good_step(rng) for _ in range(TOTAL)]
    out[BAD - 1] = (np.zeros((3, K + 1), np.float32), np.ones(3), np.ones(3))
    return out


def register(address: str) -> str:
    with EstimatorClient(address) as client:
        return client.register("t/refusal", "d/refusal", "draft_model", K).pair_id


def check_forwarded(fwd) -> None:  # noqa: ANN001
    s = fwd.stats
    assert (s.submitted, s.refused, s.acked, s.dropped) == (TOTAL, 1, TOTAL - 1, 0)
    assert s.acked_sequence == TOTAL
    assert re.match(rf"INVALID_ARGUMENT: sequence {BAD} of worker .*: k: ", fwd.last_error)


def test_the_refusal_names_the_step_in_trailing_metadata_and_in_text(server):
    pair_id = register(server.grpc_address)
    x, d, a = steps()[BAD - 1]
    bad = pb.ObserveRequest(
        pair_id=pair_id,
        worker_id="w-raw",
        sequence=BAD,
        features=x.tobytes(),
        rows=3,
        k=K + 1,
        num_verified=d.astype(int).tolist(),
        num_accepted=a.astype(int).tolist(),
    )
    channel = sync_channel(server.grpc_address, (), None)
    try:
        with pytest.raises(grpc.RpcError) as raised:
            for _ in pb_grpc.EstimatorServiceStub(channel).Observe(iter([bad]), timeout=10):
                pass
    finally:
        channel.close()
    exc = raised.value
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
    # The text as 0.1 wrote it, and the same number as data.
    assert exc.details().startswith(f"sequence {BAD} of worker 'w-raw': k: ")
    entries = [(m.key, m.value) for m in exc.trailing_metadata()]
    assert (refusal.REFUSED_SEQUENCE_KEY, str(BAD)) in entries
    assert refusal.refused_sequence_from(exc.trailing_metadata()) == BAD


def no_text(details: str | None, trailing: _stream.Metadata = None) -> int | None:
    """The client's reading with the text fallback taken away: the entry alone."""
    return refusal.refused_sequence_from(trailing)


def forward_sync(address: str, worker_id: str) -> None:
    """Send :func:`steps` through the sync forwarder; the bad one alone is refused."""
    pair_id = register(address)
    with EstimatorClient(address) as client:
        fwd = client.forwarder(pair_id, worker_id=worker_id, backoff=FAST)
        for step in steps():
            fwd.submit(*step, None)
        assert fwd.flush(timeout=30)
        fwd.close()
    check_forwarded(fwd)


def test_the_forwarder_drops_the_step_the_entry_names(server, monkeypatch):
    monkeypatch.setattr(_stream, "refused_sequence", no_text)
    forward_sync(server.grpc_address, "w-sync")


async def test_the_async_forwarder_drops_the_step_the_entry_names(server, monkeypatch):
    monkeypatch.setattr(_stream, "refused_sequence", no_text)
    pair_id = register(server.grpc_address)
    async with AsyncEstimatorClient(server.grpc_address) as client:
        fwd = client.forwarder(pair_id, worker_id="w-async", backoff=FAST)
        for step in steps():
            fwd.submit(*step, None)
        assert await fwd.flush(timeout=30)
        await fwd.close()
    check_forwarded(fwd)


def test_against_a_server_that_sends_text_only_the_text_names_the_step(server, monkeypatch):
    # The server as 0.1 is: no trailing entry.
    monkeypatch.setattr(refusal, "refused_sequence_metadata", lambda sequence: ())
    forward_sync(server.grpc_address, "w-old")


def test_the_entry_wins_over_the_text_and_the_text_stands_in_for_it():
    entry = refusal.refused_sequence_metadata(12)
    assert _stream.refused_sequence("sequence 9 of worker 'w': k: bad", entry) == 12
    assert _stream.refused_sequence("sequence 9 of worker 'w': k: bad", ()) == 9
    assert _stream.refused_sequence("k: bad", [("other", "1")]) is None
    assert refusal.refused_sequence_from([(refusal.REFUSED_SEQUENCE_KEY, b"33")]) == 33
    assert refusal.refused_sequence_from([(refusal.REFUSED_SEQUENCE_KEY, "x")]) is None
