"""``avest audit``: Monte Carlo check that each budget rule keeps sampling lossless.

Runs every rule × drafter (parallel, autoregressive) × cost profile (affine,
fixed overhead, padded buckets) on the two-token toy of ``avest.core.audit``
and compares request 0's emitted tokens with the target by χ². A rule that
claims to be lossless and comes out BIASED is a bug; ``argmax`` is expected to
come out BIASED with an autoregressive drafter under step-shaped costs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from avest.commands.options import dumps, integer, number


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trials", type=integer(1), default=200_000, help="steps per audit")
    parser.add_argument(
        "--seed", type=integer(0), default=0, help="base seed (one derived per audit)"
    )
    parser.add_argument(
        "--alpha",
        type=number(0, 1, low_open=True, high_open=True),
        default=None,
        help="significance level, in (0, 1) (default 1e-3)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from avest.core.audit import ALPHA, audit_all
    from avest_wire.errors import InvalidInput

    alpha = ALPHA if args.alpha is None else args.alpha
    try:
        results = audit_all(args.trials, args.seed)
    except InvalidInput as exc:
        print(f"avest audit: {exc}", file=sys.stderr)
        return 2
    # A rule that claims losslessness but fails is the only alarming outcome.
    broken = [r for r in results if r.lossless_claim and r.verdict(alpha) == "BIASED"]
    if args.json:
        rows: list[dict[str, Any]] = [
            {
                "rule": r.rule,
                "lossless_claim": r.lossless_claim,
                "drafter": r.drafter,
                "costs": r.costs,
                "trials": r.trials,
                "emitted_first": r.emitted_first,
                "target_first": r.target_first,
                "chi2_first": r.chi2_first,
                "p_first": r.p_first,
                "emitted_pair": r.emitted_pair,
                "target_pair": r.target_pair,
                "chi2_pair": r.chi2_pair,
                "p_pair": r.p_pair,
                "p_value": r.p_value,
                "verdict": r.verdict(alpha),
                "mean_verified": r.mean_verified,
                "tokens_per_ms": r.tokens_per_ms,
            }
            for r in results
        ]
        out = {"trials": args.trials, "seed": args.seed, "alpha": alpha, "results": rows}
        out["claims_hold"] = not broken
        print(dumps(out, indent=2))  # an infinite χ² (a count the target lacks): null
    else:
        _print_table(results, alpha)
    return 1 if broken else 0


def _print_table(results: list[Any], alpha: float) -> None:
    from avest.offline.table import Column, format_columns

    columns = (
        Column("rule", "<", width=14),
        Column("lossless", "<"),
        Column("drafter", "<", width=14),
        Column("costs", "<", width=9),
        Column("P(t0=0) emitted/target", "<"),
        Column("chi2 first", width=10),
        Column("chi2 pair", width=10),
        Column("p", width=9),
        Column("verdict", "<", width=7),
        Column("tok/ms", width=6),
    )
    rows = [
        [
            r.rule,
            "yes" if r.lossless_claim else "no",
            r.drafter,
            r.costs,
            f"{r.emitted_first[0]:.4f} / {r.target_first[0]:.4f}",
            f"{r.chi2_first:.2f}",
            f"{r.chi2_pair:.2f}",
            f"{r.p_value:.3g}",
            r.verdict(alpha),
            f"{r.tokens_per_ms:.3f}",
        ]
        for r in results
    ]
    print("\n".join(format_columns(columns, rows)))
    trials = results[0].trials if results else 0
    print(f"\n{trials} trials per row; p = Bonferroni of first-token and first-two-token χ²;")
    print(f"BIASED when p < {alpha:g}. tok/ms: realised tokens of all requests per modelled ms.")
