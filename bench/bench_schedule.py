"""The draft-length schedule against every fixed length and AV at full K (issue 32).

``avest simulate``'s ``schedule`` policy (:mod:`avest.core.schedule`, computed
online from the estimator: its coefficients in force and the histogram of the
features it has seen, recomputed at every refit with hysteresis; no oracle, no
measured throughput) against the best fixed length (speculation off included)
and ``avest/lossless-walk`` (AV drafting every position), at C = 8..256, under
every shipped cost profile, on the shared traces and three variants: the code
trace's steps reversed, the greedy and chat traces merged step by step (K cut to
5), and the chat trace with its features shifted by +1 in its second half (the
labels stay: a drift the estimator must follow). Runs start cold (the estimator
at its cold start, the schedule policy drafting K under AV until its first
schedule), or warm with ``--warmup-passes 1`` (one unmeasured pass first: the
estimate the service would have persisted).

Targets (issue 32), checked at every (trace, profile, C):

* ``vs fixed``: the schedule at most 1 % below the best fixed length;
* ``vs AV``: at most 1 % below AV at full K;
* ``gap``: where the best fixed length and AV differ by more than 1 %, the
  schedule at least 5 % above the worse of the two (where they differ by less
  than 5 %, only beating the better one can meet it).

    python bench/bench_schedule.py [--traces DIR] [--min-steps 600] [--warmup-passes 0]
        [--concurrency 8,16,32,64,128,256] [--profiles a,b] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from avest.offline.simulate.engine import make_policies, simulate
from avest.offline.simulate.profiles import load_profile, shipped_profiles
from avest.offline.strata import merge_traces, reverse_steps
from avest.offline.table import Column, format_columns
from avest.offline.trace import Trace, read_trace

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"
FILES = {
    "chat": "chat-rtn4g32-t1.0-k5.npz",
    "code": "code-rtn4g128-t0.7-k6.npz",
    "greedy": "greedy-shift-story-chat-rtn4g64-t0-k5.npz",
}
AV = "avest/lossless-walk"
#: The targets: at most this share below the best fixed length and below AV ...
TOLERANCE = 0.01
#: ... and this share above the worse of the two where they differ.
GAIN = 0.05


def traces(directory: Path) -> dict[str, Trace]:
    shared = {name: read_trace(directory / f) for name, f in FILES.items()}
    chat = shared["chat"]
    shifted = chat.features.copy()
    shifted[chat.rows // 2 :] += 1.0
    return {
        **shared,
        "code reversed": reverse_steps(shared["code"]),
        "greedy+chat merged": merge_traces([shared["greedy"], chat], k=5, longest=True),
        "chat features +1 late": replace(chat, features=shifted),
    }


@dataclass(frozen=True)
class Cell:
    trace: str
    profile: str
    c: int
    best_fixed: str
    best: float
    av: float
    schedule: float
    choices: dict[str, int]

    @property
    def vs_fixed(self) -> float:
        return self.schedule / self.best - 1.0

    @property
    def vs_av(self) -> float:
        return self.schedule / self.av - 1.0

    @property
    def differ(self) -> bool:
        return abs(self.av / self.best - 1.0) > TOLERANCE

    @property
    def vs_worse(self) -> float:
        return self.schedule / min(self.best, self.av) - 1.0

    def targets(self) -> dict[str, bool | None]:
        return {
            "vs_fixed": self.vs_fixed >= -TOLERANCE,
            "vs_av": self.vs_av >= -TOLERANCE,
            "gap": self.vs_worse >= GAIN if self.differ else None,
        }

    def as_json(self) -> dict[str, Any]:
        where = {"trace": self.trace, "profile": self.profile, "concurrency": self.c}
        return where | {
            "best_fixed": self.best_fixed,
            "best_fixed_throughput": self.best,
            "av_throughput": self.av,
            "schedule_throughput": self.schedule,
            "schedule_vs_best_fixed": self.vs_fixed,
            "schedule_vs_av": self.vs_av,
            "schedule_vs_worse": self.vs_worse,
            "schedule_choices": self.choices,
            "targets": self.targets(),
        }


def from_json(cell: dict[str, Any]) -> Cell:
    return Cell(
        cell["trace"],
        cell["profile"],
        cell["concurrency"],
        cell["best_fixed"],
        cell["best_fixed_throughput"],
        cell["av_throughput"],
        cell["schedule_throughput"],
        cell["schedule_choices"],
    )


def run(
    named: dict[str, Trace],
    profiles: list[str],
    cs: list[int],
    min_steps: int,
    warmup_passes: int = 0,
) -> list[Cell]:
    cells = []
    for name, trace in named.items():
        policies = make_policies(trace.k, False, select=[AV, "schedule"])
        for profile in profiles:
            sim = simulate(
                trace,
                load_profile(profile),
                cs,
                policies=policies,
                min_steps=min_steps,
                warmup_passes=warmup_passes,
            )
            for c, res in sim.results.items():
                best = sim.best_fixed(c)
                cells.append(
                    Cell(
                        name,
                        profile,
                        c,
                        best,
                        res[best].throughput,
                        res[AV].throughput,
                        res["schedule"].throughput,
                        sim.choices.get(c, {}),
                    )
                )
            print(f"  {name} under {profile}: done", file=sys.stderr)
    return cells


def main_choice(choices: dict[str, int]) -> str:
    return max(choices, key=lambda n: choices[n]) if choices else "-"


def format_table(cells: list[Cell]) -> str:
    columns = (
        Column("trace", "<"),
        Column("profile", "<", gap=2),
        Column("C", width=4),
        Column("best fixed", "<", gap=2),
        Column("tok/s", width=8),
        Column("AV@K", width=7),
        Column("schedule", width=9),
        Column("vs AV", width=7),
        Column("runs", "<", gap=2),
        Column("targets", "<", gap=2),
    )

    def mark(v: bool | None) -> str:
        return "-" if v is None else ("ok" if v else "MISS")

    rows = [
        [
            cell.trace,
            cell.profile,
            str(cell.c),
            cell.best_fixed,
            f"{cell.best:,.0f}",
            f"{cell.av / cell.best - 1:+.1%}",
            f"{cell.vs_fixed:+.1%}",
            f"{cell.vs_av:+.1%}",
            main_choice(cell.choices),
            " ".join(mark(v) for v in cell.targets().values()),
        ]
        for cell in cells
    ]
    head = (
        "AV@K and schedule: throughput against the best fixed length; vs AV: schedule against "
        "AV@K; runs: the schedule's most run choice; targets: vs fixed, vs AV, gap"
    )
    return "\n".join([head, *format_columns(columns, rows)])


def summary(cells: list[Cell]) -> dict[str, Any]:
    out: dict[str, Any] = {"cells": len(cells)}
    for key in ("vs_fixed", "vs_av", "gap"):
        judged = [c for c in cells if c.targets()[key] is not None]
        missed = [c for c in judged if not c.targets()[key]]
        out[key] = {"judged": len(judged), "held": len(judged) - len(missed)}
        if missed:
            attr = {"vs_fixed": "vs_fixed", "vs_av": "vs_av", "gap": "vs_worse"}[key]
            worst = min(missed, key=lambda c: getattr(c, attr))
            out[key]["worst"] = {
                "trace": worst.trace,
                "profile": worst.profile,
                "concurrency": worst.c,
                "value": getattr(worst, attr),
            }
    gap_cells = [c for c in cells if c.differ]
    out["gap"]["gap_under_5pct"] = sum(
        1 for c in gap_cells if max(c.best, c.av) / min(c.best, c.av) - 1.0 < GAIN
    )
    out["av_worst_vs_fixed"] = min(c.av / c.best - 1.0 for c in cells)
    out["schedule_worst_vs_fixed"] = min(c.vs_fixed for c in cells)
    out["schedule_worst_vs_av"] = min(c.vs_av for c in cells)
    return out


def format_summary(s: dict[str, Any]) -> str:
    lines = [f"{s['cells']} cells (trace x profile x C)"]
    for key, text in (
        ("vs_fixed", "never > 1% below the best fixed length"),
        ("vs_av", "never > 1% below AV at full K"),
        ("gap", ">= 5% above the worse where they differ by > 1%"),
    ):
        t = s[key]
        line = f"  {text}: held in {t['held']} of {t['judged']}"
        if "worst" in t:
            w = t["worst"]
            line += (
                f"; worst {w['value']:+.1%} ({w['trace']}, {w['profile']}, C={w['concurrency']})"
            )
        lines.append(line)
    lines.append(
        f"  (of those that differ, {s['gap']['gap_under_5pct']} differ by under 5%)\n"
        f"  worst against the best fixed length: AV@K {s['av_worst_vs_fixed']:+.1%}, "
        f"schedule {s['schedule_worst_vs_fixed']:+.1%}; schedule against AV@K at worst "
        f"{s['schedule_worst_vs_av']:+.1%}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=Path, default=SHARED)
    parser.add_argument("--min-steps", type=int, default=600)
    parser.add_argument("--concurrency", default="8,16,32,64,128,256")
    parser.add_argument("--profiles", default=",".join(shipped_profiles()))
    parser.add_argument(
        "--warmup-passes",
        type=int,
        default=0,
        help="learn on this many unmeasured passes first (a warm start: the service persists "
        "its estimate); default 0, cold",
    )
    parser.add_argument("--only", help="comma-separated trace names (default: all six)")
    parser.add_argument("--json", metavar="OUT", help="also write every cell as JSON here")
    parser.add_argument(
        "--from-json",
        nargs="+",
        metavar="IN",
        help="print the table and summary of cells written by earlier --json runs (e.g. "
        "halves run in parallel with --only) instead of simulating",
    )
    args = parser.parse_args(argv)
    if args.from_json:
        cells = [
            from_json(c)
            for path in args.from_json
            for c in json.loads(Path(path).read_text())["cells"]
        ]
    else:
        named = traces(args.traces)
        if args.only:
            named = {n: named[n] for n in args.only.split(",")}
        cs = [int(c) for c in args.concurrency.split(",")]
        cells = run(named, args.profiles.split(","), cs, args.min_steps, args.warmup_passes)
    s = summary(cells)
    print(format_table(cells))
    print()
    print(format_summary(s))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"summary": s, "cells": [c.as_json() for c in cells]}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
