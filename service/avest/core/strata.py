"""Strata: a coefficient set per kind of request, beside the pair's own.

One pair's batches mix requests that sample differently (greedy beside
temperature 0.7 or 1.0), and one coefficient set for all of them is
miscalibrated for each kind (their slopes differ: about 1.0 greedy against 0.67
at T = 0.7 on the shared traces) while the errors cancel in the overall
measures. A :class:`StratifiedEstimator` keeps:

- the pair's pooled :class:`~avest.core.estimator.OnlineEstimator`, fed every
  draft exactly as without strata: its coefficients are what a worker without
  strata uses, and stay what they were;
- per stratum (:func:`avest_wire.strata.stratum_of`), its own slope and
  intercepts. The pair's default rule (:class:`~avest.core.tracking.TrackingRule`,
  with its carried information, innovation test and bounds) refits the
  stratum's own fit on the stratum's own round statistics whenever the pair
  refits. What the stratum serves is one ridge Newton step from that fit with a
  Gaussian prior centred on the pair's coefficients (:func:`shrink`): the
  stratum's likelihood as its rule's quadratic (the carried information) plus
  the prior. The prior's precision is that of ``prior_drafts`` pseudo-drafts
  per position with the stratum's own features, so its share fades as the
  stratum's own information grows: a thin stratum stays near the pair's
  coefficients, a busy one serves its own maximum-likelihood fit.

A new stratum starts from the pair's coefficients. A stratum that holds every
draft of a round is the pair for that round and takes the pair's refit as its
own, so traffic of one stratum is predicted exactly as today. Past
``max_strata`` strata a new one is predicted with the pair's coefficients and
counted (:attr:`StratifiedEstimator.fallback_rows`); a stratum without drafts for
``idle_rounds`` refits is retired, freeing its place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from avest.core.estimator import Batch, OnlineEstimator
from avest.core.metrics import CalibrationState
from avest.core.model import Coefficients, linear_predictor
from avest.core.rules import Refit, arrowhead_matvec
from avest.core.stats import RoundStats, fold
from avest.core.summary import add_sketch, rebase
from avest.core.tracking import DEFAULT_TRACKING, TrackingConfig, TrackingRule, solve_arrowhead
from avest_wire.strata import MAX_STRATA, check_stratum
from avest_wire.summary import Sketch

FloatArray = npt.NDArray[np.float64]

#: Pseudo-drafts per position in a stratum's prior toward the pair's
#: coefficients, at ``p = 1/2`` (information 1/4 each): a stratum whose carried
#: information per position is that of 32 such drafts (a few dozen labels, more
#: where its predictions are confident) serves halfway between the pair's set
#: and its own fit; a busy one (thousands of drafts in the rule's ten-round
#: memory) keeps about 1 % of the pull. Larger keeps thin strata nearer the
#: pair's set for longer.
DEFAULT_PRIOR_DRAFTS = 32.0
#: Refits without a draft before a stratum is retired: 50 rounds (5,000 steps at
#: the default refit interval), far past the carried information's ten-round
#: memory, so a stratum that comes back after that is as good as new anyway.
DEFAULT_IDLE_ROUNDS = 50
#: ``p(1 - p)`` of a pseudo-draft: the information of a draft at ``p = 1/2``.
_PSEUDO_WEIGHT = 0.25


@dataclass(frozen=True)
class StrataConfig:
    """The strata's bounds and their pull toward the pair's coefficients."""

    #: Most strata fitted at once (:data:`avest_wire.strata.MAX_STRATA`).
    max_strata: int = MAX_STRATA
    #: See :data:`DEFAULT_PRIOR_DRAFTS`; 0 serves each stratum's own fit.
    prior_drafts: float = DEFAULT_PRIOR_DRAFTS
    #: See :data:`DEFAULT_IDLE_ROUNDS`.
    idle_rounds: int = DEFAULT_IDLE_ROUNDS
    #: The strata's update rule: the pair's default rule.
    tracking: TrackingConfig = DEFAULT_TRACKING

    def __post_init__(self) -> None:
        if not 1 <= self.max_strata <= MAX_STRATA:
            raise ValueError(f"max_strata must be in [1, {MAX_STRATA}]")
        if not self.prior_drafts >= 0.0:
            raise ValueError("prior_drafts must be >= 0")
        if self.idle_rounds < 1:
            raise ValueError("idle_rounds must be >= 1")


@dataclass
class Stratum:
    """One stratum: its own fit, what it serves, its open round and counters."""

    #: The rule's fit on the stratum's drafts alone (its rounds are folded at it).
    fit: Coefficients
    #: Served: the fit shrunk toward the pair's coefficients (:func:`shrink`).
    coefficients: Coefficients
    rule: TrackingRule
    round_stats: RoundStats
    #: Refits of the pair since this stratum last had a draft.
    idle: int = 0
    #: Refits that moved this stratum on its own drafts.
    rounds: int = 0
    drafts: int = 0
    #: Labelled drafts folded in the open round.
    round_drafts: int = 0
    #: The pair's coefficients when the stratum was placed (its rule's start).
    start: Coefficients | None = None
    #: Calibration of what the stratum served (predict, then learn): each raw row
    #: scored at the stratum's served coefficients, and the sketches its summaries
    #: carry (scored by their worker).
    calibration: CalibrationState | None = None


def shrink(
    fit: Coefficients,
    centre: Coefficients,
    information: tuple[float, FloatArray, FloatArray],
    drafts: float,
) -> Coefficients:
    """One ridge Newton step from ``fit`` with a Gaussian prior centred on ``centre``.

    ``information``: the arrowhead ``(a, b, c)`` of the information carried with
    ``fit`` (a rule's quadratic centred on it). The prior's precision ``P`` is that
    of ``drafts`` pseudo-drafts per position at weight 1/4, at the position's mean
    feature ``b_k / c_k`` and with the features' within-position spread (a position
    without information: its intercept alone). The step solves
    ``(I + P) d = -P (fit - centre)``: the mode of the quadratic times the prior.
    A slope the step would make negative is set to 0, the intercepts solved for it.
    """
    a, b, c = information
    k = b.shape[0]
    live = c > 0
    mean = np.where(live, b / np.where(live, c, 1.0), 0.0)
    weight = float(c[live].sum())
    spread = (a - float(np.sum(b[live] ** 2 / c[live]))) / weight if weight > 0 else 0.0
    w = drafts * _PSEUDO_WEIGHT
    pa = w * (float(np.sum(mean**2)) + k * max(spread, 0.0))
    pb = w * mean
    pc = np.full(k, w)
    pull = -arrowhead_matvec(pa, pb, pc, fit.as_vector() - centre.as_vector())
    system = (a + pa, b + pb, c + pc)
    step = solve_arrowhead(*system, pull)
    if np.all(np.isfinite(step)) and fit.slope + step[0] < 0.0:
        step = solve_arrowhead(*system, pull, slope_step=-fit.slope)
    if not np.all(np.isfinite(step)):
        return centre
    return Coefficients.from_vector(fit.as_vector() + step)


class StratifiedEstimator:
    """A pair's pooled estimator plus a coefficient set per stratum."""

    def __init__(self, pooled: OnlineEstimator, config: StrataConfig | None = None) -> None:
        self.pooled = pooled
        self.config = config if config is not None else StrataConfig()
        self.strata: dict[str, Stratum] = {}
        #: Rows (requests' steps) predicted with the pair's coefficients because
        #: their stratum found no place, and the labelled drafts among them.
        self.fallback_rows = 0
        self.fallback_drafts = 0
        #: The last stratum that found no place (for the one log line).
        self.last_fallback: str | None = None
        #: Strata retired for idleness.
        self.retired = 0

    @property
    def k(self) -> int:
        return self.pooled.k

    def coefficients_for(self, stratum: str) -> Coefficients:
        """The coefficients that predict ``stratum``'s drafts (the pair's when it has no place)."""
        own = self.strata.get(stratum)
        return own.coefficients if own is not None else self.pooled.coefficients

    def linear_predictor(self, features: npt.ArrayLike, strata: Sequence[str]) -> FloatArray:
        """``eta [R, K]`` of each row at its stratum's coefficients."""
        x = np.asarray(features, dtype=np.float64)
        names, inverse = _groups(strata, x.shape[0])
        slope = np.empty(len(names))
        intercepts = np.empty((len(names), x.shape[1]))
        for i, name in enumerate(names):
            coef = self.coefficients_for(name)
            slope[i] = coef.slope
            intercepts[i] = coef.intercept_array()
        return np.asarray(slope[inverse, None] * x + intercepts[inverse], dtype=np.float64)

    def _place(self, name: str, rows: int, drafts: int) -> Stratum | None:
        own = self.strata.get(name)
        if own is not None:
            return own
        if len(self.strata) >= self.config.max_strata:
            self.fallback_rows += rows
            self.fallback_drafts += drafts
            self.last_fallback = name
            return None
        start = self.pooled.coefficients
        # Nothing carried: the pair's information is every stratum's and would
        # hold a new stratum at the pair's coefficients; the prior does that,
        # fading with the stratum's own information.
        rule = TrackingRule(self.config.tracking)
        rule.reset(start)
        own = Stratum(
            start,
            start,
            rule,
            RoundStats.zeros(self.k),
            start=start,
            calibration=CalibrationState.empty(self.k),
        )
        self.strata[name] = own
        return own

    def apply(self, batch: Batch, strata: Sequence[str]) -> Refit | None:
        """Fold one validated step whose row ``r`` is in stratum ``strata[r]``;
        refit the pair and every stratum when the pair's round is full.

        Every name is checked (:func:`avest_wire.strata.check_stratum`) before
        anything changes."""
        self.fold_rows(batch, strata)
        self.pooled.apply(batch, refit=False)
        return self.refit() if self.pooled.round_full else None

    def fold_rows(self, batch: Batch, strata: Sequence[str]) -> None:
        """The strata's part of :meth:`apply`: each stratum's rows into its open round
        (the pair's estimator is the caller's to feed)."""
        names, inverse = _groups(strata, batch.features.shape[0])
        for name in names:
            check_stratum(name)
        for i, name in enumerate(names):
            rows = inverse == i
            observed = batch.observed[rows]
            labelled = int(observed.sum())
            own = self._place(name, int(rows.sum()), labelled)
            if own is None:
                continue
            x = batch.features[rows]
            accepted = batch.accepted[rows]
            eta = linear_predictor(own.fit, x)
            own.round_stats.add_(fold(x, eta, observed, accepted))
            own.round_drafts += labelled
            own.drafts += labelled
            if own.calibration is not None:
                served = eta if own.coefficients == own.fit else None
                if served is None:
                    served = linear_predictor(own.coefficients, x)
                own.calibration.update(served, observed, accepted)

    def add_summary(
        self,
        name: str,
        stats: RoundStats,
        at: Coefficients,
        drafts: int,
        sketch: Sketch | None = None,
    ) -> None:
        """One stratum's round in summary form (sums computed at ``at``, moved to the
        stratum's fit first) into its open round, its calibration ``sketch`` into the
        stratum's measures; the pair's estimator is the caller's to feed with the
        same summary."""
        check_stratum(name)
        own = self._place(name, 1, drafts)
        if own is None:
            return
        own.round_stats.add_(rebase(stats, at, own.fit))
        own.round_drafts += drafts
        own.drafts += drafts
        if sketch is not None and own.calibration is not None:
            add_sketch(sketch, own.calibration)

    def refit(self) -> Refit:
        """Close the pair's round, then every stratum's; each serves its fit
        shrunk toward the pair's new coefficients."""
        pair_drafts = self.pooled.round_stats.labelled()
        result = self.pooled.refit()
        self.refit_strata(pair_drafts)
        return result

    def refit_strata(self, pair_drafts: int) -> None:
        """The strata's part of :meth:`refit`, once the pair's estimator refitted a
        round of ``pair_drafts`` labelled drafts."""
        centre = self.pooled.coefficients
        for name in list(self.strata):
            own = self.strata[name]
            if own.round_drafts == 0:
                own.idle += 1
                if own.idle >= self.config.idle_rounds:
                    del self.strata[name]
                    self.retired += 1
                    continue
            else:
                own.idle = 0
                own.rounds += 1
                own.fit = own.rule.refit(own.fit, own.round_stats).coefficients
                if own.round_drafts == pair_drafts:
                    # The stratum held the whole round: it is the pair for it.
                    own.fit = centre
            own.round_stats = RoundStats.zeros(self.k)
            own.round_drafts = 0
            own.coefficients = self._served(own, centre)

    def reset(self) -> None:
        """Forget every stratum and counter (the pair's estimator was reset)."""
        self.strata.clear()
        self.fallback_rows = self.fallback_drafts = self.retired = 0
        self.last_fallback = None

    # -- persistence ------------------------------------------------------

    def snapshot(self) -> dict[str, npt.NDArray[np.generic]]:
        """The strata as named arrays under ``strata.`` (none while there are no
        strata and nothing was counted): names, then per stratum ``strata.<i>.``
        its start, fit, served coefficients, counters, open round and rule state."""
        counters = [self.fallback_rows, self.fallback_drafts, self.retired]
        if not self.strata and not any(counters):
            return {}
        names = "\n".join(self.strata).encode()
        out: dict[str, npt.NDArray[np.generic]] = {
            "strata.names": np.frombuffer(names, dtype=np.uint8).copy(),
            "strata.counters": np.array(counters, dtype=np.float64),
        }
        for i, own in enumerate(self.strata.values()):
            p = f"strata.{i}."
            out[p + "start"] = (own.start or own.fit).as_vector()
            out[p + "fit"] = own.fit.as_vector()
            out[p + "coefficients"] = own.coefficients.as_vector()
            out[p + "counters"] = np.array(
                [own.idle, own.rounds, own.drafts, own.round_drafts], dtype=np.float64
            )
            out.update({f"{p}round.{n}": v for n, v in own.round_stats.to_arrays().items()})
            if own.calibration is not None:
                cal = own.calibration.to_arrays()
                out.update({f"{p}calibration.{n}": v for n, v in cal.items()})
            out.update({f"{p}rule.{n}": v.copy() for n, v in own.rule.state().items()})
        return out

    def restore(self, arrays: dict[str, npt.NDArray[np.generic]]) -> None:
        """Resume from :meth:`snapshot` output (arrays without ``strata.`` keys: none)."""
        self.reset()
        if "strata.names" not in arrays:
            return
        raw = np.asarray(arrays["strata.names"], dtype=np.uint8).tobytes().decode()
        names = raw.split("\n") if raw else []
        counters = [int(v) for v in np.asarray(arrays["strata.counters"])]
        self.fallback_rows, self.fallback_drafts, self.retired = counters

        def part(prefix: str) -> dict[str, FloatArray]:
            return {
                n[len(prefix) :]: np.asarray(v, dtype=np.float64)
                for n, v in arrays.items()
                if n.startswith(prefix)
            }

        for i, name in enumerate(names):
            p = f"strata.{i}."
            start = Coefficients.from_vector(np.asarray(arrays[p + "start"], dtype=np.float64))
            rule = TrackingRule(self.config.tracking)
            rule.reset(start)
            rule.load_state(part(p + "rule."))
            own = Stratum(
                Coefficients.from_vector(np.asarray(arrays[p + "fit"], dtype=np.float64)),
                Coefficients.from_vector(np.asarray(arrays[p + "coefficients"], dtype=np.float64)),
                rule,
                RoundStats.from_arrays(part(p + "round.")),
                start=start,
            )
            cal = part(p + "calibration.")
            own.calibration = (
                CalibrationState.from_arrays(cal) if cal else CalibrationState.empty(self.k)
            )
            own.idle, own.rounds, own.drafts, own.round_drafts = (
                int(v) for v in np.asarray(arrays[p + "counters"])
            )
            self.strata[check_stratum(name)] = own

    def _served(self, own: Stratum, centre: Coefficients) -> Coefficients:
        if own.fit == centre or self.config.prior_drafts <= 0.0:
            return own.fit
        state = own.rule.state()
        information = (float(state["a"][0]), state["b"], state["c"])
        return shrink(own.fit, centre, information, self.config.prior_drafts)


def _groups(strata: Sequence[str], rows: int) -> tuple[list[str], npt.NDArray[np.intp]]:
    """The distinct names of ``strata`` (one per row) and each row's index among them."""
    if len(strata) != rows:
        raise ValueError(f"strata has {len(strata)} entries for {rows} rows")
    index: dict[str, int] = {}
    inverse = np.fromiter((index.setdefault(s, len(index)) for s in strata), np.intp, rows)
    return list(index), inverse
