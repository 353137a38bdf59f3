"""What the gRPC adapter reads of the process settings: its per-message and rate bounds."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StreamLimits:
    #: Largest number of requests (rows) in one Observe step.
    max_rows: int
    #: Observe steps applied per event-loop turn, all streams together (0: no limit).
    steps_per_turn: int
    #: Calls and steps per second naming one pair, all clients together (0: no limit).
    pair_rate: float
    #: Observe steps per second per stream (0: no limit).
    stream_step_rate: float
