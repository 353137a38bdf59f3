"""bench/bench_schedule_features.py: its ``verified`` variant feeds the schedule policy the
verified drafts alone, and it fails loudly when the policy no longer counts reached drafts
(the two variants would then be one, and the comparison void)."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from avest.core.schedule import reached
from avest.offline.simulate import engine

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("bench_schedule_features")


def test_the_verified_variant_keeps_only_the_verified_drafts_that_reached(bench) -> None:  # noqa: ANN001
    accepted, verified = np.array([3, 1, 0, 2]), np.array([3, 4, 0, 2])
    with bench.verified_only():
        got = engine.reached(accepted, verified, 4)
    assert engine.reached is reached  # put back
    want = reached(accepted, verified, 4) & (np.arange(4)[None, :] < verified[:, None])
    np.testing.assert_array_equal(got, want)
    # the trimmed draft after an accepted run reached its position, but was not verified
    assert reached(accepted, verified, 4)[0, 3] and not got[0, 3]


def test_it_fails_when_the_policy_counts_no_reached_drafts(bench) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit, match="never counted reached drafts"), bench.verified_only():
        pass


def test_one_cell_runs_both_variants(bench) -> None:  # noqa: ANN001
    (row,) = bench.run(["code"], ["a100-llama8b"], [128], 200, 0)
    assert row["best_fixed"].startswith("fixed-")
    assert {"reached_vs_best_fixed", "verified_vs_best_fixed"} <= set(row)
