"""Monte Carlo audit: does a budget rule keep speculative sampling lossless?

Speculative sampling emits exactly the target's distribution whatever the
drafter, as long as the number of drafts verified never depends on the draft
token being verified (docs/design.md §3). A budget rule can break that quietly, so this
module simulates one decoding step many times on a toy small enough to know
the target exactly, and compares what comes out with it by a χ² test.

The toy: two requests, two draft positions, a two-token vocabulary. Each
request draws a *context*, which fixes the target ``p`` and draft ``q``
distributions at both positions. The drafter is either *parallel* (position 1
is drafted from the context alone, as if position 0 had been the drafter's own
top token) or *autoregressive* (position 1 is drafted after the token actually
drawn at position 0, so its confidence — and the survival of slot 1 — depend
on that token). Confidences come from a fixed model of ``q_max``:
``sigmoid(slope · logit(q_max) + intercept)``. The rule sees only confidences;
verification is standard rejection sampling (accept ``x`` with
``min(1, p(x)/q(x))``, else resample from ``max(p - q, 0)``; a bonus token from
``p`` after the last verified draft). Request 0's first two emitted tokens are
recorded; when the step emits only one, the second is drawn from the target,
as the next (exact) step would. Trials share a handful of distinct confidence
patterns, so the rule runs once per pattern and the rest is vectorised.

The default toy is tuned so that the same-step ``argmax`` rule, with an
autoregressive drafter and a fixed-overhead or padded-bucket cost, verifies
request 0's first draft exactly when that draft is the drafter's favourite
token: the first emitted token then comes out ``0.5 · (1 + 0.32) = 0.66``
instead of ``0.5``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from avest.core.budget import RULES, decide
from avest.core.costs import CostTable, affine_costs, bucket_costs, overhead_costs
from avest.core.numeric import sigmoid
from avest_wire.errors import InvalidInput
from avest_wire.limits import MAX_LOG_ODDS

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

DRAFTERS = ("parallel", "autoregressive")
#: Significance level of the verdict (applied to the Bonferroni-combined p).
ALPHA = 1e-3


@dataclass(frozen=True)
class Context:
    """Target and draft distributions of one context over ``V`` tokens."""

    p0: tuple[float, ...]  # target, position 0
    p1: tuple[tuple[float, ...], ...]  # target, position 1, row = token at 0
    q0: tuple[float, ...]  # draft, position 0
    q1: tuple[tuple[float, ...], ...]  # draft, position 1, row = token drawn at 0


@dataclass(frozen=True)
class Toy:
    """Contexts and, per request, the probability of each context."""

    contexts: tuple[Context, ...]
    mix: tuple[tuple[float, ...], ...]  # [requests][contexts]
    slope: float = 1.0
    intercept: float = 0.0

    def arrays(self) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray, FloatArray]:
        """``p0 [C, V]``, ``p1 [C, V, V]``, ``q0``, ``q1`` and ``mix [R, C]``."""
        get = [np.array([getattr(c, f) for c in self.contexts]) for f in ("p0", "p1", "q0", "q1")]
        return get[0], get[1], get[2], get[3], np.array(self.mix, dtype=np.float64)


def two_token_toy() -> Toy:
    """The docs/design.md §3 example: two tokens, two positions, two requests.

    Request 0 drafts its favourite token with ``q = 0.68`` where the target
    says 0.5; after that token the drafter is sure of the next one (0.99),
    after the other it is not (0.5). Request 1 is a less confident bystander
    whose context varies, so budgets vary from trial to trial.
    """
    half = (0.5, 0.5)
    req0 = Context(half, ((0.7, 0.3), (0.2, 0.8)), (0.68, 0.32), ((0.99, 0.01), half))
    req1a = Context((0.6, 0.4), ((0.5, 0.5), (0.3, 0.7)), half, (half, half))
    req1b = Context((0.3, 0.7), ((0.6, 0.4), (0.1, 0.9)), (0.55, 0.45), ((0.7, 0.3), half))
    return Toy((req0, req1a, req1b), ((1.0, 0.0, 0.0), (0.0, 0.5, 0.5)))


def cost_profiles() -> dict[str, CostTable]:
    """Affine (single-peaked goodput), fixed overhead and padded buckets.

    With 2 requests, ``T0 = 2`` non-draft tokens and at most 4 drafts, the
    overhead is paid by any draft and the buckets pad 3-4 tokens to 4 and 5-6
    to 8. The draft step costs 0.1 ms for every budget.
    """
    return {
        "affine": affine_costs(
            draft_base=0.1, draft_per_request=0.0, verify_base=0.6, verify_per_token=0.2
        ),
        "overhead": overhead_costs(
            draft_ms=0.1, verify_base=1.0, overhead=0.92, per_token=0.05, free_tokens=2
        ),
        "buckets": bucket_costs(draft_ms=0.1, buckets=[(2, 1.0), (4, 1.71), (8, 2.12)]),
    }


@dataclass(frozen=True)
class AuditResult:
    """Emitted vs target distribution of request 0's first one and two tokens."""

    rule: str
    lossless_claim: bool
    drafter: str
    costs: str
    trials: int
    emitted_first: tuple[float, ...]
    target_first: tuple[float, ...]
    chi2_first: float
    p_first: float
    emitted_pair: tuple[float, ...]  # index t0 * V + t1
    target_pair: tuple[float, ...]
    chi2_pair: float
    p_pair: float
    mean_verified: float  # drafts verified per step, all requests
    tokens_per_ms: float  # realised tokens (all requests) over modelled step time

    @property
    def p_value(self) -> float:
        """Both tests combined (Bonferroni): ``min(1, 2 min(p_first, p_pair))``."""
        return min(1.0, 2.0 * min(self.p_first, self.p_pair))

    def verdict(self, alpha: float = ALPHA) -> str:
        return "PASS" if self.p_value >= alpha else "BIASED"


