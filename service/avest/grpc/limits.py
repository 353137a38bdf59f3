"""What the gRPC adapter reads of the process settings: its per-message and rate bounds."""

from __future__ import annotations

from dataclasses import dataclass

from avest_wire.limits import MAX_MESSAGE_BYTES


@dataclass(frozen=True)
class StreamLimits:
    #: Largest number of requests (rows) in one Observe step.
    max_rows: int
    #: Unary calls per second naming one pair, all clients together, per port (0: no limit).
    pair_rate: float
    #: Largest gRPC message sent or received (``ListPairs`` pages fit it).
    max_message_bytes: int = MAX_MESSAGE_BYTES
    #: Seconds between two coefficient pushes of one pair on one Observe stream (the
    #: latest goes when the interval is over; 0: each refit's at once).
    push_every_s: float = 0.0
