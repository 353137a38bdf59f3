"""The sliced exposition: the same text as prometheus_client's, with the loop given back.

``/metrics`` renders the per-pair families a slice at a time
(:mod:`avest.http.exposition`). What it writes must be what
``generate_latest`` writes for the same registry (escaping, label order,
number format), and a coroutine that becomes ready during a scrape must run
before the scrape ends, not after it (``bench/bench_scrape.py`` measures the
latency this buys).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from avest.core.estimator import OnlineEstimator
from avest.http import exposition
from avest.http import metrics as M
from avest.state.pairs import Pair, PairKey


class _App:
    def __init__(self, pairs: list[Pair]) -> None:
        self.hooks = SimpleNamespace(refit=[], removed=[])
        self.registry = SimpleNamespace(pairs={p.id: p for p in pairs})


def _pairs(n: int, k: int = 3) -> list[Pair]:
    rng = np.random.default_rng(5)
    out = []
    for i in range(n):
        # label values that need escaping: quote, backslash, newline
        key = PairKey.of(f'tar"get\\{i}', f"draft\n{i}", "eagle", k, {"t": f'a"{i}'})
        est = OnlineEstimator(k, refit_interval=4)
        for _ in range(6 + i % 3):
            est.observe(rng.normal(1, 2, (8, k)), [k] * 8, rng.integers(0, k + 1, 8))
        out.append(Pair(key=key, rule_name="vllm", estimator=est))
    return out


def _samples(text: str) -> dict[str, list[tuple[str, tuple, str]]]:
    """Every family's samples (values by repr: NaN equals NaN), process metrics left
    out (they move between two reads)."""
    return {
        f.name: sorted((s.name, tuple(sorted(s.labels.items())), repr(s.value)) for s in f.samples)
        for f in text_string_to_metric_families(text)
        if not f.name.startswith("process_")
    }


def test_the_sliced_text_is_prometheus_clients_text():
    pairs = _pairs(12)
    registry = CollectorRegistry()
    metrics = M.Metrics(_App(pairs), registry=registry)
    metrics.refused("Observe", "invalid")
    body, _ = metrics.exposition()
    reference = generate_latest(registry)  # the whole registry, pair collector included
    assert _samples(body.decode()) == _samples(reference.decode())

    # line for line too, families in another order (the pair families come last)
    def lines(text: bytes) -> list[str]:
        return sorted(x for x in text.decode().splitlines() if "process_" not in x)

    assert lines(body) == lines(reference)
    assert len(_samples(body.decode())["avest_slope"]) == 12


def test_rendering_yields_between_pairs_and_runs_what_waits():
    pairs = _pairs(6)
    metrics = M.Metrics(_App(pairs), registry=CollectorRegistry())
    gen = exposition.render(metrics.registry, metrics._pairs, slice_s=0.0)
    yields = 0
    try:
        while True:
            next(gen)
            yields += 1
    except StopIteration as done:
        body = done.value
    # a slice of zero: one pair, then the loop's turn; then one family at a time
    assert yields == 6 + len(metrics._pairs.families())
    assert _samples(body.decode()) == _samples(metrics.exposition()[0].decode())

    async def scrape_with_a_call_in_between() -> list[str]:
        order: list[str] = []

        async def call() -> None:
            await asyncio.sleep(0)
            order.append("rpc")

        async def scrape() -> None:
            await exposition.render_async(metrics.registry, metrics._pairs, slice_s=0.0)
            order.append("scrape done")

        await asyncio.gather(scrape(), call())
        return order

    assert asyncio.run(scrape_with_a_call_in_between()) == ["rpc", "scrape done"]
