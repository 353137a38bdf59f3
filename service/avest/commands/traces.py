"""The trace a subcommand reads: its positional argument, and reading it.

Without the argument the bundled sample is read, so every trace command runs on
a fresh install.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from avest.offline.trace import Trace


def add_trace_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", nargs="?", help="trace file (.npz); default: the bundled sample")


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
