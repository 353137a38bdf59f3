"""Strata in the shim (``AVEST_STRATA=1``, CPU stand-in): a stratum per admitted slot,
each slot predicted with its stratum's pushed set, one round summary per stratum whose
drafts add up to what vLLM graded; off, or with the sidecar down, nothing changes."""

from __future__ import annotations

import math
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import torch

from avest_client import EstimatorClient
from avest_client.summary import RoundAccumulator
from avest_client.types import Served
from avest_client.vllm import rounds as rounds_mod
from avest_client.vllm import strata
from avest_client.vllm.config import ConfigError, ShimConfig
from avest_client.vllm.estimator import make_sidecar_estimator
from avest_client.vllm.exclusion import ExclusionRegistry, install_sampler_hook
from avest_client.vllm.rounds import SummaryRound
from avest_client.vllm.sidecar.sink import SidecarSink
from avest_wire.bins import AUC_SLOTS, FEATURE_BINS, FEATURE_OFFSET, FEATURE_SCALE
from avest_wire.pair import PairKey
from tests.support.sidecar import FAST, sink_of, wait_until
from tests.support.standin import StandinAcceptanceEstimator

from .fakes import FakeSink, FakeSinkFactory

CPU = torch.device("cpu")
K = 4
MAX_REQS = 32
POOLED = (3, 0.61, [0.4, 0.1, -0.2, -0.5])
GREEDY_SET = Served(1.3, (0.9, 0.5, 0.0, -0.4), version=3)
#: Slots 0-7 greedy, 8-15 at T = 0.8 (the issue's mixed batch).
SLOTS = torch.arange(16, dtype=torch.int64)


@pytest.fixture(autouse=True)
def registry(monkeypatch: pytest.MonkeyPatch) -> strata.StrataRegistry:
    """A fresh process registry for each test."""
    reg = strata.StrataRegistry()
    monkeypatch.setattr(strata, "REGISTRY", reg)
    return reg


def admit_mixed(reg: strata.StrataRegistry, excluded: tuple[int, ...] = ()) -> None:
    for slot in SLOTS.tolist():
        t = 0.0 if slot < 8 else 0.8
        reg.record(slot, SimpleNamespace(temperature=t), excluded=slot in excluded)


def shim(sink: FakeSink, **cfg):  # noqa: ANN003, ANN201
    config = ShimConfig(**{"strata": True, "round_steps": 10, **cfg})
    cls = make_sidecar_estimator(StandinAcceptanceEstimator, FakeSinkFactory(sink), config=config)
    return cls(MAX_REQS, K, CPU)


def pooled_mixed_shim(registry: strata.StrataRegistry, **cfg):  # noqa: ANN003, ANN201
    """The shim on a sink that pushed the pair's set, the mixed batch admitted."""
    sink = FakeSink()
    sink.push(*POOLED)
    est = shim(sink, **cfg)
    admit_mixed(registry)
    return est, sink


def vllm_alone_at_the_pairs_set() -> StandinAcceptanceEstimator:
    base = StandinAcceptanceEstimator(MAX_REQS, K, CPU)
    base.slope.fill_(POOLED[1])
    base.intercepts.copy_(torch.tensor(POOLED[2]))
    return base


def logits_for(x: torch.Tensor) -> torch.Tensor:
    """Logits whose ``logit(q_max)`` is ``x`` (>= 0): ``[x + log 2, 0, 0]``."""
    z = torch.zeros(x.shape[0], 3)
    z[:, 0] = x + math.log(2.0)
    return z


