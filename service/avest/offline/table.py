"""Fixed-width text tables whose columns line up whatever their cells hold.

Every table the offline commands print goes through :func:`format_columns`: a
column is as wide as its widest cell or title, so a long policy name widens its
column instead of pushing the rest of its row out of line. Under the header
runs a rule of dashes, one run per column (what a reader, or a test, can take
the columns' spans from).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Column:
    title: str
    align: Literal["<", ">"] = ">"
    gap: int = 1  # spaces before the column (none before the first)
    width: int = 0  # at least this wide


#: A row: one cell per column (fewer: the rest are empty), or a note printed as is
#: (it widens no column).
Row = Sequence[str] | str


def format_columns(columns: Sequence[Column], rows: Sequence[Row]) -> list[str]:
    """The header, a rule of dashes under each column, then one line per row."""
    cells = [list(r) + [""] * (len(columns) - len(r)) for r in rows if not isinstance(r, str)]
    widths = [
        max([c.width, len(c.title), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)
    ]

    def line(values: Sequence[str]) -> str:
        out = ""
        for i, (col, value, width) in enumerate(zip(columns, values, widths, strict=True)):
            out += " " * (col.gap if i else 0) + f"{value:{col.align}{width}}"
        return out.rstrip()

    lines = [line([c.title for c in columns]), line(["-" * w for w in widths])]
    it = iter(cells)
    for r in rows:
        lines.append(r.rstrip() if isinstance(r, str) else line(next(it)))
    return lines
