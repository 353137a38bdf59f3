"""Summary mode in the shim: one summary per round, the device sums and sketch equal the
host reference, rounds never mix coefficients, raw steps only as sampled; against the
real sidecar the pair pools the summaries and pushes coefficients back."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from avest_client import EstimatorClient
from avest_client.summary import RoundAccumulator
from avest_client.vllm import rounds as rounds_mod
from avest_client.vllm.config import ShimConfig
from avest_client.vllm.estimator import make_sidecar_estimator
from avest_wire.bins import AUC_SLOTS, FEATURE_BINS, FEATURE_OFFSET, FEATURE_SCALE
from tests.support.sidecar import make_shim, sink_of, wait_until
from tests.support.standin import StandinAcceptanceEstimator
from tests.support.tracedrive import drive, load_trace, steps, synthetic_trace, trace_steps

from .fakes import FakeSink, FakeSinkFactory

CPU = torch.device("cpu")
POOLED = (3, 0.61, [0.4, 0.1, -0.2, -0.5, -0.9])


def _trace(n=260):
    t = load_trace()
    t = t if t is not None else synthetic_trace(steps=n, batch=16, k=5)
    return list(steps(t, 32))[:n]


def _shim(sink, **cfg):
    cls = make_sidecar_estimator(
        StandinAcceptanceEstimator, FakeSinkFactory(sink), config=ShimConfig(**cfg)
    )
    return cls(32, 5, CPU)


def _drive_rounds(est, trace) -> None:  # noqa: ANN001
    """Drive the steps, waiting for the sender to hand each closed round to the sink
    before the next step. The sender gives a round's buffer set back once it built the
    round's sketch; driving on while it still holds both sets would skip a later round's
    sketch whenever the machine is busy. Tests of the skip itself hold the sender on
    purpose (``test_a_slow_sender_skips_the_sketch_and_counts_it``)."""
    rounds = est._avest.rounds
    for s in trace:
        closed = rounds.closed_rounds
        drive(est, s)
        if rounds.closed_rounds != closed:
            assert rounds.flush(10), "the sender did not hand the round over"


def _reference(trace, coef):
    """The host accumulator over the same steps at the float32 coefficients the device used."""
    acc = RoundAccumulator(5)
    w = float(np.float32(coef[1]))
    b = np.asarray(coef[2], dtype=np.float32).astype(np.float64)
    for s in trace:
        acc.add(s.features.numpy(), s.num_verified, s.num_accepted, w, b)
    out = acc.take(coef[0], coef[1], coef[2])
    assert out is not None
    return out


def reached_reference(trace, k=5):
    """Each step's requests past their prefill (the driver's all have ``num_sampled >=
    1``): drafts ``0 .. a`` by feature bin, binned in float32 as the device bins them."""
    want = np.zeros((k, FEATURE_BINS))
    for s in trace:
        x = s.features.numpy().astype(np.float32)
        fb = (np.clip(x, -40, 40) + np.float32(FEATURE_OFFSET)) * np.float32(FEATURE_SCALE)
        fb = np.minimum(fb.astype(np.int64), FEATURE_BINS - 1)
        a = np.asarray(s.num_accepted)
        for r in range(x.shape[0]):
            for i in range(min(int(a[r]), k - 1) + 1):
                want[i, fb[r, i]] += 1
    return want


def test_device_sums_and_sketch_equal_the_host_reference(monkeypatch):
    monkeypatch.setattr(rounds_mod, "REACHED_EVERY", 1)  # every round: each one compared
    sink = FakeSink()
    sink.push(*POOLED)
    est = _shim(sink)
    trace = _trace()
    _drive_rounds(est, trace)
    assert est._avest.rounds.flush(10)
    # step 0 ran under vLLM's own coefficients (dropped); rounds of 100 steps follow
    assert [s.steps for s in sink.summaries] == [100, 100]
    assert sink.received == []  # nothing per step
    for got, part in zip(sink.summaries, (trace[1:101], trace[101:201]), strict=True):
        want = _reference(part, POOLED)
        assert (got.version, got.slope, got.intercepts) == (3, 0.61, tuple(POOLED[2]))
        np.testing.assert_array_equal(got.counts, want.counts)
        np.testing.assert_allclose(got.info, want.info, rtol=2e-4, atol=1e-3)
        np.testing.assert_allclose(got.grad, want.grad, rtol=2e-4, atol=1e-3)
        _assert_sketches_agree(got, want)
        # every draft that reached its position, verified or not, by feature bin
        assert got.reached is not None
        np.testing.assert_array_equal(got.reached.dense(), reached_reference(part))
    assert est._refits == 0  # pooled rounds replace vLLM's local refits
    # vLLM's (and this driver's) per-step tensors are fresh: kept by reference, not copied
    assert not est._avest.rounds.copy_mode and est._avest.rounds.sketches_skipped == 0
    est.avest_close()


def test_one_round_in_ten_carries_its_reached_counts():
    sink = FakeSink()
    sink.push(*POOLED)
    est = _shim(sink, round_steps=10)
    trace = _trace(221)
    _drive_rounds(est, trace)
    assert est._avest.rounds.flush(10)
    assert len(sink.summaries) == 22
    carried = [i for i, s in enumerate(sink.summaries) if s.reached is not None]
    assert carried == [0, 10, 20]
    for i in carried:  # step 0 ran under vLLM's own coefficients: round i is 1 + 10 i ..
        part = trace[1 + 10 * i : 11 + 10 * i]
        np.testing.assert_array_equal(sink.summaries[i].reached.dense(), reached_reference(part))
    est.avest_close()


@pytest.mark.parametrize("round_steps,lengths", [(250, [250]), (40, [40] * 6)])
def test_rounds_of_a_chosen_length_carry_the_same_sums(round_steps, lengths):
    """AVEST_ROUND_STEPS: one summary per that many steps, longer or shorter than vLLM's
    REFIT_INTERVAL, each equal to the host reference over its steps; vLLM's own refits
    stay skipped while pooled coefficients govern."""
    sink = FakeSink()
    sink.push(*POOLED)
    est = _shim(sink, round_steps=round_steps)
    trace = _trace(260)
    _drive_rounds(est, trace)
    assert est._avest.rounds.flush(10)
    assert [s.steps for s in sink.summaries] == lengths
    start = 1  # step 0 ran under vLLM's own coefficients
    for got, n in zip(sink.summaries, lengths, strict=True):
        want = _reference(trace[start : start + n], POOLED)
        start += n
        np.testing.assert_array_equal(got.counts, want.counts)
        np.testing.assert_allclose(got.info, want.info, rtol=2e-4, atol=1e-3)
        np.testing.assert_allclose(got.grad, want.grad, rtol=2e-4, atol=1e-3)
        _assert_sketches_agree(got, want)
    assert est._refits == 0
    assert est._avest.rounds.sketches_skipped == 0
    est.avest_close()


def test_a_slow_sender_skips_the_sketch_and_counts_it(held_sender):
    """The sender still holds both buffer sets when a round starts (held on purpose in
    the first round's sketch): that round goes without a sketch, counted in
    ``sketches_skipped``, and still carries its sums; the rounds after it get sketches."""
    entered, release = held_sender
    sink = FakeSink()
    sink.push(*POOLED)
    est = _shim(sink, round_steps=40)
    rounds = est._avest.rounds
    trace = _trace(161)  # step 0 local, then rounds 1-40, 41-80, 81-120, 121-160
    try:
        for s in trace[:81]:  # the first two rounds: the sender holds both sets
            drive(est, s)
        assert entered.wait(30), "the sender never started the first round's sketch"
        assert rounds.closed_rounds == 2 and rounds.handled == 0
        for s in trace[81:101]:  # the third round started with no set free
            drive(est, s)
    finally:
        release.set()
    assert rounds.flush(10)  # both sets back before the third round ends
    _drive_rounds(est, trace[101:])
    assert rounds.flush(10)
    assert [s.steps for s in sink.summaries] == [40] * 4
    assert [s.sketch is None for s in sink.summaries] == [False, False, True, False]
    assert rounds.sketches_skipped == 1 and not rounds.copy_mode
    assert est._avest.stats()["sketches_skipped"] == 1  # what the worker's metrics export
    start = 1
    for got in sink.summaries:  # the skipped round's sums are sent all the same
        want = _reference(trace[start : start + 40], POOLED)
        start += 40
        np.testing.assert_array_equal(got.counts, want.counts)
        np.testing.assert_allclose(got.info, want.info, rtol=2e-4, atol=1e-3)
        if got.sketch is not None:
            _assert_sketches_agree(got, want)
    est.avest_close()


@pytest.mark.parametrize("held", [False, True], ids=["checked-in-time", "checked-late"])
def test_reused_step_buffers_are_caught_and_copied_from_then_on(monkeypatch, held):
    """A caller that writes every step into the same buffers: the round that held them
    goes without a sketch, and later rounds copy the vectors and equal the reference.
    Checked late (the sender held on purpose in the first round's check until the second
    round kept steps by reference), the second round goes without a sketch as well."""
    from avest_client.vllm import sketch as sketches

    reused, release = sketches.storage_reused, threading.Event()
    if not held:
        release.set()

    def held_check(refs):  # noqa: ANN001, ANN202
        assert release.wait(30), "the test never released the sender"
        return reused(refs)

    monkeypatch.setattr(sketches, "storage_reused", held_check)
    sink = FakeSink()
    sink.push(*POOLED)
    est = _shim(sink)
    rounds = est._avest.rounds
    trace = _trace(301)
    bufs = [torch.zeros(32, dtype=dt) for dt in (torch.int64, torch.int32, torch.int32)]
    try:
        for i, s in enumerate(trace):
            if i == 150:  # held: the second round kept 49 steps by reference so far
                assert rounds.closed_rounds == 1 and rounds.copy_mode is not held
                release.set()
            n = s.idx_mapping.shape[0]
            views = [b[:n] for b in bufs]  # fresh views of one storage, as a runner's buffers
            for v, src in zip(views, (s.idx_mapping, s.num_sampled, s.num_rejected), strict=True):
                v.copy_(src)
            closed = rounds.closed_rounds
            est.load_features(s.idx_mapping, s.features)
            est.step(*views)
            if rounds.closed_rounds != closed and release.is_set():
                assert rounds.flush(10)  # the sender checked the round before the next step
    finally:
        release.set()
    assert rounds.flush(10)
    assert [s.steps for s in sink.summaries] == [100, 100, 100]
    assert rounds.copy_mode
    skipped = [s.sketch is None for s in sink.summaries]
    assert skipped == [True, held, False] and rounds.sketches_skipped == sum(skipped)
    stats = est._avest.stats()  # what the worker's metrics export
    assert stats["copy_mode"] is True and stats["sketches_skipped"] == sum(skipped)
    parts = (trace[1:101], trace[101:201], trace[201:301])
    for got, part in zip(sink.summaries, parts, strict=True):
        want = _reference(part, POOLED)  # the sums never depend on the sketch
        np.testing.assert_array_equal(got.counts, want.counts)
        if got.sketch is not None:
            _assert_sketches_agree(got, want)
    est.avest_close()


def _assert_sketches_agree(got, want) -> None:  # noqa: ANN001
    gs, ws = got.sketch, want.sketch
    dense_g, dense_w = np.zeros(5 * 2 * AUC_SLOTS), np.zeros(5 * 2 * AUC_SLOTS)
    dense_g[gs.cells], dense_w[ws.cells] = gs.counts, ws.counts
    # float32 eta on the device: a draft on a bin edge may land one slot over
    assert np.abs(dense_g - dense_w).sum() <= 2 + 0.002 * got.drafts
    assert np.abs(gs.ece[:, :, 1] - ws.ece[:, :, 1]).sum() <= 2
    assert np.abs(gs.ece[:, :, 0] - ws.ece[:, :, 0]).sum() <= 2
    np.testing.assert_allclose(gs.psum, ws.psum, rtol=1e-3, atol=0.05)
    np.testing.assert_allclose(gs.nll, ws.nll, rtol=1e-4)


def test_a_new_version_ends_the_round_and_raw_steps_go_only_as_sampled():
    sink = FakeSink()
    sink.push(*POOLED)
    est = _shim(sink, raw_sample=0.1)
    trace = _trace(160)
    for i, s in enumerate(trace):
        if i == 51:
            sink.push(4, 0.7, [0.0] * 5)
        drive(est, s)
    assert est._avest.rounds.flush(10)
    assert est._avest.transfer.flush(10)
    # steps 1..51 at version 3 (the step that sees version 4 was drafted at 3), then 4
    assert [(s.version, s.steps) for s in sink.summaries] == [(3, 51), (4, 100)]
    assert len(sink.received) == 16  # every tenth step also raw
    stats = est.avest_stats()
    assert stats["mode"] == "summary" and stats["summaries"] == 2
    est.avest_close()


def test_rounds_under_local_refits_are_not_sent():
    sink = FakeSink(connected=False)
    est = _shim(sink)
    for s in _trace(220):
        drive(est, s)
    assert est._avest.rounds.flush(10)
    assert sink.summaries == [] and est._refits == 2
    est.avest_close()


@pytest.mark.parametrize("sketch", [True, False])
def test_summaries_reach_the_sidecar_which_pools_and_pushes_back(
    start_sidecar, tmp_path, trace_slice, sketch
):
    srv = start_sidecar(tmp_path, refit_interval=100, default_rule="recursive")
    trace = trace_steps(trace_slice("chat", 0, 301))
    est = make_shim(srv.grpc_address, mode="summary")
    if not sketch:
        rounds = est._avest.rounds
        rounds.keep_sketch = rounds.keep_steps = False  # as built with AVEST_SKETCH=0
        rounds._cur = None
    sink = sink_of(est)
    assert sink.wait_connected(10)
    for s in trace:
        drive(est, s)
    assert est._avest.rounds.flush(10)
    assert sink.flush(20), sink.stats
    with EstimatorClient(srv.grpc_address) as client:
        pair = client.pair(sink.pair_id)
        summaries = est._avest.rounds.summaries
        assert summaries >= 2 and sink.stats["acked"] == summaries
        assert pair.coefficients.version >= 2  # refitted from the pooled summaries
        # rounds end at 100 steps or where a pushed update applies: all are pooled
        assert pair.steps_observed == est._avest.rounds.steps_closed >= 200
        assert (pair.calibration.count > 0) == sketch
        # the pushed coefficients govern the worker's tensors
        wait_until(
            lambda: getattr(sink.latest_coefficients(), "version", 0) == pair.coefficients.version
        )
    drive(est, trace[-1])
    assert est.slope.item() == pytest.approx(pair.coefficients.slope, rel=1e-6)
    est.avest_close()


def test_a_failed_sketch_gives_its_buffers_back(monkeypatch):
    """The sender fails on one round (counted); the next rounds still get sketches."""
    from avest_client.vllm import sketch as sketches

    build, calls = sketches.build, []

    def failing_once(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("device lost")
        return build(*args, **kwargs)

    monkeypatch.setattr(sketches, "build", failing_once)
    sink = FakeSink()
    sink.push(*POOLED)
    est = _shim(sink)
    _drive_rounds(est, _trace(301))
    rounds = est._avest.rounds
    assert rounds.flush(10)
    assert rounds.send_errors == 1 and [s.steps for s in sink.summaries] == [100, 100]
    assert all(s.sketch is not None for s in sink.summaries)
    est.avest_close()
