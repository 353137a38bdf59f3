"""``avest fleet TRACE``: what a fleet of W workers gains from a pooled estimator.

Replay a trace as a fleet: request r on worker r mod W, each worker restarted every S of
its own steps. Scores predict-then-learn every labelled draft with vLLM's in-worker
estimator (cold at launch and every restart), avest's pooled estimator (warm, with and
without the calibration layer) and the pooled estimator reset with the workers; AUC, log
loss and ECE overall and over each worker's first steps after every (re)start; then the
goodput of each driving every worker's budgets under a cost profile.

A subcommand of its own rather than an ``evaluate`` option: it replays each
trace once per fleet shape (workers x restart interval), its rows are
estimators of a fleet rather than methods, and it adds the goodput of each
under a cost profile; ``evaluate``'s table and JSON stay as they are.
"""

from __future__ import annotations

import argparse
import sys

from avest.commands.options import dumps, integer
from avest.commands.simulate import _ints
from avest.commands.traces import add_refit_interval_argument

#: The profile and per-worker concurrency of the goodput columns by default.
DEFAULT_PROFILE = "a100-llama8b-parallel"
DEFAULT_CONCURRENCY = 32


def register(p: argparse.ArgumentParser) -> None:
    from avest.core.rule_factory import DEFAULT_RULE, RULE_NAMES

    p.add_argument(
        "traces", nargs="*", metavar="TRACE", help="trace files (.npz); default: the bundled sample"
    )
    p.add_argument(
        "--workers", type=_ints(1), default=[1, 4, 8], metavar="LIST", help="W (default 1,4,8)"
    )
    p.add_argument(
        "--restart-every",
        type=_ints(0),
        default=[0, 200],
        metavar="LIST",
        help="restart each worker every S of its own steps; 0 = never (default 0,200)",
    )
    add_refit_interval_argument(p)
    p.add_argument(
        "--rule",
        choices=RULE_NAMES,
        default=DEFAULT_RULE,
        help=f"the pooled estimator's update rule (default {DEFAULT_RULE}, the core's)",
    )
    p.add_argument(
        "--early",
        type=integer(1),
        default=100,
        metavar="N",
        help="steps after each (re)start scored",
    )
    p.add_argument(
        "--no-calibration", action="store_true", help="leave out the calibration-layer row"
    )
    p.add_argument(
        "--costs",
        default=DEFAULT_PROFILE,
        metavar="PROFILE",
        help=f"cost profile of the goodput columns (default {DEFAULT_PROFILE})",
    )
    p.add_argument(
        "--concurrency",
        type=integer(1),
        default=DEFAULT_CONCURRENCY,
        metavar="C",
        help=f"requests per worker step in the goodput simulation (default {DEFAULT_CONCURRENCY})",
    )
    p.add_argument(
        "--steps",
        type=integer(1),
        default=None,
        metavar="N",
        help="goodput: steps per worker (default: the worker's whole share, at least 2000 "
        "fleet steps and 4 restarts, cycling the trace)",
    )
    p.add_argument("--no-goodput", action="store_true", help="calibration only (fast)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from avest.commands.progress import Progress
    from avest.offline.fleet import Fleet, count_worker_steps, evaluate_fleet
    from avest.offline.fleet_report import format_headline
    from avest.offline.simulate.fleet import planned_steps, simulate_fleet
    from avest.offline.simulate.profiles import ProfileError, load_profile
    from avest.offline.trace import TraceError, bundled_sample_path, read_trace

    def fail(message: object) -> int:
        print(f"avest fleet: {message}", file=sys.stderr)
        return 2

    paths = args.traces or [str(bundled_sample_path())]
    try:
        traces = [(path, read_trace(path)) for path in paths]
        profile = None if args.no_goodput else load_profile(args.costs)
        fleets = [
            Fleet(w, s, args.refit_interval, args.rule, args.early, not args.no_calibration)
            for w in args.workers
            for s in args.restart_every
        ]
    except (TraceError, ProfileError, OSError, ValueError) as exc:
        return fail(exc)
    rows = []
    try:
        total = sum(
            count_worker_steps(trace, fleet.workers)
            + (0 if profile is None else planned_steps(trace, fleet, args.concurrency, args.steps))
            for _, trace in traces
            for fleet in fleets
        )
        with Progress("fleet", total, stages=len(traces) * len(fleets)) as bar:
            for path, trace in traces:
                for fleet in fleets:
                    bar.stage(f"{path.rsplit('/', 1)[-1]} {fleet.label()}")
                    report = evaluate_fleet(trace, fleet, path, progress=bar.update)
                    goodput = (
                        None
                        if profile is None
                        else simulate_fleet(
                            trace,
                            fleet,
                            profile,
                            args.concurrency,
                            name=path,
                            steps=args.steps,
                            progress=bar.update,
                        )
                    )
                    rows.append((report, goodput))
    except ValueError as exc:
        return fail(exc)
    if args.json:
        out = [{**r.as_json(), "goodput": None if g is None else g.as_json()} for r, g in rows]
        print(dumps({"fleets": out}))
    else:
        print(format_headline(rows))
    return 0
