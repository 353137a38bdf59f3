"""``avest evaluate TRACE``: the feature table for a recorded trace."""

from __future__ import annotations

import argparse
import sys

from avest.commands.options import dumps, integer, number
from avest.commands.traces import add_trace_argument, load_trace


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "evaluate",
        help="replay a trace predict-then-learn and measure every method",
        description="Replay an avest-trace/1 file: each draft is scored by the coefficients in "
        "force when it was drafted, then learned. Prints AUC, log loss, ECE and mean predicted "
        "vs observed acceptance per method.",
    )
    add_trace_argument(p)
    p.add_argument(
        "--refit-interval",
        type=integer(1),
        default=100,
        metavar="N",
        help="refit every N steps (default 100, as vLLM)",
    )
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
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--plot", metavar="DIR", help="write a reliability diagram and per-position plot here"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from avest.commands.progress import Progress
    from avest.offline.evaluate import METHODS, ONLINE_METHODS, evaluate, format_table

    loaded = load_trace("evaluate", args.trace)
    if loaded is None:
        return 2
    path, trace = loaded

    # One bar over every method replayed step by step (on a terminal; else quiet).
    online = [m for m in (args.methods or METHODS) if m in ONLINE_METHODS]
    steps = int(np.count_nonzero(np.diff(trace.step))) + 1 if trace.rows else 0
    try:
        with Progress("evaluate", steps * len(online)) as bar:
            report = evaluate(
                trace,
                name=path,
                refit_interval=args.refit_interval,
                from_fraction=args.from_fraction,
                forgetting=args.forgetting,
                prior=args.prior,
                methods=args.methods,
                progress=bar.iterate,
            )
    except ValueError as exc:
        print(f"avest evaluate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(dumps(report.as_json()))
    else:
        print(format_table(report))
    if args.plot:
        from avest.offline.plots import write_plots

        for written in write_plots(report, args.plot):
            print(f"wrote {written}", file=sys.stderr)
    return 0
