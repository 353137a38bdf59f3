"""Text tables and Pareto plots for ``avest simulate``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from avest.offline.simulate.results import Simulation
from avest.offline.table import Column, format_columns

_COLUMNS = (
    Column("policy", "<", width=30),
    Column("tok/s", width=9),
    *(Column(t) for t in ("tok/s/req", "acc.len", "verif/req")),
    Column("vs best", width=8),
    *(Column(t, width=6) for t in ("vs oracle", "share", "refits")),
)


def _pct(v: float | None) -> str:
    return "-" if v is None or v != v else f"{100.0 * v:+.1f}%"


def format_table(sim: Simulation) -> str:
    """One block per concurrency: every policy's throughput, interactivity, gains."""
    p = sim.profile
    start = "cold start" if not sim.warmup_passes else f"after {sim.warmup_passes} warm-up pass(es)"
    lines = [
        f"{sim.trace or 'trace'} under {p.name}"
        + (f" ({p.regime})" if p.regime else "")
        + f": K={sim.k}, draft cost per {p.draft_per}, estimator {sim.update_rule} refit every "
        f"{sim.refit_interval} steps, {start}; baselines under {sim.baseline_rule}"
        + (f"; at least {sim.min_per_request} verified per request" if sim.min_per_request else ""),
    ]
    lossy = False
    for c, totals in sim.results.items():
        best = sim.best_fixed(c)
        steps = next(iter(totals.values())).steps
        lines.append("")
        cycled = sim.cycles.get(c, 1.0)
        lines.append(
            f"C={c}: {steps} steps"
            + (f" (trace cycled {cycled:g}x to reach {sim.min_steps})" if cycled > 1.0 else "")
            + f"; best fixed length {best} at {totals[best].throughput:,.0f} tok/s"
        )
        rows = []
        for policy in sim.policies:
            t = totals.get(policy.name)
            if t is None:
                continue
            lossy |= not policy.lossless
            label = policy.name + ("" if policy.lossless else " *")
            vs_best = "" if policy.name == best else _pct(sim.gain(c, policy.name))
            vs_oracle = _pct(sim.vs_oracle(c, policy.name)) if policy.adaptive else ""
            share = sim.oracle_share(c, policy.name)
            shown = "" if share is None else f"{100.0 * share:.0f}%"
            refits = "" if t.refits is None else str(t.refits)
            rows.append(
                [
                    label,
                    f"{t.throughput:,.0f}",
                    f"{t.per_request:.1f}",
                    f"{t.acceptance_length:.3f}",
                    f"{t.verified_per_request:.3f}",
                    vs_best,
                    vs_oracle,
                    shown,
                    refits,
                ]
            )
        lines += format_columns(_COLUMNS, rows)
    if sim.skipped:
        lines.append(f"\nskipped C={sim.skipped}: the trace has fewer rows than one step")
    lines.append(
        "\nacc.len: tokens per request per step (1 + accepted drafts); verif/req: drafts "
        "verified per request per step; vs best: throughput against the best fixed length "
        "(fixed-0: speculation off); share: (policy - best fixed) / (oracle - best fixed)."
    )
    if lossy:
        lines.append("* not lossless: can bias the output distribution; for comparison only")
    return "\n".join(line.rstrip() for line in lines)


def _pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points not beaten on both axes, by increasing interactivity."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(points, key=lambda q: (-q[0], -q[1])):
        if not front or y > front[-1][1]:
            front.append((x, y))
    return sorted(front)


def write_plot(sim: Simulation, directory: str | Path) -> Path:
    """Throughput vs interactivity: fixed lengths swept over concurrency, AV as points."""
    fig = pareto_figure(sim)
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    stem = Path(sim.trace).stem or "trace"
    path = out / f"{stem}-{sim.profile.name}-pareto.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def pareto_figure(sim: Simulation) -> Any:
    """The figure :func:`write_plot` saves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from avest.offline.plots import legend_outside

    stem = Path(sim.trace).stem or "trace"
    cs = list(sim.results)
    fig, ax = plt.subplots(figsize=(8, 5.5))
    fixed = [p for p in sim.policies if not p.adaptive]
    shades = plt.get_cmap("Greys")(np.linspace(0.35, 0.85, len(fixed)))
    every: list[tuple[float, float]] = []
    for policy, color in zip(fixed, shades, strict=True):
        xs = [sim.results[c][policy.name].per_request for c in cs]
        ys = [sim.results[c][policy.name].throughput for c in cs]
        every += list(zip(xs, ys, strict=True))
        ax.plot(xs, ys, color=color, lw=1, marker=".", ms=4, label=policy.name)
    front = _pareto(every)
    ax.plot(*zip(*front, strict=True), color="black", lw=2, ls="--", label="best fixed (frontier)")
    for c in cs:
        t = sim.results[c][sim.best_fixed(c)]
        ax.annotate(
            f"C={c}",
            (t.per_request, t.throughput),
            fontsize=7,
            textcoords="offset points",
            xytext=(4, -10),
        )
    shown = [
        p
        for p in sim.policies
        if p.adaptive and p.rule != "full" and (p.drafts == sim.k or p.kind == "avest")
    ][:12]
    markers = "osD^v<>PXh*p"
    for policy, marker in zip(shown, markers, strict=False):
        xs = [sim.results[c][policy.name].per_request for c in cs if policy.name in sim.results[c]]
        ys = [sim.results[c][policy.name].throughput for c in cs if policy.name in sim.results[c]]
        label = policy.name + ("" if policy.lossless else " (lossy)")
        ax.plot(xs, ys, ls="none", marker=marker, ms=6, mfc="none", label=label)
    ax.set(
        xlabel="interactivity: output tokens/s per request", ylabel="throughput: output tokens/s"
    )
    ax.set_yscale("log")
    ax.set_title(f"{stem} under {sim.profile.name}", fontsize=10)
    ax.grid(alpha=0.3)
    legend_outside(ax, fontsize=7)
    return fig
