"""``avest simulate``'s honest baselines: speculation off, parallel drafters with a
known gain, the oracle's share, the in-sample MLE, cycling, draft-length advice."""

from __future__ import annotations

import json

import numpy as np
import pytest

from avest.commands.cli import main
from avest.core.costs import CostTable
from avest.core.draft_length import best_lengths, expected_tokens
from avest.offline.simulate.derive import (
    AR_HEAD_PARAMS_B,
    GPUS,
    draft_curve,
    parallel_profile,
)
from avest.offline.simulate.engine import simulate
from avest.offline.simulate.profiles import CostProfile, load_profile
from avest.offline.simulate.recommend import recommend
from avest.offline.trace import Trace, write_trace

from .handmade import hand_meta, write_profile

pytestmark = pytest.mark.slow

# Draft 1 ms a pass; verify(T) = 10 + T ms.
AFFINE = [(1, 11.0), (2, 12.0)]
PARALLEL = CostProfile.from_curves("parallel", [(1, 1.0), (64, 1.0)], AFFINE, draft_per="proposal")
AUTOREGRESSIVE = CostProfile.from_curves("ar", [(1, 1.0), (64, 1.0)], AFFINE)


def two_kinds(steps: int, k: int = 2) -> Trace:
    """Each step: a request whose drafts are all accepted (feature +4, oracle 1) and
    one whose first draft is rejected (feature -4, oracle 0)."""
    rows = 2 * steps
    good = np.arange(rows) % 2 == 0
    feats = np.where(good[:, None], 4.0, -4.0) * np.ones((rows, k))
    return Trace(
        features=feats.astype(np.float32),
        num_verified=np.full(rows, k, dtype=np.int32),
        num_accepted=np.where(good, k, 0).astype(np.int32),
        step=np.repeat(np.arange(steps, dtype=np.int64), 2),
        request=np.tile(np.arange(2, dtype=np.int64), steps),
        meta=hand_meta(k),
        accept_rate_dist=np.where(good[:, None], 1.0, 0.0).repeat(k, 1).astype(np.float32),
    ).validate()


def test_speculation_off_by_hand() -> None:
    trace = two_kinds(10)
    sim = simulate(trace, AUTOREGRESSIVE, [2], select=[])
    off = sim.results[2]["fixed-0"]
    # Two tokens a step (one per request, nothing drafted), verify(2) = 12 ms.
    assert (off.steps, off.tokens, off.accepted, off.verified) == (10, 20, 0, 0)
    assert off.time_ms == pytest.approx(10 * 12.0)
    assert off.throughput == pytest.approx(1000.0 * 2 / 12.0)
    # fixed-2 pays 2 draft passes: 4 tokens for 2 + 10 + 6 = 18 ms.
    assert sim.results[2]["fixed-2"].throughput == pytest.approx(1000.0 * 4 / 18.0)


def test_parallel_drafter_gain_is_known() -> None:
    # One pass (1 ms) drafts both positions. Fixed v: 2 + v tokens for 1 + 10 + 2 + 2v ms
    # (v = 0: no draft, 12 ms) -> best fixed-2 at 4 / 17. Knowing which request fails,
    # verify only the good one: 4 tokens for 1 + 10 + 2 + 2 = 15 ms: a gain of 17/15 - 1.
    trace = two_kinds(40)
    sim = simulate(
        trace, PARALLEL, [2], select=["avest/lossless-walk", "oracle/*", "mle/*"], min_steps=300
    )
    res = sim.results[2]
    assert sim.best_fixed(2) == "fixed-2"
    assert res["fixed-2"].throughput == pytest.approx(1000.0 * 4 / 17.0)
    assert sim.gain(2, "oracle/lossless-walk") == pytest.approx(17 / 15 - 1)
    # The in-sample MLE separates the two kinds: it matches the oracle.
    assert sim.gain(2, "mle/lossless-walk") == pytest.approx(17 / 15 - 1)
    assert sim.oracle_share(2, "mle/lossless-walk") == pytest.approx(1.0)
    # The online estimator, from the cold start, never verifies a failing request
    # (its first draft is worth 0.1 tokens for 1 ms): the whole gain as well.
    assert sim.oracle_share(2, "avest/lossless-walk") == pytest.approx(1.0)
    assert sim.oracle_share(2, "fixed-2") is None
    # Cycled: 40 steps of trace, 300 simulated.
    assert res["fixed-0"].steps == 300 and sim.cycles[2] == pytest.approx(7.5)
    out = sim.as_json()["concurrency"]["2"]
    assert out["trace_cycles"] == pytest.approx(7.5)
    assert out["policies"]["mle/lossless-walk"]["oracle_share"] == pytest.approx(1.0)


