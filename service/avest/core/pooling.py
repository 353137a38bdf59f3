"""Round summaries' calibration sketches, pooled lazily into a pair's open round.

Folding one sketch into the round's :class:`~avest.core.metrics.CalibrationState`
and scoring it for the calibration layer costs a few dozen numpy calls; at
thousands of summaries a second that is most of the ingest. Nothing reads the
round's calibration between two summaries, so :class:`PendingSketches` only
keeps each validated sketch, and :meth:`PendingSketches.settle` folds all of
them at once (one ``bincount`` over their cells, one sum of their ECE and
log-loss sums, one scoring for the layer) when something reads the round: a
refit, a snapshot, a scrape, a raw step, a score.

The result is the same as folding each sketch when it arrives:

- the histogram, ECE and log-loss sums are sums (counts are whole numbers, so
  their float32 bins hold them exactly either way);
- the calibration layer scores a draft with its map, which changes only at a
  refit (or a reset or restore), and the estimator settles before each of
  them; the layer's losses are linear in the counts, so scoring the summed
  histogram once equals scoring each sketch (up to float rounding, about
  1e-15 relative).

Pending sketches are bounded (:data:`MAX_PENDING_CELLS`): past it the
summary that crosses it settles the rest.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from avest.core.calibration import Recalibrator
from avest.core.metrics import CalibrationState
from avest.core.summary import add_sketch, observe_counts
from avest_wire.bins import AUC_SLOTS, CELLS_PER_POSITION
from avest_wire.summary import Sketch

#: Occupied cells kept pending before they are folded (about 16 MiB of cells
#: and counts; a K = 8 sketch of 100 steps at B = 256 has about 2,700).
MAX_PENDING_CELLS = 1 << 20


class PendingSketches:
    """Validated sketches of one open round not yet folded into its calibration."""

    __slots__ = ("cells", "k", "sketches")

    def __init__(self, k: int) -> None:
        self.k = k
        self.sketches: list[Sketch] = []
        #: Occupied cells over every pending sketch.
        self.cells = 0

    def __len__(self) -> int:
        return len(self.sketches)

    @property
    def full(self) -> bool:
        return self.cells >= MAX_PENDING_CELLS

    def add(self, sketch: Sketch) -> None:
        """Keep a validated sketch of K positions (folded at :meth:`settle`)."""
        if sketch.k != self.k:
            raise ValueError(f"sketch has K={sketch.k}, the round has K={self.k}")
        self.sketches.append(sketch)
        self.cells += int(sketch.cells.size)

    def clear(self) -> None:
        self.sketches = []
        self.cells = 0

    def settle(self, state: CalibrationState, layer: Recalibrator | None) -> None:
        """Fold every pending sketch into ``state`` and score them for ``layer``; clear."""
        if not self.sketches:
            return
        sketches, k = self.sketches, self.k
        self.clear()
        if len(sketches) == 1:
            one = sketches[0]
            add_sketch(one, state)
            if layer is not None:
                observe_counts(layer, *_by_label(one.cells, one.counts))
            return
        cells = np.concatenate([s.cells for s in sketches])
        counts = np.concatenate([s.counts for s in sketches])
        state._ece += np.sum([s.ece for s in sketches], axis=0)
        state._psum += np.sum([s.psum for s in sketches], axis=0)
        state._nll += np.sum([s.nll for s in sketches], axis=0)
        if cells.size == 0:
            return
        dense = np.bincount(cells, weights=counts, minlength=k * CELLS_PER_POSITION)
        rows = dense.reshape(k * 2, AUC_SLOTS)
        used = np.flatnonzero(rows.any(axis=0))
        lo, hi = int(used[0]), int(used[-1]) + 1
        hist = state._auc
        hist.cover(lo, hi)
        window = hist.counts.reshape(k * 2, hist.width)
        window[:, lo - hist.first : hi - hist.first] += rows[:, lo:hi].astype(window.dtype)
        if layer is not None:
            by_label = rows.reshape(k, 2, AUC_SLOTS).sum(axis=0)
            observe_counts(layer, by_label[0], by_label[1])


def _by_label(
    cells: npt.NDArray[np.int64], counts: npt.NDArray[np.float64]
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """``(rejected, accepted)`` drafts per AUC slot over every position."""
    slots = cells % AUC_SLOTS
    accepted = (cells // AUC_SLOTS) % 2 == 1
    acc = np.bincount(slots[accepted], weights=counts[accepted], minlength=AUC_SLOTS)
    rej = np.bincount(slots[~accepted], weights=counts[~accepted], minlength=AUC_SLOTS)
    return np.asarray(rej, dtype=np.float64), np.asarray(acc, dtype=np.float64)
