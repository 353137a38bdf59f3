"""SIGTERM with many unsaved K = 64 pairs finishes within the grace period, and
everything it acknowledged survives the restart."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from avest_wire.v1 import estimator_pb2 as pb
from tests.support.rpc import register_k, stub_for, synthetic_steps
from tests.support.serve import spawn

pytestmark = pytest.mark.slow

PAIRS = 150
GRACE_S = 2.0


def fill(stub, pairs: int) -> tuple[list[str], threading.Event, dict[str, int], threading.Thread]:
    """Register ``pairs`` K = 64 pairs and apply one step to each on one open stream
    (no refit, no flush: all of them unsaved). Returns the ids, the event that ends the
    stream, the acks by pair and the reading thread."""
    ids = [register_k(stub, 64, n, refit_interval=1000).pair_id for n in range(pairs)]
    msgs = [synthetic_steps(pid, "w", 64, 1, seed=n, rows=32)[0] for n, pid in enumerate(ids)]
    done = threading.Event()
    acks: dict[str, int] = {}

    def requests():
        yield from msgs
        done.wait(120)

    def read() -> None:
        try:
            for resp in stub.Observe(requests(), timeout=120):
                if resp.HasField("ack"):
                    acks[resp.ack.pair_id] = resp.ack.acked_sequence
        except Exception:
            pass  # the server went away

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        steps = [stub.GetPair(pb.GetPairRequest(pair_id=ids[-1])).pair.steps_observed]
        if steps == [1]:
            break
        time.sleep(0.05)
    return ids, done, acks, reader


def test_sigterm_with_many_unsaved_k64_pairs_finishes_within_the_grace(tmp_path):
    proc, address = spawn(tmp_path, "--flush-interval-ms", "600000", "--grace-s", str(GRACE_S))
    try:
        channel, stub = stub_for(address)
        ids, done, acks, reader = fill(stub, PAIRS)
        assert len(acks) < PAIRS / 2  # most pairs unsaved when SIGTERM comes
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        took = time.monotonic() - t0
        done.set()
        reader.join(10)
        channel.close()
    finally:
        proc.kill()
        proc.wait()
    assert took < GRACE_S + 1.5, f"SIGTERM took {took:.1f}s"
    # What was acknowledged is stored; what was not is simply absent (its worker resends).
    proc, address = spawn(tmp_path)
    try:
        channel, stub = stub_for(address)
        stored = {p.pair_id: p.steps_observed for p in stub.ListPairs(pb.ListPairsRequest()).pairs}
        channel.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert set(stored) <= set(ids)
    assert {pid for pid, n in stored.items() if n == 1} >= set(acks)
    assert set(acks.values()) <= {1}
