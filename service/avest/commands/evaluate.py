"""``avest evaluate TRACE``: the feature table for a recorded trace.

Replay an avest-trace/1 file: each draft is scored by the coefficients in force when it
was drafted, then learned. Prints AUC, log loss, ECE and mean predicted vs observed
acceptance per method.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from avest.commands.options import dumps, number
from avest.commands.traces import add_refit_interval_argument, add_trace_argument, load_trace

if TYPE_CHECKING:
    from avest.commands.progress import Progress


def register(p: argparse.ArgumentParser) -> None:
    add_trace_argument(p)
    add_refit_interval_argument(p)
    p.add_argument(
        "--from",
        dest="from_fraction",
        type=number(0, 1, high_open=True),
        default=0.0,
        metavar="FRACTION",
        help="score only steps from this fraction of the trace on (e.g. 0.5: steady state)",
    )
    p.add_argument(
        "--forgetting",
        type=number(0, 1, low_open=True),
        default=0.95,
        help="recursive rule: forgetting per round, in (0, 1]",
    )
    p.add_argument(
        "--prior",
        type=number(0, low_open=True),
        default=1.0,
        help="recursive rule: prior precision",
    )
    p.add_argument(
        "--method",
        action="append",
        dest="methods",
        metavar="NAME",
        help="only this method (repeatable)",
    )
    p.add_argument(
        "--strata",
        action="store_true",
        help="per stratum (the trace's 'stratum' array; else one, its temperature's) and "
        "overall: one coefficient set (vllm, one-set) against strata; --method picks among "
        "vllm, one-set, strata",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--plot", metavar="DIR", help="write a reliability diagram and per-position plot here"
    )
    p.set_defaults(func=run)


def strata_methods(args: argparse.Namespace) -> list[str] | None:
    """``--strata``'s methods (``--method`` picks among them), or ``None`` once stderr
    says why not (the command then exits 2)."""
    from avest.offline.strata import METHODS

    if args.plot:
        print("avest evaluate: --plot does not apply with --strata", file=sys.stderr)
        return None
    methods = list(dict.fromkeys(args.methods or METHODS))
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        print(
            f"avest evaluate: --method {unknown[0]}: not a method of --strata; choose from "
            f"{', '.join(METHODS)}",
            file=sys.stderr,
        )
        return None
    return methods


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from avest.commands.progress import Progress
    from avest.offline.evaluate import METHODS, ONLINE_METHODS, evaluate, format_table
    from avest.offline.strata import evaluate_strata, format_strata

    loaded = load_trace("evaluate", args.trace)
    if loaded is None:
        return 2
    path, trace = loaded
    common = {
        "name": path,
        "refit_interval": args.refit_interval,
        "from_fraction": args.from_fraction,
    }
    replay: Callable[[Progress], Any]
    show: Callable[[Any], str]
    if args.strata:  # per stratum: evaluate_strata's report
        methods = strata_methods(args)
        if methods is None:
            return 2
        replays, show = len(methods), format_strata

        def replay(bar: Progress) -> Any:
            return evaluate_strata(trace, methods=methods, progress=bar.update, **common)
    else:
        replays = len([m for m in (args.methods or METHODS) if m in ONLINE_METHODS])
        show = format_table

        def replay(bar: Progress) -> Any:
            return evaluate(
                trace,
                forgetting=args.forgetting,
                prior=args.prior,
                methods=args.methods,
                progress=bar.iterate,
                **common,
            )

    # One bar over every method replayed step by step (on a terminal; else quiet).
    steps = int(np.count_nonzero(np.diff(trace.step))) + 1 if trace.rows else 0
    try:
        with Progress("evaluate", steps * replays) as bar:
            report = replay(bar)
    except ValueError as exc:
        print(f"avest evaluate: {exc}", file=sys.stderr)
        return 2
    print(dumps(report.as_json()) if args.json else show(report))
    if args.plot:
        from avest.offline.plots import write_plots

        for written in write_plots(report, args.plot):
            print(f"wrote {written}", file=sys.stderr)
    return 0
