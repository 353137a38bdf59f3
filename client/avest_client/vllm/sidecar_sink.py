"""Production sink factory: the network client, wired in by the client's owner.

Until then the plugin's call fails here and the shim keeps vLLM on its own
in-process estimator (exactly vLLM's behaviour), logging why.
"""

from __future__ import annotations

from avest_client.vllm.sink import Sink


def make_sink(config: object, pair_key: object) -> Sink:
    raise NotImplementedError("network sink not wired yet")
