"""Recording a pair's incoming raw stream (or a sampled fraction of it).

A :class:`Recording` is attached to a pair through the admin API (``POST
/v1/pairs/{id}/recording``); every raw step the pair applies is offered to it
(summaries carry no drafts and are not recorded), and it keeps the sampled
ones until it holds ``max_steps``. ``avest record`` starts one, waits and
downloads the result as an ``avest-trace/1`` file.

Sampling is deterministic: with fraction ``f`` the ``n``-th offered step is
kept when ``floor(n f)`` moves, so any window of ``1/f`` steps keeps one.
The wire carries no request ids and labels only reach the first rejected
draft, so the trace gets one request id per recorded row and, per row,
``num_verified`` = the drafts labelled (``a + 1`` after a rejection, ``a``
when all verified drafts were accepted): the labels are exactly those the
service learned from.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from avest.core.estimator import Batch

#: Most steps one recording may hold (memory: B x K x 4 bytes each).
MAX_STEPS = 100_000


@dataclass
class Recording:
    fraction: float
    max_steps: int
    started: float = field(default_factory=time.time)
    offered: int = 0
    features: list[npt.NDArray[np.float32]] = field(default_factory=list)
    num_verified: list[npt.NDArray[np.int32]] = field(default_factory=list)
    num_accepted: list[npt.NDArray[np.int32]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.fraction) and 0.0 < self.fraction <= 1.0):
            raise ValueError(f"fraction must lie in (0, 1], got {self.fraction}")
        if not 1 <= self.max_steps <= MAX_STEPS:
            raise ValueError(f"steps must lie in [1, {MAX_STEPS}], got {self.max_steps}")

    @property
    def kept(self) -> int:
        return len(self.features)

    @property
    def done(self) -> bool:
        return self.kept >= self.max_steps

    def offer(self, batch: Batch) -> bool:
        """Keep the step if it is sampled and room is left; returns whether it was kept."""
        if self.done:
            return False
        n = self.offered
        self.offered += 1
        if math.floor((n + 1) * self.fraction) == math.floor(n * self.fraction):
            return False
        accepted = batch.accepted.sum(axis=1).astype(np.int32)
        self.features.append(batch.features.astype(np.float32))
        self.num_verified.append(batch.observed.sum(axis=1).astype(np.int32))
        self.num_accepted.append(accepted)
        return True

    def arrays(self) -> dict[str, np.ndarray]:
        """``features``, ``num_verified``, ``num_accepted``, ``step``, ``request`` (rows)."""
        sizes = [f.shape[0] for f in self.features]
        rows = int(sum(sizes))
        k = self.features[0].shape[1] if self.features else 1
        return {
            "features": np.concatenate(self.features) if rows else np.zeros((0, k), np.float32),
            "num_verified": np.concatenate(self.num_verified) if rows else np.zeros(0, np.int32),
            "num_accepted": np.concatenate(self.num_accepted) if rows else np.zeros(0, np.int32),
            "step": np.repeat(np.arange(len(sizes), dtype=np.int64), sizes),
            "request": np.arange(rows, dtype=np.int64),
        }

    def status(self) -> dict[str, object]:
        rows = int(sum(f.shape[0] for f in self.features))
        counted = ("fraction", "max_steps", "offered", "kept")
        return {n: getattr(self, n) for n in counted} | {
            "rows": rows,
            "done": self.done,
            "started": self.started,
        }