def test_an_autoregressive_drafter_pays_for_what_it_trims() -> None:
    # The same trace with 1 ms per position drafted: AV drafts both positions (2 ms)
    # like fixed-2 and saves 2 ms of verification: 4 tokens for 16 ms against 4 / 18.
    sim = simulate(two_kinds(40), AUTOREGRESSIVE, [2], select=["oracle/*"])
    assert sim.gain(2, "oracle/lossless-walk") == pytest.approx(18 / 16 - 1)


def test_shipped_parallel_profiles_are_derived_like_the_autoregressive_ones() -> None:
    for name, gpu in GPUS.items():
        ar = load_profile(name)
        sizes = [r for r, _ in ar.draft_curve]
        # The derivation reproduces the shipped autoregressive draft curve...
        assert [tuple(p) for p in draft_curve(gpu, sizes, AR_HEAD_PARAMS_B, 1, 0)] == [
            (r, ms) for r, ms in ar.draft_curve
        ]
        # ...and the parallel profile shipped is exactly its output.
        par = load_profile(f"{name}-parallel")
        want = parallel_profile(name)
        assert [list(p) for p in par.draft_curve] == want["draft_curve"]
        assert par.verify_curve == ar.verify_curve and par.draft_per == "proposal"
        assert any("Derived the same way" in n for n in par.notes)
        # One parallel pass (1.5x the parameters, 8 tokens a request) costs more than
        # one autoregressive pass, at most 12 of them (plus the eager overhead).
        for (r, p), (_, a) in zip(par.draft_curve, ar.draft_curve, strict=True):
            assert a < p <= 12 * a + gpu.eager_overhead_ms, r


def test_best_fixed_length_in_closed_form() -> None:
    rates = [0.8, 0.5]
    assert expected_tokens(rates).tolist() == pytest.approx([1.0, 1.8, 2.2])
    table = CostTable.from_curves([(1, 2.0), (64, 2.0)], [(1, 10.0), (64, 10.0), (128, 74.0)])
    low, high = best_lengths(rates, table, [1, 64], per_position=True)
    # C=1: v drafts cost v ms, verification flat at 10 ms.
    assert low.throughput == pytest.approx([100.0, 1800 / 11, 2200 / 12])
    assert low.length == 2
    # C=64: each verified draft costs 1 ms more; speculation off wins.
    assert high.length == 0 and high.gain_over_off == 0.0


def test_cli_recommends_draft_lengths_and_says_it_cycled(tmp_path, capsys) -> None:
    path = tmp_path / "t.npz"
    write_trace(path, two_kinds(30, k=3))
    profile = write_profile(tmp_path / "p.json", "p", [[1, 1.0], [64, 1.0]], [[1, 11.0], [2, 12.0]])
    argv = ["simulate", str(path), "--costs", str(profile), "--concurrency", "2"]
    assert main([*argv, "--min-steps", "100", "--recommend", "--policy", "oracle/*"]) == 0
    text = capsys.readouterr().out
    assert "trace cycled 3.33x to reach 100" in text and "fixed-0" in text and "share" in text
    assert "recommended num_speculative_tokens" in text
    assert main([*argv, "--min-steps", "100", "--recommend", "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)["simulations"][0]
    (rec,) = sim["recommendation"]
    assert rec["concurrency"] == 2 and rec["adaptive_verification"]
    policies = sim["concurrency"]["2"]["policies"]
    assert rec["adaptive_throughput"] == max(
        v["throughput"] for n, v in policies.items() if n.startswith("avest/lossless-walk")
    )
    assert main([*argv, "--min-steps", "-1"]) == 2


def test_recommend_needs_the_policy() -> None:
    sim = simulate(two_kinds(5), PARALLEL, [2], select=["oracle/*"])
    with pytest.raises(ValueError, match="no avest/lossless-walk"):
        recommend(sim, "lossless-walk")
