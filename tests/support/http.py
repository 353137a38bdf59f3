"""The admin HTTP tests' pair: a vLLM-rule pair whose target name needs escaping in
HTML and JSON, fed a trace."""

from __future__ import annotations

from avest.offline.trace import Trace
from avest_wire.v1 import estimator_pb2 as pb
from tests.support.live import Live, messages, observe
from tests.support.live import register as shared_register


def register(live: Live, k: int = 5, refit_interval: int = 10, **labels: str) -> str:
    return shared_register(
        live, k, refit_interval, target="target <model> & co", rule=pb.UPDATE_RULE_VLLM, **labels
    )


def feed(live: Live, trace: Trace, pair_id: str) -> None:
    observe(live, messages(trace, pair_id))
