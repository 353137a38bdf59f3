"""A server's gRPC API driven by a raw stub: pairs registered from a trace or by K,
Observe messages (:func:`observe_request`) and streams of them, with the acknowledged
sequence read back."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence

import grpc
import numpy as np
import numpy.typing as npt

from avest.offline.replay import pair_key, step_bounds
from avest.offline.trace import Trace
from avest_wire import matrix as wire
from avest_wire.rules import UPDATE_RULES
from avest_wire.v1 import estimator_pb2 as pb
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc


def stub_for(address: str) -> tuple[grpc.Channel, pb_grpc.EstimatorServiceStub]:
    channel = grpc.insecure_channel(address)
    return channel, pb_grpc.EstimatorServiceStub(channel)


def pairs_by_id(address: str) -> dict[str, pb.Pair]:
    """Every pair the service at ``address`` lists (one page: up to hundreds), by id."""
    channel, stub = stub_for(address)
    try:
        return {p.pair_id: p for p in stub.ListPairs(pb.ListPairsRequest()).pairs}
    finally:
        channel.close()


def register(stub, trace, rule="recursive", refit_interval=10, labels=None):
    key = pair_key(trace)
    if labels:
        key.labels.update(labels)
    return stub.RegisterPair(
        pb.RegisterPairRequest(
            key=key, update_rule=UPDATE_RULES[rule], refit_interval=refit_interval
        ),
        timeout=10,
    )


def observe_request(
    pair_id: str,
    worker: str,
    seq: int,
    features: npt.ArrayLike,
    num_verified: Iterable[int],
    num_accepted: Iterable[int],
) -> pb.ObserveRequest:
    """One Observe message: the ``[rows, K]`` draft features as the wire carries them
    (float32) and, per row, the drafts verified and accepted."""
    data, rows, k = wire.encode(features)
    return pb.ObserveRequest(
        pair_id=pair_id,
        worker_id=worker,
        sequence=seq,
        features=data,
        rows=rows,
        k=k,
        num_verified=[int(v) for v in num_verified],
        num_accepted=[int(v) for v in num_accepted],
    )


def messages_for(
    trace: Trace, pair_id: str, worker: int, workers: int, worker_id: str, repeat: int
) -> list[pb.ObserveRequest]:
    """The Observe messages one of ``workers`` simulated workers sends, in order: each
    trace step's rows split among the workers, sequence numbers from 1."""
    out = []
    seq = 0
    for _ in range(repeat):
        for lo, hi in step_bounds(trace):
            chunk = np.array_split(np.arange(lo, hi), workers)[worker]
            if chunk.size == 0:
                continue
            sl = slice(int(chunk[0]), int(chunk[-1]) + 1)
            seq += 1
            out.append(
                observe_request(
                    pair_id,
                    worker_id,
                    seq,
                    trace.features[sl],
                    trace.num_verified[sl],
                    trace.num_accepted[sl],
                )
            )
    return out


def observe_all(stub, msgs):
    """Stream messages; return the highest acknowledged sequence and the updates."""
    acked, updates = 0, []
    for resp in stub.Observe(iter(msgs), timeout=60):
        if resp.HasField("ack"):
            acked = max(acked, resp.ack.acked_sequence)
        else:
            updates.append(resp.coefficients_update.coefficients.version)
    return acked, updates


def synthetic_steps(pair_id: str, worker: str, k: int, steps: int, seed: int, rows: int = 8):
    """``steps`` Observe messages of random drafts for a K-position pair."""
    rng = np.random.default_rng(seed)
    out = []
    for seq in range(1, steps + 1):
        x = rng.normal(0.0, 2.0, size=(rows, k)).astype(np.float32)
        d = rng.integers(0, k + 1, size=rows)
        a = np.minimum(rng.integers(0, k + 1, size=rows), d)
        out.append(observe_request(pair_id, worker, seq, x, d, a))
    return out


