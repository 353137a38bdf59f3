"""Sketches that stop growing with the fleet: the service asks each worker of a pair for
a round summary's calibration sketch with one round in ceil(streaming workers /
``--sketched-workers``) (``WorkerOpened.sketch_every``, ``CoefficientsUpdate.sketch_every``),
and the client sends it so; rounds without one still pool their sums."""

from __future__ import annotations

import queue
from collections.abc import Iterator

from avest_client import EstimatorClient
from avest_client.summary import RoundAccumulator
from avest_wire.messages import summary_to_pb
from avest_wire.v1 import estimator_pb2 as pb
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc
from tests.support.helpers import wait_until
from tests.support.live import register
from tests.support.steps import synthetic_steps

K = 5


class Stream:
    """One Observe call on the raw stub, fed request by request."""

    def __init__(self, stub: pb_grpc.EstimatorServiceStub) -> None:
        self._requests: queue.Queue[pb.ObserveRequest | None] = queue.Queue()
        self._responses = stub.Observe(self._feed(), timeout=60)

    def _feed(self) -> Iterator[pb.ObserveRequest]:
        while (req := self._requests.get()) is not None:
            yield req

    def send(self, req: pb.ObserveRequest) -> None:
        self._requests.put(req)

    def next(self, event: str) -> pb.ObserveResponse:
        """The next response of kind ``event`` (others skipped)."""
        for resp in self._responses:
            if resp.WhichOneof("event") == event:
                return resp
        raise AssertionError(f"the stream ended before a {event}")

    def close(self) -> None:
        """Half-close, and wait for the server to end the call."""
        self._requests.put(None)
        for _ in self._responses:
            pass


def _open(stub: pb_grpc.EstimatorServiceStub, pair_id: str, worker: str) -> tuple[Stream, int]:
    stream = Stream(stub)
    stream.send(pb.ObserveRequest(pair_id=pair_id, worker_id=worker, open=True))
    return stream, stream.next("opened").opened.sketch_every


def _summary(coef: pb.Coefficients, steps: int, seed: int = 0):  # noqa: ANN202
    """A round of ``steps`` synthetic decode steps, summed at ``coef``, with its sketch."""
    acc = RoundAccumulator(K)
    for x, verified, accepted in synthetic_steps(steps, k=K, seed=seed):
        acc.add(x, verified, accepted, coef.slope, tuple(coef.intercepts))
    summary = acc.take(coef.version, coef.slope, tuple(coef.intercepts))
    assert summary is not None and summary.sketch is not None
    return summary


def test_the_service_asks_for_fewer_sketches_as_more_workers_stream(open_server):
    live = open_server(sketched_workers=2, refit_interval=10)
    pair_id = register(live, k=K, refit_interval=10)
    streams, asked = [], []
    try:
        for w in range(5):
            stream, every = _open(live.stub, pair_id, f"w{w}")
            streams.append(stream)
            asked.append(every)
        # 1..5 workers streaming, 2 sketched in full: ceil(n / 2) beyond 2
        assert asked == [1, 1, 2, 2, 3]
        for stream in streams[:2]:
            stream.close()
        streams = streams[2:]
        stream, every = _open(live.stub, pair_id, "w5")
        streams.append(stream)
        assert every == 2  # 4 streaming again
        # a refit's push carries what the pair's workers are asked now
        coef = live.stub.GetCoefficients(pb.GetCoefficientsRequest(pair_id=pair_id)).coefficients
        summary = _summary(coef, 12)
        stream.send(
            pb.ObserveRequest(
                pair_id=pair_id, worker_id="w5", sequence=1, k=K, summary=summary_to_pb(summary)
            )
        )
        update = stream.next("coefficients_update").coefficients_update
        assert update.coefficients.version > coef.version
        assert update.sketch_every == 2
    finally:
        for stream in streams:
            stream.close()


def test_at_zero_every_worker_sends_every_sketch(open_server):
    live = open_server(sketched_workers=0)
    pair_id = register(live, k=K)
    streams = [_open(live.stub, pair_id, f"w{w}") for w in range(3)]
    try:
        assert [every for _, every in streams] == [1, 1, 1]
    finally:
        for stream, _ in streams:
            stream.close()


