"""The model pair a worker serves, read from the vLLM config current at construction.

``OnlineAcceptanceEstimator`` only receives ``(max_num_reqs,
num_speculative_steps, device)``. vLLM builds it inside ``load_model``, which
the worker runs under ``set_current_vllm_config``, so
``vllm.config.get_current_vllm_config_or_none()`` returns the full config there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PairKey:
    target: str
    draft: str
    method: str
    num_speculative_tokens: int
    draft_sample_method: str = ""
    labels: tuple[tuple[str, str], ...] = ()


def pair_from_vllm_config(
    vllm_config: object | None, num_speculative_tokens: int, labels: tuple[tuple[str, str], ...]
) -> PairKey:
    """Best effort: unknown parts become ``""`` rather than failing the worker."""
    model_config = getattr(vllm_config, "model_config", None)
    spec = getattr(vllm_config, "speculative_config", None)
    return PairKey(
        target=str(getattr(model_config, "model", "") or ""),
        draft=str(getattr(spec, "model", "") or ""),
        method=str(getattr(spec, "method", "") or ""),
        num_speculative_tokens=int(num_speculative_tokens),
        draft_sample_method=str(getattr(spec, "draft_sample_method", "") or ""),
        labels=labels,
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
