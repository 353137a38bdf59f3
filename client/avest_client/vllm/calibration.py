"""The pair's calibration layer inside vLLM's ``predict``: fixed shapes, no host sync.

The sidecar pushes, with each set of coefficients, a fixed-size table (``M``
knots on the linear predictor ``eta = slope * x + b_i`` and the mapped
log-odds at each) and whether it is served. :class:`ConfidenceMap` keeps the
table in preallocated device tensors, updated in place with ``copy_`` at step
boundaries, and :meth:`ConfidenceMap.apply` rewrites the confidences vLLM's
``predict`` just wrote with torch ops only (gather, bucketize, lerp, scatter):
no ``.item()``, no host synchronisation, the same shapes at every call, so it
runs inside the captured draft CUDA graph. vLLM's ``predictions`` (what its
IRLS statistics are computed from) stay the plain logistic's.

Which table is in force is decided like the coefficients: on rank 0 from the
sink, broadcast to every rank at the governor's sync boundaries, and served
only while pooled coefficients govern (a map fitted to the pooled
coefficients means nothing to vLLM's local refits).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from avest_wire.bins import CALIBRATION_SLOTS

logger = logging.getLogger(__name__)

#: Knots in the table: the contract's size, which the service's layer fills.
SLOTS = CALIBRATION_SLOTS

#: ``(knots, logits, served)`` as a plain, picklable payload.
Table = tuple[tuple[float, ...], tuple[float, ...], bool]


def validate_table(raw: object) -> Table | None:
    """A sink's ``latest_calibration()`` as a checked table, or None if unusable."""
    if raw is None:
        return None
    try:
        knots_raw, logits_raw, served_raw = raw  # type: ignore[misc]
        knots = tuple(float(v) for v in knots_raw)
        logits = tuple(float(v) for v in logits_raw)
        served = bool(served_raw)
    except (TypeError, ValueError):
        return None
    if len(knots) != SLOTS or len(logits) != SLOTS:
        return None
    if not all(math.isfinite(v) for v in knots + logits):
        return None
    if any(b <= a for a, b in zip(knots, knots[1:], strict=False)) or any(
        b < a for a, b in zip(logits, logits[1:], strict=False)
    ):
        return None
    return knots, logits, served


