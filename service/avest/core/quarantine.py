"""Robust pooling: each worker's recent evidence against the pooled model, and its bound.

Every step or round summary a worker sends becomes round statistics at the
coefficients in force (:mod:`avest.core.stats`) before it joins the pair's
round. Three of their sums say how the worker's drafts compare with what the
pooled model predicted for them, summed over positions:

    residual = sum g1_k = observed accepted - sum p     (what the model missed)
    variance = sum c_k  = sum p (1 - p)                 (the count's variance under it)
    drafts   = sum n_k

:class:`Evidence` keeps them per worker, every sum multiplied by :data:`DECAY`
at each refit of the pair (recent rounds weigh most); a round summary's are
taken as sent, at the coefficients the worker held (what it predicted against
what it saw). A worker's **score** compares its recent residual per draft with
the other workers', all measured on the pooled model, so a model that is wrong
for the whole fleet (the cold start, a workload shift) leaves every score near
zero. The others are summed up robustly (:func:`reference`): the median ``m``
of the residual rates of the workers in good standing with at least
:data:`MIN_RATE_DRAFTS` recent drafts, so a worker that floods the pair with
many times the others' drafts cannot become the yardstick they are judged by:

    z = (d_w - m) / sqrt((V_w + MIN_VARIANCE) / N_w^2 + var(m) + tau^2),
    d = residual / drafts

``V / N^2`` is the binomial variance of a mean residual; ``tau`` is the
overdispersion, the larger of :data:`TAU` and the rates' own robust spread
(honest workers serve different request mixes, so their rates differ beyond
sampling noise); :data:`MIN_VARIANCE` keeps a handful of surprising drafts,
whose count the normal approximation cannot describe, from deciding
anything. A worker is judged once :data:`MIN_PEERS` workers make up the
reference, and quarantined only while a majority of the pair's workers stays
in good standing.

A message that takes a worker beyond :data:`QUARANTINE_Z` is held back
(scored, not folded); the worker is quarantined when its next message is
beyond the margin on the same side (:data:`STRIKES` in a row): while the
pooled model moves fast (each round summary of a small fleet is a refit) an
honest worker's score can swing beyond the margin once, to one side then the
other, but a broken worker's stays on its side. A quarantined worker's data is
scored, never folded; back within :data:`RELEASE_Z` it is released.

**Bounded influence** (:class:`RoundShare`): whatever its score, what a worker
folds into one round is bounded per position: its gradient satisfies

    |G1_k| <= max(MAX_STEP (C_k + INFO_FLOOR), ROUND_SHARE C*_k)

with ``C_k`` the information it brought itself and ``C*_k`` the information
the whole pair pooled in its last round, and the slope's gradient ``G0_k``
likewise with ``A_k`` and ``A*_k``; the part beyond is dropped from
``g0_k, g1_k`` (both by the smaller of their factors). The first term is a trust
region on the worker's own data: a worker sending only drafts near ``p = 1``
that are rejected (gradient -1, almost no information each) moves the fit by
almost nothing, before anyone has scored it. The second lets an honest
worker's few such drafts (real drafters pile features at the clamp) count in
full inside a pooled round, and caps any one worker's pull on a refit at
about ROUND_SHARE in log-odds. Honest rounds, whose gradient is of the order
of their information, are untouched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from avest.core.stats import RoundStats

FloatArray = npt.NDArray[np.float64]

#: Weight the recent evidence keeps per refit of the pair: about ten refits
#: (a thousand pooled steps at the default interval), long enough for a worker's
#: score to rest on hundreds of drafts, short enough that a worker that mends
#: is released within a few dozen refits.
DECAY = 0.9
#: Overdispersion, as a rate: the spread of honest workers' acceptance around
#: the pooled model that is not sampling noise (the floor of ``tau``: the
#: workers' own spread is used when larger). Scores stay below QUARANTINE_Z
#: until a worker's recent rate differs from the others' by more than
#: QUARANTINE_Z x TAU = 0.2 on the same model. Honest fleets on the shared
#: traces (each split over 8 workers by request, chat and code pooled into one
#: pair, the greedy trace through its workload shift; raw steps and round
#: summaries) scored at most 3.6.
TAU = 0.04
#: Added to a worker's variance: four drafts' worth at p = 1/2 (the most one
#: draft carries is 1/4). Below about one expected surprise the normal
#: approximation fails (a single rejected draft at p = 0.99 would be a z of 10);
#: with it, about six drafts the model calls certain must all go the other way
#: before they alone reach QUARANTINE_Z.
MIN_VARIANCE = 1.0
#: Quarantine beyond this score: a normal tail of 6e-7 per look, so an honest
#: fleet scored at every message for months does not trip it on noise alone.
QUARANTINE_Z = 5.0
#: Messages in a row beyond the margin, on the same side, that quarantine a
#: worker (each of them is held back, not folded).
STRIKES = 2
#: Release within this score (hysteresis, so a worker near the threshold does
#: not flap in and out at every message).
RELEASE_Z = 2.5
#: Workers in good standing the reference needs, the judged one included: with
#: two, a disagreement cannot tell which of them is wrong; with three the median
#: is one of the two that agree.
MIN_PEERS = 3
#: Recent drafts a worker needs for its rate to enter the reference (its
#: residual per draft is then known to about 0.1).
MIN_RATE_DRAFTS = 20.0
#: The largest intercept step (in log-odds) one worker's round may imply: a
#: rate of 0.12 moved to 0.88. Honest rounds stay inside: of the 16,000 honest
#: messages of the shared traces' fleets (see TAU) one was cut.
MAX_STEP = 4.0
#: Information a worker's round is credited beyond its own: one draft's most,
#: p(1 - p) <= 1/4, so a worker's first surprising draft of a round always counts
#: in full.
INFO_FLOOR = 0.25
#: The share of the pair's last round's information one worker's gradient may
#: reach: a pull of half a log-odds unit at the scale of a whole round, so one
#: worker moves a refit at most half as far as a round that agrees throughout.
ROUND_SHARE = 0.5


@dataclass
class Evidence:
    """Decayed sums of one worker (or of several): residual, variance, drafts.

    ``clock`` is the pair's refit count the sums are decayed to; :meth:`at`
    brings them to a later one.
    """

    residual: float = 0.0
    variance: float = 0.0
    drafts: float = 0.0
    clock: int = 0

    def at(self, clock: int) -> Evidence:
        """These sums decayed to ``clock`` (in place; returns ``self``)."""
        if clock > self.clock:
            f = DECAY ** (clock - self.clock)
            self.residual *= f
            self.variance *= f
            self.drafts *= f
        self.clock = max(self.clock, clock)
        return self

    def add(self, stats: RoundStats) -> None:
        self.residual += float(stats.g1.sum())
        self.variance += float(stats.c.sum())
        self.drafts += float(stats.n.sum())

    def plus(self, other: Evidence, sign: float = 1.0) -> Evidence:
        """``self + sign * other`` (both at the same clock); never below zero drafts."""
        return Evidence(
            self.residual + sign * other.residual,
            max(0.0, self.variance + sign * other.variance),
            max(0.0, self.drafts + sign * other.drafts),
            max(self.clock, other.clock),
        )

    @classmethod
    def of(cls, stats: RoundStats, clock: int = 0) -> Evidence:
        out = cls(clock=clock)
        out.add(stats)
        return out


@dataclass(frozen=True)
class Reference:
    """What a worker is judged against: the median residual rate of the workers in
    good standing, the sampling variance of that median, the overdispersion, and
    how many workers it rests on."""

    rate: float
    variance: float
    overdispersion: float
    workers: int

    @property
    def judges(self) -> bool:
        return self.workers >= MIN_PEERS


#: No workers to judge against.
NO_REFERENCE = Reference(0.0, 0.0, TAU, 0)
#: The median absolute deviation times this estimates a normal standard deviation.
MAD_TO_SD = 1.4826


def reference(rates: npt.ArrayLike, pooled: Evidence) -> Reference:
    """The reference from the residual rates of the workers in good standing with at
    least :data:`MIN_RATE_DRAFTS` recent drafts (``rates``) and their evidence summed
    (``pooled``): the median; the sampling variance of the pooled rate times pi/2
    (a median's, against a mean's, for normal data); and the overdispersion, the
    larger of :data:`TAU` and the rates' own spread (their median absolute deviation,
    as a standard deviation): when the model fits the whole fleet badly (a poisoned
    start, a shift) honest rates spread further, and only a worker far outside that
    spread stands out."""
    r = np.asarray(rates, dtype=np.float64)
    if r.size == 0 or pooled.drafts <= 0.0:
        return NO_REFERENCE
    median = float(np.median(r))
    spread = MAD_TO_SD * float(np.median(np.abs(r - median)))
    var = math.pi / 2.0 * pooled.variance / pooled.drafts**2
    return Reference(median, var, max(TAU, spread), int(r.size))


def score(own: Evidence, ref: Reference) -> float:
    """The standardized difference between ``own``'s residual per draft and the
    reference's (see the module docstring); 0 without drafts to judge."""
    if own.drafts <= 0.0 or not ref.judges:
        return 0.0
    gap = own.residual / own.drafts - ref.rate
    spread = (own.variance + MIN_VARIANCE) / own.drafts**2 + ref.variance + ref.overdispersion**2
    return gap / math.sqrt(spread)


