"""Text tables as the commands print them: found in an output and checked to line up."""

from __future__ import annotations

import re

RULE = re.compile(r"^-+( +-+)+$")


def tables(text: str) -> list[tuple[list[tuple[int, int]], list[str]]]:
    """``(column spans, header and rows)`` of every table in ``text``."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        if not RULE.match(line):
            continue
        spans = [(m.start(), m.end()) for m in re.finditer(r"-+", line)]
        rows = []
        for row in lines[i + 1 :]:
            if not row.strip() or RULE.match(row):
                break
            rows.append(row)
        found.append((spans, [lines[i - 1], *rows]))
    return found


def assert_lined_up(spans: list[tuple[int, int]], lines: list[str]) -> None:
    header, *rows = lines
    rows = [r for r in rows if "steps per worker" not in r]  # a fleet shape's note
    for row in [header, *rows]:
        gaps = [row[end:start] for (_, end), (start, _) in zip(spans, spans[1:], strict=False)]
        assert all(not g.strip() for g in gaps) and not row[spans[-1][1] :].strip(), (
            f"out of its column:\n{header}\n{row}"
        )
    for start, end in spans:
        cells = [r[start:end] for r in rows if r[start:end].strip()]
        flush_left = all(c == c.lstrip() for c in cells)
        flush_right = all(c == c.rstrip() for c in cells)
        assert flush_left or flush_right, f"column at {start} is ragged:\n" + "\n".join(cells)
