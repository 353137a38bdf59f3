"""Robust pooling in the state: honest fleets are never quarantined, one poisoner among
eight barely moves the pair, a quarantined worker comes back, a lone worker learns as
before. The fleets are the shared traces split by request (tests.support.fleets),
fed into a pair's state directly."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from avest.core.estimator import Batch, OnlineEstimator
from avest.core.rule_factory import make_rule
from avest.state.workers import OK, QUARANTINED
from tests.support import fleets as F
from tests.support.traces import load_trace

#: The most one poisoner among eight may move the mean predicted acceptance on the
#: honest workers' drafts.
TARGET = 0.02
MODES = ("raw", "summary")


def quarantined(pair) -> list[str]:
    return [r.worker_id for r in pair.workers.rows() if r.quarantines or r.state != OK]


def check_honest(senders: list[F.Sender], mode: str, k: int) -> None:
    pair = F.feed(F.new_pair(k), senders, mode)
    assert quarantined(pair) == []
    assert pair.workers.quarantined == 0 and pair.workers.quarantined_steps == 0
    assert all(r.held == 0 for r in pair.workers.rows())
    scores = [abs(r.score) for r in pair.workers.rows() if r.score is not None]
    assert len(scores) == len(senders)  # every worker was judged


@pytest.mark.parametrize("mode", MODES)
def test_an_honest_fleet_on_one_trace_is_never_quarantined(mode):
    check_honest(F.honest(load_trace("chat"), 8), mode, 5)


@pytest.mark.parametrize("mode", MODES)
def test_two_workloads_pooled_into_one_pair_are_never_quarantined(mode):
    """Chat (K = 5) and code (K = 6, its first five positions) on four workers each."""
    chat, code = load_trace("chat"), load_trace("code")
    check_honest(F.honest(chat, 4, "chat") + F.honest(code, 4, "code", k=5), mode, 5)


def test_a_fleet_through_a_workload_shift_is_never_quarantined():
    check_honest(F.honest(load_trace("greedy-shift-story-chat-rtn4g64-t0-k5.npz"), 8), "raw", 5)


def test_a_fleet_joining_late_while_rounds_are_held_open_is_never_quarantined():
    """Rounds held open by the refit interval through a whole fleet's run, refitted once
    it ends, then a second fleet replaying the trace: its workers are judged on recent
    evidence (aged per round's worth of steps, as refits would have), not on the first
    fleet's, scored at the cold model since refitted."""
    trace = load_trace("chat")
    pair = F.new_pair(5, refit_interval=10)
    F.feed(pair, F.honest(trace, 2, "first"), "raw", refit_every=10_000)
    pair.refit_held()
    steps = pair.estimator.steps
    F.feed(pair, F.honest(trace, 2, "again"), "raw", refit_every=10_000)
    assert quarantined(pair) == []
    assert all(r.held == 0 for r in pair.workers.rows())
    assert pair.estimator.steps == 2 * steps


def test_the_reference_is_computed_per_refit_not_per_held_round(monkeypatch):
    """Rounds held open by the refit interval age the evidence at every round's worth
    of steps (each message here); the reference the workers are judged against,
    which visits every worker, is computed once per refit and when a worker's rate
    first enters it, not at every aged round."""
    import avest.state.workers as workers

    calls = []
    real = workers.reference
    monkeypatch.setattr(workers, "reference", lambda *a: calls.append(1) or real(*a))
    trace = load_trace("chat")
    pair = F.new_pair(5, refit_interval=10)
    F.feed(pair, F.honest(trace, 8), "summary", refit_every=10_000)
    table = pair.workers
    assert table.clock > 50 and table.rounds <= 1  # rounds aged, no refit
    assert table.reference().judges and quarantined(pair) == []
    # the eight workers' rates entering it (and a prune), never once per message
    assert len(calls) <= 8 + 2, (len(calls), table.clock)
    before = len(calls)
    pair.refit_held()
    table.reference()
    assert len(calls) == before + 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("poison", ["all-accepted", "flipped"])
def test_a_poisoner_is_quarantined_while_rounds_are_held_open(mode, poison):
    """Rounds held open (a full round refits only every 50th message): a poisoner's
    evidence ages per round's worth of steps, its share of a round is bounded per refit."""
    corrupt, burst = POISONS[poison]
    senders = F.honest(load_trace("chat"), 8)
    fleet = [*senders[1:], F.poisoner(senders[0], "bad", corrupt, burst=burst)]
    honest_only = F.feed(F.new_pair(5), senders[1:], mode, refit_every=50)
    pair = F.feed(F.new_pair(5), fleet, mode, refit_every=50)
    moved = F.honest_acceptance(pair.coefficients, fleet) - F.honest_acceptance(
        honest_only.coefficients, fleet
    )
    assert quarantined(pair) == ["bad"]
    assert abs(moved) <= TARGET


@pytest.fixture(scope="module")
def baselines() -> dict[str, float]:
    """The honest acceptance with the seven honest workers alone, per mode."""
    out = {}
    for mode in MODES:
        senders = F.honest(load_trace("chat"), 8)[1:]
        pair = F.feed(F.new_pair(5), senders, mode)
        out[mode] = F.honest_acceptance(pair.coefficients, senders)
    return out


POISONS = {
    "rejected-at-clamp": (F.rejected_at_clamp, 1),
    "rejected-at-clamp-flood": (F.rejected_at_clamp, 20),
    "all-accepted": (F.all_accepted, 1),
    "flipped": (F.flipped, 1),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("poison", POISONS)
def test_one_poisoner_among_eight_barely_moves_the_honest_acceptance(mode, poison, baselines):
    corrupt, burst = POISONS[poison]
    senders = F.honest(load_trace("chat"), 8)
    bad = F.poisoner(senders[0], "bad", corrupt, burst=burst)
    fleet = [*senders[1:], bad]
    pair = F.feed(F.new_pair(5), fleet, mode)
    moved = F.honest_acceptance(pair.coefficients, fleet) - baselines[mode]
    print(f"{mode} {poison}: honest acceptance moved by {moved:+.4f}")
    assert abs(moved) <= TARGET
    assert quarantined(pair) == ["bad"]
    row = next(r for r in pair.workers.rows() if r.worker_id == "bad")
    assert row.state == QUARANTINED and abs(row.score) > 5.0
    # Held back from its first judgement on, quarantined from its second (a flood's
    # first summaries arrive before three workers can judge it: bounded, not held).
    assert row.held == 1 and row.quarantined_steps + row.held_steps > 0.8 * len(bad.steps)
    assert pair.workers.quarantined_steps == row.quarantined_steps


def test_without_the_guard_the_same_poisoner_wrecks_the_pair():
    """What the guard prevents: the same eight workers folded into a bare estimator."""
    senders = F.honest(load_trace("chat"), 8)
    fleet = [*senders[1:], F.poisoner(senders[0], "bad", F.rejected_at_clamp, burst=20)]
    bare = F.new_pair(5).estimator
    for _, b in F.interleave(fleet):
        bare.apply(b)
    assert abs(F.honest_acceptance(bare.coefficients, fleet) - 0.7) > 0.2


def test_a_lone_worker_learns_as_a_bare_estimator_does():
    """One worker: nobody to judge it against, and its own rounds are never cut."""
    (worker,) = F.honest(load_trace("chat"), 1)
    pair = F.feed(F.new_pair(5), [worker], "raw")
    bare = F.new_pair(5).estimator
    for b in worker.steps:
        bare.apply(b)
    assert pair.coefficients == bare.coefficients
    assert pair.workers.rows()[0].score is None


def test_a_quarantined_worker_comes_back_when_its_data_agree_again():
    """A worker broken for a while, then mended: released without an admin."""
    senders = F.honest(load_trace("chat"), 8)
    steps = senders[0].steps
    cut = len(steps) // 4
    mended = F.Sender("bad", [F.rejected_at_clamp(b) for b in steps[:cut]] + steps[cut:])
    pair = F.new_pair(5)
    F.feed(pair, [*senders[1:], mended], "raw")
    row = next(r for r in pair.workers.rows() if r.worker_id == "bad")
    assert row.quarantines == 1 and row.state == OK
    assert 0 < row.quarantined_steps < len(steps) - cut
    assert pair.workers.quarantined == 0


def test_an_admin_release_folds_the_worker_again_and_scores_it_afresh():
    senders = F.honest(load_trace("chat"), 8)
    fleet = [*senders[1:], F.poisoner(senders[0], "bad", F.all_accepted)]
    pair = F.feed(F.new_pair(5), fleet, "raw")
    table = pair.workers
    with pytest.raises(KeyError):
        table.release("nobody")
    with pytest.raises(ValueError):
        table.release("w1")
    assert table.quarantined == 1
    row = table.release("bad")
    assert row.state == OK and row.score is None and table.quarantined == 0
    # Released, it is folded again: its next honest step changes the open round.
    before = pair.estimator.round_stats.n.sum()
    pair.observe("bad", 10**6, senders[0].steps[-1])
    assert pair.estimator.round_stats.n.sum() > before or pair.estimator.steps_in_round == 0


def test_a_quarantined_worker_s_heavy_step_folded_off_the_loop_is_dropped():
    """A step folded into a copy on a worker thread does not replace the estimator
    when its worker is quarantined (the copy is built here as the fold does)."""
    senders = F.honest(load_trace("chat"), 8)
    fleet = [*senders[1:], F.poisoner(senders[0], "bad", F.rejected_at_clamp)]
    pair = F.feed(F.new_pair(5), fleet, "raw")
    assert pair.workers.quarantined == 1
    step = F.rejected_at_clamp(senders[0].steps[0])
    est = pair.estimator
    copied: OnlineEstimator = copy.deepcopy(est)
    stats = copied.contribution(step)
    folded = (copied, copied.apply(step, stats), stats)
    applied, refit = pair.observe("bad", 10**6, step, folded)
    assert applied and refit is None and pair.estimator is est
    # An honest worker's heavy step takes the estimator's place as before.
    good = senders[1].steps[0]
    copied = copy.deepcopy(est)
    stats = copied.contribution(good)
    applied, _ = pair.observe("w1", 10**6, good, (copied, copied.apply(good, stats), stats))
    assert applied and pair.estimator is copied


def test_bounded_rounds_match_a_bare_estimator_fed_the_bounded_statistics():
    """What the pair folds is the estimator's own fold of the statistics it kept."""
    rng = np.random.default_rng(0)
    x = rng.normal(0, 2, size=(16, 5))
    obs = np.ones((16, 5), dtype=bool)
    batch = Batch(x, obs, rng.random((16, 5)) < 0.5)
    pair = F.new_pair(5)
    pair.observe("w0", 1, batch)
    bare = OnlineEstimator(5, make_rule(pair.rule_name), pair.estimator.refit_interval)
    bare.apply(batch)
    assert pair.estimator.round_stats.equals(bare.round_stats)
