"""Fuzzing over the wire: generated messages and raw bytes against a live server.

Every example is one call (one message; Observe gets a stream of one) to a
server on 127.0.0.1:0. After each: the call ended with a status the contract
names (never UNKNOWN or INTERNAL), the server still answers, every pair's
coefficients are finite with a non-negative slope, and a refused call left
the state exactly as it was (``ListPairs``, byte for byte).

Budget: ``AVEST_FUZZ_EXAMPLES`` examples per strategy (default 150, a few
seconds each). The long run, >= 10^4 generated messages and 10^4 byte
strings::

    AVEST_FUZZ_EXAMPLES=10000 python -m pytest -q tests/fuzz
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from avest_wire import matrix as wire
from avest_wire.v1 import estimator_pb2 as pb
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc
from tests.support.rpc import observe_request
from tests.support.server import ADMIN, launch

pytestmark = pytest.mark.slow


EXAMPLES = int(os.environ.get("AVEST_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=False,
    database=None,
    suppress_health_check=list(HealthCheck),
)
#: Statuses a call may end with; anything else (UNKNOWN, INTERNAL) is a bug.
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.UNAUTHENTICATED,  # admin methods called without the token
}
METHODS = list(pb.DESCRIPTOR.services_by_name["EstimatorService"].methods_by_name)
K = 4


class Target:
    """The live server, a channel, and two pairs with a little history."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.channel = grpc.insecure_channel(
            handle.grpc_address, options=[("grpc.max_send_message_length", 64 << 20)]
        )
        self.stub = pb_grpc.EstimatorServiceStub(self.channel)
        self.pairs = []
        for method in ("eagle", "ngram"):
            key = pb.PairKey(
                target_model="t", draft_model="d", method=method, num_speculative_tokens=K
            )
            pid = self.stub.RegisterPair(pb.RegisterPairRequest(key=key, refit_interval=3)).pair_id
            self.pairs.append(pid)
            steps = [valid_step(pid, "seed", s) for s in range(1, 8)]
            list(self.stub.Observe(iter(steps), timeout=10))
        self.sequence = 100

    def pairs_now(self) -> pb.ListPairsResponse:
        return self.stub.ListPairs(pb.ListPairsRequest(), timeout=10)

    def check_valid(self, listing: pb.ListPairsResponse | None = None) -> None:
        for p in (listing or self.pairs_now()).pairs:
            c = p.coefficients
            assert math.isfinite(c.slope) and c.slope >= 0.0, (p.pair_id, c.slope)
            assert all(math.isfinite(b) for b in c.intercepts), (p.pair_id, list(c.intercepts))

    def call(self, method: str, payload: bytes, admin: bool = False) -> grpc.StatusCode:
        path = f"/avest.v1.EstimatorService/{method}"
        md = ADMIN if admin else ()
        try:
            if method == "Observe":
                fn = self.channel.stream_stream(path)
                list(fn(iter([payload]), timeout=10, metadata=md))
            elif method == "WatchCoefficients":
                fn = self.channel.unary_stream(path)
                stream = fn(payload, timeout=10, metadata=md)
                next(iter(stream), None)
                stream.cancel()
            else:
                self.channel.unary_unary(path)(payload, timeout=10, metadata=md)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED and method == "WatchCoefficients":
                return grpc.StatusCode.OK
            assert exc.code() in ALLOWED, (method, exc.code(), exc.details())
            return exc.code()
        return grpc.StatusCode.OK

    def probe(self, method: str, payload: bytes, admin: bool = False) -> None:
        before = self.pairs_now()
        code = self.call(method, payload, admin)
        after = self.pairs_now()
        if code != grpc.StatusCode.OK:
            assert after == before, f"refused {method} ({code.name}) changed the state"
        self.check_valid(after)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    handle = launch(
        tmp_path_factory.mktemp("fuzz"),
        max_pairs=32,
        refit_interval=3,
        rpc_rate=0,
        flush_interval_ms=5,
    )
    t = Target(handle)
    try:
        yield t
    finally:
        t.channel.close()
        handle.stop()


def valid_step(
    pair_id: str, worker: str, seq: int, rows: int = 6, seed: int = 0
) -> pb.ObserveRequest:
    rng = np.random.default_rng(seed + seq)
    d = rng.integers(0, K + 1, size=rows)
    x = rng.normal(0, 3, size=(rows, K))
    return observe_request(pair_id, worker, seq, x, d, [rng.integers(0, v + 1) for v in d])


# -- strategies ------------------------------------------------------------------------------

texts = st.one_of(st.text(max_size=40), st.just(""), st.text(min_size=200, max_size=600))
u32 = st.integers(0, 2**32 - 1)
small = st.one_of(st.integers(0, 8), u32)
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)


