"""Pooled coefficients: applied in place at step boundaries; who governs the refit."""

from __future__ import annotations

import copy

import pytest
import torch

from avest_client.types import Served
from avest_client.vllm.coefficients import Governor, validate
from avest_client.vllm.config import ShimConfig
from avest_client.vllm.estimator import make_sidecar_estimator
from avest_client.vllm.tp import SingleProcessGroup
from tests.support.standin import StandinAcceptanceEstimator
from tests.support.tracedrive import drive, steps, synthetic_trace

from .fakes import FakeSink, FakeSinkFactory

CPU = torch.device("cpu")
K = 4


def _make(sink: FakeSink, base=StandinAcceptanceEstimator, **kw):
    cls = make_sidecar_estimator(base, FakeSinkFactory(sink), config=ShimConfig(**kw))
    return cls(32, K, CPU)


def _trace(n_steps: int, seed: int = 0):
    return list(steps(synthetic_trace(steps=n_steps, batch=12, k=K, seed=seed), 32))


def test_pushed_coefficients_land_in_place_at_the_next_boundary():
    sink = FakeSink()
    est = _make(sink)
    ptr_w, ptr_b = est.slope.data_ptr(), est.intercepts.data_ptr()
    trace = _trace(5)
    drive(est, trace[0])
    sink.push(7, 0.61, [0.3, 0.1, -0.2, -0.5])
    # between steps nothing changes: the push waits for a step boundary
    assert est.slope.item() == pytest.approx(0.5)
    drive(est, trace[1])
    assert est.slope.item() == pytest.approx(0.61)
    assert est.intercepts.tolist() == pytest.approx([0.3, 0.1, -0.2, -0.5])
    assert (est.slope.data_ptr(), est.intercepts.data_ptr()) == (ptr_w, ptr_b)
    assert est.avest_stats()["version"] == 7 and est.avest_stats()["governed"]
    # the same version is not re-applied; a different one is (a restarted sidecar may count down)
    est.slope.fill_(0.0)
    drive(est, trace[2])
    assert est.slope.item() == 0.0
    sink.push(3, 0.4, [0.0] * K)
    drive(est, trace[3])
    assert est.slope.item() == pytest.approx(0.4)
    assert est.slope.data_ptr() == ptr_w


def test_never_mid_step():
    """A push that arrives while the base step runs is applied at the next boundary."""
    sink = FakeSink()
    seen: list[float] = []

    class Probe(StandinAcceptanceEstimator):
        push_during_step: tuple | None = None

        def step(self, idx_mapping, num_sampled, num_rejected):
            seen.append(self.slope.item())
            if self.push_during_step is not None:
                sink.push(*self.push_during_step)
            super().step(idx_mapping, num_sampled, num_rejected)
            seen.append(self.slope.item())

    est = _make(sink, base=Probe)
    trace = _trace(3)
    est.push_during_step = (1, 0.9, [0.0] * K)
    drive(est, trace[0])
    assert seen == [0.5, 0.5]  # pushed mid-step: not applied in that step
    est.push_during_step = None
    drive(est, trace[1])
    assert seen[2:] == [pytest.approx(0.9), pytest.approx(0.9)]  # applied before the base step


def test_invalid_coefficients_are_ignored():
    assert validate((1, 0.5, [0.0] * 3), 4) is None  # wrong K
    assert validate((1, float("nan"), [0.0] * 4), 4) is None
    assert validate((1, -0.1, [0.0] * 4), 4) is None  # negative slope
    assert validate((1, 0.5, [0.0, float("inf"), 0, 0]), 4) is None
    assert validate("garbage", 4) is None
    assert validate((2, 0.5, [0, 0, 0, 0]), 4) == Served(0.5, (0.0, 0.0, 0.0, 0.0), version=2)
    served = Served(0.5, (0.0, 0.0, 0.0, 0.0), version=3)
    assert validate(served, 4) == served
    assert validate(Served(-0.5, (0.0,) * 4, version=3), 4) is None
    sink = FakeSink()
    est = _make(sink)
    sink.push(1, 0.7, [0.0] * 3)
    drive(est, _trace(1)[0])
    assert est.slope.item() == pytest.approx(0.5) and not est.avest_stats()["governed"]