def chi2_sf(x: float, df: int) -> float:
    """``P(χ²_df > x)``: the regularized upper incomplete gamma ``Q(df/2, x/2)``."""
    if df < 1:
        raise InvalidInput("df", f"must be >= 1, got {df}")
    return _gamma_q(df / 2.0, x / 2.0)


def _gamma_q(a: float, x: float) -> float:
    """``Q(a, x)`` by the power series (``x < a + 1``) or Lentz's continued fraction."""
    if x <= 0.0:
        return 1.0
    if math.isinf(x):
        return 0.0
    log_front = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1.0:
        term = total = 1.0 / a
        ap = a
        for _ in range(1000):
            ap += 1.0
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300
    b = x + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        h *= d * c
        if abs(d * c - 1.0) < 1e-16:
            break
    return math.exp(log_front) * h


def chi2_statistic(counts: npt.ArrayLike, probs: npt.ArrayLike) -> tuple[float, int]:
    """Pearson's χ² of ``counts`` against ``probs``, and its degrees of freedom.

    Categories the target never emits are left out of the sum; a count in one
    of them makes the statistic infinite (p = 0).
    """
    n_obs = np.asarray(counts, dtype=np.float64)
    p = np.asarray(probs, dtype=np.float64)
    live = p > 0
    if np.any(n_obs[~live] > 0):
        return math.inf, max(int(live.sum()) - 1, 1)
    expected = n_obs.sum() * p[live]
    stat = float(np.sum((n_obs[live] - expected) ** 2 / expected))
    return stat, max(int(live.sum()) - 1, 1)


def _confidence(q: FloatArray, toy: Toy) -> FloatArray:
    """``sigmoid(slope · logit(q_max) + intercept)`` over the last axis, stably."""
    top = q.max(axis=-1)
    rest = q.sum(axis=-1) - top
    with np.errstate(divide="ignore"):
        x = np.clip(np.log(top) - np.log(rest), -MAX_LOG_ODDS, MAX_LOG_ODDS)
    return sigmoid(toy.slope * x + toy.intercept)


def _cdf(probs: FloatArray) -> FloatArray:
    """Row-wise CDFs of ``probs [..., V]`` flattened to ``[states, V]``, last column 1."""
    rows = probs.reshape(-1, probs.shape[-1])
    return np.asarray(np.cumsum(rows, axis=1) / rows.sum(axis=1, keepdims=True))


def _draw(cdf: FloatArray, state: IntArray, rng: np.random.Generator) -> IntArray:
    """One categorical draw per element of ``state`` from the row ``cdf[state]``."""
    u = rng.random(state.shape)
    token = np.zeros(state.shape, dtype=np.int64)
    for v in range(cdf.shape[1] - 1):  # the vocabulary is tiny
        token += u >= cdf[:, v][state]
    return token


def _residual(p: FloatArray, q: FloatArray) -> FloatArray:
    """``max(p - q, 0)``; where ``p == q`` (nothing left) ``p``: never used there."""
    r = np.maximum(p - q, 0.0)
    return np.where(r.sum(axis=-1, keepdims=True) > 0, r, p)


