"""``avest simulate TRACE --costs COSTS``: what adaptive verification buys.

Replay a trace's decode steps at each concurrency (C rows per step, in trace order)
under measured or derived step-cost curves, and compare fixed verification lengths with
adaptive verification: the avest estimator (learning online, predict-then-learn) under
every budget rule, q_max unfitted, the per-position rate, the in-sample
maximum-likelihood fit and the trace's oracle confidences. Step time = draft cost +
verify cost[C + verified drafts]; a policy that drafts d positions pays d draft passes
(profiles with draft_per=position), whatever it trims. fixed-0 is speculation off.
Traces shorter than --min-steps steps at a concurrency are cycled (requests re-enter
with their rows).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from fnmatch import fnmatchcase
from typing import Any

from avest.commands.options import dumps, integer, number
from avest.commands.traces import add_refit_interval_argument


def _ints(low: int) -> Callable[[str], list[int]]:
    """An argparse type: ``"8,16,32"`` or ranges ``"1-5"``, comma-separated, each >= ``low``."""

    def parse(text: str) -> list[int]:
        out: list[int] = []
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            lo, sep, hi = part.partition("-")
            try:
                out += list(range(int(lo), int(hi) + 1)) if sep and lo else [int(part)]
            except ValueError:
                out = []
                break
        if not out or min(out) < low:
            raise argparse.ArgumentTypeError(
                f"must be integers >= {low} like 8,16 or 1-5, got {text!r}"
            )
        return out

    return parse


def _lengths(text: str) -> list[int] | str:
    """``"all"`` (1..K of each trace) or a list as ``_ints`` reads it."""
    return "all" if text.strip() == "all" else _ints(1)(text)


#: Simulated steps per concurrency at least: shorter traces are cycled.
MIN_STEPS = 2000


def register(p: argparse.ArgumentParser) -> None:
    from avest.core.rule_factory import DEFAULT_RULE, RULE_NAMES
    from avest.settings import Settings

    defaults = Settings()
    p.add_argument(
        "traces", nargs="*", metavar="TRACE", help="trace files (.npz); default: the bundled sample"
    )
    p.add_argument(
        "--costs",
        action="append",
        metavar="PROFILE",
        help="cost profile: a shipped name or an avest-costs/1 JSON file (repeatable, or "
        "comma-separated); default: every shipped profile",
    )
    p.add_argument(
        "--concurrency",
        type=_ints(1),
        default=[8, 16, 32, 64, 128],
        metavar="LIST",
        help="requests per step (default 8,16,32,64,128)",
    )
    add_refit_interval_argument(p, defaults.refit_interval)
    p.add_argument(
        "--update-rule",
        choices=RULE_NAMES,
        default=DEFAULT_RULE,
        help=f"estimator update rule (default {DEFAULT_RULE}, the core's default)",
    )
    p.add_argument(
        "--forgetting",
        type=number(0, 1, low_open=True),
        default=None,
        help="forgetting per round, in (0, 1] (default: the rule's own)",
    )
    p.add_argument(
        "--min-steps",
        type=integer(0),
        default=MIN_STEPS,
        metavar="N",
        help=f"cycle the trace to at least N steps per concurrency (default {MIN_STEPS}; 0: "
        "one pass)",
    )
    p.add_argument(
        "--recommend",
        action="store_true",
        help="also run the avest policy drafting 1..K under the default budget rule and print "
        "the recommended num_speculative_tokens per concurrency",
    )
    p.add_argument(
        "--prior",
        type=number(0, low_open=True),
        default=defaults.prior,
        help="recursive rule: prior precision",
    )
    p.add_argument(
        "--rule",
        dest="baseline_rule",
        default=None,
        metavar="NAME",
        help="budget rule for the q_max, position-rate and oracle policies "
        "(default: the core's lossless default)",
    )
    p.add_argument(
        "--draft-lengths",
        type=_lengths,
        default=None,
        metavar="LIST",
        help="also run adaptive policies drafting fewer positions: a list such as 2-4, or "
        "'all' for 1..K (named @d; default: K only)",
    )
    p.add_argument(
        "--policy",
        action="append",
        dest="select",
        metavar="PATTERN",
        help="only adaptive policies matching this shell pattern, e.g. 'avest/*' "
        "(repeatable; fixed lengths always run)",
    )
    p.add_argument(
        "--warmup-passes",
        type=integer(0),
        default=0,
        metavar="N",
        help="learn on N unmeasured passes of the trace first (a warm start; default 0: cold)",
    )
    p.add_argument(
        "--min-per-request",
        type=integer(0),
        default=0,
        metavar="M",
        help="adaptive policies always verify the first M drafts of every request (default 0)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--table",
        action="store_true",
        help="print every policy's table even when stdout is not a terminal (there, with "
        "several traces or cost profiles, the default is a summary: one line per concurrency)",
    )
    p.add_argument("--plot", metavar="DIR", help="write throughput-interactivity Pareto plots here")
    p.set_defaults(func=run)


def format_summary(sim: Any, rule: str) -> str:
    """One row per concurrency: the best fixed length, avest under ``rule``, the oracle, and
    the draft-length schedule (gains against the best fixed length); on a stratified
    trace also ``avest+strata`` and its throughput against the one set's."""
    from avest.offline.simulate.results import STRATIFIED
    from avest.offline.table import Column, format_columns

    p = sim.profile
    adaptive = [q for q in sim.policies if q.kind == "avest" and q.rule == rule and q.lossless]
    # A stratified trace: avest+strata against the one set under the same budget rule.
    strata = next(
        (q.name for q in sim.policies if q.kind == STRATIFIED and q.drafts == sim.k), None
    )
    rows = []
    for c, res in sim.results.items():
        best = sim.best_fixed(c)
        row = [str(c), best, f"{res[best].throughput:,.0f}"]
        runs = [q for q in adaptive if q.name in res]
        if runs:
            top = max(runs, key=lambda q: res[q.name].throughput)
            row += [top.name, f"{sim.gain(c, top.name):+.1%}"]
            oracle = sim.oracle_name(top.drafts)
            row.append(f"{sim.gain(c, oracle):+.1%}" if oracle in res else "")
        elif strata is not None:
            row += ["", "", ""]  # keep the strata cells under their columns
        row.append(f"{sim.gain(c, 'schedule'):+.1%}" if "schedule" in res else "")
        if strata is not None:
            one = strata.replace(STRATIFIED, "avest", 1)
            if strata in res and one in res:
                ratio = res[strata].throughput / res[one].throughput - 1.0
                row += [f"{sim.gain(c, strata):+.1%}", f"{ratio:+.2%}"]
        rows.append(row)
    columns = [
        Column("C", width=4),
        Column("best fixed", "<", gap=2),
        Column("tok/s", width=9),
        Column("best avest", "<", gap=2),
        Column("vs best"),
        Column("oracle", gap=2),
        Column("schedule", gap=2),
    ]
    if strata is not None:
        columns += [Column("strata", gap=2), Column("strata/one set")]
    lines = [f"{sim.trace or 'trace'} under {p.name}: K={sim.k}", *format_columns(columns, rows)]
    if sim.skipped:
        lines.append(f"skipped C={sim.skipped}: the trace has fewer rows than one step")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from avest.commands.progress import Progress
    from avest.core.budget import DEFAULT_RULE
    from avest.offline.simulate.engine import make_policies, planned_steps, simulate
    from avest.offline.simulate.profiles import ProfileError, load_profile, shipped_profiles
    from avest.offline.simulate.report import format_table, write_plot
    from avest.offline.trace import TraceError, bundled_sample_path, read_trace

    def fail(message: object) -> int:
        print(f"avest simulate: {message}", file=sys.stderr)
        return 2

    paths = args.traces or [str(bundled_sample_path())]
    names = [n.strip() for spec in (args.costs or []) for n in spec.split(",") if n.strip()]
    try:
        traces = [(path, read_trace(path)) for path in paths]
        profiles = [load_profile(n) for n in (names or shipped_profiles())]
    except (TraceError, ProfileError, OSError) as exc:
        return fail(exc)
    baseline_rule = args.baseline_rule or DEFAULT_RULE
    options = {
        "min_steps": args.min_steps,
        "refit_interval": args.refit_interval,
        "update_rule": args.update_rule,
        "forgetting": args.forgetting,
        "prior": args.prior,
        "warmup_passes": args.warmup_passes,
        "min_per_request": args.min_per_request,
    }
    try:
        plans = []
        for path, trace in traces:
            lengths = (
                range(1, trace.k + 1)
                if args.draft_lengths == "all" or args.recommend
                else args.draft_lengths
            )
            select = args.select
            if args.recommend and select:
                select = [*select, f"avest/{DEFAULT_RULE}*"]
            stratified = trace.stratum is not None
            policies = make_policies(
                trace.k,
                trace.accept_rate_dist is not None,
                baseline_rule,
                lengths,
                select,
                strata=stratified,
            )
            if args.select:
                every = make_policies(
                    trace.k,
                    trace.accept_rate_dist is not None,
                    baseline_rule,
                    lengths,
                    strata=stratified,
                )
                unmatched = [
                    pat for pat in args.select if not any(fnmatchcase(q.name, pat) for q in every)
                ]
                if unmatched:
                    names = ", ".join(q.name for q in every if q.kind != "fixed")
                    return fail(f"--policy {unmatched[0]!r} matches no policy; they are {names}")
            plans.append((path, trace, policies))
        total = sum(
            planned_steps(t, args.concurrency, pol, args.warmup_passes, args.min_steps)
            for _, t, pol in plans
        ) * len(profiles)
        sims = []
        with Progress("simulate", total, stages=len(plans) * len(profiles)) as bar:
            for path, trace, policies in plans:
                for profile in profiles:
                    bar.stage(f"{path.rsplit('/', 1)[-1]} {profile.name}")
                    sims.append(
                        simulate(
                            trace,
                            profile,
                            args.concurrency,
                            name=path,
                            baseline_rule=baseline_rule,
                            policies=policies,
                            progress=bar.update,
                            **options,
                        )
                    )
    except ValueError as exc:
        return fail(exc)
    from avest.offline.simulate.recommend import format_recommendations, recommend

    recs = [recommend(s, DEFAULT_RULE) if args.recommend else [] for s in sims]
    if args.json:
        blocks = [s.as_json() for s in sims]
        if args.recommend:
            for block, rec in zip(blocks, recs, strict=True):
                block["recommendation"] = [r.as_json() for r in rec]
        print(dumps({"simulations": blocks}))
    elif args.table or len(sims) == 1 or sys.stdout.isatty():
        tables = [format_table(s) for s in sims]
        if args.recommend:
            tables = [
                f"{t}\n\n{format_recommendations(s, r)}"
                for t, s, r in zip(tables, sims, recs, strict=True)
            ]
        if len(sims) > 1:
            tables.append("summary\n" + "\n".join(format_summary(s, DEFAULT_RULE) for s in sims))
        print("\n\n".join(tables))
    else:
        # Not a terminal (a pipe, a log): the summary, not hundreds of table lines.
        blocks = [format_summary(s, DEFAULT_RULE) for s in sims]
        if args.recommend:
            blocks = [
                f"{b}\n\n{format_recommendations(s, r)}"
                for b, s, r in zip(blocks, sims, recs, strict=True)
            ]
        print("\n\n".join(blocks))
        print(
            f"\n{len(sims)} simulations; gains are throughput against the best fixed length "
            "(fixed-0: speculation off). Every policy's table: --table; all numbers: --json"
        )
    if args.plot:
        for sim in sims:
            if sim.results:
                print(f"wrote {write_plot(sim, args.plot)}", file=sys.stderr)
    return 0