def make_steps(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per step: features [16, K] (>= 0), num_sampled, num_rejected for the 16 slots."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = torch.from_numpy(rng.uniform(0.0, 5.0, size=(16, K)).astype(np.float32))
        verified = rng.integers(0, K + 1, size=16)
        accepted = np.minimum(rng.integers(0, K + 1, size=16), verified)
        out.append(
            (
                x,
                torch.from_numpy((accepted + 1).astype(np.int32)),
                torch.from_numpy((verified - accepted).astype(np.int32)),
            )
        )
    return out


def propose(est, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """vLLM's drafting: ``predict`` once per position; the confidences it leaves."""
    conf = torch.zeros(16, K)
    temperature = torch.ones(MAX_REQS)
    for k in range(K):
        est.predict(logits_for(x[:, k]), SLOTS, torch.tensor(k), conf, temperature)
    return conf


def run(est, steps, confs: list | None = None) -> None:  # noqa: ANN001
    for x, sampled, rejected in steps:
        conf = propose(est, x)
        if confs is not None:
            confs.append(conf)
        est.step(SLOTS.clone(), sampled, rejected)  # fresh, as vLLM's: kept by reference
        rounds = est._avest.rounds if est._avest is not None else None
        if rounds is not None:
            assert rounds.flush(10)


def graded_counts(steps, rows: slice = slice(None)) -> np.ndarray:  # noqa: ANN001
    """Per position, the drafts vLLM graded (observed) in ``steps``."""
    total = np.zeros(K)
    pos = np.arange(K)
    for _, sampled, rejected in steps:
        a = np.maximum(sampled.numpy()[rows] - 1, 0)[:, None]
        d = a + rejected.numpy()[rows][:, None]
        total += ((pos <= a) & (pos < d)).sum(0)
    return total


def test_a_mixed_batch_sends_one_summary_per_stratum_adding_up_to_what_was_graded(registry):
    est, sink = pooled_mixed_shim(registry)
    steps = make_steps(21)
    run(est, steps)
    # step 0 ran under vLLM's coefficients (not sent); two rounds of 10 steps follow
    assert sink.summary_strata == ["greedy", "t0.5-1"] * 2
    for r, part in enumerate((steps[1:11], steps[11:21])):
        two = sink.summaries[2 * r : 2 * r + 2]
        assert sum(s.steps for s in two) == 10
        assert all((s.version, s.slope) == (3, 0.61) for s in two)  # no set pushed: the pair's
        np.testing.assert_array_equal(two[0].counts, graded_counts(part, slice(0, 8)))
        np.testing.assert_array_equal(two[1].counts, graded_counts(part, slice(8, 16)))
        np.testing.assert_array_equal(two[0].counts + two[1].counts, graded_counts(part))
    # the strata add up to vLLM's own sums of the same rounds (the shim without strata)
    plain_sink = FakeSink()
    plain_sink.push(*POOLED)
    plain = shim(plain_sink, strata=False)
    assert plain._avest.strata is None
    run(plain, steps)
    assert plain_sink.summary_strata == [None, None]
    for r, whole in enumerate(plain_sink.summaries):
        two = sink.summaries[2 * r : 2 * r + 2]
        np.testing.assert_array_equal(two[0].counts + two[1].counts, whole.counts)
        np.testing.assert_allclose(two[0].info + two[1].info, whole.info, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(two[0].grad + two[1].grad, whole.grad, rtol=1e-5, atol=1e-5)
    est.avest_close()
    plain.avest_close()


def reached_of_rows(x: np.ndarray, sampled: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``[K, FEATURE_BINS]``: the drafts of ``rows`` past their prefill (``num_sampled
    >= 1``) whose earlier drafts were accepted, binned in float32 as the device bins them."""
    out = np.zeros((K, FEATURE_BINS))
    fb = (np.clip(x, -40, 40).astype(np.float32) + np.float32(FEATURE_OFFSET)) * np.float32(
        FEATURE_SCALE
    )
    fb = np.minimum(fb.astype(np.int64), FEATURE_BINS - 1)
    for r in np.flatnonzero(rows & (sampled[: rows.size] >= 1)):
        for i in range(min(int(sampled[r]) - 1, K - 1) + 1):
            out[i, fb[r, i]] += 1
    return out


def _dense(sketch) -> tuple[np.ndarray, ...]:  # noqa: ANN001
    hist = np.zeros(K * 2 * AUC_SLOTS)
    hist[sketch.cells] = sketch.counts
    return hist, sketch.ece, sketch.psum, sketch.nll


def test_each_strata_summary_sums_and_sketches_its_own_rows_at_its_own_set(registry, monkeypatch):
    """Every stratum's summary carries a sketch whose drafts are its counts; summed over
    the run, each stratum's sums and sketches are the host reference over that
    stratum's rows, scored at the set they were predicted with (greedy's own once
    pushed, the pair's otherwise), with slots readmitted into another stratum
    mid-round, excluded rows in none and rows of no stratum in the pooled summary's."""
    monkeypatch.setattr(rounds_mod, "REACHED_EVERY", 1)  # every round carries its reached
    sink = FakeSink()
    sink.push(*POOLED)
    est = shim(sink)
    rt = est._avest
    admit_mixed(registry, excluded=(0, 1))
    for slot in range(12, 16):  # past the bound: the pair's pooled rows
        registry.slots[slot] = strata.POOL
        rt.strata.slot[slot] = strata.POOL
    steps = make_steps(47, seed=7)
    refs: dict[str | None, RoundAccumulator] = {}
    reached: dict[str | None, np.ndarray] = {}
    for t, (x, sampled, rejected) in enumerate(steps):
        if t == 6:
            sink.strata = {"greedy": GREEDY_SET}
        if t == 23:  # slot 7 readmitted at T = 0.8, slot 9 greedy, in the middle of a round
            registry.record(7, SimpleNamespace(temperature=0.8))
            registry.record(9, SimpleNamespace(temperature=0.0))
        recorded = rt.rounds.version is not None
        index = rt.strata.slot[:16].numpy().copy()
        in_force = list(rt.strata.in_force)
        propose(est, x)
        est.step(SLOTS.clone(), sampled, rejected)  # fresh, as vLLM's: kept by reference
        assert rt.rounds.flush(10)  # the sender never holds both sets: no sketch skipped
        if not recorded:
            continue
        verified = sampled.numpy() - 1 + rejected.numpy()
        for i in set(index.tolist()) - {strata.EXCLUDED}:
            name = None if i == strata.POOL else registry.names[i]
            own = None if i == strata.POOL else in_force[i]
            slope, b = (own[1], own[2]) if own is not None else (POOLED[1], POOLED[2])
            acc = refs.setdefault(name, RoundAccumulator(K))
            acc.add(x.numpy(), verified, sampled.numpy() - 1,
                    float(np.float32(slope)), np.asarray(b, dtype=np.float32).astype(np.float64),
                    exclude=index != i)  # fmt: skip
            mine = np.zeros(x.shape[0], dtype=bool)
            mine[: index.size] = index == i
            want_reached = reached.setdefault(name, np.zeros((K, FEATURE_BINS)))
            want_reached += reached_of_rows(x.numpy(), sampled.numpy(), mine)
    assert rt.rounds.flush(10)
    assert rt.rounds.send_errors == 0 and rt.rounds.sketches_skipped == 0
    assert set(sink.summary_strata) == {"greedy", "t0.5-1", None}
    assert any(s.slope == GREEDY_SET.slope for s in sink.summaries)  # greedy's own set served
    got: dict[str | None, list[np.ndarray]] = {}
    for summary, name in zip(sink.summaries, sink.summary_strata, strict=True):
        assert summary.sketch is not None
        np.testing.assert_array_equal(summary.sketch.drafts_per_position(), summary.counts)
        assert summary.reached is not None
        parts = (
            summary.info,
            summary.grad,
            summary.counts,
            *_dense(summary.sketch),
            summary.reached.dense(),
        )
        before = got.setdefault(name, [np.zeros_like(p) for p in parts])
        got[name] = [a + b for a, b in zip(before, parts, strict=True)]
    assert set(got) == set(refs)
    for name, acc in refs.items():
        want = acc.take(1, POOLED[1], POOLED[2])
        assert want is not None and want.sketch is not None
        info, grad, counts, hist, ece, psum, nll, got_reached = got[name]
        np.testing.assert_array_equal(counts, want.counts)
        # the drafts of the stratum's rows that reached their position, by feature bin
        np.testing.assert_array_equal(got_reached, reached[name])
        np.testing.assert_allclose(info, want.info, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(grad, want.grad, rtol=1e-4, atol=1e-4)
        whist, wece, wpsum, wnll = _dense(want.sketch)
        assert hist.sum() == whist.sum() > 0, name
        # float32 eta on the device: a draft on a bin edge may land one slot over
        assert np.abs(hist - whist).sum() <= 2 + 0.002 * whist.sum(), name
        assert np.abs(ece - wece).sum() <= 2, name
        np.testing.assert_allclose(psum, wpsum, rtol=1e-3, atol=0.05)
        np.testing.assert_allclose(nll, wnll, rtol=1e-4)
    est.avest_close()


def test_without_the_sketch_strata_are_still_summed_from_the_rounds_steps(registry):
    """``AVEST_SKETCH=0`` with strata: the round still keeps its steps (the per-stratum
    sums come from them), and the summaries go without sketches, none counted skipped."""
    est, sink = pooled_mixed_shim(registry, sketch=False)
    rt = est._avest
    assert rt.rounds.keep_steps and not rt.rounds.keep_sketch
    steps = make_steps(21, seed=10)
    run(est, steps)
    assert sink.summary_strata == ["greedy", "t0.5-1"] * 2
    assert all(s.sketch is None for s in sink.summaries)
    assert rt.rounds.sketches_skipped == 0 and rt.rounds.strata_rounds_pooled == 0
    for r, part in enumerate((steps[1:11], steps[11:21])):
        two = sink.summaries[2 * r : 2 * r + 2]
        np.testing.assert_array_equal(two[0].counts, graded_counts(part, slice(0, 8)))
        np.testing.assert_array_equal(two[1].counts, graded_counts(part, slice(8, 16)))
    est.avest_close()


def test_the_first_round_after_the_sidecar_returns_takes_the_buffers_given_back(
    registry, held_sender
):
    """The sidecar is lost while the sender holds both buffer sets (held on purpose): the
    sets come back while local refits govern, and the first round once pooled
    coefficients return keeps its steps again (sums and sketches by the sender), not
    summed on the step."""
    entered, release = held_sender
    est, sink = pooled_mixed_shim(registry)
    rt = est._avest
    steps = iter(make_steps(40, seed=11))

    def step() -> None:
        x, sampled, rejected = next(steps)
        propose(est, x)
        est.step(SLOTS.clone(), sampled, rejected)

    for _ in range(21):  # step 0 local; rounds 1-10 (held in the sender) and 11-20 handed
        step()
    assert entered.wait(30), "the sender never started the first round"
    assert rt.rounds._cur is None  # both sets with the sender
    sink.is_connected = False
    step()  # lost: the open round ends (no set free for the next), local refits govern
    release.set()
    assert rt.rounds.flush(10) and len(rt.rounds._free) == 2
    step()
    sink.is_connected = True
    sink.push(4, 0.6, [0.4, 0.1, -0.2, -0.5])
    sent = len(sink.summaries)
    for _ in range(12):
        step()
    assert rt.rounds.flush(10)
    later = sink.summaries[sent:]
    assert [s.version for s in later] == [4, 4] and all(s.sketch is not None for s in later)
    est.avest_close()


def test_a_round_not_summed_per_stratum_goes_as_vllms_pooled_sums(registry):
    """A caller that hands every step the same idx_mapping tensor: the first round's
    references may be overwritten, so it is not summed per stratum; it goes as one
    summary of vLLM's own sums without a stratum (counted), nothing of it lost; the
    shim copies the vectors from then on and the next rounds are per stratum."""
    est, sink = pooled_mixed_shim(registry)
    rt = est._avest
    steps = make_steps(31, seed=8)
    for x, sampled, rejected in steps:
        propose(est, x)
        est.step(SLOTS, sampled, rejected)  # one tensor for every step
        assert rt.rounds.flush(10)
    assert rt.rounds.copy_mode
    assert sink.summary_strata == [None] + ["greedy", "t0.5-1"] * 2
    first = sink.summaries[0]
    assert first.sketch is None and first.steps == 10
    np.testing.assert_array_equal(first.counts, graded_counts(steps[1:11]))
    assert rt.rounds.strata_rounds_pooled == 1 == est.avest_stats()["strata_rounds_pooled"]
    for r, part in enumerate((steps[11:21], steps[21:31])):
        two = sink.summaries[1 + 2 * r : 3 + 2 * r]
        assert all(s.sketch is not None for s in two)
        np.testing.assert_array_equal(two[0].counts, graded_counts(part, slice(0, 8)))
        np.testing.assert_array_equal(two[1].counts, graded_counts(part, slice(8, 16)))
    est.avest_close()


def test_a_round_without_free_buffers_is_summed_per_stratum_on_the_step(registry, held_sender):
    """The sender held on purpose in the first round's sums: the rounds that start while
    it holds both buffer sets add their per-stratum sums up on the step, exactly (no
    sketch, counted as skipped); none goes pooled, and the first rounds keep theirs."""
    entered, release = held_sender
    est, sink = pooled_mixed_shim(registry)
    rt = est._avest
    steps = make_steps(41, seed=9)
    try:
        for i, (x, sampled, rejected) in enumerate(steps):
            propose(est, x)
            est.step(SLOTS.clone(), sampled, rejected)
            if i == 10:  # round 1 (steps 1-10) is with the sender, which holds in it
                assert entered.wait(30), "the sender never started the first round"
    finally:
        release.set()
    assert rt.rounds.flush(10)
    # rounds 1-2 had buffer sets; rounds 3-4 (steps 21-40) started with none free
    assert sink.summary_strata == ["greedy", "t0.5-1"] * 4
    assert [s.sketch is not None for s in sink.summaries] == [True] * 4 + [False] * 4
    assert rt.rounds.sketches_skipped == 2 and rt.rounds.strata_rounds_pooled == 0
    for r in range(4):
        part = steps[1 + 10 * r : 11 + 10 * r]
        for j, rows in enumerate((slice(0, 8), slice(8, 16))):
            got = sink.summaries[2 * r + j]
            want = RoundAccumulator(K, sketch=False)
            for x, sampled, rejected in part:
                a = sampled.numpy()[rows] - 1
                want.add(x.numpy()[rows], a + rejected.numpy()[rows], a,
                         float(np.float32(POOLED[1])),
                         np.asarray(POOLED[2], dtype=np.float32).astype(np.float64))  # fmt: skip
            np.testing.assert_array_equal(got.counts, want.counts)
            np.testing.assert_allclose(got.info, want.info, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(got.grad, want.grad, rtol=1e-4, atol=1e-4)
    est.avest_close()


def test_predict_uses_each_slots_stratum_set_once_pushed(registry):
    est, sink = pooled_mixed_shim(registry)
    base = vllm_alone_at_the_pairs_set()
    steps = make_steps(25, seed=1)
    run(est, steps[:3])
    conf = propose(est, steps[3][0])
    np.testing.assert_array_equal(conf, propose(base, steps[3][0]))  # nothing pushed yet
    est.step(SLOTS.clone(), *steps[3][1:])
    sink.strata = {"greedy": GREEDY_SET}
    empty = SLOTS[:0].clone()
    est.step(empty, empty.clone(), empty.clone())  # a boundary: the round ends, the set loads
    assert est._avest.strata.in_force[0] == ("greedy", 1.3, GREEDY_SET.intercepts)
    x = steps[4][0]
    conf = propose(est, x)
    want = torch.sigmoid(1.3 * x[:8] + torch.tensor(GREEDY_SET.intercepts))
    torch.testing.assert_close(conf[:8], want, rtol=1e-6, atol=1e-7)
    assert torch.equal(conf[8:], propose(base, x)[8:])  # no set: vLLM's value, bit for bit
    est.step(SLOTS.clone(), *steps[4][1:])
    assert est._avest.rounds.flush(10)  # the rounds before the load are sent: then cleared
    sink.summaries.clear()
    sink.summary_strata.clear()
    run(est, steps[5:25])
    # rounds after the load: the greedy stratum at its own set, the other at the pair's
    assert sink.summary_strata[:2] == ["greedy", "t0.5-1"]
    greedy, sampled = sink.summaries[:2]
    assert (greedy.slope, greedy.intercepts) == (1.3, GREEDY_SET.intercepts)
    assert (sampled.slope, sampled.intercepts) == (0.61, tuple(POOLED[2]))
    est.avest_close()


def test_with_the_sidecar_down_predict_and_refits_are_vllms_bit_for_bit(registry):
    sink = FakeSink(connected=False)
    sink.push(*POOLED)
    sink.strata = {"greedy": GREEDY_SET}
    est = shim(sink)
    admit_mixed(registry)
    base = StandinAcceptanceEstimator(MAX_REQS, K, CPU)
    steps = make_steps(110, seed=2)
    mine: list[torch.Tensor] = []
    theirs: list[torch.Tensor] = []
    run(est, steps, mine)
    for x, sampled, rejected in steps:
        theirs.append(propose(base, x))
        base.step(SLOTS, sampled, rejected)
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    assert est._refits == base._refits == 1
    assert torch.equal(est.slope, base.slope) and torch.equal(est.intercepts, base.intercepts)
    assert sink.summaries == []
    est.avest_close()


def test_excluded_requests_are_in_no_summary_and_predicted_with_the_pairs_set(registry):
    sink = FakeSink()
    sink.push(*POOLED)
    sink.strata = {"greedy": GREEDY_SET}
    est = shim(sink)
    admit_mixed(registry, excluded=(0, 1))
    steps = make_steps(11, seed=3)
    confs: list[torch.Tensor] = []
    run(est, steps, confs)
    base = vllm_alone_at_the_pairs_set()
    assert torch.equal(confs[-1][:2], propose(base, steps[-1][0])[:2])
    assert sink.summary_strata == ["greedy", "t0.5-1"]
    np.testing.assert_array_equal(sink.summaries[0].counts, graded_counts(steps[1:11], slice(2, 8)))
    est.avest_close()


def test_slots_of_no_known_stratum_are_the_pairs_pooled_summary(registry):
    est, sink = pooled_mixed_shim(registry)
    for slot in range(8, 16):  # readmitted past the bound: pooled
        registry.slots[slot] = strata.POOL
        est._avest.strata.slot[slot] = strata.POOL
    steps = make_steps(11, seed=4)
    run(est, steps)
    assert sink.summary_strata == ["greedy", None]
    np.testing.assert_array_equal(sink.summaries[1].counts, graded_counts(steps[1:], slice(8, 16)))


def test_the_registry_is_bounded_and_reads_temperature_and_label(registry):
    registry.configure((0.5, 1.0), "kind")
    registry.record(0, SimpleNamespace(temperature=1e-6))
    registry.record(1, SimpleNamespace(temperature=0.3, extra_args={"kind": "code"}))
    registry.record(2, SimpleNamespace(temperature=1.5, extra_args={"kind": "a/b"}))
    assert registry.names == ["greedy", "code/t<0.5", "t>=1"]
    for i in range(3, 40):
        registry.record(i, SimpleNamespace(temperature=0.7, extra_args={"kind": f"l{i}"}))
    assert len(registry.names) == strata.MAX_STRATA and registry.overflow > 0
    assert registry.slots[39] == strata.POOL


def test_the_sampler_hook_records_strata_only_when_on(registry):
    sampler = type("Sampler", (), {"add_request": lambda self, i, sp: None})
    install_sampler_hook(sampler, ExclusionRegistry())
    sampler().add_request(3, SimpleNamespace(temperature=0.0))
    assert registry.names == []  # off: nothing recorded
    registry.enabled = True
    sampler().add_request(3, SimpleNamespace(temperature=0.0))
    sampler().add_request(4, SimpleNamespace(temperature=0.8, repetition_penalty=1.2))
    assert registry.names == ["greedy", "t0.5-1"]  # an excluded request keeps its name
    assert registry.slots[3] == 0 and registry.slots[4] == strata.EXCLUDED
    assert registry.named[4] == 1 and not registry.named.flags.writeable


def test_config_reads_the_strata_variables():
    cfg = ShimConfig.from_env({"AVEST_STRATA": "1", "AVEST_STRATA_EDGES": "0.3,0.9"})
    assert cfg.strata and cfg.strata_edges == (0.3, 0.9)
    assert not ShimConfig.from_env({}).strata
    with pytest.raises(ConfigError):
        ShimConfig.from_env({"AVEST_STRATA_EDGES": "0.9,0.3"})


def test_strata_off_builds_nothing(registry):
    sink = FakeSink()
    sink.push(*POOLED)
    cls = make_sidecar_estimator(
        StandinAcceptanceEstimator, FakeSinkFactory(sink), config=ShimConfig(round_steps=10)
    )
    est = cls(MAX_REQS, K, CPU)
    assert est._avest.strata is None and est._avest.strata_sync is None
    assert not registry.enabled
    est.avest_close()


@pytest.mark.parametrize("mode", ["summary", "raw"])
def test_a_live_sidecar_fits_the_strata_and_pushes_their_sets_back(start_sidecar, tmp_path, mode):
    srv = start_sidecar(tmp_path, refit_interval=100, default_rule="recursive")
    cfg = ShimConfig(
        address=srv.grpc_address, strata=True, round_steps=10, timeout_s=5.0, mode=mode,
        queue_size=4096,
    )  # fmt: skip

    def factory(config: ShimConfig, pair_key: PairKey) -> SidecarSink:
        return SidecarSink(config, pair_key, backoff=FAST)

    cls = make_sidecar_estimator(
        StandinAcceptanceEstimator,
        factory,
        config=cfg,
        pair_resolver=lambda k: PairKey("t", "d", "draft_model", k, {"strata": mode}),
    )
    est = cls(MAX_REQS, K, CPU)
    reg = strata.REGISTRY
    reg.active = True
    admit_mixed(reg)
    sink = sink_of(est)
    assert sink.wait_connected(10)
    steps = make_steps(400, seed=5)
    rt = est._avest
    for x, sampled, rejected in steps:
        propose(est, x)
        est.step(SLOTS.clone(), sampled, rejected)  # fresh, as vLLM's: kept by reference
        if mode == "summary":
            assert rt.rounds.flush(10)  # the sender never holds both sets: every sketch sent
        if rt.strata.in_force[0] is not None and rt.strata.in_force[1] is not None:
            break
    if mode == "summary":
        assert rt.rounds.flush(10)
    else:
        assert rt.transfer.flush(10)
    assert sink.flush(20), sink.stats
    assert sink.stats["invalid"] == 0
    if mode == "summary":
        with EstimatorClient(srv.grpc_address) as client:
            pair = client.pair(sink.pair_id)
            # the split steps add up (a round shorter than its summaries borrows steps)
            assert pair.steps_observed == rt.rounds.steps_closed + rt.rounds.step_debt
        # every summary carried its stratum's sketch: each stratum's calibration counts
        # exactly its drafts (the sketches as the worker scored them)
        assert rt.rounds.sketches_skipped == 0
        body = httpx.get(f"{srv.http_url}/v1/pairs/{sink.pair_id}/strata", timeout=10).json()
        cal = {s["stratum"]: (s["calibration"]["count"], s["drafts"]) for s in body["strata"]}
        assert set(cal) == {"greedy", "t0.5-1"}
        assert all(count == drafts > 0 for count, drafts in cal.values()), cal
    wait_until(lambda: set(sink.latest_strata()) >= {"greedy", "t0.5-1"}, what="strata pushed")
    est.step(SLOTS[:0].clone(), SLOTS[:0].clone(), SLOTS[:0].clone())
    served = {s[0]: s for s in rt.strata.in_force if s is not None}
    assert set(served) == {"greedy", "t0.5-1"}
    x = steps[0][0]
    conf = propose(est, x)
    g = served["greedy"]
    want = torch.sigmoid(g[1] * x[:8] + torch.tensor(g[2], dtype=torch.float32))
    torch.testing.assert_close(conf[:8], want, rtol=1e-5, atol=1e-6)
    est.avest_close()


def test_a_round_shorter_than_its_summaries_borrows_steps_from_the_next(registry):
    est, sink = pooled_mixed_shim(registry)
    steps = make_steps(12, seed=6)
    run(est, steps[:1])  # step 0 local: pooled coefficients govern from its end
    sink.push(4, *POOLED[1:])  # an update ends the next round after one step
    run(est, steps[1:12])  # ... then a round of 10 steps
    rounds = est._avest.rounds
    assert [s.steps for s in sink.summaries] == [1, 1, 5, 4] and rounds.step_debt == 0
    assert sum(s.steps for s in sink.summaries) == rounds.steps_closed == 11
    est.avest_close()


def test_the_sidecar_sink_serves_strata_only_with_the_push_they_came_with():
    v3, v4 = Served(0.6, (0.1,), version=3), Served(0.7, (0.2,), version=4)
    fwd = SimpleNamespace(latest_coefficients=lambda: v4, latest_strata=lambda: {"greedy": v3})
    assert SidecarSink._strata_for(fwd, v4) is None  # half stored: wait a tick
    fwd.latest_strata = lambda: {"greedy": Served(1.0, (0.3,), version=4)}
    assert set(SidecarSink._strata_for(fwd, v4)) == {"greedy"}
    assert SidecarSink._strata_for(fwd, v3) == {}  # other coefficients (a warm start)
    assert SidecarSink._strata_for(fwd, None) == {}


def test_the_handoff_keeps_a_summarys_stratum_until_the_forwarder_attaches():
    from avest_client._stream import StratumSummary
    from avest_client.vllm.sidecar.handoff import Handoff

    got = []
    fwd = SimpleNamespace(submit_summary=lambda s, stratum=None: got.append((s, stratum)))
    h = Handoff(4)
    summary = object()
    assert h.offer(StratumSummary(summary, "greedy")) is None  # type: ignore[arg-type]
    assert h.attach(fwd)  # type: ignore[arg-type]
    assert got == [(summary, "greedy")]


def test_raw_steps_name_each_rows_stratum(registry):
    sink = FakeSink()
    sink.push(*POOLED)
    est = shim(sink, mode="raw")
    admit_mixed(registry, excluded=(1,))
    install_sampler_hook(
        type("S", (), {"add_request": lambda self, i, sp: None}), ExclusionRegistry()
    )
    steps = make_steps(3, seed=7)
    run(est, steps)
    assert est._avest.transfer.flush(10)
    assert len(sink.received) == 3
    for got in sink.received:
        assert got.strata == ["greedy"] * 8 + ["t0.5-1"] * 8  # excluded rows keep their name
    est.avest_close()


def test_raw_steps_go_without_strata_when_a_row_has_none(registry):
    sink = FakeSink()
    sink.push(*POOLED)
    est = shim(sink, mode="raw")
    registry.active = True
    registry.record(0, SimpleNamespace(temperature=0.0))  # slots 1-15 never seen admitted
    run(est, make_steps(2, seed=8))
    assert est._avest.transfer.flush(10)
    assert [r.strata for r in sink.received] == [None, None]
    est.avest_close()


def test_on_cuda_a_round_summed_on_the_step_is_copied_before_the_senders_event(
    registry, monkeypatch
):
    """The order ``end()`` enqueues its work in on CUDA (traced on the CPU with a
    recording event): the sender's side stream waits on ``ready`` and then reads vLLM's
    sums and the strata's sums, so both copies come before the event is recorded."""
    log: list[str] = []

    class Event:
        def record(self, stream=None) -> None:  # noqa: ANN001
            log.append("ready")

    st = strata.StrataState(MAX_REQS, K, CPU, registry=registry)
    rounds = SummaryRound(FakeSink(), K, CPU, True, max_num_reqs=MAX_REQS, strata=st)
    rounds._queue.put(None)  # the sender stops: only end() is traced
    rounds._thread.join(10)
    rounds._cuda, rounds._cur = True, None  # the sender holds both sets: summed on the step
    rounds._free.clear()
    clone, cat = torch.Tensor.clone, torch.cat

    def logged_clone(t: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # noqa: ANN002, ANN003
        log.append("strata")
        return clone(t, *args, **kwargs)

    def logged_cat(parts, *args, **kwargs) -> torch.Tensor:  # noqa: ANN001, ANN002, ANN003
        log.append("vllm")
        return cat(parts, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "Event", Event)
        m.setattr(torch.Tensor, "clone", logged_clone)
        m.setattr(torch, "cat", logged_cat)
        rounds.start(1, 0.5, (0.0,) * K)
        rounds.steps = 3
        rounds.end(StandinAcceptanceEstimator(MAX_REQS, K, CPU))
    item = rounds._queue.get_nowait()
    assert item.strata_sums is not None and item.ready is not None
    assert log == ["vllm", "strata", "ready"]
    st.close()
