"""The default rule's mixture weight on /metrics: what the pair's rule holds, only for
pairs on the tracking rule."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from avest.core.estimator import make_batch
from avest.metrics.names import TRACKING_WEIGHT
from avest.state.pairs import Registry, RuleConfig
from avest_wire.pair import PairKey
from avest_wire.v1 import estimator_pb2 as pb
from tests.support.calibration import K, bent_steps, observe
from tests.support.live import Live, register


def _series(live: Live, name: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = live.http.get("/metrics").text
    return {
        s.labels["pair"]: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    }


def test_the_tracking_weight_is_the_rules_own(open_server: Callable[..., Live]) -> None:
    live = open_server()
    tracked = register(live, K, 10, rule=pb.UPDATE_RULE_TRACKING)
    plain = register(live, K + 1, 10, rule=pb.UPDATE_RULE_VLLM)
    steps = bent_steps(120, seed=4)
    observe(live, tracked, steps)
    # the same steps through the state's own registry, in this process
    pair, _ = Registry(RuleConfig()).register(PairKey.of("t", "d", "m", K), "tracking", 10)
    for seq, (x, d, a) in enumerate(steps, start=1):
        pair.observe("w0", seq, make_batch(x, np.array(d), np.array(a), K))
    want = pair.estimator.rule.tracking_weight
    got = _series(live, TRACKING_WEIGHT)
    assert plain not in got
    assert got[tracked] == want
    assert 0.0 < want < 1.0 and want != 0.5  # refitted: the losses have moved it
