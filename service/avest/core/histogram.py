"""Per-position histograms of the linear predictor, by label, over the slots in use.

The AUC needs, per draft position and class (rejected, accepted), the count of
drafts in each of ``AUC_SLOTS`` bins of ``eta`` (an underflow slot, 1024 equal
bins on [-12, 12), an overflow slot). Held densely in float64 that is
K x 2 x 1026 x 8 bytes per state (128 KiB at K = 8, 1 MiB at K = 64), and
the service keeps three states per pair. Real predictors occupy a fraction of
the range, so :class:`EtaHistogram` keeps only a window ``[first, first + W)``
of slots shared by every position and class, grown (in steps of ``GRAIN``
slots) when a draft lands outside it, and counts in float32: a round's counts
are exact integers (below 2^24 per bin), and merging whole rounds into the
all-time and recent states rounds each sum to float32's 24 bits (relative
error below 6e-8 per merge, nothing the AUC can show). Slots outside the
window hold zero. An empty histogram allocates nothing.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from avest_wire.bins import AUC_SLOTS
from avest_wire.errors import InvalidInput

#: The window grows by multiples of this many slots (fewer reallocations).
GRAIN = 32
#: Storage type of the counts.
DTYPE = np.float32

Counts = npt.NDArray[np.float32]
IntArray = npt.NDArray[np.intp]


def _round_out(lo: int, hi: int) -> tuple[int, int]:
    lo = (lo // GRAIN) * GRAIN
    hi = min(-(-hi // GRAIN) * GRAIN, AUC_SLOTS)
    return lo, hi


class EtaHistogram:
    """Counts ``[K, 2, W]`` of slots ``[first, first + W)``; every other slot is zero."""

    __slots__ = ("counts", "first")

    def __init__(self, counts: Counts, first: int = 0) -> None:
        if counts.ndim != 3 or counts.shape[1] != 2:
            raise InvalidInput("auc", f"must have shape [K, 2, W], got {list(counts.shape)}")
        if not 0 <= first <= AUC_SLOTS - counts.shape[2]:
            raise InvalidInput("auc_first_slot", f"window [{first}, +{counts.shape[2]}) exceeds")
        self.counts = np.ascontiguousarray(counts, dtype=DTYPE)
        self.first = int(first)

    @classmethod
    def empty(cls, k: int) -> EtaHistogram:
        return cls(np.zeros((k, 2, 0), dtype=DTYPE))

    @property
    def k(self) -> int:
        return int(self.counts.shape[0])

    @property
    def width(self) -> int:
        return int(self.counts.shape[2])

    @property
    def nbytes(self) -> int:
        return int(self.counts.nbytes)

    def copy(self) -> EtaHistogram:
        return EtaHistogram(self.counts.copy(), self.first)

    def cover(self, lo: int, hi: int) -> None:
        """Grow the window to include slots ``[lo, hi)`` (no-op if it does)."""
        if hi <= lo:
            return
        w = self.width
        if w and self.first <= lo and hi <= self.first + w:
            return
        if w:
            lo, hi = min(lo, self.first), max(hi, self.first + w)
        lo, hi = _round_out(lo, hi)
        grown = np.zeros((self.k, 2, hi - lo), dtype=DTYPE)
        if w:
            grown[:, :, self.first - lo : self.first - lo + w] = self.counts
        self.counts, self.first = grown, lo

    def add(self, cells: IntArray, slots: IntArray) -> None:
        """Count one draft per entry: ``cells`` = position * 2 + label, ``slots`` its slot."""
        if slots.size == 0:
            return
        self.cover(int(slots.min()), int(slots.max()) + 1)
        one = DTYPE(1.0)  # (a float64 1.0 sends np.add.at down a slow casting path)
        np.add.at(self.counts.reshape(-1), cells * self.width + (slots - self.first), one)

    def merge(self, other: EtaHistogram) -> None:
        if other.width == 0:
            return
        self.cover(other.first, other.first + other.width)
        at = other.first - self.first
        self.counts[:, :, at : at + other.width] += other.counts

    def scale(self, factor: float) -> None:
        self.counts *= DTYPE(factor)

    def totals(self) -> npt.NDArray[np.float64]:
        """Drafts per position (both classes), in float64."""
        out: npt.NDArray[np.float64] = self.counts.sum(axis=(1, 2), dtype=np.float64)
        return out

    def trimmed(self) -> EtaHistogram:
        """The same counts over the smallest window (on ``GRAIN``) holding every non-zero slot."""
        used = np.flatnonzero(self.counts.any(axis=(0, 1)))
        if used.size == 0:
            return EtaHistogram.empty(self.k)
        lo, hi = _round_out(self.first + int(used[0]), self.first + int(used[-1]) + 1)
        at = lo - self.first
        if at == 0 and hi - lo == self.width:
            return self
        # windows start on GRAIN (or at 0), so [lo, hi) lies inside this one
        return EtaHistogram(self.counts[:, :, at : at + hi - lo].copy(), lo)

    def dense(self) -> npt.NDArray[np.float64]:
        """All ``AUC_SLOTS`` slots ``[K, 2, AUC_SLOTS]`` in float64 (references, tests)."""
        out = np.zeros((self.k, 2, AUC_SLOTS))
        out[:, :, self.first : self.first + self.width] = self.counts
        return out