def register_k(stub, k: int, n: int, refit_interval: int = 10) -> pb.RegisterPairResponse:
    key = pb.PairKey(
        target_model="target", draft_model="draft", method="draft_model",
        num_speculative_tokens=k, labels={"n": str(n)},
    )  # fmt: skip
    return stub.RegisterPair(
        pb.RegisterPairRequest(
            key=key, update_rule=pb.UPDATE_RULE_RECURSIVE, refit_interval=refit_interval
        )
    )


def register_named(
    stub: pb_grpc.EstimatorServiceStub,
    name: str,
    k: int,
    refit_interval: int = 0,
    metadata: Sequence[tuple[str, str]] | None = None,
) -> str:
    """The id of a pair of target ``name`` drafting ``k`` positions (``refit_interval`` 0:
    the service's default)."""
    key = pb.PairKey(target_model=name, draft_model="d", method="m", num_speculative_tokens=k)
    request = pb.RegisterPairRequest(key=key, refit_interval=refit_interval)
    return str(stub.RegisterPair(request, metadata=metadata).pair_id)


def random_step(
    pair_id: str, worker: str, seq: int, rows: int, k: int, seed: int, accept: int | None = None
) -> pb.ObserveRequest:
    """An Observe message of ``rows`` random rows (features drawn from N(0, 2²), the spread
    of the real traces), every draft verified; per row ``accept`` drafts accepted, or a
    uniform draw from 0..k."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 2.0, size=(rows, k))
    a = rng.integers(0, k + 1, size=rows) if accept is None else [accept] * rows
    return observe_request(pair_id, worker, seq, x, [k] * rows, a)


def zero_step(pair_id: str, worker: str, seq: int, k: int, rows: int) -> pb.ObserveRequest:
    """An Observe message of ``rows`` all-zero feature rows, every draft verified and
    only the first accepted: cheap to send and to fold, for load and fairness tests."""
    return observe_request(pair_id, worker, seq, np.zeros((rows, k)), [k] * rows, [1] * rows)


async def flood(
    stub: pb_grpc.EstimatorServiceStub,
    msg: pb.ObserveRequest,
    seconds: float,
    metadata: Sequence[tuple[str, str]] | None = None,
) -> None:
    """``msg`` sent again and again on one Observe stream (sequence 1, 2, ...) for
    ``seconds``, as fast as flow control lets it; a stream the service ends is left so."""
    deadline = time.monotonic() + seconds

    async def gen() -> AsyncIterator[pb.ObserveRequest]:
        seq = 0
        while time.monotonic() < deadline:
            seq += 1
            msg.sequence = seq
            yield msg

    with contextlib.suppress(grpc.aio.AioRpcError):
        async for _ in stub.Observe(gen(), metadata=metadata, timeout=seconds + 30):
            pass


class HeldStream:
    """``msgs`` streamed to ``address`` on a thread of their own from :meth:`start`, the
    stream held open until ``last`` is acknowledged or the ``with`` block ends:
    :attr:`acks` as they come, ``(monotonic time, sequence)``, and :attr:`done` set
    once ``last`` is."""

    def __init__(
        self, address: str, msgs: list[pb.ObserveRequest], last: int, wait_s: float = 90.0
    ) -> None:
        self.address, self.msgs, self.last, self.wait_s = address, msgs, last, wait_s
        self.acks: list[tuple[float, int]] = []
        self.done = threading.Event()
        self._reader = threading.Thread(target=self._consume, daemon=True)

    def acked(self) -> list[int]:
        return [seq for _, seq in self.acks]

    def _requests(self) -> Iterator[pb.ObserveRequest]:
        yield from self.msgs
        self.done.wait(3 * self.wait_s)  # the stream stays open for its acks

    def _consume(self) -> None:
        channel, stub = stub_for(self.address)
        try:
            for resp in stub.Observe(self._requests(), timeout=4 * self.wait_s):
                if resp.HasField("ack"):
                    self.acks.append((time.monotonic(), resp.ack.acked_sequence))
                    if resp.ack.acked_sequence == self.last:
                        self.done.set()
        finally:
            channel.close()

    def start(self) -> None:
        self._reader.start()

    def __enter__(self) -> HeldStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        if self._reader.is_alive():
            self._reader.join(self.wait_s)