def test_sink_errors_mean_local():
    class Broken(FakeSink):
        @property
        def connected(self):
            raise ConnectionError("boom")

    g = Governor(SingleProcessGroup(), Broken(), K, 16)
    assert g.boundary() is None and not g.governed


def _run(est, trace, on_step=None):
    for i, s in enumerate(trace):
        if on_step:
            on_step(i)
        drive(est, s)


def test_disconnected_shim_is_exactly_vllm():
    trace = _trace(450, seed=1)
    plain = StandinAcceptanceEstimator(32, K, CPU)
    est = _make(FakeSink(connected=False))
    _run(plain, trace)
    _run(est, trace)
    assert est._refits == plain._refits == 4
    assert torch.equal(est.slope, plain.slope)
    assert torch.equal(est.intercepts, plain.intercepts)
    assert torch.equal(est.info, plain.info) and torch.equal(est.counts, plain.counts)


def test_connected_skips_local_refits_and_resumes_when_lost():
    trace = _trace(700, seed=2)
    sink = FakeSink(connected=True)
    est = _make(sink)
    pooled = [0.58, 0.4, 0.1, -0.1, -0.4]
    snap: dict[str, object] = {}

    def script(i: int) -> None:
        if i == 30:
            sink.push(1, pooled[0], pooled[1:])
        if i == 350:  # sidecar lost mid-round
            sink.is_connected = False
            snap["est"] = {
                n: copy.deepcopy(getattr(est, n))
                for n in ("slope", "intercepts", "info", "grad", "counts", "_steps_since_refit")
            }
            snap["refits"] = est._refits

    for i, s in enumerate(trace):
        script(i)
        if i == 350:
            # a plain estimator continuing from the shim's state at the moment of loss
            ref = StandinAcceptanceEstimator(32, K, CPU)
            for n, v in snap["est"].items():
                setattr(ref, n, v)
            ref.features, ref.predictions = est.features.clone(), est.predictions.clone()
        if i < 350:
            drive(est, s)
            if i >= 30:
                assert est.slope.item() == pytest.approx(pooled[0])
                assert est.intercepts.tolist() == pytest.approx(pooled[1:])
        else:
            drive(est, s)
            drive(ref, s)
    # until step 30 the local refit was free to run; after that none ran while connected
    assert snap["refits"] == 0
    assert est.avest_stats()["skipped_refits"] == 3  # rounds ending at steps 99, 199, 299
    # after the loss: exactly vLLM's behaviour from the pooled coefficients
    assert est._refits == ref._refits == 4  # rounds ending at steps 399, 499, 599, 699
    assert torch.equal(est.slope, ref.slope) and torch.equal(est.intercepts, ref.intercepts)
    assert est.slope.item() != pytest.approx(pooled[0])


def test_pooled_take_over_again_when_the_sidecar_is_back():
    sink = FakeSink(connected=True)
    est = _make(sink)
    trace = _trace(320, seed=4)
    sink.push(5, 0.6, [0.2] * K)
    _run(est, trace[:10])
    sink.is_connected = False
    _run(est, trace[10:210])  # local refits move the tensors
    assert est._refits == 2 and est.slope.item() != pytest.approx(0.6)
    sink.is_connected = True  # same version as before: applied again anyway
    _run(est, trace[210:211])
    assert est.slope.item() == pytest.approx(0.6)
    assert est.intercepts.tolist() == pytest.approx([0.2] * K)
    refits = est._refits
    _run(est, trace[211:])
    assert est._refits == refits


def test_connected_without_coefficients_keeps_local_refits():
    trace = _trace(210, seed=6)
    plain = StandinAcceptanceEstimator(32, K, CPU)
    est = _make(FakeSink(connected=True))  # nothing pushed yet
    _run(plain, trace)
    _run(est, trace)
    assert est._refits == 2 and torch.equal(est.slope, plain.slope)