class RoundShare:
    """What one worker has folded into the pair's open round, per position, and
    the bound on it (see the module docstring)."""

    def __init__(self, k: int, round_key: object = None) -> None:
        self.round_key = round_key
        #: The gradients ``g0, g1`` folded so far ``[2, K]``, and the information
        #: ``a, c`` brought ``[2, K]``.
        self.gradient = np.zeros((2, k))
        self.information = np.zeros((2, k))

    def bound(self, stats: RoundStats, round_key: object, pooled: FloatArray) -> RoundStats:
        """``stats`` with its gradient cut to what the bound leaves this worker in
        the round ``round_key`` (a new key starts a fresh round; ``pooled``: the
        information ``a, c`` ``[2, K]`` the pair pooled in its last round); records
        what it returns as folded. The slope's gradient ``g0_k`` is bounded by
        ``a_k`` as ``g1_k`` by ``c_k``, and both are cut by the smaller factor.
        ``a, b, c, n`` are kept: the information is real."""
        if round_key != self.round_key or self.gradient.shape != (2, stats.k):
            self.round_key = round_key
            self.gradient = np.zeros((2, stats.k))
            self.information = np.zeros((2, stats.k))
        g = np.stack((stats.g0, stats.g1))
        info = self.information + np.stack((stats.a, stats.c))
        limit = np.maximum(MAX_STEP * (info + INFO_FLOOR), ROUND_SHARE * pooled)
        total = self.gradient + g
        over = np.abs(total) > limit
        self.information = info
        if not over.any():
            self.gradient = total
            return stats
        kept = np.clip(total, -limit, limit) - self.gradient
        with np.errstate(divide="ignore", invalid="ignore"):
            factor = np.clip(np.where(over, kept / g, 1.0), 0.0, 1.0).min(axis=0)
        self.gradient = self.gradient + g * factor
        return RoundStats(
            a=stats.a, b=stats.b, c=stats.c, g0=stats.g0 * factor, g1=stats.g1 * factor, n=stats.n
        )