def test_workers_send_a_sketch_with_one_round_in_what_they_are_asked(open_server):
    """Through the real client: four forwarders of one pair with one worker sketched in
    full send sketches with fewer of their rounds; every round's sums are pooled."""
    live = open_server(sketched_workers=1, refit_interval=1_000_000)
    workers, rounds, steps = 4, 6, 5
    with EstimatorClient(live.grpc_address, timeout=30) as client:
        reg = client.register("t", "d", "m", K, {}, refit_interval=1_000_000)
        coef = client.coefficients(reg.pair_id)
        wire_coef = pb.Coefficients(
            version=coef.version, slope=coef.slope, intercepts=coef.intercepts
        )
        fwds = [client.forwarder(reg.pair_id, f"w{w}", k=K) for w in range(workers)]
        # every forwarder opens its worker (and so streams) before its rounds go out
        for i, fwd in enumerate(fwds):
            fwd.submit_summary(_summary(wire_coef, steps, seed=i))
            assert fwd.flush(20)
        sketched_before = client.pair(reg.pair_id).calibration.count
        drafts_before = client.pair(reg.pair_id).drafts_observed
        for r in range(rounds):
            for i, fwd in enumerate(fwds):
                fwd.submit_summary(_summary(wire_coef, steps, seed=100 * r + i + 1))
        for fwd in fwds:
            assert fwd.flush(20)
            assert fwd.stats.refused == 0 and fwd.stats.invalid == 0
        assert wait_until(
            lambda: client.pair(reg.pair_id).steps_observed == workers * (rounds + 1) * steps,
            timeout=20,
        )
        pair = client.pair(reg.pair_id)
    sketched = pair.calibration.count - sketched_before
    drafts = pair.drafts_observed - drafts_before
    # the last to open was asked for one round in 4, the first for every round: far
    # fewer sketched drafts than pooled ones, and some
    assert 0 < sketched < 0.8 * drafts
    # the worker table says which worker sent how many
    rows = live.http.get(f"/v1/pairs/{reg.pair_id}/workers").json()["workers"]
    counts = {r["worker_id"]: (r["summaries"], r["sketches"]) for r in rows}
    assert counts["w0"] == (rounds + 1, rounds + 1)
    assert counts["w3"][0] == rounds + 1 and 1 <= counts["w3"][1] <= 3


def test_a_session_sends_a_sketch_with_one_round_in_what_it_was_asked():
    from avest_client._stream import Backoff, Session, StratumSummary
    from avest_client.ledger import Ledger, Step

    session = Session("p", "w", Ledger(), Backoff())
    opened = pb.WorkerOpened(pair_id="p", worker_id="w", sketch_every=3)
    session.on_response(pb.ObserveResponse(opened=opened))
    assert session.sketch_every == 3
    coef = pb.Coefficients(slope=1.0, intercepts=[0.0] * K)
    summary = _summary(coef, 2)

    def sent(payload: object) -> pb.ObserveRequest:
        return session.message(Step(sequence=1, payload=payload))

    whole = [sent(summary).summary.HasField("sketch") for _ in range(9)]
    greedy = [sent(StratumSummary(summary, "greedy")).summary.HasField("sketch") for _ in range(6)]
    assert sum(whole) == 3 and sum(greedy) == 2  # each stratum's rounds counted apart
    # a message is built once: a resend is what was sent
    step = Step(sequence=2, payload=summary)
    assert session.message(step) is session.message(step)
    # a push from a service that does not ask (0): every round again
    update = pb.CoefficientsUpdate(coefficients=pb.Coefficients(pair_id="p"), sketch_every=0)
    session.on_response(pb.ObserveResponse(coefficients_update=update))
    assert session.sketch_every == 1
    assert all(sent(summary).summary.HasField("sketch") for _ in range(4))


def test_streams_that_end_are_no_longer_counted(open_server):
    live = open_server(sketched_workers=1)
    pair_id = register(live, k=K)
    for w in range(3):
        stream, every = _open(live.stub, pair_id, f"w{w}")
        assert every == 1  # the ones before it ended
        stream.close()
    first, _ = _open(live.stub, pair_id, "a")
    second, every = _open(live.stub, pair_id, "b")
    assert every == 2
    first.close()
    second.close()
