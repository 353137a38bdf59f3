"""What the shim hands the sink: exactly the step's rows, off the step, with exact drop counts."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from avest_client.vllm.config import ShimConfig
from avest_client.vllm.estimator import make_sidecar_estimator
from avest_client.vllm.exclusion import ExclusionRegistry
from avest_wire.pair import PairKey
from tests.support.standin import StandinAcceptanceEstimator
from tests.support.tracedrive import drive, load_trace, steps, synthetic_trace

from .fakes import FakeSink, FakeSinkFactory

CPU = torch.device("cpu")


def _shim(sink: FakeSink, queue_size: int = 4096, **kw):
    factory = FakeSinkFactory(sink)
    cls = make_sidecar_estimator(
        StandinAcceptanceEstimator,
        factory,
        config=ShimConfig(queue_size=queue_size, mode="raw"),
        **kw,
    )
    return cls, factory


def _trace():
    t = load_trace()
    return t if t is not None else synthetic_trace(steps=800, batch=16, k=5)


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    ),
]


@pytest.mark.parametrize("device", DEVICES)
def test_trace_rows_reach_the_sink_exactly(device):
    """On CUDA this exercises the side stream, pinned buffers and events."""
    trace = _trace()
    k = trace["features"].shape[1]
    sink = FakeSink(connected=False)
    cls, factory = _shim(sink)
    est = cls(32, k, torch.device(device))
    assert len(factory.calls) == 1
    config, pair = factory.calls[0]
    assert isinstance(config, ShimConfig) and pair == PairKey("", "", "", k)
    expected = list(steps(trace, 32))
    for s in expected:
        drive(est, s.to(device))
    assert est._avest.transfer.flush(10)
    got = sink.snapshot()
    assert len(got) == len(expected)
    for sub, s in zip(got, expected, strict=True):
        assert sub.features.dtype == np.float32 and sub.features.shape == s.features.shape
        assert np.array_equal(sub.features, s.features.numpy())  # bit-exact
        assert sub.num_verified.dtype == np.int32 and sub.num_accepted.dtype == np.int32
        assert np.array_equal(sub.num_verified, s.num_verified)
        assert np.array_equal(sub.num_accepted, s.num_accepted)
        assert sub.exclude is None  # no exclusion source: unknown, not "all included"
    all_rows = np.concatenate([x.features for x in got])
    assert np.array_equal(all_rows, trace["features"])
    stats = est.avest_stats()
    assert stats["dropped"] == 0 and stats["submitted"] == len(expected)
    est.avest_close()


def test_count_conversion_handles_prefill_and_trimmed_rows():
    sink = FakeSink()
    cls, _ = _shim(sink)
    est = cls(8, 4, CPU)
    idx = torch.tensor([5, 0, 3, 7])
    # prefill (0 sampled), all accepted + bonus, 1 accepted then rejected, trimmed to 2 verified
    sampled = torch.tensor([0, 5, 2, 3], dtype=torch.int64)
    rejected = torch.tensor([0, 0, 1, 0], dtype=torch.int32)
    est.load_features(idx, torch.arange(16, dtype=torch.float32).reshape(4, 4))
    est.step(idx, sampled, rejected)
    est._avest.transfer.flush(5)
    (sub,) = sink.snapshot()
    assert sub.num_accepted.tolist() == [0, 4, 1, 2]
    assert sub.num_verified.tolist() == [0, 4, 2, 2]
    assert sub.features.tolist() == torch.arange(16.0).reshape(4, 4).tolist()


def test_snapshot_is_taken_inside_step_before_propose_overwrites():
    sink = FakeSink(gate=threading.Event())  # consumer blocked: data sits in the ring
    cls, _ = _shim(sink)
    est = cls(4, 2, CPU)
    idx = torch.tensor([1, 2])
    est.load_features(idx, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    est.step(idx, torch.tensor([2, 1]), torch.tensor([1, 1]))
    est.features.fill_(99.0)  # the next propose overwrites every slot
    sink.gate.set()
    assert est._avest.transfer.flush(30)
    assert sink.snapshot()[0].features.tolist() == [[1.0, 2.0], [3.0, 4.0]]


def test_flush_waits_until_the_sink_has_the_step():
    """flush() returns once the step is with the sink, not once the consumer has read it:
    a sink still inside submit keeps flush waiting."""
    sink = FakeSink(gate=threading.Event())  # submit blocks until the gate opens
    cls, _ = _shim(sink)
    est = cls(4, 2, CPU)
    idx = torch.tensor([1, 2])
    est.load_features(idx, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    est.step(idx, torch.tensor([2, 1]), torch.tensor([1, 1]))
    fwd = est._avest.transfer
    deadline = time.monotonic() + 30
    while fwd.queue.delivered < 1:  # the consumer took the step; it waits in submit
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert not fwd.flush(0.3)
    assert sink.snapshot() == []
    sink.gate.set()
    assert fwd.flush(30)
    assert len(sink.snapshot()) == 1


def test_exclusion_flags_follow_the_request_slots():
    reg = ExclusionRegistry()
    reg.active = True

    class SP:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    reg.record(2, SP(repetition_penalty=1.2))
    reg.record(3, SP(allowed_token_ids=[1, 2]))
    reg.record(4, SP(temperature=0.7, top_p=0.9))  # workload, not a transform
    reg.record(5, SP(bad_words_token_ids=[[7]]))
    sink = FakeSink()
    cls, _ = _shim(sink, exclusion=reg)
    est = cls(8, 2, CPU)
    idx = torch.tensor([5, 4, 3, 2, 0])
    est.step(idx, torch.ones(5, dtype=torch.int32), torch.zeros(5, dtype=torch.int32))
    reg.record(5, SP())  # slot reused by a plain request after the step: snapshot holds
    est._avest.transfer.flush(5)
    assert sink.snapshot()[0].exclude.tolist() == [True, False, True, True, False]


def test_drop_counter_is_exact_when_the_consumer_is_blocked():
    gate = threading.Event()
    sink = FakeSink(gate=gate)
    q = 8
    cls, _ = _shim(sink, queue_size=q)
    est = cls(4, 2, CPU)
    idx = torch.tensor([0])

    def one(i: int) -> None:
        est.load_features(idx, torch.tensor([[float(i), 0.0]]))
        est.step(idx, torch.tensor([1]), torch.tensor([0]))

    one(0)
    assert sink.entered.wait(5)  # the consumer holds step 0 inside submit
    n = 50
    for i in range(1, n + 1):
        one(i)
    stats = est.avest_stats()
    assert stats["captured"] == n + 1
    assert stats["dropped"] == n - q  # exact: everything beyond the queue's capacity
    gate.set()
    assert est._avest.transfer.flush(5)
    firsts = [s.features[0, 0] for s in sink.snapshot()]
    assert firsts == [0.0, *range(n - q + 1, n + 1)]  # oldest dropped, newest kept
    assert est.avest_stats()["submitted"] == q + 1


def test_slow_or_failing_sink_never_slows_the_step():
    """A sink stuck in its first submit: 50 steps still complete (the step never waits
    for it) and everything past the queue is dropped, counted."""
    k = 8
    gate = threading.Event()
    sink = FakeSink(gate=gate)
    cls, _ = _shim(sink, queue_size=4)
    est = cls(256, k, CPU)
    idx = torch.randperm(256)
    ones = torch.ones(256, dtype=torch.int32)
    est.step(idx, ones + 2, ones)
    assert sink.entered.wait(5)  # the consumer is inside submit, blocked on the gate
    done = threading.Event()

    def steps() -> None:
        for _ in range(50):
            est.step(idx, ones + 2, ones)
        done.set()

    threading.Thread(target=steps, daemon=True).start()
    finished = done.wait(60)  # a step that waited for the sink would never finish
    blocked = not gate.is_set() and sink.received == []
    gate.set()
    assert finished and blocked  # all 50 steps ran while the sink had completed nothing
    assert est.avest_stats()["dropped"] == 50 - 4
    failing = FakeSink(fail=True)
    cls2, _ = _shim(failing)
    est2 = cls2(8, 2, CPU)
    for _ in range(3):
        est2.step(torch.tensor([0]), torch.tensor([1]), torch.tensor([0]))
    est2._avest.transfer.flush(5)
    assert est2.avest_stats()["submit_errors"] == 3


def test_no_sink_leaves_a_plain_estimator():
    factory = FakeSinkFactory(error=NotImplementedError("network sink not wired yet"))
    cls = make_sidecar_estimator(StandinAcceptanceEstimator, factory, config=ShimConfig(mode="raw"))
    est = cls(8, 3, CPU)
    plain = StandinAcceptanceEstimator(8, 3, CPU)
    trace = synthetic_trace(steps=250, batch=6, k=3, seed=5)
    for s in steps(trace, 8):
        drive(est, s)
        drive(plain, s)
    assert est._refits == plain._refits == 2
    assert torch.equal(est.slope, plain.slope) and torch.equal(est.intercepts, plain.intercepts)
    assert est.avest_stats()["captured"] == 0


def test_capture_failure_disables_forwarding_only():
    sink = FakeSink()
    cls, _ = _shim(sink)
    est = cls(4, 2, CPU)
    with pytest.raises(IndexError):
        # a bad index fails in the base step first: vLLM's own error surfaces unchanged
        est.step(torch.tensor([9]), torch.tensor([1]), torch.tensor([0]))
    est._avest.transfer.capture = None  # type: ignore[assignment]  # break the transfer
    est.step(torch.tensor([0]), torch.tensor([1]), torch.tensor([0]))
    est.step(torch.tensor([0]), torch.tensor([1]), torch.tensor([0]))
    assert est._avest._forward_failed
