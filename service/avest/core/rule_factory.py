"""Update rules by name: what a pair, the evaluator and the simulator build.

``vllm`` and ``recursive`` live in :mod:`avest.core.rules`, ``tracking`` (the
default) in :mod:`avest.core.tracking`.
"""

from __future__ import annotations

from dataclasses import replace

from avest.core.rules import RecursiveRule, UpdateRule, VllmRule
from avest.core.tracking import DEFAULT_TRACKING, TrackingConfig, TrackingRule

RULE_NAMES = ("vllm", "recursive", "tracking")
#: The rule a pair gets when it names none (docs/estimator.md: measured on traces).
DEFAULT_RULE = "tracking"


def make_rule(
    name: str,
    *,
    l2: float = 1e-3,
    damping: float = 50.0,
    forgetting: float | None = None,
    prior: float = 1.0,
    tracking: TrackingConfig = DEFAULT_TRACKING,
) -> UpdateRule:
    """Build an update rule by name; each rule reads only its own parameters.

    ``forgetting`` defaults per rule: 0.95 for ``recursive``, ``tracking``'s
    own (0.9) for ``tracking``, whose other values come from ``tracking``
    (``l2`` and ``damping`` included: those given here are vLLM's rule's).
    """
    if name == "vllm":
        return VllmRule(l2=l2, damping=damping)
    if name == "recursive":
        return RecursiveRule(forgetting=0.95 if forgetting is None else forgetting, prior=prior)
    if name == "tracking":
        config = tracking if forgetting is None else replace(tracking, forgetting=forgetting)
        return TrackingRule(config)
    raise ValueError(f"unknown update rule {name!r}; choose one of {', '.join(RULE_NAMES)}")


def rule_options(rule: str, forgetting: float, prior: float) -> dict[str, float]:
    """``make_rule`` options from the service's settings: ``--forgetting`` and
    ``--prior`` are the recursive rule's; the others keep their own defaults."""
    return {"forgetting": forgetting, "prior": prior} if rule == "recursive" else {}
