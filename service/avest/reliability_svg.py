"""A hand-written SVG reliability diagram (no plotting library).

:func:`render` draws two panels side by side:

- left, the reliability diagram: for each of the ECE probability bins that
  holds drafts, a point at (mean predicted, observed acceptance), its area
  proportional to the bin's draft count, over the diagonal of perfect
  calibration, with the count histogram along the bottom;
- right, mean predicted against observed acceptance per draft position.

The output is a standalone, well-formed XML document. Points carry
``class`` and ``data-*`` attributes (``class="bin"``, ``data-bin``,
``data-count``, ``data-predicted``, ``data-observed``; ``class="predicted"``
/ ``class="observed"`` with ``data-position``) and a ``<title>`` tooltip, so
tests and scripts can read the plotted values back.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from xml.sax.saxutils import escape, quoteattr

from avest.core.metrics import PositionSummary, Reliability

WIDTH = 980
HEIGHT = 470
#: Plot areas: (left, top, width, height).
_LEFT = (70, 90, 330, 300)
_RIGHT = (540, 90, 400, 300)
_HIST_H = 50  # height of the count histogram strip inside the left plot
_PRED = "#1f77b4"
_OBS = "#ff7f0e"
_GRID = "#e6e6e6"
_FONT = "font-family:Helvetica,Arial,sans-serif"


_XML_BAD = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _clean(s: str) -> str:
    """``s`` without characters XML 1.0 cannot hold (model names are free text)."""
    return _XML_BAD.sub("\ufffd", s)


def _finite(v: float) -> bool:
    return v is not None and math.isfinite(v)


def _fmt(v: float, digits: int = 3) -> str:
    return f"{v:.{digits}f}" if _finite(v) else "n/a"


def _n(v: float) -> str:
    """A coordinate: short, no exponent."""
    return f"{v:.2f}".rstrip("0").rstrip(".")


class _Doc:
    def __init__(self) -> None:
        self.parts: list[str] = []

    def add(self, s: str) -> None:
        self.parts.append(s)

    def text(
        self,
        x: float,
        y: float,
        s: str,
        *,
        size: int = 12,
        anchor: str = "start",
        weight: str = "normal",
        fill: str = "#222",
        cls: str = "",
        rotate: float | None = None,
    ) -> None:
        extra = f' class="{cls}"' if cls else ""
        if rotate is not None:
            extra += f' transform="rotate({_n(rotate)} {_n(x)} {_n(y)})"'
        self.add(
            f'<text x="{_n(x)}" y="{_n(y)}" font-size="{size}" text-anchor="{anchor}" '
            f'font-weight="{weight}" fill="{fill}"{extra}>{escape(_clean(s))}</text>'
        )

    def line(
        self,
        x1: float,
        y1: float,
        x2: float,
        y2: float,
        stroke: str = "#444",
        width: float = 1.0,
        dash: str = "",
        cls: str = "",
    ) -> None:
        d = f' stroke-dasharray="{dash}"' if dash else ""
        c = f' class="{cls}"' if cls else ""
        self.add(
            f'<line x1="{_n(x1)}" y1="{_n(y1)}" x2="{_n(x2)}" y2="{_n(y2)}" '
            f'stroke="{stroke}" stroke-width="{_n(width)}"{d}{c}/>'
        )


def _axes(
    doc: _Doc,
    area: tuple[int, int, int, int],
    xticks: Sequence[tuple[float, str]],
    xlabel: str,
    ylabel: str,
) -> None:
    """Frame, y grid at 0..1 by 0.2, the given x ticks, axis labels."""
    x0, y0, w, h = area
    for i in range(6):
        v = i / 5
        y = y0 + h - v * h
        doc.line(x0, y, x0 + w, y, stroke=_GRID)
        doc.text(x0 - 6, y + 4, f"{v:.1f}", size=11, anchor="end")
    for x, label in xticks:
        doc.line(x, y0 + h, x, y0 + h + 4)
        doc.text(x, y0 + h + 17, label, size=11, anchor="middle")
    doc.add(
        f'<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#444" '
        'stroke-width="1"/>'
    )
    doc.text(x0 + w / 2, y0 + h + 36, xlabel, size=12, anchor="middle")
    doc.text(x0 - 42, y0 + h / 2, ylabel, size=12, anchor="middle", rotate=-90)


def _reliability_panel(doc: _Doc, rel: Reliability, ece: float) -> int:
    x0, y0, w, h = _LEFT

    def px(v: float) -> float:
        return x0 + min(max(v, 0.0), 1.0) * w

    def py(v: float) -> float:
        return y0 + h - min(max(v, 0.0), 1.0) * h

    doc.text(x0, y0 - 14, f"Reliability (all positions)   ECE {_fmt(ece)}", size=14, weight="bold")
    edges = [float(e) for e in rel.edges]
    for e in edges[1:-1]:
        doc.line(px(e), y0, px(e), y0 + h, stroke="#f3f3f3")
    _axes(
        doc,
        _LEFT,
        [(px(i / 5), f"{i / 5:.1f}") for i in range(6)],
        "mean predicted acceptance",
        "observed acceptance",
    )
    # Count histogram along the bottom of the plot.
    counts = [float(c) for c in rel.count]
    top = max(counts) if counts else 0.0
    doc.add('<g class="histogram">')
    for i, c in enumerate(counts):
        if c <= 0 or top <= 0:
            continue
        bh = _HIST_H * c / top
        doc.add(
            f'<rect class="count" data-bin="{i}" data-count="{c:.6g}" '
            f'x="{_n(px(edges[i]) + 1)}" y="{_n(y0 + h - bh)}" '
            f'width="{_n(max(px(edges[i + 1]) - px(edges[i]) - 2, 1))}" height="{_n(bh)}" '
            f'fill="#cfcfcf"><title>{escape(f"bin {i}: {c:.6g} drafts")}</title></rect>'
        )
    doc.add("</g>")
    doc.line(px(0), py(0), px(1), py(1), stroke="#888", dash="4 3", cls="diagonal")
    points = [
        (i, float(p), float(o), counts[i])
        for i, (p, o) in enumerate(zip(rel.mean_predicted, rel.observed, strict=True))
        if counts[i] > 0 and _finite(float(p)) and _finite(float(o))
    ]
    if len(points) > 1:
        path = " ".join(f"{_n(px(p))},{_n(py(o))}" for _, p, o, _ in points)
        doc.add(f'<polyline class="curve" points="{path}" fill="none" stroke="{_PRED}"/>')
    doc.add('<g class="bins">')
    for i, p, o, c in points:
        r = 3.0 + 7.0 * math.sqrt(c / top)
        tip = (
            f"bin {i} [{edges[i]:.3f}, {edges[i + 1]:.3f}): {c:.6g} drafts, "
            f"predicted {p:.4f}, observed {o:.4f}"
        )
        doc.add(
            f'<circle class="bin" data-bin="{i}" data-count="{c:.6g}" '
            f'data-predicted="{p:.6f}" data-observed="{o:.6f}" '
            f'cx="{_n(px(p))}" cy="{_n(py(o))}" r="{_n(r)}" fill="{_PRED}" '
            f'fill-opacity="0.75" stroke="#0b3c5d"><title>{escape(tip)}</title></circle>'
        )
    doc.add("</g>")
    if not points:
        doc.text(x0 + w / 2, y0 + h / 2, "no verified drafts yet", size=13, anchor="middle")
    ly = y0 + h + 58
    doc.add('<g class="legend">')
    doc.add(f'<circle cx="{x0 + 4}" cy="{ly - 4}" r="4" fill="{_PRED}" fill-opacity="0.75"/>')
    doc.text(x0 + 12, ly, "bin: mean predicted vs observed (area \u221d drafts)", size=11)
    doc.add(f'<rect x="{x0 + 310}" y="{ly - 9}" width="8" height="9" fill="#cfcfcf"/>')
    doc.text(x0 + 322, ly, "drafts per bin", size=11)
    doc.add("</g>")
    return len(points)


def _positions_panel(doc: _Doc, positions: Sequence[PositionSummary]) -> None:
    x0, y0, w, h = _RIGHT
    k = len(positions)
    doc.text(x0, y0 - 14, "Acceptance per draft position", size=14, weight="bold")

    def px(i: int) -> float:
        return x0 + (i + 0.5) * w / max(k, 1)

    def py(v: float) -> float:
        return y0 + h - min(max(v, 0.0), 1.0) * h

    step = max(1, math.ceil(k / 16))
    _axes(
        doc,
        _RIGHT,
        [(px(i), str(i)) for i in range(0, k, step)],
        "draft position",
        "acceptance rate",
    )
    for name, color, cls, values in (
        ("predicted", _PRED, "predicted", [p.mean_predicted for p in positions]),
        ("observed", _OBS, "observed", [p.observed for p in positions]),
    ):
        pts = [(i, float(v)) for i, v in enumerate(values) if _finite(float(v))]
        if len(pts) > 1:
            path = " ".join(f"{_n(px(i))},{_n(py(v))}" for i, v in pts)
            doc.add(
                f'<polyline class="{cls}-line" points="{path}" fill="none" stroke="{color}" '
                'stroke-width="1.5"/>'
            )
        doc.add(f'<g class="{cls}-points">')
        for i, v in pts:
            tip = f"position {i}: {name} {v:.4f} ({positions[i].count:.6g} drafts)"
            attrs = (
                f'class="{cls}" data-position="{i}" data-value="{v:.6f}" '
                f'data-count="{positions[i].count:.6g}"'
            )
            if cls == "predicted":
                doc.add(
                    f'<circle {attrs} cx="{_n(px(i))}" cy="{_n(py(v))}" r="4" fill="{color}">'
                    f"<title>{escape(tip)}</title></circle>"
                )
            else:
                doc.add(
                    f'<rect {attrs} x="{_n(px(i) - 4)}" y="{_n(py(v) - 4)}" width="8" '
                    f'height="8" fill="{color}"><title>{escape(tip)}</title></rect>'
                )
        doc.add("</g>")
    if not any(p.count > 0 for p in positions):
        doc.text(x0 + w / 2, y0 + h / 2, "no verified drafts yet", size=13, anchor="middle")
    # Legend, under the plot (never over the data).
    lx, ly = x0, y0 + h + 58
    doc.add('<g class="legend">')
    doc.add(f'<circle cx="{lx + 4}" cy="{ly - 4}" r="4" fill="{_PRED}"/>')
    doc.text(lx + 12, ly, "mean predicted", size=11)
    doc.add(f'<rect x="{lx + 110}" y="{ly - 8}" width="8" height="8" fill="{_OBS}"/>')
    doc.text(lx + 122, ly, "observed", size=11)
    doc.add("</g>")


def render(
    reliability: Reliability,
    positions: Sequence[PositionSummary],
    *,
    title: str,
    subtitle: str = "",
    ece: float = math.nan,
) -> str:
    """The SVG document (a ``str``) for one pair's calibration."""
    doc = _Doc()
    title = _clean(title)
    doc.add('<?xml version="1.0" encoding="UTF-8"?>')
    doc.add(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" style="{_FONT}" role="img" '
        f"aria-label={quoteattr(title)}>"
    )
    doc.add(f"<title>{escape(title)}</title>")
    doc.add(f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>')
    doc.text(20, 28, title, size=16, weight="bold", cls="heading")
    if subtitle:
        doc.text(20, 50, subtitle, size=12, fill="#555", cls="subheading")
    _reliability_panel(doc, reliability, ece)
    _positions_panel(doc, positions)
    doc.add("</svg>")
    return "\n".join(doc.parts) + "\n"
