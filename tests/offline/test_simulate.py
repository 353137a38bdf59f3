"""``avest simulate``: truncation, cost accounting, closed forms, oracles, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from avest.commands.cli import main
from avest.core.budget import RULES
from avest.core.model import survival
from avest.core.rule_factory import DEFAULT_RULE as DEFAULT_UPDATE_RULE
from avest.core.rule_factory import make_rule
from avest.core.tracking import round_steps
from avest.offline.simulate.engine import make_policies, planned_steps, simulate, truncate
from avest.offline.simulate.profiles import (
    CostProfile,
    ProfileError,
    load_profile,
    shipped_profiles,
)
from avest.offline.trace import Trace, write_trace

from .handmade import hand_meta, write_profile

pytestmark = pytest.mark.slow

# Draft pass 0.2 ms; verify 5 ms + 0.1 ms per token: verification turns
# expensive quickly, so trimming pays at the larger concurrencies.
AFFINE = CostProfile.from_curves("affine", [(1, 0.2), (2, 0.2)], [(1, 5.1), (2, 5.2)])
AFFINE_PROPOSAL = CostProfile.from_curves(
    "affine-proposal", [(1, 1.0), (2, 1.0)], [(1, 5.1), (2, 5.2)], draft_per="proposal"
)


def hand_trace(accepted: list[int], verified: list[int], k: int, requests: int) -> Trace:
    rows = len(accepted)
    return Trace(
        features=np.zeros((rows, k), dtype=np.float32),
        num_verified=np.asarray(verified, dtype=np.int32),
        num_accepted=np.asarray(accepted, dtype=np.int32),
        step=np.arange(rows, dtype=np.int64) // requests,
        request=np.arange(rows, dtype=np.int64) % requests,
        meta=hand_meta(k),
    ).validate()


# -- truncation and accounting ---------------------------------------------


def test_truncate_hand_made_rows() -> None:
    got, observed, accepted = truncate([0, 2, 5, 3, 4], [3, 1, 5, 0, 4], 5)
    assert got.tolist() == [0, 1, 5, 0, 4]
    assert observed.astype(int).tolist() == [
        [1, 0, 0, 0, 0],  # first draft rejected: it is the only label
        [1, 0, 0, 0, 0],  # accepted 2, verified 1: one accepted label, nothing after
        [1, 1, 1, 1, 1],  # everything accepted
        [0, 0, 0, 0, 0],  # nothing verified: nothing learned
        [1, 1, 1, 1, 0],  # accepted all 4 verified; the 5th was never verified
    ]
    assert accepted.astype(int).tolist() == [
        [0, 0, 0, 0, 0],
        [1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1],
        [0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0],
    ]


def test_fixed_and_full_accounting_on_hand_made_trace() -> None:
    # Two steps of two requests, K = 3; the last row was recorded with one draft verified.
    trace = hand_trace([0, 3, 1, 1], [3, 3, 3, 1], k=3, requests=2)
    # Draft pass 1 ms at any batch; verify(T) = 10 + T ms.
    profile = CostProfile.from_curves("hand", [(1, 1.0), (2, 1.0)], [(1, 11.0), (2, 12.0)])
    sim = simulate(trace, profile, [2])
    res = sim.results[2]

    f2 = res["fixed-2"]  # verifies [2, 2] then [2, 1 (all the trace knows)]
    assert (f2.steps, f2.accepted, f2.verified) == (2, 0 + 2 + 1 + 1, 4 + 3)
    assert f2.tokens == 2 * 2 + 4
    assert f2.time_ms == pytest.approx((2 * 1 + 10 + 6) + (2 * 1 + 10 + 5))
    assert f2.throughput == pytest.approx(1000 * 8 / 35)
    assert f2.per_request == pytest.approx(f2.throughput / 2)
    assert f2.acceptance_length == pytest.approx(8 / 4)
    assert f2.verified_per_request == pytest.approx(7 / 4)

    full = res["avest/full"]  # the full rule drafts and verifies all 3: same as fixed-3
    f3 = res["fixed-3"]
    assert (full.tokens, full.verified, full.time_ms) == (f3.tokens, f3.verified, f3.time_ms)
    assert f3.tokens == 4 + 0 + 3 + 1 + 1
    assert f3.time_ms == pytest.approx((3 + 10 + 8) + (3 + 10 + 6))
    assert sim.gain(2, sim.best_fixed(2)) == 0.0


def test_adaptive_policies_pay_for_every_drafted_position() -> None:
    trace = hand_trace([3, 3, 3, 3], [3, 3, 3, 3], k=3, requests=2)
    # Verification is free: verifying everything is optimal, so every adaptive
    # policy matches fixed-3, and the one drafting 2 positions matches fixed-2.
    profile = CostProfile.from_curves("flat", [(1, 1.0), (2, 1.0)], [(1, 10.0), (64, 10.0)], 64)
    sim = simulate(trace, profile, [2], draft_lengths=[2, 3], select=["avest/*"])
    res = sim.results[2]
    for name in ("avest/lossless-walk", "avest/argmax", "avest/stale"):
        assert res[name].time_ms == pytest.approx(res["fixed-3"].time_ms)
        assert res[name].tokens == res["fixed-3"].tokens
    assert res["avest/lossless-walk@2"].time_ms == pytest.approx(res["fixed-2"].time_ms)
    assert res["avest/lossless-walk@2"].tokens == res["fixed-2"].tokens


def test_proposal_profiles_charge_the_draft_once() -> None:
    trace = hand_trace([1, 1, 1, 1], [3, 3, 3, 3], k=3, requests=2)
    base = [(1, 10.0), (2, 10.0)]
    per_pos = simulate(trace, CostProfile.from_curves("p", [(1, 2.0)], base), [2])
    per_prop = simulate(
        trace, CostProfile.from_curves("q", [(1, 2.0)], base, draft_per="proposal"), [2]
    )
    for v in (1, 2, 3):
        extra = per_pos.results[2][f"fixed-{v}"].time_ms - per_prop.results[2][f"fixed-{v}"].time_ms
        assert extra == pytest.approx(2 * 2.0 * (v - 1))  # two steps, v - 1 extra passes each


def test_min_per_request_keeps_every_adaptive_policy_learning() -> None:
    # Verification so expensive that every policy would trim everything.
    trace = hand_trace([2, 0, 1, 2] * 4, [3] * 16, k=3, requests=2)
    dear = CostProfile.from_curves("dear", [(1, 0.0)], [(1, 1.0), (2, 101.0)])
    lean = simulate(trace, dear, [2], select=["avest/lossless-walk", "position-rate/*"])
    kept = simulate(
        trace, dear, [2], select=["avest/lossless-walk", "position-rate/*"], min_per_request=1
    )
    assert lean.results[2]["position-rate/lossless-walk"].verified == 0
    for name in ("avest/lossless-walk", "position-rate/lossless-walk"):
        assert kept.results[2][name].verified_per_request >= 1.0
    assert kept.as_json()["min_per_request"] == 1


def test_remainder_rows_are_dropped_and_tiny_traces_skipped() -> None:
    trace = hand_trace([1] * 5, [2] * 5, k=2, requests=5)
    sim = simulate(trace, AFFINE, [2, 8])
    assert sim.skipped == [8]
    assert sim.results[2]["fixed-1"].steps == 2


# -- closed forms on synthetic traces ----------------------------------------


def expected_accepted(p: np.ndarray, v: int) -> np.ndarray:
    """E[min(a, v)] per row for independent acceptance with prefix semantics."""
    return survival(p)[:, :v].sum(axis=1)


@pytest.mark.parametrize("c", [8, 32])
def test_fixed_lengths_match_the_closed_form(make_synthetic_trace, c: int) -> None:
    trace = make_synthetic_trace(steps=200, requests=64, k=5, seed=3)
    sim = simulate(trace, AFFINE, [c], select=[])
    steps = trace.rows // c
    n = steps * c
    p = trace.accept_rate_dist[:n].astype(np.float64)
    for v in range(1, 6):
        t = sim.results[c][f"fixed-{v}"]
        time_ms = steps * (v * 0.2 + 5.0 + 0.1 * (c + v * c))
        assert t.time_ms == pytest.approx(time_ms)
        closed = 1000.0 * (n + expected_accepted(p, v).sum()) / time_ms
        realized = np.minimum(trace.num_accepted[:n], v)
        noise = 1000.0 * realized.std() * np.sqrt(n) / time_ms  # one standard error of the sum
        assert abs(t.throughput - closed) < 4 * noise, (v, t.throughput, closed, noise)


def test_oracle_is_never_beaten_and_beats_every_fixed_length(make_synthetic_trace) -> None:
    # Drafting costs the same whatever the length: only verification differs.
    trace = make_synthetic_trace(steps=256, requests=32, k=5, seed=1)
    sim = simulate(trace, AFFINE_PROPOSAL, [8, 32, 128])
    oracle = "oracle/lossless-walk"
    for c, res in sim.results.items():
        for name, t in res.items():
            # the oracle still drafts; speculation off does not (nor the schedule, which can
            # turn it off)
            if name not in ("fixed-0", "schedule"):
                assert res[oracle].throughput >= t.throughput * (1 - 0.01), (c, name)
    # Where verification is the bottleneck, knowing which drafts will fail pays
    # against every length that drafts...
    res = sim.results[128]
    drafting = max(res[f"fixed-{v}"].throughput for v in range(1, 6))
    assert res[oracle].throughput / drafting - 1.0 > 0.03
    # ...but switching speculation off pays more: it is the best fixed length,
    # and the gain is measured against it.
    assert sim.best_fixed(128) == "fixed-0"
    assert sim.gain(128, oracle) < 0.0


def test_perfect_estimator_beats_the_best_fixed_length_per_draft_length(
    make_synthetic_trace,
) -> None:
    # Drafting d positions costs d passes: the oracle drafting d is compared with
    # fixed-d (same drafting cost), and the best oracle with the best fixed length.
    trace = make_synthetic_trace(steps=256, requests=32, k=5, seed=2)
    sim = simulate(trace, AFFINE, [8, 32, 128], draft_lengths=range(1, 6), select=["oracle/*"])
    for c, res in sim.results.items():
        for d in range(1, 6):
            name = "oracle/lossless-walk" + ("" if d == 5 else f"@{d}")
            assert res[name].throughput >= res[f"fixed-{d}"].throughput * (1 - 0.01), (c, d)
        best_oracle = max(t.throughput for n, t in res.items() if n.startswith("oracle"))
        assert best_oracle >= res[sim.best_fixed(c)].throughput * (1 - 0.01)
        # Each adaptive policy is compared with the oracle drafting as many positions.
        assert sim.vs_oracle(c, "oracle/lossless-walk@2") == 0.0
        assert sim.vs_oracle(c, "fixed-2") is None


def test_avest_learns_close_to_the_oracle(make_synthetic_trace) -> None:
    trace = make_synthetic_trace(steps=256, requests=32, k=5, seed=4)
    sim = simulate(trace, AFFINE_PROPOSAL, [32], warmup_passes=1, select=["avest/*", "oracle/*"])
    assert abs(sim.vs_oracle(32, "avest/lossless-walk")) < 0.01
    # The default rule refits early while it warms up, then every 100 steps.
    ends, end, r = [], 0, 0
    while end <= 2 * (trace.rows // 32):
        end += round_steps(make_rule(DEFAULT_UPDATE_RULE), r, 100)
        ends.append(end)
        r += 1
    assert sim.results[32]["avest/lossless-walk"].refits == len(ends) - 1


# -- policies and profiles -----------------------------------------------------


def test_policies_mark_the_lossy_rule_and_need_an_oracle_to_list_one() -> None:
    policies = {p.name: p for p in make_policies(4, has_oracle=False)}
    assert [n for n in policies if n.startswith("fixed-")] == [f"fixed-{v}" for v in range(0, 5)]
    assert policies["fixed-0"].description == "speculation off"
    for rule, entry in RULES.items():
        assert policies[f"avest/{rule}"].lossless == entry.lossless
    assert not policies["avest/argmax"].lossless
    assert not any(n.startswith("oracle") for n in policies)
    with pytest.raises(ValueError, match="draft lengths"):
        make_policies(4, True, draft_lengths=[5])


def test_progress_counts_the_planned_steps(sample_trace) -> None:
    seen: list[int] = []
    policies = make_policies(sample_trace.k, True, select=["avest/lossless-walk"])
    simulate(sample_trace, AFFINE, [16, 64], policies=policies, progress=seen.append)
    assert sum(seen) == planned_steps(sample_trace, [16, 64], policies)


@pytest.mark.parametrize("name", shipped_profiles())
def test_shipped_profiles_load_and_say_where_they_come_from(name: str) -> None:
    profile = load_profile(name)
    assert profile.name == name and profile.description and profile.regime
    assert len(profile.notes) >= 3 and any("not measured" in n for n in profile.notes)
    costs = profile.step_costs(6, 128, 128 * 7)
    verify = costs.verify_ms(np.arange(1, 128 * 7 + 1))
    assert np.all(np.diff(verify) >= 0)
    passes = 6 if profile.draft_per == "position" else 1
    assert costs.draft_ms(64, 6) == pytest.approx(passes * costs.draft_ms(64, 1))
    assert costs.draft_ms(64, 0) == 0.0  # speculation off drafts nothing


def test_three_regimes_are_shipped() -> None:
    assert len(shipped_profiles()) >= 3
    pow2 = load_profile("h100-llama8b-pow2").step_costs(5, 128, 1024)
    v = pow2.verify_ms(np.array([129, 200, 256, 257]))
    assert v[0] == v[1] == v[2] < v[3]  # a padded bucket, then the cliff without graphs


def test_bad_profiles_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="no cost profile"):
        load_profile("no-such-profile")
    bad = write_profile(tmp_path / "bad.json", "x", [[1, 1]], [[2, 1], [1, 2]])
    with pytest.raises(ProfileError, match="increasing"):
        load_profile(bad)
    bad.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ProfileError, match="format"):
        load_profile(bad)


# -- command line ----------------------------------------------------------------


def test_cli_end_to_end_json(tmp_path: Path, trace_slice, capsys) -> None:
    path = write_trace(tmp_path / "slice.npz", trace_slice("sample", 0, 40))
    profile = write_profile(
        tmp_path / "p.json", "mine", [[1, 0.5]], [[1, 5], [512, 40]], cudagraph_limit=0
    )
    rc = main(
        [
            "simulate",
            str(path),
            "--costs",
            f"a100-llama8b,{profile}",
            "--concurrency",
            "4,8",
            "--min-steps",
            "0",
            "--json",
            "--plot",
            str(tmp_path / "plots"),
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    sims = out["simulations"]
    assert [s["profile"]["name"] for s in sims] == ["a100-llama8b", "mine"]
    for s in sims:
        assert set(s["concurrency"]) == {"4", "8"}
        block = s["concurrency"]["8"]
        assert block["policies"][block["best_fixed"]]["gain_vs_best_fixed"] == 0.0
        assert s["policies"]["avest/argmax"]["lossless"] is False
        assert "oracle/lossless-walk" in block["policies"]
        for row in block["policies"].values():
            assert row["throughput"] > 0 and row["per_request"] * 8 == pytest.approx(
                row["throughput"]
            )
    assert len(list((tmp_path / "plots").glob("*.png"))) == 2


def test_cli_table_and_errors(tmp_path: Path, trace_slice, capsys) -> None:
    path = write_trace(tmp_path / "slice.npz", trace_slice("sample", 0, 20))
    argv = ["simulate", str(path), "--costs", "l40s-llama8b", "--concurrency", "8"]
    rc = main([*argv, "--min-steps", "0"])
    text = capsys.readouterr().out
    assert rc == 0 and "best fixed length" in text and "avest/argmax *" in text
    assert main(["simulate", str(path), "--costs", "nope"]) == 2
    assert main(["simulate", str(path), "--rule", "nope"]) == 2
    assert main(["simulate", str(tmp_path / "missing.npz")]) == 2
