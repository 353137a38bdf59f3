"""Tensor parallelism: two gloo ranks switch coefficients at the same step, rank 0 decides."""

from __future__ import annotations

import json

import pytest
import torch.multiprocessing as mp

from .tp_worker import STEPS, SYNC, K, run

pytestmark = pytest.mark.slow


def test_two_ranks_apply_the_same_version_at_the_same_step(tmp_path):
    mp.spawn(run, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["log"] == r1["log"]  # bit-identical coefficients, decisions and refits every step
    assert r0["factory_calls"] == 1 and r1["factory_calls"] == 0  # only rank 0 has a sidecar
    assert r0["forwarded"] == STEPS and r1["forwarded"] == 0

    log = r0["log"]
    versions = [e["version"] for e in log]
    changed = [i for i in range(1, STEPS) if versions[i] != versions[i - 1]]
    # pushed at steps 5, 20, 70, 101 -> applied at the next multiple of SYNC
    assert changed == [8, 24, 72, 104]
    assert all(i % SYNC == 0 for i in changed)
    governed = [e["governed"] for e in log]
    assert not any(governed[:8]) and all(governed[8:48]) and not any(governed[48:72])
    assert all(governed[72:])
    assert [versions[i] for i in changed] == [1, 2, 3, 4]
    # rounds end at steps 24, 49, 74, 99, 124 (REFIT_INTERVAL 25); only the one at 49 fell
    # while the sidecar was away, so both ranks ran exactly that one local refit
    refits = [e["refits"] for e in log]
    assert refits[48] == 0 and refits[49] == 1 and refits[-1] == 1
    assert log[49]["slope"] != log[48]["slope"]
    assert log[72]["slope"] == 0.550000011920929 and len(log[72]["intercepts"]) == K


def test_rank0_without_a_sink_does_not_hang_the_others(tmp_path):
    """Rank 0's sink factory fails: it still joins every broadcast (with None)."""
    args = (2, str(tmp_path / "store"), str(tmp_path), True)
    mp.spawn(run, args=args, nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["log"] == r1["log"]
    assert not any(e["governed"] for e in r0["log"])
    assert r0["log"][-1]["refits"] == STEPS // 25  # vLLM's own refits, in step on both ranks


def test_two_ranks_serve_the_same_strata_sets_at_the_same_step(tmp_path):
    """AVEST_STRATA=1: every rank loads the pushed strata sets at the same boundary, so the
    confidences the draft graph reads are bit-identical on every rank at every step."""
    args = (2, str(tmp_path / "store"), str(tmp_path), False, True)
    mp.spawn(run, args=args, nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["log"] == r1["log"]
    served = [e["served"] for e in r0["log"]]
    assert served[7] == [] and served[8] == ["greedy"]  # pushed at 5, applied at 8
    assert served[48] == [] and served[72] == ["greedy"]  # lost at 45: the pair's set only
    assert served[104] == ["t0.5-1"]
