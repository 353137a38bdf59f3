"""Policies and results of ``avest simulate`` (see ``avest.offline.simulate.engine``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from avest.core.budget import DEFAULT_RULE, RULES
from avest.offline.simulate.profiles import CostProfile

DEFAULT_CONCURRENCY = (8, 16, 32, 64, 128)
#: Confidence sources other than the estimator, run under ``baseline_rule``.
BASELINES = {
    "mle": "in-sample maximum-likelihood linear fit of the whole trace: what the model can know",
    "qmax-nofit": "q_max itself (sigmoid of the feature), no fit",
    "position-rate": "per-position running acceptance rate, no feature",
    "oracle": "true acceptance rate given the distributions (accept_rate_dist): the ceiling",
}


#: The estimator's served confidences through the calibration layer.
CALIBRATED = "avest+calibration"
#: The draft-length schedule computed online from the estimator (avest.core.schedule).
SCHEDULED = "schedule"
#: The estimator with a coefficient set per stratum (avest.core.strata): on traces
#: that carry a ``stratum`` array only.
STRATIFIED = "avest+strata"
#: The in-sample maximum-likelihood linear fit of each stratum's rows (with ``avest+strata``).
STRATIFIED_MLE = "mle+strata"


@dataclass(frozen=True)
class Policy:
    name: str
    kind: str  # "fixed", "avest" or a key of BASELINES
    length: int = 0  # fixed: drafts verified (and drafted) per request
    rule: str = ""  # adaptive: the budget rule
    lossless: bool = True
    description: str = ""
    drafts: int = 0  # positions drafted per request (fixed: = length)

    @property
    def adaptive(self) -> bool:
        return self.kind != "fixed"


def make_policies(
    k: int,
    has_oracle: bool,
    baseline_rule: str = DEFAULT_RULE,
    draft_lengths: Iterable[int] | None = None,
    select: Sequence[str] | None = None,
    strata: bool = False,
) -> list[Policy]:
    """Fixed lengths ``0..k``, avest under every budget rule, then the baselines.

    ``fixed-0`` is speculation off (nothing drafted, nothing verified): a
    fixed length like the others, so a gain over the best fixed length is
    never a gain from merely switching speculation off. ``avest+calibration``
    is the estimator's served confidences through the calibration layer
    (under ``baseline_rule``). With ``strata`` (a trace that carries a
    ``stratum`` array), ``avest+strata`` follows it: the same estimator plus a
    coefficient set per stratum, each row predicted by its stratum's (under
    ``baseline_rule``; against ``avest/<baseline_rule>``, the one set), then
    ``mle+strata``, the in-sample fit of each stratum (against ``mle``).

    Adaptive policies draft ``k`` positions, or each of ``draft_lengths``
    (a name gets ``@d`` when ``d < k``: vLLM with ``num_speculative_tokens =
    d`` and adaptive verification on). ``select`` keeps only the adaptive
    policies whose name matches one of its shell-style patterns; the fixed
    lengths are always kept (every gain is measured against them).
    """
    if baseline_rule not in RULES:
        raise ValueError(f"unknown budget rule {baseline_rule!r}; choose from {sorted(RULES)}")
    lengths = sorted({int(d) for d in (draft_lengths or [k])}, reverse=True)
    if lengths[-1] < 1 or lengths[0] > k:
        raise ValueError(f"draft lengths must lie in [1, K={k}], got {lengths}")
    out = [
        Policy(
            f"fixed-{v}",
            "fixed",
            length=v,
            description=f"draft and verify {v}" if v else "speculation off",
            drafts=v,
        )
        for v in range(0, k + 1)
    ]
    lossless = RULES[baseline_rule].lossless
    adaptive = []
    for d in lengths:
        at = "" if d == k else f"@{d}"
        for rule, entry in RULES.items():
            adaptive.append(
                Policy(f"avest/{rule}{at}", "avest", 0, rule, entry.lossless, entry.description, d)
            )
        adaptive.append(
            Policy(
                f"{CALIBRATED}/{baseline_rule}{at}",
                CALIBRATED,
                0,
                baseline_rule,
                lossless,
                "the avest estimator served through the calibration layer",
                d,
            )
        )
        if strata:
            adaptive.append(
                Policy(
                    f"{STRATIFIED}/{baseline_rule}{at}",
                    STRATIFIED,
                    0,
                    baseline_rule,
                    lossless,
                    "the avest estimator plus a coefficient set per stratum (avest.core.strata)",
                    d,
                )
            )
            adaptive.append(
                Policy(
                    f"{STRATIFIED_MLE}/{baseline_rule}{at}",
                    STRATIFIED_MLE,
                    0,
                    baseline_rule,
                    lossless,
                    "in-sample maximum-likelihood linear fit of each stratum's rows: what a "
                    "linear model per stratum can know (against mle, one fit)",
                    d,
                )
            )
        for kind, text in BASELINES.items():
            if kind != "oracle" or has_oracle:
                name = f"{kind}/{baseline_rule}{at}"
                adaptive.append(Policy(name, kind, 0, baseline_rule, lossless, text, d))
    adaptive.append(
        Policy(
            SCHEDULED,
            SCHEDULED,
            0,
            DEFAULT_RULE,
            RULES[DEFAULT_RULE].lossless,
            "the draft-length schedule (length, AV on or off) computed online from the estimator",
            k,
        )
    )
    if select:
        adaptive = [p for p in adaptive if any(fnmatchcase(p.name, pat) for pat in select)]
    return out + adaptive


@dataclass
class Totals:
    """One policy at one concurrency: sums over the measured steps."""

    concurrency: int
    steps: int = 0
    time_ms: float = 0.0
    tokens: int = 0
    accepted: int = 0
    verified: int = 0
    refits: int | None = None

    @property
    def throughput(self) -> float:
        """Output tokens per second."""
        return 1000.0 * self.tokens / self.time_ms if self.time_ms > 0 else float("nan")

    @property
    def per_request(self) -> float:
        """Output tokens per second per request (interactivity)."""
        return self.throughput / self.concurrency

    @property
    def acceptance_length(self) -> float:
        """Tokens per request per step: 1 + accepted drafts (vLLM's mean acceptance length)."""
        return self.tokens / (self.steps * self.concurrency) if self.steps else float("nan")

    @property
    def verified_per_step(self) -> float:
        return self.verified / self.steps if self.steps else float("nan")

    @property
    def verified_per_request(self) -> float:
        return self.verified_per_step / self.concurrency


@dataclass
class Simulation:
    """Every policy at every concurrency, for one trace under one cost profile."""

    trace: str
    k: int
    profile: CostProfile
    refit_interval: int
    update_rule: str
    warmup_passes: int
    baseline_rule: str
    policies: list[Policy]
    results: dict[int, dict[str, Totals]] = field(default_factory=dict)
    skipped: list[int] = field(default_factory=list)
    min_per_request: int = 0
    #: Passes over the trace per concurrency (above 1: cycled to ``min_steps``).
    cycles: dict[int, float] = field(default_factory=dict)
    min_steps: int = 0
    #: The schedule policy's measured steps per choice (``fixed-v``, ``av-d``), per concurrency.
    choices: dict[int, dict[str, int]] = field(default_factory=dict)

    def best_fixed(self, c: int) -> str:
        fixed = {n: t for n, t in self.results[c].items() if n.startswith("fixed-")}
        return max(fixed, key=lambda n: fixed[n].throughput)

    def gain(self, c: int, name: str) -> float:
        """Throughput relative to the best fixed length at ``c``, minus 1."""
        best = self.results[c][self.best_fixed(c)].throughput
        return self.results[c][name].throughput / best - 1.0

    def oracle_name(self, drafts: int | None = None) -> str | None:
        """The oracle policy drafting ``drafts`` positions (default ``K``), if run."""
        want = self.k if drafts is None else drafts
        return next(
            (p.name for p in self.policies if p.kind == "oracle" and p.drafts == want), None
        )

    def vs_oracle(self, c: int, name: str) -> float | None:
        """Throughput against the oracle drafting as many positions, minus 1."""
        policy = next(p for p in self.policies if p.name == name)
        oracle = self.oracle_name(policy.drafts) if policy.adaptive else None
        if oracle is None or oracle not in self.results[c]:
            return None
        return self.results[c][name].throughput / self.results[c][oracle].throughput - 1.0

    def oracle_share(self, c: int, name: str) -> float | None:
        """``(policy - best fixed) / (oracle - best fixed)`` in throughput.

        The oracle drafts as many positions as the policy; ``None`` for fixed
        lengths and where the oracle gains nothing over the best fixed length.
        """
        policy = next(p for p in self.policies if p.name == name)
        oracle = self.oracle_name(policy.drafts) if policy.adaptive else None
        if oracle is None or oracle not in self.results[c]:
            return None
        best = self.results[c][self.best_fixed(c)].throughput
        room = self.results[c][oracle].throughput - best
        if not room > 0.0:
            return None
        return (self.results[c][name].throughput - best) / room

    def as_json(self) -> dict[str, Any]:
        def num(v: float | None) -> float | None:
            return None if v is None or v != v else float(v)

        out: dict[str, Any] = {
            "trace": self.trace,
            "k": self.k,
            "profile": self.profile.as_json(),
            "refit_interval": self.refit_interval,
            "update_rule": self.update_rule,
            "warmup_passes": self.warmup_passes,
            "min_per_request": self.min_per_request,
            "baseline_rule": self.baseline_rule,
            "policies": {
                p.name: {
                    "kind": p.kind,
                    "rule": p.rule or None,
                    "drafts": p.drafts,
                    "lossless": p.lossless,
                    "description": p.description,
                }
                for p in self.policies
            },
            "skipped_concurrency": self.skipped,
            "min_steps": self.min_steps,
            "concurrency": {},
        }
        for c, totals in self.results.items():
            block: dict[str, Any] = {
                "steps": next(iter(totals.values())).steps,
                "best_fixed": self.best_fixed(c),
                "trace_cycles": self.cycles.get(c, 1.0),
                "schedule_choices": self.choices.get(c),
                "policies": {},
            }
            for name, t in totals.items():
                block["policies"][name] = {
                    "throughput": num(t.throughput),
                    "per_request": num(t.per_request),
                    "acceptance_length": num(t.acceptance_length),
                    "verified_per_step": num(t.verified_per_step),
                    "verified_per_request": num(t.verified_per_request),
                    "gain_vs_best_fixed": num(self.gain(c, name)),
                    "vs_oracle": num(self.vs_oracle(c, name)),
                    "oracle_share": num(self.oracle_share(c, name)),
                    "tokens": t.tokens,
                    "time_ms": t.time_ms,
                    "refits": t.refits,
                }
            out["concurrency"][str(c)] = block
        return out
