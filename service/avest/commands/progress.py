"""Progress of the offline commands on stderr.

On a terminal: one tqdm bar with the rate and the time left, naming the stage
it is in. Elsewhere (a pipe, a log, CI): no bar, and at most one short line per
stage (``simulate 2/6: chat.npz a100-llama8b``). A client-only install has no
tqdm: the lines only.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any


class Progress:
    """``with Progress("fleet", total, stages=n) as p: p.stage(label); p.update(steps)``."""

    def __init__(self, command: str, total: int, *, stages: int = 0, unit: str = "step") -> None:
        self.command, self.stages, self.done = command, stages, 0
        self._bar: Any = None
        try:
            from tqdm import tqdm
        except ModuleNotFoundError:
            return
        self._bar = tqdm(
            total=total, desc=command, unit=unit, leave=False, disable=None, file=sys.stderr
        )

    @property
    def terminal(self) -> bool:
        """Whether the bar shows (stderr is a terminal)."""
        return self._bar is not None and not self._bar.disable

    def stage(self, label: str) -> None:
        """A stage starts: the bar names it, or a line says so."""
        self.done += 1
        if self.terminal:
            self._bar.set_postfix_str(label)
        elif self.stages:
            print(f"{self.command} {self.done}/{self.stages}: {label}", file=sys.stderr)

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def iterate(self, items: Iterable[int]) -> Iterator[int]:
        """``items``, counting each one."""
        for item in items:
            yield item
            self.update()

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._bar.close()
