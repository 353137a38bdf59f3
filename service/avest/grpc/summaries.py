"""Summary mode on the Observe stream: an Observe message that carries a round summary."""

from __future__ import annotations

from avest.state.pairs import Pair
from avest_wire.errors import InvalidInput
from avest_wire.messages import summary_from_pb as summary_of
from avest_wire.summary import RoundSummary
from avest_wire.v1 import estimator_pb2 as pb


def summary_from_pb(req: pb.ObserveRequest, pair: Pair) -> RoundSummary:
    """Validate an Observe message carrying a summary; InvalidInput names the field."""
    if req.rows or req.features or len(req.num_verified) or len(req.num_accepted):
        raise InvalidInput("summary", "a summary message carries no step (rows, features, counts)")
    if len(req.exclude):
        raise InvalidInput("exclude", "must be empty in a summary message")
    if req.k not in (0, pair.k):
        raise InvalidInput("k", f"is {req.k}, the pair has K={pair.k}")
    return summary_of(req.summary, pair.k)
