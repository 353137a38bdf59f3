"""The recommended ``num_speculative_tokens`` per concurrency, from a simulation.

For each concurrency: the best fixed length (speculation off included) and
the best adaptive policy (the avest estimator under one budget rule, drafting
``d = 1..K``); the recommendation is whichever is faster: ``d`` drafts with
adaptive verification on, or the fixed length with it off. Run the
simulation with ``draft_lengths = 1..K`` so that every ``d`` is there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from avest.offline.simulate.results import Simulation
from avest.offline.table import Column, format_columns


@dataclass(frozen=True)
class Recommendation:
    concurrency: int
    best_fixed: int  # num_speculative_tokens without adaptive verification (0: off)
    best_fixed_throughput: float
    adaptive_drafts: int  # the best d with adaptive verification on
    adaptive_throughput: float
    adaptive_policy: str

    @property
    def adaptive_gain(self) -> float:
        """The best adaptive policy against the best fixed length, minus 1."""
        return self.adaptive_throughput / self.best_fixed_throughput - 1.0

    @property
    def num_speculative_tokens(self) -> int:
        return self.adaptive_drafts if self.adaptive_gain > 0 else self.best_fixed

    @property
    def adaptive_verification(self) -> bool:
        return self.adaptive_gain > 0

    def as_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _JSON_FIELDS}


#: What :meth:`Recommendation.as_json` holds, in order: the choice first, then its evidence.
_JSON_FIELDS = (
    "concurrency",
    "num_speculative_tokens",
    "adaptive_verification",
    "best_fixed",
    "best_fixed_throughput",
    "adaptive_drafts",
    "adaptive_policy",
    "adaptive_throughput",
    "adaptive_gain",
)


def recommend(sim: Simulation, rule: str) -> list[Recommendation]:
    """One recommendation per simulated concurrency, for ``avest/<rule>`` at every length."""
    out = []
    adaptive = [p for p in sim.policies if p.kind == "avest" and p.rule == rule]
    if not adaptive:
        raise ValueError(f"the simulation ran no avest/{rule} policy")
    for c, res in sim.results.items():
        best = sim.best_fixed(c)
        runs = [p for p in adaptive if p.name in res]
        top = max(runs, key=lambda p: res[p.name].throughput)
        out.append(
            Recommendation(
                c,
                int(best.split("-", 1)[1]),
                res[best].throughput,
                top.drafts,
                res[top.name].throughput,
                top.name,
            )
        )
    return out


_COLUMNS = (
    Column("C", width=5),
    Column("best fixed"),
    Column("tok/s", width=9),
    Column("AV drafts", gap=3),
    Column("tok/s", width=9),
    Column("AV gain", width=8),
    Column("recommendation", "<", gap=3),
)


def format_recommendations(sim: Simulation, recs: list[Recommendation]) -> str:
    rows = []
    for r in recs:
        advice = (
            f"num_speculative_tokens={r.num_speculative_tokens}, adaptive verification on"
            if r.adaptive_verification
            else (
                f"num_speculative_tokens={r.best_fixed}, adaptive verification off"
                if r.best_fixed
                else "speculation off"
            )
        )
        rows.append(
            [
                str(r.concurrency),
                str(r.best_fixed),
                f"{r.best_fixed_throughput:,.0f}",
                str(r.adaptive_drafts),
                f"{r.adaptive_throughput:,.0f}",
                f"{100 * r.adaptive_gain:+.1f}%",
                advice,
            ]
        )
    title = (
        f"recommended num_speculative_tokens for {sim.trace or 'trace'} under {sim.profile.name} "
        f"(draft per {sim.profile.draft_per}):"
    )
    return "\n".join([title, *format_columns(_COLUMNS, rows)])
