"""The rule names of the wire contract and their enum values, in one place.

``UpdateRule`` and ``BudgetRule`` (``protos/avest/v1/estimator.proto``) travel as
enums; people, flags and the admin API use the names below. The empty name is
``*_UNSPECIFIED``: the service's default (``--default-rule`` for update rules;
for budgets a lossless rule, ``stale`` when stale confidences are sent and
``lossless-walk`` otherwise). Client, service and offline tools all
read these tables, so a rule added to the proto is added here once.
"""

from __future__ import annotations

from avest_wire.v1 import estimator_pb2 as pb

#: update rule name -> ``UpdateRule`` value
UPDATE_RULES: dict[str, int] = {
    "": pb.UPDATE_RULE_UNSPECIFIED,
    "vllm": pb.UPDATE_RULE_VLLM,
    "recursive": pb.UPDATE_RULE_RECURSIVE,
    "tracking": pb.UPDATE_RULE_TRACKING,
}
UPDATE_RULE_NAMES: dict[int, str] = {v: k for k, v in UPDATE_RULES.items()}

#: budget rule name -> ``BudgetRule`` value
BUDGET_RULES: dict[str, int] = {
    "": pb.BUDGET_RULE_UNSPECIFIED,
    "stale": pb.BUDGET_RULE_STALE,
    "lossless-walk": pb.BUDGET_RULE_LOSSLESS_WALK,
    "argmax": pb.BUDGET_RULE_ARGMAX,
    "full": pb.BUDGET_RULE_FULL,
}
BUDGET_RULE_NAMES: dict[int, str] = {v: k for k, v in BUDGET_RULES.items()}
