"""What the draft-length schedule loses when it reads only the verified drafts' features.

The schedule needs, per position, the features of the drafts that *reached* it
(every earlier draft of the request accepted), verified or trimmed. Before
reached counts, the service read them back from the recent calibration
histogram, which counts the verified (labelled) drafts only: under adaptive
verification the trimmed drafts, the unconfident ones, are missing, and the
schedule overrates acceptance at depth. This runs ``avest simulate``'s
``schedule`` policy twice on the same traces, profiles and concurrencies:

* ``reached``: as it is (what the service reads from reached counts now);
* ``verified``: fed the features of the verified drafts only (what it read
  before), its evidence gate counting them alike.

and reports each against the best fixed length (speculation off included).

    python bench/bench_schedule_features.py [--concurrency 32,64,128,256]
        [--profiles a,b] [--min-steps 600] [--warmup-passes 0] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from bench_schedule import SHARED, traces

from avest.offline.simulate import engine
from avest.offline.simulate.engine import make_policies, simulate
from avest.offline.simulate.profiles import load_profile, shipped_profiles


@contextlib.contextmanager
def verified_only() -> Iterator[None]:
    """The schedule policy counts only the verified drafts among those that reached.
    Fails loudly if the policy no longer reads ``reached`` (the variant would then be
    the policy as it is, and the comparison void)."""
    real = engine.reached
    calls = [0]

    def verified(
        num_accepted: npt.ArrayLike, num_verified: npt.ArrayLike, drafted: int
    ) -> npt.NDArray[np.bool_]:
        calls[0] += 1
        v = np.asarray(num_verified, dtype=np.int64)
        return real(num_accepted, num_verified, drafted) & (
            np.arange(drafted)[None, :] < v[:, None]
        )

    engine.reached = verified  # type: ignore[assignment]
    try:
        yield
    finally:
        engine.reached = real  # type: ignore[assignment]
    if not calls[0]:
        raise SystemExit("the schedule policy never counted reached drafts: nothing was compared")


def run(names: list[str], profiles: list[str], cs: list[int], min_steps: int,
        warmup_passes: int) -> list[dict[str, Any]]:  # fmt: skip
    named = traces(SHARED)
    out = []
    for name in names:
        trace = named[name]
        policies = make_policies(trace.k, False, select=["schedule"])
        for profile in profiles:
            got = {}
            for variant in ("reached", "verified"):
                ctx = verified_only() if variant == "verified" else contextlib.nullcontext()
                with ctx:
                    got[variant] = simulate(trace, load_profile(profile), cs, policies=policies,
                                            min_steps=min_steps, warmup_passes=warmup_passes)  # fmt: skip
            for c in cs:
                sims = {v: got[v] for v in got}
                best = sims["reached"].best_fixed(c)
                base = sims["reached"].results[c][best].throughput
                row = {"trace": name, "profile": profile, "concurrency": c, "best_fixed": best}
                for v, sim in sims.items():
                    row[f"{v}_vs_best_fixed"] = sim.results[c]["schedule"].throughput / base - 1.0
                    choices = sim.choices.get(c, {})
                    row[f"{v}_runs"] = max(choices, key=lambda n: choices[n]) if choices else "-"
                out.append(row)
            print(f"  {name} under {profile}: done", file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", default="chat,code,greedy,greedy+chat merged")
    ap.add_argument("--profiles", default=",".join(shipped_profiles()))
    ap.add_argument("--concurrency", default="32,64,128,256")
    ap.add_argument("--min-steps", type=int, default=600)
    ap.add_argument("--warmup-passes", type=int, default=0)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rows = run(a.traces.split(","), a.profiles.split(","),
               [int(c) for c in a.concurrency.split(",")], a.min_steps, a.warmup_passes)  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))
    print(
        f"{'trace':<20} {'profile':<28} {'C':>4} {'best':<8} {'reached':>8} {'verified':>9}  runs"
    )
    for r in rows:
        print(f"{r['trace']:<20} {r['profile']:<28} {r['concurrency']:>4} {r['best_fixed']:<8} "
              f"{r['reached_vs_best_fixed']:>+8.1%} {r['verified_vs_best_fixed']:>+9.1%}  "
              f"{r['reached_runs']} / {r['verified_runs']}")  # fmt: skip
    diff = [r["reached_vs_best_fixed"] - r["verified_vs_best_fixed"] for r in rows]
    worse = [d for d in diff if d < -0.001]
    print(
        f"\nreached minus verified, over {len(diff)} cells: mean {np.mean(diff):+.2%}, "
        f"best {max(diff):+.2%}, worst {min(diff):+.2%}; reached behind in {len(worse)}"
    )


if __name__ == "__main__":
    main()
