"""Which request slots have transformed target sampling, as vLLM adds them.

The estimator sees only request-state indices. vLLM's worker learns each
request's ``SamplingParams`` in ``Sampler.add_request(req_idx,
sampling_params)`` (same index space as ``idx_mapping``); the plugin wraps that
method to record one flag per slot here. A request is excluded when its
target distribution is transformed, so its acceptance does not measure the
pair: penalties (repetition, frequency, presence), allowed token ids, logit
bias, bad words, structured output. Temperature/top-p/top-k/min-p are not
exclusions: they are part of the workload (use ``AVEST_LABELS``).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from avest_client.vllm.hooks import record_after

logger = logging.getLogger(__name__)


def transforms_target_sampling(sp: Any) -> bool:
    return bool(
        getattr(sp, "repetition_penalty", 1.0) != 1.0
        or getattr(sp, "frequency_penalty", 0.0) != 0.0
        or getattr(sp, "presence_penalty", 0.0) != 0.0
        or getattr(sp, "allowed_token_ids", None)
        or getattr(sp, "logit_bias", None)
        or getattr(sp, "bad_words", None)
        or getattr(sp, "bad_words_token_ids", None)
        or getattr(sp, "structured_outputs", None) is not None
    )


class ExclusionRegistry:
    """Per-process flags by request-state index, copy-on-write.

    ``record`` (on request admission) replaces the array only when a flag
    changes; ``current`` (on every step) is a reference, never a copy, and the
    array it returns is never modified afterwards, so the forwarder thread can
    read it later while new requests reuse the slots.
    """

    def __init__(self) -> None:
        self.active = False  # True once a hook feeds it; until then exclusions are unknown
        self._mask = np.zeros(0, dtype=bool)

    def record(self, req_idx: int, sampling_params: Any) -> None:
        flag = transforms_target_sampling(sampling_params)
        mask = self._mask
        if req_idx < mask.shape[0] and mask[req_idx] == flag:
            return
        new = np.zeros(max(req_idx + 1, mask.shape[0], 256), dtype=bool)
        new[: mask.shape[0]] = mask
        new[req_idx] = flag
        new.flags.writeable = False
        self._mask = new

    def current(self) -> np.ndarray:
        """Flags by request-state index (read-only; indices past its end are not excluded)."""
        return self._mask


REGISTRY = ExclusionRegistry()


def strata_registry() -> Any:
    """The process's :class:`~avest_client.vllm.strata.StrataRegistry` (imported late:
    without strata its module is never loaded by the hook)."""
    from avest_client.vllm import strata

    return strata.REGISTRY


def install_sampler_hook(sampler_cls: type, registry: ExclusionRegistry | None = None) -> bool:
    """Wrap ``sampler_cls.add_request`` to record flags; idempotent. False if it cannot."""
    reg = REGISTRY if registry is None else registry

    def record(sampler: Any, req_idx: int, sampling_params: Any, *_: Any, **__: Any) -> None:
        reg.record(int(req_idx), sampling_params)
        strata = strata_registry()
        if strata.enabled:  # AVEST_STRATA=1: the slot's stratum too (docs/strata.md)
            strata.record(
                int(req_idx), sampling_params, transforms_target_sampling(sampling_params)
            )

    wrapped = record_after(
        sampler_cls,
        "add_request",
        record,
        missing="exclusions disabled",
        failed="recording exclusion flags",
    )
    if wrapped:  # fed from now on (a method wrapped before feeds the registry it was given)
        reg.active = True
        strata_registry().active = True
    return wrapped is not False
