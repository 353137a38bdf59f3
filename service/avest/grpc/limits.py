"""What the gRPC adapter reads of the process settings: its per-message and rate bounds."""

from __future__ import annotations

from dataclasses import dataclass

from avest_wire.limits import MAX_MESSAGE_BYTES


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
    #: Shed streams that press once steps have stood this long in line for a turn,
    #: seconds (0: never shed; see :class:`avest.grpc.turns.Shedding`).
    shed_after_s: float = 0.1
    #: Pace the streams once the event loop has lagged this long, seconds (0: never
    #: pace; see :class:`avest.grpc.pacing.Pacing`).
    pace_after_s: float = 0.05
    #: Largest gRPC message sent or received (``ListPairs`` pages fit it).
    max_message_bytes: int = MAX_MESSAGE_BYTES
