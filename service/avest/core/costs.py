"""Step-cost tables: what a draft step and a verification step cost, in ms.

The budget rules trade expected accepted tokens against step time, so they
need ``draft_cost[num_requests]`` and ``verify_cost[num_target_tokens]`` for
every size a step can take. Only a handful of sizes are profiled; the rest are
filled in with the semantics of vLLM 0.33 (``build_cost_tables_from_curves``):

* Costs are made non-decreasing (running maximum): timing noise must never
  make a bigger batch look cheaper, or the budget would chase the noise.
* At or below the CUDA-graph capture limit execution pads up to the next
  captured size, so the cost of ``n`` is the cost of the first profiled size
  ``>= n`` — a step function. Interpolating there would invent marginal
  per-token costs that do not exist inside a pad bucket.
* Above the limit nothing pads: cost is interpolated linearly between the
  profiled points that are themselves above the limit (crossing the limit
  loses CUDA graphs, a real discontinuity, so the last point below it is
  never blended with the first above it).
* Past the last profiled point, linear extrapolation from the last two.
* Draft cost is clipped at 0, verify cost at ``1e-6`` (it divides goodput).

A limit of 0 means "unknown" and, as in vLLM, leaves the whole profiled range
a step function. The same limit applies to both curves, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np
import numpy.typing as npt

from avest_wire.errors import InvalidInput

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
Curve = Sequence[tuple[int, float]]

MIN_DRAFT_MS = 0.0
MIN_VERIFY_MS = 1e-6
#: Entries kept by each table's cache of extension rates (one per step shape).
_RATE_CACHE_SIZE = 64
#: Most (budget, candidate) pairs formed at once, to bound temporary memory.
_PAIRS = 1 << 20


def check_curve(curve: Curve, name: str) -> tuple[FloatArray, FloatArray]:
    """Validate a measured curve ``[(size, ms), ...]``; return sizes and costs.

    Sizes must be positive integers in strictly increasing order, costs finite
    and non-negative. ``name`` is the field reported in ``InvalidInput``.
    """
    try:
        arr = np.asarray(curve, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(name, "must be a sequence of (size, ms) pairs") from exc
    if arr.ndim != 2 or arr.shape[1] != 2 or arr.shape[0] == 0:
        raise InvalidInput(
            name, f"need a non-empty list of (size, ms) pairs, got shape {arr.shape}"
        )
    if not np.all(np.isfinite(arr)):
        raise InvalidInput(name, "sizes and costs must be finite")
    xs, ys = arr[:, 0].copy(), arr[:, 1].copy()
    if np.any(xs < 1) or np.any(xs != np.round(xs)):
        raise InvalidInput(name, "sizes must be positive integers")
    if np.any(np.diff(xs) <= 0):
        raise InvalidInput(name, "sizes must be strictly increasing")
    if np.any(ys < 0):
        raise InvalidInput(name, "costs must be >= 0 ms")
    return xs, ys


def evaluate_curve(
    xs: FloatArray, ys: FloatArray, cudagraph_limit: int, sizes: npt.ArrayLike
) -> FloatArray:
    """Cost at integer ``sizes`` of a validated curve (module docstring rules).

    The floor (0 or 1e-6) is applied by ``CostTable``, not here.
    """
    level = np.maximum.accumulate(ys)
    n = np.asarray(sizes, dtype=np.float64).reshape(-1)
    idx = np.minimum(np.searchsorted(xs, n, side="left"), xs.size - 1)
    out = level[idx]
    if cudagraph_limit > 0:
        smooth = n > cudagraph_limit
        above = xs > cudagraph_limit
        if smooth.any() and above.any():
            out[smooth] = np.interp(n[smooth], xs[above], level[above])
    if xs.size > 1:
        after = n > xs[-1]
        slope = (level[-1] - level[-2]) / (xs[-1] - xs[-2])
        out[after] = level[-1] + slope * (n[after] - xs[-1])
    return np.asarray(out, dtype=np.float64)


def _sizes(values: npt.ArrayLike, name: str) -> IntArray:
    n = np.asarray(values)
    integral = n.dtype.kind in "iu" or (
        n.dtype.kind == "f" and bool(np.all(np.isfinite(n))) and bool(np.all(n == np.round(n)))
    )
    if not integral:
        raise InvalidInput(name, "must be integers")
    sizes = n.astype(np.int64)
    if np.any(sizes < 0):
        raise InvalidInput(name, "must be >= 0")
    return sizes


@dataclass(frozen=True, eq=False)
class CostTable:
    """Precomputed ``draft_table[0..max_requests]`` and ``verify_table[0..max_tokens]``.

    Sizes beyond the tables are evaluated from the curves on demand, so a
    lookup never fails for a valid size; the tables make the hot path a slice.
    Build with ``from_curves`` (or a profile helper), not the constructor.
    """

    draft_table: FloatArray
    verify_table: FloatArray
    draft_curve: tuple[FloatArray, FloatArray]
    verify_curve: tuple[FloatArray, FloatArray]
    cudagraph_limit: int
    _rates: dict[tuple[int, int], FloatArray] = field(
        default_factory=dict, compare=False, repr=False
    )

    @classmethod
    def from_curves(
        cls,
        draft_curve: Curve,
        verify_curve: Curve,
        cudagraph_limit: int = 0,
        *,
        max_requests: int = 1024,
        max_tokens: int = 16384,
    ) -> CostTable:
        """Tables from measured ``[(size, ms)]`` curves (vLLM semantics)."""
        dx, dy = check_curve(draft_curve, "draft_curve")
        vx, vy = check_curve(verify_curve, "verify_curve")
        if isinstance(cudagraph_limit, bool) or int(cudagraph_limit) != cudagraph_limit:
            raise InvalidInput("cudagraph_limit", "must be an integer")
        if cudagraph_limit < 0:
            raise InvalidInput("cudagraph_limit", f"must be >= 0, got {cudagraph_limit}")
        for name, value in (("max_requests", max_requests), ("max_tokens", max_tokens)):
            if int(value) != value or value < 1:
                raise InvalidInput(name, f"must be a positive integer, got {value!r}")
        limit = int(cudagraph_limit)
        draft = np.maximum(evaluate_curve(dx, dy, limit, np.arange(max_requests + 1)), MIN_DRAFT_MS)
        verify = np.maximum(evaluate_curve(vx, vy, limit, np.arange(max_tokens + 1)), MIN_VERIFY_MS)
        draft.flags.writeable = False
        verify.flags.writeable = False
        return cls(draft, verify, (dx, dy), (vx, vy), limit)

    @property
    def max_requests(self) -> int:
        return int(self.draft_table.size - 1)

    @property
    def max_tokens(self) -> int:
        return int(self.verify_table.size - 1)

    @overload
    def draft_cost(self, num_requests: int) -> float: ...
    @overload
    def draft_cost(self, num_requests: npt.NDArray[Any] | Sequence[int]) -> FloatArray: ...
    def draft_cost(
        self, num_requests: int | npt.NDArray[Any] | Sequence[int]
    ) -> float | FloatArray:
        """Draft-step cost (ms) for ``num_requests``; scalar in, scalar out."""
        return self._lookup(
            num_requests, "num_requests", self.draft_table, self.draft_curve, MIN_DRAFT_MS
        )

    @overload
    def verify_cost(self, num_tokens: int) -> float: ...
    @overload
    def verify_cost(self, num_tokens: npt.NDArray[Any] | Sequence[int]) -> FloatArray: ...
    def verify_cost(self, num_tokens: int | npt.NDArray[Any] | Sequence[int]) -> float | FloatArray:
        """Verification (target forward) cost (ms) for ``num_tokens``."""
        return self._lookup(
            num_tokens, "num_tokens", self.verify_table, self.verify_curve, MIN_VERIFY_MS
        )

    def verify_range(self, start: int, stop: int) -> FloatArray:
        """``verify_cost(n)`` for ``n = start..stop`` inclusive (a slice when tabled)."""
        if start < 0 or stop < start:
            raise InvalidInput("num_tokens", f"need 0 <= start <= stop, got {start}..{stop}")
        if stop <= self.max_tokens:
            return self.verify_table[start : stop + 1]
        return self.verify_cost(np.arange(start, stop + 1))

    def _lookup(
        self,
        values: int | npt.NDArray[Any] | Sequence[int],
        name: str,
        table: FloatArray,
        curve: tuple[FloatArray, FloatArray],
        floor: float,
    ) -> float | FloatArray:
        if type(values) is int and 0 <= values < table.size:  # the hot path: one size, tabled
            return float(table[values])
        sizes = _sizes(values, name)
        flat = sizes.reshape(-1)
        out = table[np.minimum(flat, table.size - 1)]
        beyond = flat >= table.size
        if beyond.any():
            out = out.copy()
            extra = evaluate_curve(curve[0], curve[1], self.cudagraph_limit, flat[beyond])
            out[beyond] = np.maximum(extra, floor)
        if np.ndim(values) == 0:
            return float(out[0])
        return np.asarray(out.reshape(sizes.shape), dtype=np.float64)

    def extension_rates(self, num_non_draft_tokens: int, max_drafts: int) -> FloatArray:
        """``rate[m] = min_{m < b <= N} (v(T0+b) - v(T0+m)) / (b - m)`` for ``m < N``.

        The cheapest average verify cost per extra draft of growing a budget of
        ``m`` drafts to any larger one (``N = max_drafts``, ``T0`` the non-draft
        tokens, ``v`` the verify cost; the draft cost is the same for every
        budget and cancels). The lossless walk compares it with the survival of
        the next slot. It depends on the costs alone, never on survivals, so any
        rounding here can only cost goodput, never losslessness.

        Exact and fast: the minimum is attained at ``m + 1``, at ``N``, or at a
        convex kink (second difference > 0). Proof: let ``b`` be the largest
        minimiser with ``m + 1 < b < N`` and ``λ`` the minimum; ``g(b-1) >= λ``
        gives ``v_b - v_{b-1} <= λ``; if the kink at ``b`` is not convex,
        ``v_{b+1} - v_b <= v_b - v_{b-1} <= λ``, so ``g(b+1) <= λ`` and ``b+1``
        is a minimiser too, a contradiction. Costs are non-decreasing, so where
        ``v`` is flat the rate is 0 and no search is needed. Real tables have a
        few dozen convex kinks (profiled points, pad-bucket edges), so this is
        ``O(N * kinks)``; results are cached per ``(T0, N)``, which repeats
        from step to step in steady state.
        """
        key = (int(num_non_draft_tokens), int(max_drafts))
        cached = self._rates.get(key)
        if cached is not None:
            return cached
        t0, n = key
        if t0 < 0 or n < 0:
            raise InvalidInput("num_non_draft_tokens", "sizes must be >= 0")
        v = self.verify_range(t0, t0 + n)
        rates = _extension_rates(v)
        rates.flags.writeable = False
        if len(self._rates) >= _RATE_CACHE_SIZE:
            self._rates.clear()  # atomic, so safe if threads share the table
        self._rates[key] = rates
        return rates


def _extension_rates(v: FloatArray) -> FloatArray:
    """``extension_rates`` for costs ``v[0..N]`` (see its docstring).

    Only pairs ``(m, k)`` with ``m`` rising and ``k > m`` a candidate are
    formed, as one flat ragged batch (reduced per ``m`` with ``reduceat``),
    in chunks of at most ``_PAIRS`` pairs to bound memory on curved costs.
    """
    n = v.size - 1
    if n <= 0:
        return np.zeros(0, dtype=np.float64)
    step = np.diff(v)
    rates = step.copy()
    scale = 1e-12 * max(float(np.max(np.abs(v))), 1e-300)
    kinks = np.flatnonzero(np.diff(step) > scale) + 1
    candidates = np.append(kinks, n).astype(np.int64)
    rising = np.flatnonzero(step > 0)
    first = np.searchsorted(candidates, rising, side="right")  # first candidate > m
    counts = candidates.size - first  # >= 1: N itself is always past m
    ends = np.cumsum(counts)
    lo = 0
    while lo < rising.size:
        hi = max(int(np.searchsorted(ends, ends[lo] - counts[lo] + _PAIRS, side="right")), lo + 1)
        m, c = rising[lo:hi], counts[lo:hi]
        starts = np.cumsum(c) - c
        k = candidates[np.arange(int(c.sum())) - np.repeat(starts - first[lo:hi], c)]
        mm = np.repeat(m, c)
        slope = (v[k] - v[mm]) / (k - mm)
        rates[m] = np.minimum(rates[m], np.minimum.reduceat(slope, starts))
        lo = hi
    return rates


def affine_costs(
    *,
    draft_base: float,
    draft_per_request: float,
    verify_base: float,
    verify_per_token: float,
    max_requests: int = 64,
    max_tokens: int = 1024,
) -> CostTable:
    """``draft(R) = a + b R``, ``verify(T) = c + d T``: no padding, no overhead.

    Goodput is then single-peaked, and the same-step argmax is lossless.
    """
    # Two points and linear extrapolation past the second; size 0 costs as size 1.
    draft = [(1, draft_base + draft_per_request), (2, draft_base + 2 * draft_per_request)]
    verify = [(1, verify_base + verify_per_token), (2, verify_base + 2 * verify_per_token)]
    return CostTable.from_curves(draft, verify, 0, max_requests=max_requests, max_tokens=max_tokens)


def overhead_costs(
    *,
    draft_ms: float,
    verify_base: float,
    overhead: float,
    per_token: float,
    free_tokens: int,
    max_requests: int = 64,
    max_tokens: int = 1024,
) -> CostTable:
    """A fixed overhead as soon as verification grows past ``free_tokens``.

    ``verify(T) = verify_base`` for ``T <= free_tokens`` and
    ``verify_base + overhead + per_token * (T - free_tokens)`` above, e.g. the
    non-draft tokens fit a captured graph and any draft spills to a slower
    path. Flat draft cost. The goodput curve has a notch: not single-peaked.
    """
    if free_tokens < 1 or free_tokens + 1 >= max_tokens:
        raise InvalidInput("free_tokens", "must be in [1, max_tokens - 2]")
    verify = [
        (free_tokens, verify_base),
        (free_tokens + 1, verify_base + overhead + per_token),
        (max_tokens, verify_base + overhead + per_token * (max_tokens - free_tokens)),
    ]
    draft = [(1, draft_ms)]
    return CostTable.from_curves(
        draft, verify, free_tokens, max_requests=max_requests, max_tokens=max_tokens
    )


def bucket_costs(
    *,
    draft_ms: float,
    buckets: Sequence[tuple[int, float]],
    max_requests: int = 64,
    max_tokens: int = 1024,
) -> CostTable:
    """Padded buckets: ``verify(T)`` is the cost of the smallest bucket ``>= T``.

    All buckets are CUDA-graph captured (the limit is the largest bucket), so
    the verify cost is a staircase; past the last bucket it extrapolates.
    """
    sizes = [int(s) for s, _ in buckets]
    limit = max(sizes) if sizes else 0
    return CostTable.from_curves(
        [(1, draft_ms)], buckets, limit, max_requests=max_requests, max_tokens=max_tokens
    )
