"""The model pair a worker serves, read from the vLLM config current at construction.

``OnlineAcceptanceEstimator`` only receives ``(max_num_reqs,
num_speculative_steps, device)``. vLLM builds it inside ``load_model``, which
the worker runs under ``set_current_vllm_config``, so
``vllm.config.get_current_vllm_config_or_none()`` returns the full config there.
"""

from __future__ import annotations

import logging

from avest_wire.pair import PairKey

logger = logging.getLogger(__name__)


#: Label added to the pair key from vLLM's speculative config (AVEST_LABELS may override).
SAMPLE_METHOD_LABEL = "draft_sample_method"


def pair_from_vllm_config(
    vllm_config: object | None, num_speculative_tokens: int, labels: tuple[tuple[str, str], ...]
) -> PairKey:
    """Best effort: unknown parts become ``""`` rather than failing the worker. The
    draft sampling method joins the labels (``labels`` wins for the same name)."""
    model_config = getattr(vllm_config, "model_config", None)
    spec = getattr(vllm_config, "speculative_config", None)
    named = dict(labels)
    sample_method = str(getattr(spec, "draft_sample_method", "") or "")
    if sample_method:
        named.setdefault(SAMPLE_METHOD_LABEL, sample_method)
    return PairKey(
        str(getattr(model_config, "model", "") or ""),
        str(getattr(spec, "model", "") or ""),
        str(getattr(spec, "method", "") or ""),
        int(num_speculative_tokens),
        named,
    )


def current_pair(num_speculative_tokens: int, labels: tuple[tuple[str, str], ...]) -> PairKey:
    """The pair from vLLM's current config (import is lazy: vLLM is optional)."""
    vllm_config = None
    try:
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
    except Exception:  # noqa: BLE001 - vLLM absent or changed: fall back to an anonymous pair
        logger.warning("avest: could not read the current vLLM config; pair key is partial")
    return pair_from_vllm_config(vllm_config, num_speculative_tokens, labels)