def _accept(p: FloatArray, q: FloatArray) -> FloatArray:
    """``min(1, p / q)``, the chance a draft token is accepted (1 where ``q = 0``)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(q > 0, np.minimum(1.0, p / q), 1.0)


def run_audit(
    rule: str,
    drafter: str,
    costs: str,
    trials: int = 200_000,
    seed: int = 0,
    toy: Toy | None = None,
    profiles: Mapping[str, CostTable] | None = None,
) -> AuditResult:
    """Simulate ``trials`` steps under ``rule`` and test request 0's output.

    Every distribution is tabulated per small integer state (context, token)
    first, so each trial costs a few table look-ups.
    """
    if rule not in RULES:
        raise InvalidInput("rule", f"unknown rule {rule!r}; choose from {sorted(RULES)}")
    if drafter not in DRAFTERS:
        raise InvalidInput("drafter", f"must be one of {DRAFTERS}, got {drafter!r}")
    table = (profiles or cost_profiles()).get(costs)
    if table is None:
        raise InvalidInput("costs", f"unknown cost profile {costs!r}")
    if trials < 1:
        raise InvalidInput("trials", f"must be >= 1, got {trials}")
    toy = toy or two_token_toy()
    p0, p1, q0, q1, mix = toy.arrays()
    n_req, n_ctx = mix.shape
    vocab = p0.shape[1]
    if drafter == "parallel":  # position 1 drafted as if position 0 were q0's argmax
        q1 = np.repeat(q1[np.arange(n_ctx), np.argmax(q0, axis=1)][:, None, :], vocab, axis=1)
    conf0, conf1 = _confidence(q0, toy), _confidence(q1, toy)  # [C], [C, V]
    rng = np.random.default_rng(seed)

    ctx = _draw(_cdf(mix), np.broadcast_to(np.arange(n_req), (trials, n_req)), rng)
    x0 = _draw(_cdf(q0), ctx, rng)
    stale_x0 = _draw(_cdf(q0), ctx, rng)  # last step's draft: independent of this one
    after0 = ctx * vocab + x0  # state (context, token at 0)
    x1 = _draw(_cdf(q1), after0, rng)

    # The rule once per distinct (context, token, stale token) pattern.
    state = after0 * vocab + stale_x0
    code = state @ (n_ctx * vocab * vocab) ** np.arange(n_req)
    patterns, inverse = np.unique(code, return_inverse=True)
    lengths = np.empty((patterns.size, n_req), dtype=np.int64)
    cost_ms = np.empty(patterns.size)
    for i, t in enumerate(np.unique(inverse.reshape(-1), return_index=True)[1]):
        c, x, xs = ctx[t], x0[t], stale_x0[t]
        conf = np.stack([conf0[c], conf1[c, x]], axis=1)
        stale = np.stack([conf0[c], conf1[c, xs]], axis=1)
        d = decide(rule, conf, np.full(n_req, 2), table, n_req, n_req, stale)
        lengths[i], cost_ms[i] = d.verify_lengths, d.cost_ms
    inverse = inverse.reshape(-1)
    verify_len = lengths[inverse]

    accept0 = rng.random(x0.shape) < _accept(p0, q0).reshape(-1)[after0]
    tok0 = np.where(accept0, x0, _draw(_cdf(_residual(p0, q0)), ctx, rng))
    emitted0 = np.where(verify_len >= 1, tok0, _draw(_cdf(p0), ctx, rng))
    accept1 = rng.random(x1.shape) < _accept(p1, q1).reshape(-1)[after0 * vocab + x1]
    tok1 = np.where(accept1, x1, _draw(_cdf(_residual(p1, q1)), after0, rng))
    on_to_1 = (verify_len >= 2) & accept0
    # Otherwise the next token is a bonus or the next step's: exact target.
    fresh1 = _draw(_cdf(p1), ctx * vocab + emitted0, rng)
    emitted1 = np.where(on_to_1, tok1, fresh1)
    tokens = 1 + ((verify_len >= 1) & accept0) + (on_to_1 & accept1)

    first_counts = np.bincount(emitted0[:, 0], minlength=vocab)
    pair_counts = np.bincount(emitted0[:, 0] * vocab + emitted1[:, 0], minlength=vocab * vocab)
    target_first = mix[0] @ p0
    target_pair = np.einsum("c,ca,cab->ab", mix[0], p0, p1).reshape(-1)
    chi_f, df_f = chi2_statistic(first_counts, target_first)
    chi_p, df_p = chi2_statistic(pair_counts, target_pair)
    return AuditResult(
        rule=rule,
        lossless_claim=RULES[rule].lossless,
        drafter=drafter,
        costs=costs,
        trials=trials,
        emitted_first=tuple(float(v) for v in first_counts / trials),
        target_first=tuple(float(v) for v in target_first),
        chi2_first=chi_f,
        p_first=chi2_sf(chi_f, df_f),
        emitted_pair=tuple(float(v) for v in pair_counts / trials),
        target_pair=tuple(float(v) for v in target_pair),
        chi2_pair=chi_p,
        p_pair=chi2_sf(chi_p, df_p),
        mean_verified=float(verify_len.sum() / trials),
        tokens_per_ms=float(tokens.sum() / cost_ms[inverse].sum()),
    )


def audit_all(trials: int = 200_000, seed: int = 0) -> list[AuditResult]:
    """Every rule × drafter × cost profile, each with its own derived seed."""
    profiles = cost_profiles()
    combos = [(r, d, c) for r in RULES for d in DRAFTERS for c in profiles]
    seeds = np.random.SeedSequence(seed).generate_state(len(combos))
    return [
        run_audit(r, d, c, trials, int(s), profiles=profiles)
        for (r, d, c), s in zip(combos, seeds, strict=True)
    ]
