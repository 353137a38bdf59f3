"""The trace a subcommand reads (its positional argument, and reading it), and
``avest traces merge``: mixed traces built from recorded ones.

Without the argument the bundled sample is read, so every trace command runs on
a fresh install.

``avest traces merge OUT IN1 IN2 ... [--label NAME ...] [--k K] [--longest]``
merges recorded traces step by step into one stream of mixed batches
(:func:`avest.offline.strata.merge_traces`): step ``i`` holds step ``i`` of every
trace, in the order given, until the shortest ends (``--longest``: the longest);
every trace is cut to the smallest K (or ``--k``), and each row is in its trace's
stratum (its ``stratum`` array, else its temperature's) or in the ``--label``
given for its trace.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from avest.commands.options import integer

if TYPE_CHECKING:
    from avest.offline.trace import Trace

#: ``--label`` value that keeps a trace's own strata.
OWN = "-"


def add_trace_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", nargs="?", help="trace file (.npz); default: the bundled sample")


def add_refit_interval_argument(p: argparse.ArgumentParser, default: int = 100) -> None:
    """``--refit-interval`` of the commands that replay a trace through the estimator
    (100 steps by default, as vLLM's)."""
    about = f"the estimator refits every N replayed steps (default {default})"
    p.add_argument("--refit-interval", type=integer(1), default=default, metavar="N", help=about)


def load_trace(command: str, path: str | None) -> tuple[str, Trace] | None:
    """The path read and its trace, or ``None`` once stderr says why ``avest
    <command>`` cannot read it (the command then exits 2)."""
    from avest.offline.trace import TraceError, bundled_sample_path, read_trace

    path = path or str(bundled_sample_path())
    try:
        return path, read_trace(path)
    except FileNotFoundError:
        print(
            f"avest {command}: {path}: no such file; give an avest trace (.npz), or no "
            "argument for the bundled sample",
            file=sys.stderr,
        )
    except (TraceError, OSError) as exc:
        print(f"avest {command}: {exc}", file=sys.stderr)
    return None


# -- avest traces -----------------------------------------------------------------


def _label(text: str) -> str:
    """An argparse type: a stratum name (:func:`avest_wire.strata.check_stratum`), or
    ``-`` for the trace's own."""
    from avest_wire.errors import InvalidInput
    from avest_wire.strata import check_stratum

    if text != OWN:
        try:
            check_stratum(text)
        except InvalidInput as exc:
            raise argparse.ArgumentTypeError(
                f"must be a stratum name or '{OWN}' (a trace's own): {exc.problem}"
            ) from None
    return text


_label.__name__ = "stratum name"  # what argparse names in its errors


def register(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    merge = actions.add_parser(
        "merge",
        help="merge traces step by step into mixed batches, each row in its trace's stratum",
        description="Merge avest-trace/1 files step by step into one trace of mixed batches: "
        "step i holds step i of every trace, in the order given, until the shortest ends "
        "(--longest: the longest). Requests are renumbered apart, every trace is cut to the "
        "smallest K (or --k: num_verified capped at K, num_accepted at it, what a K-token "
        "drafter would have earned), and each row is in its trace's stratum (its 'stratum' "
        "array, else its temperature's: greedy, t0.5-1, ...) or in the --label given for its "
        "trace. Evaluate the result with `avest evaluate OUT --strata`.",
    )
    merge.add_argument("out", metavar="OUT", help="the merged trace to write (.npz)")
    merge.add_argument(
        "traces", nargs="+", metavar="TRACE", help="the traces to merge (.npz), in batch order"
    )
    merge.add_argument(
        "--label",
        action="append",
        dest="labels",
        type=_label,
        metavar="NAME",
        help="the stratum of every row of a trace: once per trace, in their order; "
        f"'{OWN}' keeps that trace's own",
    )
    merge.add_argument(
        "--k",
        type=integer(1),
        default=None,
        metavar="K",
        help="cut every trace to its first K positions (default: the smallest K of the traces)",
    )
    merge.add_argument(
        "--longest",
        action="store_true",
        help="run until the longest trace ends (the traces that ended leave the batches)",
    )
    merge.set_defaults(func=run_merge)


def run_merge(args: argparse.Namespace) -> int:
    from collections import Counter

    from avest.offline.strata import merge_traces
    from avest.offline.trace import TraceError, write_trace

    def fail(message: str) -> int:
        print(f"avest traces merge: {message}", file=sys.stderr)
        return 2

    if not args.out.endswith(".npz"):
        return fail(f"OUT {args.out!r}: give a file name ending in .npz")
    labels = args.labels
    if labels is not None and len(labels) != len(args.traces):
        return fail(
            f"--label: given {len(labels)} time(s) for {len(args.traces)} trace(s); give one "
            f"per trace, in their order ('{OWN}' keeps a trace's own strata)"
        )
    sources = []
    for path in args.traces:
        loaded = load_trace("traces merge", path)
        if loaded is None:
            return 2
        sources.append(loaded[1])
    try:
        merged = merge_traces(
            sources,
            labels=None if labels is None else [None if n == OWN else n for n in labels],
            names=[p.rsplit("/", 1)[-1] for p in args.traces],
            k=args.k,
            longest=args.longest,
        )
    except ValueError as exc:
        return fail(f"--k: {exc}" if args.k is not None and "k must" in str(exc) else str(exc))
    try:
        write_trace(args.out, merged)
    except (TraceError, OSError) as exc:
        print(f"avest traces merge: cannot write {args.out}: {exc}", file=sys.stderr)
        return 1
    counts = Counter(str(s) for s in merged.strata())
    strata = ", ".join(f"{name} {n}" for name, n in sorted(counts.items()))
    print(
        f"merged {len(sources)} trace(s) into {args.out}: {merged.num_steps} steps, "
        f"{merged.rows} rows (by stratum: {strata}), K={merged.k}, "
        f"{merged.labelled_count()} labelled drafts"
    )
    return 0
