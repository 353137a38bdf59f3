"""The fleet table: calibration and goodput of each estimator, per fleet shape."""

from __future__ import annotations

from collections.abc import Sequence

from avest.offline.fleet import FleetReport
from avest.offline.simulate.fleet import ORACLE, FleetGoodput

Row = tuple[FleetReport, FleetGoodput | None]


def _f(v: float, width: int = 7, digits: int = 4) -> str:
    return f"{v:>{width}.{digits}f}" if v == v else f"{'-':>{width}}"


def format_headline(rows: Sequence[Row]) -> str:
    """One block per trace: a line per (W, S, estimator), then goodput baselines."""
    lines: list[str] = []
    trace = None
    head = (
        f"{'W':>3} {'S':>4}  {'estimator':<19} {'AUC':>7} {'logloss':>8} {'ECE':>7}  "
        f"{'early ECE':>9} {'logloss':>8}  {'tok/s':>9} {'vs best':>8}"
    )
    for report, goodput in rows:
        if report.trace != trace:
            trace = report.trace
            if lines:
                lines.append("")
            f = report.fleet
            lines.append(
                f"{trace or 'trace'} (K={report.k}): refit every {f.refit_interval} steps "
                f"(in-worker: its own, pooled: all workers'), pooled rule {f.pooled_rule}; "
                f"early = each worker's first {f.early} steps after launch and every restart"
            )
            if goodput is not None:
                lines.append(
                    f"goodput: {goodput.profile.name} (draft per {goodput.profile.draft_per}), "
                    f"C={goodput.concurrency} per worker, budget rule {goodput.rule}, each worker's "
                    "estimator driving its own budgets; vs best: against the best fixed length "
                    "(speculation off included)"
                )
            lines += [head, "-" * len(head)]
        f = report.fleet
        for name, (whole, early) in report.summaries().items():
            tput = gain = ""
            if goodput is not None and name in goodput.results:
                tput = f"{goodput.results[name].throughput:>9,.0f}"
                gain = f"{100 * goodput.gain(name):>+7.1f}%"
            lines.append(
                f"{f.workers:>3} {f.restart_every:>4}  {name:<19} {_f(whole.auc)} "
                f"{_f(whole.logloss, 8)} {_f(whole.ece)}  {_f(early.ece, 9)} "
                f"{_f(early.logloss, 8)}  {tput:>9} {gain:>8}"
            )
        if goodput is not None:
            best = goodput.best_fixed()
            extra = [(f"best fixed: {best}", best)]
            if ORACLE in goodput.results:
                extra.append((ORACLE, ORACLE))
            for label, key in extra:
                g = goodput.results[key]
                lines.append(
                    f"{'':>3} {'':>4}  {label:<19} {'':>7} {'':>8} {'':>7}  {'':>9} {'':>8}  "
                    f"{g.throughput:>9,.0f} {100 * goodput.gain(key):>+7.1f}%"
                )
            lines.append(
                f"{'':>10}({goodput.steps_per_worker} steps per worker, "
                f"{report.worker_steps} worker steps scored, {report.restarts} restarts; "
                f"goodput trace cycled {goodput.cycles:g}x)"
            )
    return "\n".join(line.rstrip() for line in lines)
