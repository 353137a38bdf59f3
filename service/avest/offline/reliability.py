"""One pair's reliability diagram as an SVG document, drawn with matplotlib.

:func:`render` draws two panels side by side:

- left, the reliability diagram: for each of the ECE probability bins that
  holds drafts, a point at (mean predicted, observed acceptance), its area
  proportional to the bin's draft count, over the diagonal of perfect
  calibration, with the count histogram along the bottom;
- right, mean predicted against observed acceptance per draft position.

Text stays text (``svg.fonttype = none``). Each plotted point is a group that
carries ``class`` and ``data-*`` attributes (``class="bin"``, ``data-bin``,
``data-count``, ``data-predicted``, ``data-observed``; ``class="predicted"`` /
``class="observed"`` with ``data-position`` and ``data-value``), so tests and
scripts can read the plotted values back.
"""

from __future__ import annotations

import io
import math
import re
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from avest.core.metrics import PositionSummary, Reliability

_PRED = "#1f77b4"
_OBS = "#ff7f0e"
#: pyplot and rcParams are process-wide: one diagram is drawn at a time.
_DRAWING = threading.Lock()
#: Characters XML 1.0 cannot hold (model names are free text).
_XML_BAD = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _clean(s: str) -> str:
    return _XML_BAD.sub("\ufffd", s)


def _fmt(v: float, digits: int = 3) -> str:
    return f"{v:.{digits}f}" if math.isfinite(v) else "n/a"


def render(reliability: Reliability, positions: Sequence[PositionSummary], **labels: Any) -> str:
    """The SVG document (a ``str``) for one pair's calibration; ``labels``: the
    ``title``, ``subtitle`` and ``ece`` :func:`figure` takes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    attrs: dict[str, str] = {}
    with _DRAWING, plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": "avest"}):
        fig = figure(reliability, positions, attrs=attrs, **labels)
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None})
        plt.close(fig)
    svg = buf.getvalue()
    for gid, extra in attrs.items():
        svg = svg.replace(f'id="{gid}"', f'id="{gid}" {extra}', 1)
    return svg


def figure(
    reliability: Reliability,
    positions: Sequence[PositionSummary],
    *,
    title: str,
    subtitle: str = "",
    ece: float = math.nan,
    attrs: dict[str, str] | None = None,
) -> Any:
    """The matplotlib figure :func:`render` writes (``attrs`` collects the points'
    SVG attributes); the positions panel's legend sits under its axes, off the data."""
    import matplotlib.pyplot as plt

    attrs = {} if attrs is None else attrs
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.8, 5.2))
    fig.suptitle(_clean(title), x=0.02, ha="left", fontweight="bold")
    if subtitle:
        fig.text(0.02, 0.905, _clean(subtitle), fontsize=8, color="#555")
    _reliability_panel(left, reliability, ece, attrs)
    _positions_panel(right, positions, attrs)
    fig.subplots_adjust(top=0.82, bottom=0.22, left=0.07, right=0.98, wspace=0.25)
    return fig


def _reliability_panel(ax: Any, rel: Reliability, ece: float, attrs: dict[str, str]) -> None:
    ax.set_title(f"Reliability (all positions)   ECE {_fmt(ece)}", loc="left", fontsize=11)
    ax.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--")
    count = np.asarray(rel.count, dtype=np.float64)
    total = float(count.sum())
    if total > 0:
        peak = float(count.max())
        width = np.diff(rel.edges)
        ax.bar(rel.edges[:-1], 0.15 * count / peak, width=width, align="edge", color="0.85")
        for b in np.flatnonzero(count > 0):
            pred, obs = float(rel.mean_predicted[b]), float(rel.observed[b])
            size = 20 + 280 * float(count[b]) / peak
            (pt,) = ax.plot([pred], [obs], "o", ms=math.sqrt(size), color=_PRED, alpha=0.7)
            gid = f"avest-bin-{b}"
            pt.set_gid(gid)
            attrs[gid] = (
                f'class="bin" data-bin="{b}" data-count="{float(count[b]):.6g}" '
                f'data-predicted="{pred:.9g}" data-observed="{obs:.9g}"'
            )
    else:
        ax.text(0.5, 0.5, "no verified drafts yet", ha="center")
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="mean predicted", ylabel="observed acceptance")


def _positions_panel(ax: Any, positions: Sequence[PositionSummary], attrs: dict[str, str]) -> None:
    ax.set_title("Acceptance per draft position", loc="left", fontsize=11)
    shown = any(p.count > 0 for p in positions)
    for kind, color, marker in (("predicted", _PRED, "o"), ("observed", _OBS, "s")):
        values = [p.mean_predicted if kind == "predicted" else p.observed for p in positions]
        pts = [(i, float(v)) for i, v in enumerate(values) if math.isfinite(float(v))]
        xs, ys = [i for i, _ in pts], [v for _, v in pts]
        if xs:
            ax.plot(
                xs, ys, color=color, lw=1, label=f"mean {kind}" if kind == "predicted" else kind
            )
        for i, v in zip(xs, ys, strict=True):
            (pt,) = ax.plot([i], [v], marker, color=color)
            gid = f"avest-{kind}-{i}"
            pt.set_gid(gid)
            attrs[gid] = f'class="{kind}" data-position="{i}" data-value="{float(v):.9g}"'
    if shown:
        # Under the axes (below the x label), never over the plotted points.
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
        ax.set_xticks(range(len(positions)))
    else:
        ax.text(0.5, 0.5, "no verified drafts yet", ha="center")
    ax.set(ylim=(0, 1), xlabel="draft position", ylabel="acceptance rate")
