"""The draft budget: how many drafts to verify this step, and which ones.

Each scheduled (request, position) slot scores its *survival*, the running
product of the request's confidences up to it: the chance it is accepted.
Verifying ``B`` drafts yields ``S + Σ_{j<B} s_(j)`` expected tokens (``S``
requests sample a token whatever happens) for ``draft_cost[R] +
verify_cost[T0 + B]`` ms. Slots rank by survival, descending, ties by request
then position; survival never rises along a request, so any top-``B`` is a
prefix of every request's drafts.

Losslessness (docs/design.md §3): speculative sampling stays exact as long as whether
draft ``i`` is verified never depends on the token drawn at ``i``. Survival at
``i`` depends only on earlier tokens, so ranking slots by survival is safe; but
with an autoregressive drafter survival at ``i + 1`` depends on the token at
``i``, so a budget *size* computed from the same step's survivals may not be.
Each rule in ``RULES`` states whether it is lossless; ``DEFAULT_RULE`` is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from avest.core.costs import CostTable
from avest.core.model import survival as running_survival
from avest.core.selection import (
    allocate,
    as_count,
    as_matrix,
    as_scheduled,
    best_first_values,
    check_survival,
    eligible_slots,
    fill,
)
from avest_wire.errors import InvalidInput

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

__all__ = [
    "DEFAULT_RULE",
    "RULES",
    "BudgetDecision",
    "BudgetStep",
    "Rule",
    "allocate",
    "budget_size",
    "decide",
    "goodput_curve",
    "lossless_walk_size",
]


def goodput_curve(scores: FloatArray, s: float, r: int, t0: int, costs: CostTable) -> FloatArray:
    """Expected tokens per ms for budgets ``B = 0..len(scores)``, scores best first.

    ``s`` requests sample a token, ``r`` requests draft, ``t0`` non-draft tokens.
    """
    gained = s + np.concatenate(([0.0], np.cumsum(scores)))
    spent = costs.draft_cost(r) + costs.verify_range(t0, t0 + scores.size)
    return np.asarray(gained / spent, dtype=np.float64)


def _sorted_scores(
    survival: npt.ArrayLike, scheduled: npt.ArrayLike | None
) -> tuple[FloatArray, int | None]:
    """Scores best first from a sorted vector or a ``[R, K]`` survival matrix."""
    s = np.asarray(survival, dtype=np.float64)
    if s.ndim == 1:
        if np.any(np.diff(as_matrix(s[None, :], "survival")[0]) > 0):
            raise InvalidInput("survival", "a vector of scores must be sorted descending")
        return s, None
    m = as_matrix(s, "survival")
    sched = as_scheduled(scheduled, m.shape[0], m.shape[1])
    check_survival(m, sched)
    return best_first_values(m, eligible_slots(m, sched, np.zeros_like(sched))), m.shape[0]


def _common(
    num_sampling: int, num_requests: int, num_non_draft_tokens: int, rows: int | None
) -> tuple[int, int, int]:
    s = as_count(num_sampling, "num_sampling")
    r = as_count(num_requests, "num_requests")
    if rows is not None and r != rows:
        raise InvalidInput("num_requests", f"survival has {rows} requests, got {r}")
    if s > r:
        raise InvalidInput("num_sampling", f"at most num_requests ({r}), got {s}")
    return s, r, as_count(num_non_draft_tokens, "num_non_draft_tokens")


def budget_size(
    survival: npt.ArrayLike,
    num_sampling: int,
    num_requests: int,
    num_non_draft_tokens: int,
    costs: CostTable,
    *,
    scheduled: npt.ArrayLike | None = None,
) -> int:
    """``B* = argmax_B (S + Σ_{j<B} s_(j)) / (draft[R] + verify[T0 + B])``.

    ``survival`` is either the scores sorted descending or an ``[R, K]``
    survival matrix (``scheduled[R]`` drafts each, default all ``K``). ``B``
    ranges over ``0..#slots`` and the *global* argmax is taken (step-shaped
    costs make goodput multi-peaked); ties go to the smallest ``B``.

    Lossless only if the survivals it is given do not depend on this step's
    drafted tokens (e.g. last step's, as vLLM does). Fed the current
    survivals of an autoregressive drafter it is not, unless goodput is
    single-peaked (affine or convex costs), where it equals the lossless walk.
    """
    scores, rows = _sorted_scores(survival, scheduled)
    s, r, t0 = _common(num_sampling, num_requests, num_non_draft_tokens, rows)
    return int(np.argmax(goodput_curve(scores, s, r, t0, costs)))


def lossless_walk_size(
    survival: npt.ArrayLike,
    num_sampling: int,
    num_requests: int,
    num_non_draft_tokens: int,
    costs: CostTable,
    *,
    scheduled: npt.ArrayLike | None = None,
) -> int:
    """Budget of the walk of docs/design.md §3 rule 2; arguments as ``budget_size``.

    Walk the slots best first; slot ``m`` (0-based rank, ``A = S + Σ_{j<m}
    s_(j)``) is included iff ``max_{m<b<=N} (A + (b-m) s_m) / cost(b) >
    A / cost(m)``, i.e. some larger budget beats stopping even if every slot
    from ``m`` on scored ``s_m`` (an optimistic bound: later slots score less);
    the walk stops at the first exclusion. Always lossless: the test reads only
    slots ranked at or above ``m``, which for slot ``(r, i)`` are request
    ``r``'s earlier drafts and other requests' slots. Vectorised as
    ``s_m cost(m) > A · CostTable.extension_rates[m]`` (costs only, cached).

    The result is ``>= budget_size`` of the same survivals and its goodput is
    ``>=`` that of every larger budget (verifying everything included); it can
    fall below the argmax's goodput when the optimistic bound overshoots.
    """
    scores, rows = _sorted_scores(survival, scheduled)
    s, r, t0 = _common(num_sampling, num_requests, num_non_draft_tokens, rows)
    return _walk(scores, s, r, t0, costs)


def _walk(scores: FloatArray, s: float, r: int, t0: int, costs: CostTable) -> int:
    n = scores.size
    if n == 0:
        return 0
    rate = costs.extension_rates(t0, n)
    cost = costs.draft_cost(r) + costs.verify_range(t0, t0 + n - 1)
    before = s + np.concatenate(([0.0], np.cumsum(scores[:-1])))
    include = scores * cost > before * rate
    return n if bool(include.all()) else int(np.argmin(include))


@dataclass(frozen=True, eq=False)
class BudgetStep:
    """One step's validated inputs, shared by every rule."""

    survival: FloatArray
    scheduled: IntArray
    costs: CostTable
    num_non_draft_tokens: int
    num_sampling: int
    stale_survival: FloatArray | None
    min_per_request: int

    @classmethod
    def of(
        cls,
        confidences: npt.ArrayLike,
        scheduled: npt.ArrayLike,
        costs: CostTable,
        num_non_draft_tokens: int,
        num_sampling: int,
        stale_confidences: npt.ArrayLike | None = None,
        min_per_request: int = 0,
    ) -> BudgetStep:
        c = as_matrix(confidences, "confidences")
        sched = as_scheduled(scheduled, c.shape[0], c.shape[1])
        stale = None
        if stale_confidences is not None:
            st = as_matrix(stale_confidences, "stale_confidences")
            if st.shape != c.shape:
                raise InvalidInput("stale_confidences", f"must have shape {c.shape}")
            stale = running_survival(st)
        s, _, t0 = _common(num_sampling, c.shape[0], num_non_draft_tokens, None)
        m = as_count(min_per_request, "min_per_request")
        return cls(running_survival(c), sched, costs, t0, s, stale, m)

    @property
    def num_requests(self) -> int:
        return int(self.survival.shape[0])

    @functools.cached_property
    def forced(self) -> IntArray:
        return np.asarray(np.minimum(self.scheduled, self.min_per_request), dtype=np.int64)


def _after_forced(step: BudgetStep, survival: FloatArray) -> tuple[FloatArray, float, int]:
    """Ranked free slots, expected gain and ``T0`` once the forced minimum is verified."""
    forced = step.forced
    scores = best_first_values(survival, eligible_slots(survival, step.scheduled, forced))
    if not forced.any():
        return scores, float(step.num_sampling), step.num_non_draft_tokens
    gain = step.num_sampling + float(
        survival[np.arange(survival.shape[1])[None, :] < forced[:, None]].sum()
    )
    return scores, gain, step.num_non_draft_tokens + int(forced.sum())


def _top(step: BudgetStep, survival: FloatArray) -> IntArray:
    """Size by the argmax of ``survival`` after the forced drafts; fill by current."""
    scores, gain, t0 = _after_forced(step, survival)
    size = int(np.argmax(goodput_curve(scores, gain, step.num_requests, t0, step.costs)))
    reuse = scores if survival is step.survival and not step.forced.any() else None
    return fill(step.survival, step.scheduled, step.forced, int(step.forced.sum()) + size, reuse)


def stale_rule(step: BudgetStep) -> IntArray:
    """vLLM's rule: ``B*`` from stale (last step's) survivals, top-``B*`` by current.

    Without stale confidences every stale confidence is taken as 1, the value
    vLLM gives a request it has no history for: token-independent (so still
    lossless) but optimistic, so it leans toward verifying more.
    """
    stale = step.stale_survival
    return _top(step, np.ones_like(step.survival) if stale is None else stale)


def argmax_rule(step: BudgetStep) -> IntArray:
    """Same-step global argmax, then top-``B*``. Not lossless (see module doc)."""
    return _top(step, step.survival)


def lossless_walk_rule(step: BudgetStep) -> IntArray:
    """The walk of ``lossless_walk_size`` after the per-request minimum.

    Forced drafts are verified first; they count as extra tokens of the
    step (``T0``) and their survivals as expected gain, then the walk runs over
    the remaining slots. A forced slot of request ``r`` lies before every
    walked slot of ``r``, so this reads nothing drawn at or after the slot.
    """
    scores, gain, t0 = _after_forced(step, step.survival)
    size = _walk(scores, gain, step.num_requests, t0, step.costs)
    return fill(step.survival, step.scheduled, step.forced, int(step.forced.sum()) + size, scores)


def full_rule(step: BudgetStep) -> IntArray:
    """Verify every scheduled draft: no trimming, trivially lossless."""
    return step.scheduled.copy()


class Rule(NamedTuple):
    function: Callable[[BudgetStep], IntArray]
    lossless: bool
    description: str


RULES: Mapping[str, Rule] = {
    "lossless-walk": Rule(
        lossless_walk_rule, True, "walk best first, each slot decided from above"
    ),
    "stale": Rule(stale_rule, True, "size from last step's confidences (vLLM), top-B by now"),
    "argmax": Rule(argmax_rule, False, "same-step global argmax; biased on step-shaped costs"),
    "full": Rule(full_rule, True, "verify every scheduled draft"),
}
DEFAULT_RULE = "lossless-walk"


@dataclass(frozen=True, eq=False)
class BudgetDecision:
    """What a rule chose for one step, with its expected payoff."""

    rule: str
    budget: int
    verify_lengths: IntArray
    expected_tokens: float
    cost_ms: float
    lossless: bool

    @property
    def goodput(self) -> float:
        """Expected tokens per ms."""
        return self.expected_tokens / self.cost_ms


def decide(
    rule: str,
    confidences: npt.ArrayLike,
    scheduled: npt.ArrayLike,
    costs: CostTable,
    num_non_draft_tokens: int,
    num_sampling: int,
    stale_confidences: npt.ArrayLike | None = None,
    min_per_request: int = 0,
) -> BudgetDecision:
    """Apply the named rule (``RULES``; ``DEFAULT_RULE`` is lossless) to one step.

    ``confidences[R, K]`` are this step's per-position acceptance probabilities,
    ``scheduled[R]`` the drafts scheduled per request, ``num_non_draft_tokens``
    the step's other target tokens (``T0``), ``num_sampling`` the requests that
    sample a token this step (``S``). Lossless iff ``RULES[rule].lossless``.
    """
    entry = RULES.get(rule)
    if entry is None:
        raise InvalidInput("rule", f"unknown rule {rule!r}; choose from {sorted(RULES)}")
    given = (confidences, scheduled, costs, num_non_draft_tokens, num_sampling)
    step = BudgetStep.of(*given, stale_confidences, min_per_request)
    lengths, s = entry.function(step), step.survival
    total = int(lengths.sum())
    gain = step.num_sampling + float(s[np.arange(s.shape[1])[None, :] < lengths[:, None]].sum())
    cost = costs.draft_cost(step.num_requests) + costs.verify_cost(
        step.num_non_draft_tokens + total
    )
    return BudgetDecision(rule, total, lengths, gain, cost, entry.lossless)