def predicted_tokens(
    num_tokens: int, idx_mapping: torch.Tensor, draft_step: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tokens vLLM's predict kernel wrote, as ``(req, valid, step, batch)``: token
    ``t`` with ``idx_mapping[t] >= 0`` (``valid``) wrote ``confidence_probs[batch,
    step]`` of request slot ``req``, with ``batch = t`` and one shared ``step`` (a step
    per call), or ``batch = t // K`` and ``step = draft_step[t]`` (a per-token step)."""
    token = torch.arange(num_tokens, device=idx_mapping.device)
    req = idx_mapping[:num_tokens].to(torch.int64)
    if draft_step.dim() > 0:
        return req, req >= 0, draft_step[:num_tokens].to(torch.int64), token // k
    return req, req >= 0, draft_step.to(torch.int64).expand(num_tokens), token


class ConfidenceMap:
    """The calibration table on the estimator's device, applied in place."""

    def __init__(self, device: Any) -> None:
        self.knots = torch.linspace(-1.0, 1.0, SLOTS, dtype=torch.float32, device=device)
        self.logits = self.knots.clone()
        #: 1.0 while the map is served, else 0.0 (a tensor: read on the device only).
        self.served = torch.zeros((), dtype=torch.float32, device=device)
        self.table: Table | None = None
        self.loads = 0

    def load(self, table: Table | None, governed: bool) -> None:
        """Copy ``table`` into the device tensors (in place); serve it only if ``governed``."""
        if table is None:
            knots, logits, served = None, None, False
        else:
            knots, logits, served = table
        values = torch.tensor(
            (*(knots or ()), *(logits or ()), 1.0 if served and governed else 0.0),
            dtype=torch.float32,
        )
        if self.served.device.type == "cuda":
            values = values.pin_memory()
        if knots is not None:
            self.knots.copy_(values[:SLOTS], non_blocking=True)
            self.logits.copy_(values[SLOTS : 2 * SLOTS], non_blocking=True)
        self.served.copy_(values[-1], non_blocking=True)
        self.table = table
        self.loads += 1

    def mapped(self, eta: torch.Tensor) -> torch.Tensor:
        """The table's piecewise-linear map of ``eta``, flat beyond the end knots."""
        hi = torch.bucketize(eta, self.knots).clamp_(1, SLOTS - 1)
        lo = hi - 1
        x0, x1 = self.knots[lo], self.knots[hi]
        t = ((eta - x0) / (x1 - x0)).clamp_(0.0, 1.0)
        y0, y1 = self.logits[lo], self.logits[hi]
        return y0 + t * (y1 - y0)

    def apply(
        self,
        est: Any,
        num_tokens: int,
        idx_mapping: torch.Tensor,
        draft_step: torch.Tensor,
        confidence_probs: torch.Tensor,
    ) -> None:
        """Rewrite the confidences ``predict`` just wrote for this call's tokens.

        The same tokens as vLLM's predict kernel: token ``t`` with
        ``idx_mapping[t] >= 0`` wrote ``confidence_probs[batch, step]``, with
        ``batch = t`` and one shared ``step`` (a step per call), or
        ``batch = t // K`` and ``step = draft_step[t]`` (a per-token step).
        ``eta`` is recomputed from the stored feature, exactly.
        """
        k = int(est.num_speculative_steps)
        req, valid, step, batch = predicted_tokens(num_tokens, idx_mapping, draft_step, k)
        x = est.features[req.clamp(min=0), step]
        eta = est.slope[0] * x + est.intercepts[step]
        current = confidence_probs[batch, step]
        calibrated = torch.sigmoid(self.mapped(eta)).to(confidence_probs.dtype)
        use = valid & (self.served > 0.5)
        confidence_probs[batch, step] = torch.where(use, calibrated, current)


class TableSync:
    """Decides the table in force at step boundaries, identically on every TP rank."""

    def __init__(self, group: Any, sink: Any, sync_steps: int, device: Any) -> None:
        self.group = group
        self.sink = sink if group.rank == 0 else None
        self.sync_steps = sync_steps
        self.map = ConfidenceMap(device)
        self.steps = 0
        self._governed = False
        self._errors = 0
        self._last_raw: object = None
        self._last_table: Table | None = None
        self._single = group.world_size == 1
        #: the sink's reader, looked up once (None: the sink serves no table)
        self._reader = getattr(self.sink, "latest_calibration", None)

    def _read_sink(self) -> Table | None:
        reader = self._reader
        if reader is None:
            return None
        try:
            raw = reader()
            if raw is not self._last_raw:  # unchanged: already validated
                self._last_raw, self._last_table = raw, validate_table(raw)
            return self._last_table
        except Exception:  # noqa: BLE001 - a faulty sink must not stop decoding
            self._errors += 1
            if self._errors == 1:
                logger.exception("avest: reading the calibration table failed; not served")
            return None

    def boundary(self, governed: bool) -> None:
        """Call at every step boundary after the governor's, on every rank."""
        n = self.steps
        self.steps = n + 1
        if self._single and governed is self._governed:
            reader = self._reader
            if reader is None:
                return  # nothing to read; the (identity) map stays as loaded
            try:
                if reader() is self._last_raw:
                    return  # unchanged: already validated and loaded
            except Exception:  # noqa: BLE001 - counted and logged by _read_sink below
                pass
        if not self._single:
            if n % self.sync_steps:
                return
            table = self.group.broadcast_object(self._read_sink() if self.group.rank == 0 else None)
        else:
            table = self._read_sink()
        if table != self.map.table or governed != self._governed:
            self._governed = governed
            self.map.load(table, governed)
