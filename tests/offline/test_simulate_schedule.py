"""``avest simulate``'s ``schedule`` policy: the schedule computed online from the estimator."""

from __future__ import annotations

import pytest

from avest.offline.simulate.engine import make_policies, simulate
from avest.offline.simulate.profiles import CostProfile

# Verification that grows steeply with the batch: every drafted token costs almost as
# much as a sampled one, so at 64 requests speculating loses to not speculating.
STEEP = CostProfile.from_curves("steep", [(1, 0.3), (2, 0.3)], [(1, 0.6), (2, 1.2)])
# A flat verify cost: drafting every position and verifying it all is best.
FLAT = CostProfile.from_curves("flat", [(1, 0.01), (2, 0.01)], [(1, 20.0), (4096, 20.0)])


def run(trace, profile: CostProfile, c: int):
    policies = make_policies(trace.k, False, select=["avest/lossless-walk", "schedule"])
    return simulate(trace, profile, [c], policies=policies, min_steps=300)


def test_schedule_is_a_default_policy() -> None:
    policy = next(p for p in make_policies(4, has_oracle=False) if p.name == "schedule")
    assert policy.adaptive and policy.lossless and policy.drafts == 4


def test_schedule_turns_speculation_off_where_verification_dominates(make_synthetic_trace) -> None:
    trace = make_synthetic_trace(steps=150, requests=64, k=4, seed=5)
    sim = run(trace, STEEP, 64)
    res, choices = sim.results[64], sim.choices[64]
    assert sim.best_fixed(64) == "fixed-0"
    # it starts at AV over every position, then runs what the schedule says: off
    assert choices.get("fixed-0", 0) > 0.8 * sum(choices.values())
    assert res["schedule"].throughput > res["avest/lossless-walk"].throughput
    assert res["schedule"].throughput > 0.97 * res["fixed-0"].throughput
    assert sim.as_json()["concurrency"]["64"]["schedule_choices"] == choices


def test_schedule_keeps_every_position_where_verification_is_free(make_synthetic_trace) -> None:
    trace = make_synthetic_trace(steps=150, requests=16, k=4, seed=6)
    sim = run(trace, FLAT, 16)
    res = sim.results[16]
    assert sim.best_fixed(16) == "fixed-4"
    assert all(name.endswith("-4") for name in sim.choices[16])
    assert res["schedule"].throughput == pytest.approx(res["fixed-4"].throughput, rel=0.01)
