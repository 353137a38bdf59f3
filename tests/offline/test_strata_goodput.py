"""Strata's goodput: ``avest simulate`` and ``avest fleet`` run the online estimator as one
coefficient set and as strata on a trace that carries a ``stratum`` array."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from avest.commands.cli import main
from avest.core.budget import DEFAULT_RULE
from avest.offline.fleet import POOLED, POOLED_STRATA, Fleet, evaluate_fleet
from avest.offline.simulate.engine import simulate
from avest.offline.simulate.fleet import simulate_fleet
from avest.offline.simulate.profiles import CostProfile
from avest.offline.simulate.results import STRATIFIED, STRATIFIED_MLE, make_policies
from avest.offline.strata import OVERALL, evaluate_strata, merge_traces
from avest.offline.trace import Trace, write_trace
from tests.support.traces import make_synthetic_trace

ONE_SET = f"avest/{DEFAULT_RULE}"
STRATA = f"{STRATIFIED}/{DEFAULT_RULE}"
#: Verification expensive next to a draft pass: adaptive verification trims at C = 16.
PROFILE = CostProfile.from_curves(
    "affine-proposal", [(1, 1.0), (2, 1.0)], [(1, 5.1), (2, 5.2)], draft_per="proposal"
)


def two_strata(steps: int = 120, seed: int = 0) -> Trace:
    """Half of every step greedy (sharp: slope 1.6), half sampled (flat: slope 0.3)."""
    sharp = make_synthetic_trace(steps, 8, 4, slope=1.6, intercepts=0.6, seed=seed)
    flat = make_synthetic_trace(steps, 8, 4, slope=0.3, intercepts=-0.4, seed=seed + 1)
    return merge_traces([sharp, flat], labels=["greedy", "t>=1"])


def test_a_trace_without_strata_runs_the_policies_it_ran() -> None:
    trace = make_synthetic_trace(60, 8, 4)
    assert trace.stratum is None
    names = [p.name for p in make_policies(4, True)]
    assert not any(STRATIFIED in n for n in names)
    assert names == [p.name for p in make_policies(4, True, strata=False)]
    sim = simulate(trace, PROFILE, [8, 16])
    assert [p.name for p in sim.policies] == names
    # With strata the list gains avest+strata, right after the calibration layer's.
    tagged = [p.name for p in make_policies(4, True, strata=True)]
    at = tagged.index(STRATA)
    assert tagged[at + 1] == f"{STRATIFIED_MLE}/{DEFAULT_RULE}"
    assert tagged[:at] + tagged[at + 2 :] == names and tagged[at - 1].startswith("avest+cal")


def test_one_stratum_is_the_one_set_exactly() -> None:
    trace = make_synthetic_trace(150, 8, 4, slope=0.9)
    tagged = replace(trace, stratum=np.full(trace.rows, "greedy"))
    sim = simulate(tagged, PROFILE, [8, 16], refit_interval=10, select=[ONE_SET, STRATA])
    plain = simulate(trace, PROFILE, [8, 16], refit_interval=10, select=[ONE_SET])
    for c in (8, 16):
        one, strata = sim.results[c][ONE_SET], sim.results[c][STRATA]
        assert (strata.tokens, strata.time_ms, strata.verified) == (
            one.tokens,
            one.time_ms,
            one.verified,
        )
        # The one set is the same whether the trace carries strata or not.
        assert plain.results[c][ONE_SET] == one
        assert one.verified < 16 * c * one.steps // 4  # adaptive verification trimmed
    fleet = Fleet(workers=2, refit_interval=10, calibrate=False)
    g = simulate_fleet(tagged, fleet, PROFILE, 8, steps=60)
    assert g.results[POOLED_STRATA].tokens.tolist() == g.results[POOLED].tokens.tolist()
    assert g.results[POOLED_STRATA].time_ms.tolist() == g.results[POOLED].time_ms.tolist()


def test_two_strata_gain_goodput_and_calibrate_each_stratum_better() -> None:
    trace = two_strata()
    sim = simulate(
        trace, PROFILE, [16], refit_interval=10, select=[ONE_SET, STRATA, "oracle/*", "mle*"]
    )
    res = sim.results[16]
    one, strata = res[ONE_SET], res[STRATA]
    assert one.verified < trace.num_verified[: 16 * one.steps].sum()  # it trims
    # Not below the one set by more than noise (in fact above it here).
    assert strata.throughput >= one.throughput * 0.995
    assert res[f"oracle/{DEFAULT_RULE}"].throughput >= strata.throughput * 0.99
    # In sample, a fit per stratum beats one fit.
    mle, mle_strata = res[f"mle/{DEFAULT_RULE}"], res[f"{STRATIFIED_MLE}/{DEFAULT_RULE}"]
    assert mle_strata.throughput > mle.throughput
    report = evaluate_strata(trace, refit_interval=10, methods=("one-set", "strata"))
    by = report.measures
    for stratum in ("greedy", "t>=1"):
        assert by["strata"][stratum].ece < by["one-set"][stratum].ece
        assert by["strata"][stratum].logloss < by["one-set"][stratum].logloss
    assert by["strata"][OVERALL].logloss < by["one-set"][OVERALL].logloss
    # The fleet's goodput has the strata row beside its per-stratum calibration.
    fleet = Fleet(workers=2, refit_interval=10, calibrate=False)
    g = simulate_fleet(trace, fleet, PROFILE, 8, steps=120)
    assert g.results[POOLED_STRATA].throughput >= g.results[POOLED].throughput * 0.995
    cal = evaluate_fleet(trace, fleet).by_stratum
    for stratum in ("greedy", "t>=1"):
        assert cal[POOLED_STRATA][stratum].ece < cal[POOLED][stratum].ece


def _strict(text: str) -> object:
    def refuse(constant: str) -> None:
        raise AssertionError(f"bare {constant} in the JSON")

    return json.loads(text, parse_constant=refuse)


def test_cli_reports_strata_goodput_in_strict_json_and_tables(tmp_path: Path, capsys) -> None:
    path = write_trace(tmp_path / "mixed.npz", two_strata(60))
    profile = "a100-llama8b-parallel"
    argv = ["simulate", str(path), "--costs", profile, "--concurrency", "8,16,2000"]
    assert main([*argv, "--min-steps", "0", "--policy", "avest*/lossless-walk", "--json"]) == 0
    out = _strict(capsys.readouterr().out)
    block = out["simulations"][0]  # type: ignore[index]
    assert block["skipped_concurrency"] == [2000]
    policies = block["concurrency"]["16"]["policies"]
    assert {ONE_SET, STRATA} <= set(policies)
    assert policies[STRATA]["throughput"] > 0 and policies[STRATA]["vs_oracle"] is None
    # The summary (not a terminal, several profiles) gains the strata columns.
    argv[3] = f"{profile},l40s-llama8b-parallel"
    assert main([*argv, "--min-steps", "0", "--policy", "avest*/lossless-walk"]) == 0
    text = capsys.readouterr().out
    assert "strata/one set" in text and STRATA not in text.split("strata/one set")[0]
    fleet = ["fleet", str(path), "--workers", "2", "--restart-every", "0", "--steps", "30"]
    assert main([*fleet, "--json"]) == 0
    g = _strict(capsys.readouterr().out)["fleets"][0]["goodput"]  # type: ignore[index]
    assert g["policies"][POOLED_STRATA]["throughput"] > 0
    assert main(fleet) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if POOLED_STRATA in ln)
    assert line.rstrip().endswith("%")  # its goodput cells are filled


def test_a_trace_without_strata_prints_what_it_printed(tmp_path: Path, capsys) -> None:
    """A plain trace runs no strata policy, and a stratum array changes no other policy's
    figure: the JSON of the trace tagged with one stratum, less ``avest+strata``, is the
    plain trace's; so is the table, less its line and the summary's strata columns."""
    trace = make_synthetic_trace(40, 8, 4)
    plain = write_trace(tmp_path / "plain.npz", trace)
    tagged = write_trace(tmp_path / "tagged.npz", replace(trace, stratum=np.full(trace.rows, "g")))
    argv = ["--costs", "a100-llama8b-parallel", "--concurrency", "8,16", "--min-steps", "0"]
    assert main(["simulate", str(plain), *argv, "--json"]) == 0
    before = _strict(capsys.readouterr().out)["simulations"][0]  # type: ignore[index]
    assert main(["simulate", str(tagged), *argv, "--json"]) == 0
    after = _strict(capsys.readouterr().out)["simulations"][0]  # type: ignore[index]
    added = [STRATA, f"{STRATIFIED_MLE}/{DEFAULT_RULE}"]
    assert not set(added) & set(before["policies"]) and set(added) <= set(after["policies"])
    for name in added:
        del after["policies"][name]
        for block in after["concurrency"].values():
            del block["policies"][name]
    after["trace"] = before["trace"]
    assert after == before
    assert main(["simulate", str(plain), *argv, "--table"]) == 0
    text = capsys.readouterr().out
    assert STRATIFIED not in text
    assert main(["simulate", str(tagged), *argv, "--table"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if not any(n in ln for n in added)]
    assert "\n".join(lines).replace(str(tagged), str(plain)) == text.rstrip("\n")
