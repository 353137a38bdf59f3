"""Update rules by name: what a pair, the evaluator and the simulator build.

``vllm`` and ``recursive`` live in :mod:`avest.core.rules`, ``tracking`` (the
default: the tracking step with vLLM's step as a shadow) in
:mod:`avest.core.tracking` and :mod:`avest.core.shadow`.
"""

from __future__ import annotations

from avest.core.rules import RecursiveRule, UpdateRule, VllmRule
from avest.core.shadow import ShadowedTracking

RULE_NAMES = ("vllm", "recursive", "tracking")
#: The rule a pair gets when it names none (README: measured on traces).
DEFAULT_RULE = "tracking"


def make_rule(
    name: str,
    *,
    l2: float = 1e-3,
    damping: float = 50.0,
    forgetting: float | None = None,
    prior: float = 1.0,
) -> UpdateRule:
    """Build an update rule by name; each rule reads only its own parameters.

    ``forgetting`` defaults per rule: 0.95 for ``recursive``, 0.9 for
    ``tracking``.
    """
    if name == "vllm":
        return VllmRule(l2=l2, damping=damping)
    if name == "recursive":
        return RecursiveRule(forgetting=0.95 if forgetting is None else forgetting, prior=prior)
    if name == "tracking":
        return ShadowedTracking(
            forgetting=0.9 if forgetting is None else forgetting, damping=damping, l2=l2
        )
    raise ValueError(f"unknown update rule {name!r}; choose one of {', '.join(RULE_NAMES)}")


def rule_options(rule: str, forgetting: float, prior: float) -> dict[str, float]:
    """``make_rule`` options from the service's settings: ``--forgetting`` and
    ``--prior`` are the recursive rule's; the others keep their own defaults."""
    return {"forgetting": forgetting, "prior": prior} if rule == "recursive" else {}