@st.composite
def observe_messages(draw: st.DrawFn, target: Target) -> pb.ObserveRequest:
    pair_id = draw(st.one_of(st.sampled_from(target.pairs), texts))
    rows = draw(st.integers(0, 12))
    k = draw(st.one_of(st.just(K), st.integers(0, 70)))
    if draw(st.booleans()):
        features = wire.encode(
            np.array(
                draw(st.lists(floats, min_size=rows * K, max_size=rows * K)), dtype=np.float32
            ).reshape(rows, K)
        )[0]
    else:
        features = draw(st.binary(max_size=256))
    n_ver = draw(
        st.lists(st.integers(0, K + 2), min_size=rows, max_size=rows) | st.lists(u32, max_size=14)
    )
    n_acc = draw(
        st.lists(st.integers(0, K + 2), min_size=rows, max_size=rows) | st.lists(u32, max_size=14)
    )
    target.sequence += 1
    seq = draw(st.one_of(st.just(target.sequence), st.integers(0, 2**64 - 1)))
    return pb.ObserveRequest(
        pair_id=pair_id,
        worker_id=draw(st.one_of(st.just("fuzz"), texts)),
        sequence=seq,
        features=features,
        rows=rows,
        k=k,
        num_verified=n_ver,
        num_accepted=n_acc,
        exclude=draw(st.lists(st.booleans(), max_size=14)),
        coefficients_version=draw(st.integers(0, 2**64 - 1)),
    )


@st.composite
def unary_messages(draw: st.DrawFn, target: Target) -> tuple[str, bytes, bool]:
    pair_id = draw(st.one_of(st.sampled_from(target.pairs), texts))
    rows = draw(st.integers(0, 10))
    k = draw(st.one_of(st.just(K), st.integers(0, 70)))
    if draw(st.booleans()):
        matrix = draw(st.binary(max_size=200))
    else:
        values = draw(st.lists(floats, min_size=rows * K, max_size=rows * K))
        matrix = wire.encode(np.array(values, dtype=np.float32).reshape(rows, K))[0]
    points = st.lists(
        st.builds(pb.CostPoint, size=small, ms=st.floats(allow_nan=True, allow_infinity=True)),
        max_size=12,
    )
    method = draw(
        st.sampled_from(
            [
                "RegisterPair",
                "Score",
                "Budget",
                "SetCostCurves",
                "GetPair",
                "GetSchedule",
                "GetCoefficients",
                "WatchCoefficients",
            ]
        )
    )
    msg: Any
    if method == "RegisterPair":
        msg = pb.RegisterPairRequest(
            key=pb.PairKey(
                target_model=draw(texts),
                draft_model=draw(texts),
                method=draw(texts),
                num_speculative_tokens=draw(st.one_of(st.integers(0, 100), u32)),
                labels=draw(st.dictionaries(texts, texts, max_size=4)),
            ),
            update_rule=draw(st.integers(0, 5)),
            refit_interval=draw(st.one_of(st.integers(0, 2_000_000), u32)),
        )
    elif method == "Score":
        msg = pb.ScoreRequest(pair_id=pair_id, features=matrix, rows=rows, k=k)
    elif method == "Budget":
        msg = pb.BudgetRequest(
            pair_id=pair_id,
            confidences=matrix,
            rows=rows,
            k=k,
            scheduled_drafts=draw(st.lists(small, max_size=12)),
            num_non_draft_tokens=draw(small),
            num_sampling_requests=draw(small),
            rule=draw(st.integers(0, 7)),
            hardware=draw(st.one_of(st.just(""), texts)),
            min_drafts_per_request=draw(small),
        )
    elif method == "SetCostCurves":
        msg = pb.SetCostCurvesRequest(
            pair_id=pair_id,
            hardware=draw(st.one_of(st.just(""), texts)),
            draft_curve=draw(points),
            verify_curve=draw(points),
            cudagraph_capture_limit=draw(small),
        )
    elif method == "WatchCoefficients":
        msg = pb.WatchCoefficientsRequest(pair_id=pair_id)
    elif method == "GetPair":
        msg = pb.GetPairRequest(pair_id=pair_id)
    elif method == "GetSchedule":
        msg = pb.GetScheduleRequest(pair_id=pair_id, hardware=draw(st.one_of(st.just(""), texts)))
    else:
        msg = pb.GetCoefficientsRequest(pair_id=pair_id)
    return method, msg.SerializeToString(), method == "SetCostCurves"


# -- the fuzz runs ----------------------------------------------------------------------------


def test_fuzz_observe_messages(target: Target) -> None:
    @FUZZ
    @given(st.data())
    def run(data: st.DataObject) -> None:
        msg = data.draw(observe_messages(target))
        target.probe("Observe", msg.SerializeToString())

    run()


def test_fuzz_unary_messages(target: Target) -> None:
    @FUZZ
    @given(st.data())
    def run(data: st.DataObject) -> None:
        method, payload, admin = data.draw(unary_messages(target))
        target.probe(method, payload, admin)

    run()


def test_fuzz_raw_bytes(target: Target) -> None:
    @FUZZ
    @given(st.sampled_from(METHODS), st.binary(max_size=512), st.booleans())
    def run(method: str, payload: bytes, admin: bool) -> None:
        target.probe(method, payload, admin)

    run()


def test_fuzzed_server_still_learns(target: Target) -> None:
    """After the fuzzing, valid steps are still applied and acknowledged."""
    pid = target.pairs[0]
    seqs = range(10_000_000, 10_000_010)
    acks = list(target.stub.Observe(iter([valid_step(pid, "after", s) for s in seqs]), timeout=10))
    assert max(a.ack.acked_sequence for a in acks if a.HasField("ack")) == seqs[-1]
    target.check_valid()
