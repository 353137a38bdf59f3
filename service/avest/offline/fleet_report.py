"""The fleet table: calibration and goodput of each estimator, per fleet shape."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from avest.offline.fleet import POOLED, FleetReport
from avest.offline.simulate.fleet import ORACLE, FleetGoodput
from avest.offline.strata import MEASURE_COLUMNS, OVERALL, cells
from avest.offline.table import Column, format_columns

Row = tuple[FleetReport, FleetGoodput | None]


def _f(v: float, digits: int = 4) -> str:
    return f"{v:.{digits}f}" if v == v else "-"


_COLUMNS = (
    Column("W", width=3),
    Column("S", width=4),
    Column("estimator", "<", gap=2, width=19),
    Column("AUC", width=7),
    Column("logloss", width=8),
    Column("ECE", width=7),
    Column("early ECE", gap=2),
    Column("logloss", width=8),
    Column("tok/s", gap=2, width=9),
    Column("vs best", width=8),
)


def format_headline(rows: Sequence[Row]) -> str:
    """One block per trace: a line per (W, S, estimator), then goodput baselines."""
    blocks: list[list[str]] = []
    table: list[list[str] | str] = []
    trace = None
    for report, goodput in rows:
        if report.trace != trace or not blocks:
            trace = report.trace
            if blocks:
                blocks[-1] += format_columns(_COLUMNS, table)
            table = []
            f = report.fleet
            head = [
                f"{trace or 'trace'} (K={report.k}): refit every {f.refit_interval} steps "
                f"(in-worker: its own, pooled: all workers'), pooled rule {f.pooled_rule}; "
                f"early = each worker's first {f.early} steps after launch and every restart"
            ]
            if goodput is not None:
                head.append(
                    f"goodput: {goodput.profile.name} (draft per {goodput.profile.draft_per}), "
                    f"C={goodput.concurrency} per worker, budget rule {goodput.rule}, each worker's "
                    "estimator driving its own budgets; vs best: against the best fixed length "
                    "(speculation off included)"
                )
            blocks.append(head)
        f = report.fleet
        for name, (whole, early) in report.summaries().items():
            tput = gain = ""
            if goodput is not None and name in goodput.results:
                tput = f"{goodput.results[name].throughput:,.0f}"
                gain = f"{100 * goodput.gain(name):+.1f}%"
            table.append(
                [
                    str(f.workers),
                    str(f.restart_every),
                    name,
                    _f(whole.auc),
                    _f(whole.logloss),
                    _f(whole.ece),
                    _f(early.ece),
                    _f(early.logloss),
                    tput,
                    gain,
                ]
            )
        if goodput is not None:
            best = goodput.best_fixed()
            extra = [(f"best fixed: {best}", best)]
            if ORACLE in goodput.results:
                extra.append((ORACLE, ORACLE))
            for label, key in extra:
                g = goodput.results[key]
                table.append(
                    ["", "", label, *[""] * 5]
                    + [f"{g.throughput:,.0f}", f"{100 * goodput.gain(key):+.1f}%"]
                )
            table.append(
                f"{'':>10}({goodput.steps_per_worker} steps per worker, "
                f"{report.worker_steps} worker steps scored, {report.restarts} restarts; "
                f"goodput trace cycled {goodput.cycles:g}x)"
            )
    if blocks:
        blocks[-1] += format_columns(_COLUMNS, table)
    strata = format_strata_table(report for report, _ in rows)
    return "\n\n".join(["\n".join(line.rstrip() for line in b) for b in blocks] + strata)


_STRATA_COLUMNS = (
    Column("W", width=3),
    Column("S", width=4),
    Column("stratum", "<", gap=2),
    Column("estimator", "<"),
    *MEASURE_COLUMNS,
    Column("ECE/pooled"),
)


def format_strata_table(reports: Iterable[FleetReport]) -> list[str]:
    """Per trace with strata: each fleet shape's estimators per stratum and overall
    (exact measures; ECE/pooled: against the pooled estimator's one set)."""
    out: list[str] = []
    by_trace: dict[str, list[FleetReport]] = {}
    for report in reports:
        if report.by_stratum:
            by_trace.setdefault(report.trace, []).append(report)
    for trace, shapes in by_trace.items():
        table: list[list[str]] = []
        for report in shapes:
            f = report.fleet
            for stratum in [*report.strata, OVERALL]:
                base = report.by_stratum.get(POOLED, {}).get(stratum)
                for i, (name, by) in enumerate(report.by_stratum.items()):
                    lead = [str(f.workers), str(f.restart_every), stratum] if i == 0 else [""] * 3
                    table.append([*lead, name, *cells(by[stratum], base)])
        head = (
            f"{trace or 'trace'} per stratum ({', '.join(shapes[0].strata)}) and overall "
            f"{OVERALL}: each stratum measured on its own rows"
        )
        out.append("\n".join([head, *format_columns(_STRATA_COLUMNS, table)]))
    return out
