"""PromQL pieces of the dashboard: selectors, vLLM 0.33 metric names, thresholds,
and the running-product (survival) expressions PromQL has no function for."""

from __future__ import annotations

#: Positions written out in the running-product (survival) expressions.
MAX_POSITIONS = 16
#: Thresholds drawn on the panels; the same numbers as deploy/prometheus/alerts.yml.
ECE_THRESHOLD = 0.05
DIVERGENCE_THRESHOLD = 0.1

# vLLM 0.33 (vllm/v1/spec_decode/metrics.py): labels model_name, engine (+ position).
VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"

PAIR = 'pair="$pair"'
VLLM_SEL = 'model_name="$target"'
RI = "$__rate_interval"


def survival(metric: str, max_positions: int = MAX_POSITIONS) -> str:
    """Per position i: the product of ``metric`` over positions 0..i of the pair
    (labels ``pair`` and ``position``), as one PromQL expression."""
    parts = []
    for i in range(max_positions):
        upto = "|".join(str(j) for j in range(i + 1))
        parts.append(
            f'label_replace(exp(sum by (pair) (ln({metric}{{{PAIR},position=~"{upto}"}})))'
            f' and on (pair) {metric}{{{PAIR},position="{i}"}}, "position", "{i}", "", "")'
        )
    return "\n or ".join(parts)


def vllm_per_position() -> str:
    return (
        f"sum by (position) (rate({VLLM_ACCEPTED_PER_POS}{{{VLLM_SEL}}}[{RI}]))\n"
        f"/ on () group_left sum(rate({VLLM_DRAFTS}{{{VLLM_SEL}}}[{RI}]))"
    )


def vllm_acceptance_length() -> str:
    return (
        f"1 + sum(rate({VLLM_ACCEPTED}{{{VLLM_SEL}}}[{RI}]))"
        f" / sum(rate({VLLM_DRAFTS}{{{VLLM_SEL}}}[{RI}]))"
    )
