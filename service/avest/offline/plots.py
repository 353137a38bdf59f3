"""Image files for ``avest evaluate --plot`` (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from avest.offline.evaluate import Report


def legend_outside(ax: Any, **kwargs: Any) -> Any:
    """The axes' legend to the right of its data area, never over it (save the figure
    with ``bbox_inches="tight"`` so that it stays in the image)."""
    return ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, **kwargs)


def write_plots(report: Report, directory: str | Path) -> list[Path]:
    """A reliability diagram and per-position predicted vs observed acceptance."""
    drawn = figures(report)
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    stem = Path(report.trace).stem or "trace"
    written = []
    for kind, fig in drawn:
        path = out / f"{stem}-{kind}.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written


def figures(report: Report) -> list[tuple[str, Any]]:
    """``(kind, figure)``: the reliability diagram, then acceptance by position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stem = Path(report.trace).stem or "trace"
    fig, ax = plt.subplots(figsize=(6, 6))
    ax.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--", label="perfect calibration")
    for name, m in report.methods.items():
        rel = m.calibration.reliability()
        keep = rel.count > 0
        ax.plot(
            rel.mean_predicted[keep],
            rel.observed[keep],
            marker="o",
            ms=3,
            label=f"{name} (ECE {m.summary.ece:.3f})",
        )
    ax.set(xlabel="predicted acceptance", ylabel="observed acceptance", xlim=(0, 1), ylim=(0, 1))
    ax.set_title(f"Reliability: {stem}")
    legend_outside(ax, fontsize=8)
    reliability = fig

    fig, ax = plt.subplots(figsize=(7, 4.5))
    first = next(iter(report.methods.values()))
    positions = np.arange(len(first.summary.by_position))
    ax.plot(
        positions,
        [p.observed for p in first.summary.by_position],
        color="black",
        lw=2,
        marker="s",
        label="observed",
    )
    for name, m in report.methods.items():
        ax.plot(
            positions,
            [p.mean_predicted for p in m.summary.by_position],
            marker="o",
            ms=3,
            lw=1,
            label=name,
        )
    ax.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1), xticks=positions)
    ax.set_title(f"Predicted vs observed acceptance by position: {stem}")
    legend_outside(ax, fontsize=8)
    return [("reliability", reliability), ("positions", fig)]
