"""Who governs the coefficients, decided at step boundaries, identically on every TP rank.

* Pooled: the sink is connected and has delivered coefficients. They are
  applied in place, the local refit is skipped.
* Local: otherwise. vLLM's own refit runs, starting from whatever the
  tensors hold (the last pooled coefficients, or the cold-start constants).
  When the sidecar comes back, its coefficients are applied again even if
  their version did not change, since local refits moved the tensors.

Single rank: the sink is read at every step boundary. With tensor
parallelism only rank 0 reads it, and only every ``sync_steps`` steps (step
index ``n % sync_steps == 0``), then broadcasts the decision over the TP group
so every rank applies it at that same step. Versions are compared for
equality, not order: a restarted sidecar may count from 1 again.
"""

from __future__ import annotations

import logging
import math

from avest_client.types import Served
from avest_client.vllm.sink import Sink
from avest_client.vllm.tp import TPGroup
from avest_wire.coefficients import slope_ok

logger = logging.getLogger(__name__)

#: What rank 0 broadcasts: the served coefficients, or None (local refits govern).
Payload = Served | None


def validate(raw: object, num_positions: int) -> Payload:
    """A sink's ``latest_coefficients()`` as a plain, picklable payload, or None if unusable."""
    if raw is None:
        return None
    try:
        if isinstance(raw, Served):
            version, slope, intercepts = raw.version, raw.slope, raw.intercepts
        else:
            version, slope, intercepts = raw  # type: ignore[misc]  # any (version, slope, b) triple
        version = int(version)
        slope = float(slope)
        b = tuple(float(x) for x in intercepts)
    except (TypeError, ValueError):
        return None
    if len(b) != num_positions:
        return None
    if not (slope_ok(slope) and all(math.isfinite(x) for x in b)):
        return None
    return Served(slope, b, version=version)


class Governor:
    def __init__(self, group: TPGroup, sink: Sink | None, num_positions: int, sync_steps: int):
        if sync_steps < 1:
            raise ValueError("sync_steps must be >= 1")
        self.group = group
        self.sink = sink if group.rank == 0 else None
        self.num_positions = num_positions
        self.sync_steps = sync_steps
        self.governed = False
        self.applied_version: int | None = None
        self.steps = 0
        self.updates = 0
        self._sink_errors = 0
        self._last_raw: object = None
        self._last_payload: Payload = None
        self._single = group.world_size == 1

    def _read_sink(self) -> Payload:
        sink = self.sink
        if sink is None:
            return None
        try:
            if not sink.connected:
                return None
            raw = sink.latest_coefficients()
            if raw is self._last_raw or raw == self._last_raw:  # unchanged: already validated
                self._last_raw = raw  # the fast path in boundary compares identity
                return self._last_payload
            payload = validate(raw, self.num_positions)
            self._last_raw, self._last_payload = raw, payload
        except Exception:  # noqa: BLE001 - a faulty sink must not stop decoding
            self._sink_errors += 1
            if self._sink_errors == 1:
                logger.exception("avest: reading the sink failed; local refits govern")
            return None
        return payload

    def boundary(self) -> Served | None:
        """Call at the start of every step, on every rank. Returns what to apply now."""
        n = self.steps
        self.steps = n + 1
        sink = self.sink
        if self._single and self.governed and sink is not None:
            # the common step: pooled coefficients govern and the sink holds the very
            # object they came from (no validation, no decision to make)
            try:
                if sink.connected and sink.latest_coefficients() is self._last_raw:
                    return None
            except Exception:  # noqa: BLE001 - counted and logged by _read_sink below
                pass
        if not self._single:
            if n % self.sync_steps:
                return None
            payload = self.group.broadcast_object(
                self._read_sink() if self.group.rank == 0 else None
            )
        else:
            payload = self._read_sink()
        return self._decide(payload)

    def _decide(self, payload: Payload) -> Served | None:
        if payload is None:
            if self.governed:
                logger.warning("avest: sidecar coefficients lost; local refits resume")
            self.governed = False
            return None
        version = payload.version
        fresh = not self.governed or version != self.applied_version
        if not self.governed:
            logger.info("avest: pooled coefficients (version %d) govern", version)
        self.governed = True
        if not fresh:
            return None
        self.applied_version = version
        self.updates += 1
        return payload
