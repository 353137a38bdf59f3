"""The tensor-parallel group, behind the one operation the shim needs.

With tensor parallelism every rank must hold the same coefficients at the
same step (ranks that chose different budgets would issue mismatched
collectives). Rank 0 alone reads the sidecar and broadcasts what it read;
vLLM does the same for its cost curves (``get_tp_group().broadcast_object``,
which in 0.33 rides the TP group's shared-memory message queue).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class TPGroup(Protocol):
    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def broadcast_object(self, obj: Any) -> Any:
        """Blocking collective: every rank gets rank 0's ``obj``."""
        ...


class SingleProcessGroup:
    rank = 0
    world_size = 1

    def broadcast_object(self, obj: Any) -> Any:
        return obj


class VllmTPGroup:
    """Adapter over vLLM's ``GroupCoordinator`` (``get_tp_group()``)."""

    def __init__(self, coordinator: Any) -> None:
        self._g = coordinator
        self.rank = int(coordinator.rank_in_group)
        self.world_size = int(coordinator.world_size)

    def broadcast_object(self, obj: Any) -> Any:
        return self._g.broadcast_object(obj, src=0)


class TorchDistGroup:
    """Over a ``torch.distributed`` process group (gloo in tests); ``None`` = the default group."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._src = dist.get_global_rank(group, 0) if group is not None else 0

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=self._src, group=self._group)
        return box[0]


def vllm_tp_group() -> TPGroup:
    """vLLM's TP group; a single-process group only when no distributed run exists.

    Raises when the group cannot be found inside a multi-process run: guessing
    "single rank" there would let every rank decide alone.
    """
    try:
        from vllm.distributed.parallel_state import get_tp_group

        return VllmTPGroup(get_tp_group())
    except Exception as exc:  # noqa: BLE001 - not inside a vLLM worker, or vLLM changed
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError(f"cannot find vLLM's TP group in a distributed run: {exc}") from exc
        logger.info("avest: no vLLM TP group; running as a single rank")
        return SingleProcessGroup()
