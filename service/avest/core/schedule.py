"""The draft-length schedule: per batch-size range, how many drafts and whether AV stays on.

Adaptive verification (AV, :mod:`avest.core.budget`) trims what is verified,
but the drafter has already drafted every position; at large batches, where
verification is compute-bound, drafting fewer positions (or none) beats
drafting ``K`` and trimming. vLLM takes a per-batch-size length
(``speculative_config.num_speculative_tokens_per_batch_size``); this module
computes it from what the service holds about a pair, without replaying a
trace:

* the pair's coefficients ``p_i = sigmoid(w x + b_i)``;
* the recent distribution of its feature ``x = logit(q_max)`` per position, a
  mergeable :class:`FeatureHistogram` (fixed bins, so histograms from workers
  and rounds add up, and decay by scaling). Position ``i`` counts the drafts
  that *reached* it: every earlier draft of the request was verified and
  accepted (whether ``i`` itself was verified or not), so that
  ``r_i = E[p_i(x) | reached i]`` is the chain-rule factor of survival;
* the cost table of one hardware (:mod:`avest.core.costs`).

**Expected goodput of each choice** at batch size ``C`` (tokens per second):

* fixed length ``v`` (AV off; ``v = 0`` is speculation off): the closed form
  of :func:`avest.core.draft_length.best_lengths`, ``C (1 + Σ_{i<v} Π_{j<=i}
  r_j) / (draft(C, v) + verify(C + C v))``;
* AV drafting ``d``: each step verifies the ``B`` drafts of highest survival
  ``s_{r,i} = Π_{j<=i} p_j(x_{r,j})`` for the ``B`` that maximises expected
  tokens per ms (:func:`avest.core.budget.goodput_curve`). Taken in the large-
  batch (fluid) limit, the top ``B`` survivals of ``C`` requests sum to
  ``C G_d(B / C)``, ``G_d(m)`` the expected survival mass of the best ``m``
  slots per request, and the goodput is ``max_B C (1 + G_d(B/C)) / (draft(C, d)
  + verify(C + B))``. ``G_d`` comes from the distribution of survival, built
  by convolving the per-position distributions of ``log p_i`` on a grid of
  log-survival cells (positions independent given that they are reached),
  each cell carrying its probability mass and its exact expected survival, so
  ``G_d(d) = Σ_{i<d} Π_{j<=i} r_j`` and AV at ``B = C d`` is exactly the
  fixed length ``d``. A step's own argmax can only do better than the argmax
  of the expectation, so the estimate is slightly conservative for AV.

**Choice**: the option of highest expected goodput, where AV must beat the
same length without it by :data:`AV_MARGIN`; with a previous schedule, the
choice at a batch size changes only when the new one beats the one in force
by :data:`SWITCH_MARGIN` (hysteresis). Adjacent batch sizes with the same
choice form a range; at most :data:`MAX_RANGES` ranges are kept, by merging
the neighbours whose merge loses the least expected goodput.

Public API: :func:`compute_schedule` returns a frozen :class:`Schedule`
(ranges, every option's expected goodput per batch size, ``to_vllm()``);
:class:`FeatureHistogram` is its feature input, filled from raw steps
(:meth:`FeatureHistogram.add`, :func:`reached`) or from a round summary's
linear-predictor histogram (:meth:`FeatureHistogram.add_eta`);
:func:`vllm_lengths` expands a vLLM schedule as vLLM's scheduler does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from avest.core.costs import CostTable
from avest.core.draft_length import best_lengths, draft_ms
from avest.core.histogram import EtaHistogram
from avest.core.model import Coefficients
from avest.core.numeric import sigmoid
from avest_wire.bins import AUC_BINS, ETA_RANGE, FEATURE_BINS, feature_bin
from avest_wire.errors import InvalidInput
from avest_wire.limits import MAX_LOG_ODDS

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

__all__ = [
    "AV_MARGIN",
    "BUDGET_RULES",
    "MIN_DRAFTS",
    "FEATURE_BINS",
    "MAX_RANGES",
    "SWITCH_MARGIN",
    "Choice",
    "FeatureHistogram",
    "Range",
    "Schedule",
    "compute_schedule",
    "reached",
    "survival_mass",
    "vllm_lengths",
]

#: At most this many batch-size ranges. The best length moves with the pad buckets of
#: the verify curve (on a profile captured at powers of two it changes inside nearly every
#: bucket); twelve ranges keep every shipped profile's schedule within 0.1 % of the
#: uncapped one at every batch size on the shared traces (eight lose up to 1.8 % on the
#: H100 power-of-two profile), while a config stays short enough to read and the small
#: steps of noisier curves are merged away.
MAX_RANGES = 12
#: Hysteresis: a batch size keeps the choice in force unless the new best is expected
#: to beat it by this share of goodput. Holding on costs at most this much expected
#: goodput (the issue's 1 % tolerance), and one refit's noise in the coefficients moves
#: the goodput of near-equal choices by less, so two lengths do not alternate.
SWITCH_MARGIN = 0.01
#: AV is kept on only where it is expected to beat the same length without it by this
#: share: the walk sizes budgets from estimated confidences and is lossless only by
#: verifying a little more than the argmax, and AV costs the estimator's kernels on
#: every step; a smaller expected gain is not worth that risk.
AV_MARGIN = 0.005
#: AV budget rules whose expected goodput :func:`compute_schedule` can take.
BUDGET_RULES = ("lossless-walk", "argmax")
#: Drafts that reached each position before a schedule is worth computing (a caller's
#: gate): a rate from 1000 drafts has a standard error under 1.6 %, which moves a length's
#: expected goodput by under 1 %. A position the schedule stops drafting is learnt no
#: more, so a schedule from thin early evidence would freeze its mistakes.
MIN_DRAFTS = 1000
#: The log-survival grid: cells of 0.02 nats (2 % of a survival) down to ``e^-16``;
#: a slot of survival below 1e-7 is never worth verifying, its mass joins the last cell.
_CELL = 0.02
_DEPTH = 16.0
_CELLS = int(round(_DEPTH / _CELL)) + 1
#: Default largest batch size scheduled (vLLM's default ``max_num_seqs``); the last
#: range runs on past it, as in vLLM's lookup.
DEFAULT_MAX_BATCH_SIZE = 256

_EDGES = np.linspace(-MAX_LOG_ODDS, MAX_LOG_ODDS, FEATURE_BINS + 1)
_CENTRES = 0.5 * (_EDGES[:-1] + _EDGES[1:])


class FeatureHistogram:
    """Counts ``[K, FEATURE_BINS]`` of the feature of each draft that reached its position.

    Mergeable (:meth:`merge` adds counts) and forgetful (:meth:`scale`); counts
    are float64 so decayed weights stay exact enough.
    """

    __slots__ = ("counts",)

    def __init__(self, counts: npt.ArrayLike) -> None:
        c = np.asarray(counts, dtype=np.float64)
        if c.ndim != 2 or c.shape[1] != FEATURE_BINS or c.shape[0] < 1:
            raise InvalidInput("features", f"counts must be [K, {FEATURE_BINS}]")
        if not np.all(np.isfinite(c)) or np.any(c < 0):
            raise InvalidInput("features", "counts must be finite and >= 0")
        self.counts = c.copy()

    @classmethod
    def empty(cls, k: int) -> FeatureHistogram:
        return cls(np.zeros((k, FEATURE_BINS)))

    @classmethod
    def of(cls, features: npt.ArrayLike, mask: npt.ArrayLike | None = None) -> FeatureHistogram:
        """The histogram of ``features[R, K]`` where ``mask`` (default: every draft)."""
        x = np.asarray(features, dtype=np.float64)
        out = cls.empty(x.shape[1] if x.ndim == 2 else 1)
        out.add(x, mask)
        return out

    @property
    def k(self) -> int:
        return int(self.counts.shape[0])

    def totals(self) -> FloatArray:
        """Drafts counted per position."""
        return np.asarray(self.counts.sum(axis=1), dtype=np.float64)

    def add(self, features: npt.ArrayLike, mask: npt.ArrayLike | None = None) -> None:
        """Count ``features[R, K]`` where ``mask[R, K]`` (see :func:`reached`)."""
        x = np.asarray(features, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != self.k:
            raise InvalidInput("features", f"must be [R, {self.k}], got {list(x.shape)}")
        keep = np.ones(x.shape, dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
        if keep.shape != x.shape:
            raise InvalidInput("mask", f"must have the features' shape {list(x.shape)}")
        keep = keep & np.isfinite(x)
        rows, pos = np.nonzero(keep)
        bins = feature_bin(x[rows, pos])
        np.add.at(self.counts, (pos, bins), 1.0)

    def add_eta(self, histogram: EtaHistogram | npt.ArrayLike, at: Coefficients) -> None:
        """Count a linear-predictor histogram (a round's sketch) scored at ``at``.

        ``histogram`` is an :class:`~avest.core.histogram.EtaHistogram` or its
        dense ``[K, 2, AUC_SLOTS]`` counts (both labels are drafts); each AUC
        slot's centre ``eta`` maps back to ``x = (eta - b_i) / w``. A sketch
        counts verified drafts only, so under AV a position's trimmed drafts
        are missing (a bias toward confident drafts that :meth:`add` with
        :func:`reached` avoids).
        """
        if isinstance(histogram, EtaHistogram):
            dense = histogram.dense()
        else:
            dense = np.asarray(histogram, dtype=np.float64)
        if dense.ndim != 3 or dense.shape[0] != self.k or at.k != self.k:
            raise InvalidInput("histogram", f"must be [{self.k}, 2, slots] at K={self.k}")
        counts = dense.sum(axis=1)
        width = 2.0 * ETA_RANGE / AUC_BINS
        # slot 0 and the last are under/overflow: taken at the range's edges
        eta = np.clip((np.arange(counts.shape[1]) - 0.5) * width - ETA_RANGE, -ETA_RANGE, ETA_RANGE)
        slope = at.slope if abs(at.slope) > 1e-9 else 1e-9
        for i, b in enumerate(at.intercept_array()):
            used = counts[i] > 0
            bins = feature_bin((eta[used] - b) / slope)
            np.add.at(self.counts[i], bins, counts[i, used])

    def add_cells(self, cells: npt.ArrayLike, counts: npt.ArrayLike) -> None:
        """Add sparse counts: ``cells`` distinct flat indices ``position * FEATURE_BINS +
        bin`` (a round summary's ``reached``)."""
        self.counts.reshape(-1)[np.asarray(cells, dtype=np.intp)] += np.asarray(counts, np.float64)

    def merge(self, other: FeatureHistogram) -> None:
        if other.k != self.k:
            raise InvalidInput("features", f"K={other.k} cannot merge into K={self.k}")
        self.counts += other.counts

    def scale(self, factor: float) -> None:
        """Forget: every count times ``factor`` in ``[0, 1]``."""
        if not 0.0 <= factor <= 1.0:
            raise InvalidInput("factor", f"must lie in [0, 1], got {factor}")
        self.counts *= factor

    def copy(self) -> FeatureHistogram:
        return FeatureHistogram(self.counts)


def reached(num_accepted: npt.ArrayLike, num_verified: npt.ArrayLike, drafted: int) -> BoolArray:
    """``[R, drafted]``: position ``i`` was reached (drafts ``0..i-1`` verified and accepted).

    ``num_accepted`` counts accepted drafts among the ``num_verified`` of each
    request; a position past the verified ones is reached when every verified
    draft was accepted and it is the next one.
    """
    a = np.asarray(num_accepted, dtype=np.int64)
    v = np.asarray(num_verified, dtype=np.int64)
    got = np.minimum(a, v)
    return np.asarray(np.arange(drafted)[None, :] <= got[:, None], dtype=bool)


def _distributions(coefficients: Coefficients, features: FeatureHistogram) -> FloatArray:
    """Normalised ``[K, FEATURE_BINS]`` weights; an unseen position borrows its nearest seen one."""
    if features.k != coefficients.k:
        raise InvalidInput("features", f"K={features.k}, the coefficients have K={coefficients.k}")
    totals = features.totals()
    seen = np.flatnonzero(totals > 0)
    if seen.size == 0:
        raise InvalidInput("features", "no draft counted at any position")
    nearest = seen[np.abs(np.arange(features.k)[:, None] - seen[None, :]).argmin(axis=1)]
    return np.asarray(features.counts[nearest] / totals[nearest, None], dtype=np.float64)


def _probabilities(coefficients: Coefficients) -> FloatArray:
    """``p[i, bin]`` at each feature bin's centre."""
    b = coefficients.intercept_array()
    return sigmoid(coefficients.slope * _CENTRES[None, :] + b[:, None])


def survival_mass(
    coefficients: Coefficients, features: FeatureHistogram, drafts: int
) -> tuple[FloatArray, FloatArray]:
    """The pooled distribution of the survival of a request's first ``drafts`` slots.

    Returns ``(mass, value)`` over log-survival cells, best first: ``mass[c]`` the
    expected number of slots per request in cell ``c`` (summing to ``drafts``),
    ``value[c]`` their expected summed survival (summing to ``Σ_{i<d} Π_{j<=i} r_j``).
    """
    weights = _distributions(coefficients, features)
    probs = _probabilities(coefficients)
    mass_total = np.zeros(_CELLS)
    value_total = np.zeros(_CELLS)
    mass = np.zeros(_CELLS)
    value = np.zeros(_CELLS)
    mass[0], value[0] = 1.0, 1.0  # before any draft: survival 1, surely
    for i in range(drafts):
        step_mass, step_value = _cells(probs[i], weights[i])
        mass = _truncate(np.convolve(mass, step_mass))
        value = _truncate(np.convolve(value, step_value))
        mass_total += mass
        value_total += value
    return mass_total, value_total


def _cells(p: FloatArray, w: FloatArray) -> tuple[FloatArray, FloatArray]:
    """One position's ``(mass, mass x probability)`` per log-probability cell."""
    depth = -np.log(np.maximum(p, 1e-300))
    cell = np.minimum((depth / _CELL + 0.5).astype(np.intp), _CELLS - 1)
    return (
        np.asarray(np.bincount(cell, weights=w, minlength=_CELLS), dtype=np.float64),
        np.asarray(np.bincount(cell, weights=w * p, minlength=_CELLS), dtype=np.float64),
    )


def _truncate(a: FloatArray) -> FloatArray:
    out = a[:_CELLS].copy()
    out[-1] += a[_CELLS:].sum()
    return out


@dataclass(frozen=True)
class Choice:
    """What runs at a batch size: ``length`` drafts (0: speculation off), AV on or off."""

    length: int
    adaptive: bool = False

    @property
    def name(self) -> str:
        return f"av-{self.length}" if self.adaptive else f"fixed-{self.length}"


@dataclass(frozen=True)
class Range:
    """Batch sizes ``start..end`` (inclusive, as vLLM reads them) and their choice."""

    start: int
    end: int
    choice: Choice


@dataclass(frozen=True)
class Schedule:
    """A schedule for one pair and hardware (see the module docstring).

    ``goodput[c - 1][j]`` is the expected tokens per second of ``options[j]``
    at batch size ``c`` (``1..max_batch_size``).
    """

    k: int
    ranges: tuple[Range, ...]
    options: tuple[Choice, ...]
    goodput: tuple[tuple[float, ...], ...]
    rates: tuple[float, ...]

    @property
    def max_batch_size(self) -> int:
        return len(self.goodput)

    def choice_at(self, batch_size: int) -> Choice:
        """The choice at ``batch_size``; past the last range the last one runs on (vLLM)."""
        if batch_size < 1:
            raise InvalidInput("batch_size", f"must be >= 1, got {batch_size}")
        for r in self.ranges:
            if batch_size <= r.end:
                return r.choice
        return self.ranges[-1].choice

    def expected_goodput(self, batch_size: int, choice: Choice | None = None) -> float:
        """Expected tokens per second of ``choice`` (default: the scheduled one)."""
        c = min(max(int(batch_size), 1), self.max_batch_size)
        option = self.choice_at(c) if choice is None else choice
        return self.goodput[c - 1][self.options.index(option)]

    def to_vllm(self) -> list[tuple[int, int, int]]:
        """``num_speculative_tokens_per_batch_size``: ``(start, end, length)``, inclusive."""
        return [(r.start, r.end, r.choice.length) for r in self.ranges]

    def as_json(self) -> dict[str, object]:
        return {
            "k": self.k,
            "num_speculative_tokens_per_batch_size": [list(e) for e in self.to_vllm()],
            "ranges": [
                {
                    "start": r.start,
                    "end": r.end,
                    "num_speculative_tokens": r.choice.length,
                    "adaptive_verification": r.choice.adaptive,
                    "expected_goodput": self.expected_goodput(r.start, r.choice),
                }
                for r in self.ranges
            ],
            "rates": list(self.rates),
        }


def vllm_lengths(
    entries: Sequence[Sequence[int]], max_batch_size: int, num_speculative_tokens: int
) -> list[int]:
    """vLLM's dense lookup of a 3-item schedule: ``out[bs]`` for ``bs = 0..max_batch_size``.

    As ``vllm/v1/spec_decode/dynamic/utils.py`` reads it: inclusive ranges,
    sorted and non-overlapping, the first starting at 1; a gap takes the
    previous range's length, sizes past the last range its length; every
    length capped at ``num_speculative_tokens``; index 0 unused (0).
    """
    ranges = sorted((int(a), int(b), int(k)) for a, b, k in entries)
    if not ranges or ranges[0][0] != 1:
        raise InvalidInput("schedule", "the first range must start at 1")
    out = [0] * (max_batch_size + 1)
    for n, (lo, hi, k) in enumerate(ranges):
        if lo > hi or k < 0 or (n and lo <= ranges[n - 1][1]):
            raise InvalidInput("schedule", f"bad or overlapping range {(lo, hi, k)}")
        stop = ranges[n + 1][0] - 1 if n + 1 < len(ranges) else max_batch_size
        for bs in range(lo, min(stop, max_batch_size) + 1):
            out[bs] = min(k, num_speculative_tokens)
    return out


def _options(k: int, adaptive: bool) -> tuple[Choice, ...]:
    fixed = tuple(Choice(v) for v in range(k + 1))
    return fixed + (tuple(Choice(d, True) for d in range(1, k + 1)) if adaptive else ())


def _av_goodput(
    mass: FloatArray,
    value: FloatArray,
    costs: CostTable,
    c: int,
    drafts: int,
    drafting: float,
    walk: bool,
) -> float:
    """Expected tokens per second of AV drafting ``drafts`` at batch size ``c``.

    ``C (1 + G(B/C)) / (drafting + verify(C + B))`` at the budget ``B`` the rule
    takes from the expected ranked survivals: the global argmax, or (``walk``)
    the lossless walk's stop (:func:`avest.core.budget.lossless_walk_size`: slot
    ``m`` is kept while ``s_m cost(m) > A_m rate_m``, ``s_m`` the survival of
    the ``m``-th best slot, read from the cell holding it).
    """
    cum_mass = np.concatenate(([0.0], np.cumsum(mass)))
    cum_value = np.concatenate(([0.0], np.cumsum(value)))
    n = c * drafts
    budgets = np.arange(n + 1)
    gained = c + c * np.interp(budgets / c, cum_mass, cum_value)
    spent = drafting + costs.verify_range(c, c + n)
    goodput = gained / spent
    if not walk or n == 0:
        return float(1000.0 * np.max(goodput))
    level = np.divide(value, mass, out=np.zeros_like(value), where=mass > 0)
    cell = np.minimum(np.searchsorted(cum_mass[1:], (budgets[:-1] + 0.5) / c), mass.size - 1)
    include = level[cell] * spent[:-1] > gained[:-1] * costs.extension_rates(c, n)
    stop = n if bool(include.all()) else int(np.argmin(include))
    return float(1000.0 * goodput[stop])


def _goodput_table(
    coefficients: Coefficients,
    features: FeatureHistogram,
    costs: CostTable,
    sizes: range,
    options: tuple[Choice, ...],
    per_position: bool,
    proposal_length: int,
    walk: bool,
) -> tuple[FloatArray, FloatArray]:
    k = coefficients.k
    weights = _distributions(coefficients, features)
    rates = np.clip(np.sum(weights * _probabilities(coefficients), axis=1), 0.0, 1.0)
    fixed = best_lengths(
        rates, costs, sizes, per_position=per_position, proposal_length=proposal_length
    )
    table = np.zeros((len(sizes), len(options)))
    table[:, : k + 1] = [f.throughput for f in fixed]
    pooled = {o.length: survival_mass(coefficients, features, o.length) for o in options[k + 1 :]}
    lengths = np.arange(k + 1)
    for n, c in enumerate(sizes):
        drafting = draft_ms(
            costs, c, lengths, per_position=per_position, proposal_length=proposal_length
        )
        for j, o in enumerate(options[k + 1 :], start=k + 1):
            mass, value = pooled[o.length]
            table[n, j] = _av_goodput(
                mass, value, costs, c, o.length, float(drafting[o.length]), walk
            )
    return table, rates


def _pick(
    table: FloatArray, options: tuple[Choice, ...], previous: Schedule | None, margin: float
) -> npt.NDArray[np.intp]:
    """Per batch size, the index of the option in force after hysteresis."""
    score = table.copy()
    for j, o in enumerate(options):
        if o.adaptive:  # AV must clear its margin over the same length without it
            same = options.index(Choice(o.length))
            score[:, j] = np.where(
                table[:, j] > table[:, same] * (1.0 + AV_MARGIN), table[:, j], -np.inf
            )
    best = np.argmax(score, axis=1)  # ties: the first option (fixed before AV, shorter first)
    if previous is None:
        return np.asarray(best, dtype=np.intp)
    out = best.copy()
    for n in range(table.shape[0]):
        held = previous.choice_at(n + 1)
        if held not in options:
            continue
        j = options.index(held)
        if not table[n, best[n]] > table[n, j] * (1.0 + margin):
            out[n] = j
    return np.asarray(out, dtype=np.intp)


def _cap(table: FloatArray, picked: npt.NDArray[np.intp], max_ranges: int) -> list[list[int]]:
    """Runs ``[start, end, option]`` (0-based sizes), merged down to ``max_ranges``.

    Each merge joins the two neighbouring runs whose union, under its best single
    option, loses the least at its worst size (relative to the choice there): the
    targets hold at every batch size, so the worst size is what a merge is judged by.
    """
    rows = np.arange(table.shape[0])
    loss = 1.0 - table / table[rows, picked][:, None]  # [sizes, options], 0 at the choice
    runs: list[list[int]] = []
    for n, j in enumerate(picked):
        if runs and runs[-1][2] == j:
            runs[-1][1] = n
        else:
            runs.append([n, n, int(j)])
    while len(runs) > max_ranges:
        worst = [loss[a[0] : b[1] + 1].max(axis=0) for a, b in zip(runs, runs[1:], strict=False)]
        at = int(np.argmin([w.min() for w in worst]))
        option = int(np.argmin(worst[at]))
        runs[at : at + 2] = [[runs[at][0], runs[at + 1][1], option]]
        merged: list[list[int]] = []  # a merge can make neighbours equal: join them
        for r in runs:
            if merged and merged[-1][2] == r[2]:
                merged[-1][1] = r[1]
            else:
                merged.append(r)
        runs = merged
    return runs


def compute_schedule(
    coefficients: Coefficients,
    features: FeatureHistogram,
    costs: CostTable,
    *,
    per_position: bool,
    proposal_length: int | None = None,
    previous: Schedule | None = None,
    max_ranges: int = MAX_RANGES,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    margin: float = SWITCH_MARGIN,
    adaptive: bool = True,
    budget_rule: str = "lossless-walk",
) -> Schedule:
    """The schedule of a pair on one hardware, batch sizes ``1..max_batch_size``.

    ``coefficients``: the pair's slope and intercepts (``K`` positions).
    ``features``: the recent distribution of its features per position (the
    drafts that reached each position; see :class:`FeatureHistogram`).
    ``costs``: the hardware's cost table; ``costs.draft_cost(C)`` is one
    proposal of ``proposal_length`` drafts (default ``K``), paid per position
    (``per_position``, an autoregressive drafter) or once (a parallel one).
    ``previous``: the schedule in force; a batch size changes its choice only
    when the new one is expected to beat it by ``margin``. ``adaptive=False``
    leaves AV out (fixed lengths only); ``budget_rule`` is the AV rule whose
    budget the estimate takes: ``lossless-walk`` (the core's default) or
    ``argmax`` (also vLLM's ``stale`` rule, in expectation). At most
    ``max_ranges`` ranges.

    Raises :class:`~avest_wire.errors.InvalidInput` when no draft was counted
    (nothing to estimate from) or an argument is out of range.
    """
    k = coefficients.k
    if max_ranges < 1:
        raise InvalidInput("max_ranges", f"must be >= 1, got {max_ranges}")
    if max_batch_size < 1:
        raise InvalidInput("max_batch_size", f"must be >= 1, got {max_batch_size}")
    if not margin >= 0.0:
        raise InvalidInput("margin", f"must be >= 0, got {margin}")
    per = k if proposal_length is None else int(proposal_length)
    if per < 1:
        raise InvalidInput("proposal_length", f"must be >= 1, got {per}")
    if budget_rule not in BUDGET_RULES:
        raise InvalidInput("budget_rule", f"must be one of {BUDGET_RULES}, got {budget_rule!r}")
    options = _options(k, adaptive)
    sizes = range(1, max_batch_size + 1)
    walk = budget_rule == "lossless-walk"
    table, rates = _goodput_table(
        coefficients, features, costs, sizes, options, per_position, per, walk
    )
    picked = _pick(table, options, previous, margin)
    runs = _cap(table, picked, max_ranges)
    return Schedule(
        k,
        tuple(Range(a + 1, b + 1, options[j]) for a, b, j in runs),
        options,
        tuple(tuple(float(g) for g in row) for row in table),
        tuple(float(r) for r in rates),
    )
