"""The sliced exposition: the same text as prometheus_client's, with the loop given back.

``/metrics`` renders the per-pair families a slice at a time
(:mod:`avest.metrics.exposition`). What it writes must be what
``generate_latest`` writes for the same registry (escaping, label order,
number format), and a coroutine that becomes ready during a scrape must run
before the scrape ends, not after it (``bench/bench_scrape.py`` measures the
latency this buys).
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from avest.metrics import registry as M
from avest.state.pairs import Pair
from avest_wire.v1 import estimator_pb2 as pb
from tests.support.live import Live, observe, observe_requests, register
from tests.support.metrics import StubApp as _App
from tests.support.metrics import escaped_pairs as _pairs
from tests.support.metrics import samples_by_family as _samples


def _drain(render: Generator[None, None, list[bytes]]) -> tuple[int, StopIteration]:
    """A render run to its end: how many times it yielded, and the ``StopIteration``
    that carries its text."""
    yields = 0
    while True:
        try:
            next(render)
        except StopIteration as done:
            return yields, done
        yields += 1


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
    yields, done = _drain(metrics.text.render(slice_s=0.0))
    body = b"".join(done.value)
    # a slice of zero: the loop's turn after each of the registry's other families
    # and collectors, after each pair, and after each family's join (the pair
    # collector's, then the worker tables')
    metrics._pairs.paused = metrics._workers.paused = True
    others = list(metrics.registry.collect())
    metrics._pairs.paused = metrics._workers.paused = False
    families = len(metrics._pairs.families()) + len(metrics._workers.families())
    collectors = len(metrics.text._others())
    assert yields == len(others) + collectors + 2 * 6 + families
    assert _samples(body.decode()) == _samples(metrics.exposition()[0].decode())
    # the next scrape, nothing changed: no pair and no join, only the other families
    again, done = _drain(metrics.text.render(slice_s=0.0))
    assert _samples(b"".join(done.value).decode()) == _samples(body.decode())
    assert again == len(others) + collectors + 2 * 6

    async def scrape_with_a_call_in_between() -> list[str]:
        order: list[str] = []

        async def call() -> None:
            await asyncio.sleep(0)
            order.append("rpc")

        async def scrape() -> None:
            await metrics.text.render_async(slice_s=0.0)
            order.append("scrape done")

        await asyncio.gather(scrape(), call())
        return order

    assert asyncio.run(scrape_with_a_call_in_between()) == ["rpc", "scrape done"]


# -- each pair's text is kept until the pair changes ------------------------------


def _pair_lines(body: bytes, pid: str) -> list[str]:
    return [x for x in body.decode().splitlines() if f'pair="{pid}"' in x]


def test_a_scrape_renders_only_the_pairs_that_changed():
    pairs = _pairs(4, k=3)
    metrics = M.Metrics(_App(pairs), registry=CollectorRegistry())
    first, _ = metrics.exposition()
    assert metrics.text.rendered == {p.id for p in pairs}
    again, _ = metrics.exposition()
    assert metrics.text.rendered == set()  # nothing changed: every pair's text was kept
    for p in pairs:
        assert _pair_lines(again, p.id) == _pair_lines(first, p.id)

    # a step on one pair: that pair alone is rendered again, and its series moved
    busy = pairs[1]
    rng = np.random.default_rng(9)
    before = busy.estimator.steps
    busy.observe("w-new", 1, _batch(rng, busy.k))
    third, _ = metrics.exposition()
    assert metrics.text.rendered == {busy.id}
    steps = [x for x in _pair_lines(third, busy.id) if x.startswith("avest_steps_observed")]
    assert steps == [f'avest_steps_observed_total{{pair="{busy.id}"}} {float(before + 1)}']
    assert _pair_lines(third, busy.id) != _pair_lines(again, busy.id)
    assert any('worker="w-new"' in x for x in _pair_lines(third, busy.id))  # its worker table
    for p in pairs:
        if p is not busy:
            assert _pair_lines(third, p.id) == _pair_lines(first, p.id)
    # the cached text is the text prometheus_client writes for the same state
    assert _samples(third.decode()) == _samples(generate_latest(metrics.registry).decode())


def test_a_removed_or_replaced_pair_is_not_served_from_the_cache():
    pairs = _pairs(3, k=3)
    app = _App(pairs)
    metrics = M.Metrics(app, registry=CollectorRegistry())
    metrics.exposition()
    gone = pairs[0]
    del app.registry.pairs[gone.id]
    body, _ = metrics.exposition()
    assert _pair_lines(body, gone.id) == []
    # a new pair object under the same id, with the same counters: rendered afresh
    twin = Pair(key=pairs[1].key, rule_name="tracking", estimator=pairs[1].estimator)
    twin.updated = pairs[1].updated
    app.registry.pairs[twin.id] = twin
    body, _ = metrics.exposition()
    assert metrics.text.rendered == {twin.id}
    assert any('rule="tracking"' in x for x in _pair_lines(body, twin.id))


def _batch(rng: np.random.Generator, k: int):  # noqa: ANN202
    from avest.core.estimator import make_batch

    return make_batch(rng.normal(1, 2, (8, k)), [k] * 8, rng.integers(0, k + 1, 8), k)


def _observe(live: Live, pid: str, steps: list, first: int) -> None:
    rows = ((st.features, st.num_verified, st.num_accepted) for st in steps)
    acked = observe(live, observe_requests(rows, pid, first=first))
    assert acked == first + len(steps) - 1


def _scrape(live: Live) -> dict[tuple[str, tuple], float | str]:
    """Every pair series' value (process metrics and RPC timings left out: they
    move between two reads; NaN as the string, so that it equals itself)."""
    r = live.http.get("/metrics")
    assert r.status_code == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value if s.value == s.value else "nan"
        for f in text_string_to_metric_families(r.text)
        for s in f.samples
        if "pair" in s.labels
    }


def test_a_refit_changes_the_scraped_series_of_its_pair(live: Live, trace_slice) -> None:
    """The real server: scrapes between refits are served from the cache, and a
    refit's coefficients, round and calibration show in the next scrape."""
    steps = list(trace_slice("sample", 0, 15).steps())
    k = steps[0].features.shape[1]
    pid = register(live, k=k, refit_interval=10)
    idle = register(live, k=k, refit_interval=10, workload="idle")
    _observe(live, pid, steps[:5], first=1)  # no refit yet
    before = _scrape(live)
    assert _scrape(live) == before  # nothing changed: the same text
    assert live.handle.server.metrics.text.rendered == set()
    assert before[("avest_coefficients_version", (("pair", pid),))] == 0.0
    assert before[("avest_steps_observed_total", (("pair", pid),))] == 5.0

    _observe(live, pid, steps[5:], first=6)  # the tenth step refits
    after = _scrape(live)
    assert live.handle.server.metrics.text.rendered == {pid}  # the idle pair was kept
    coef = live.stub.GetCoefficients(pb.GetCoefficientsRequest(pair_id=pid)).coefficients
    assert coef.version >= 1
    assert after[("avest_coefficients_version", (("pair", pid),))] == coef.version
    assert after[("avest_round", (("pair", pid),))] == coef.round == 1
    assert after[("avest_slope", (("pair", pid),))] == coef.slope
    assert after[("avest_slope", (("pair", pid),))] != before[("avest_slope", (("pair", pid),))]
    for i, b in enumerate(coef.intercepts):
        assert after[("avest_intercept", (("pair", pid), ("position", str(i))))] == b
    assert after[("avest_steps_observed_total", (("pair", pid),))] == 15.0
    assert after[("avest_auc", (("pair", pid),))] != before[("avest_auc", (("pair", pid),))]
    mine = {key for key in after if ("pair", idle) in key[1]}
    assert mine and all(after[key] == before[key] for key in mine)


def test_interleaved_scrapes_never_serve_a_pair_older_than_their_start():
    """Two scrapes on one loop: one that finds a pair already re-rendered by the other
    (so sees no change itself) must still not reuse text joined before the change."""
    pairs = _pairs(3, k=3)
    metrics = M.Metrics(_App(pairs), registry=CollectorRegistry())
    metrics.exposition()  # everything cached and joined
    busy = pairs[2]
    busy.observe("w-late", 1, _batch(np.random.default_rng(3), busy.k))
    line = f'avest_steps_observed_total{{pair="{busy.id}"}} {float(busy.estimator.steps)}'

    first = metrics.text.render(slice_s=0.0)
    while metrics.text._texts[0].get(busy.id, (None, None))[1] != metrics._pairs.stamp(busy):
        next(first)  # until the first scrape has re-rendered the busy pair
    second = metrics.text.render_now()  # a whole scrape meanwhile
    assert line in second.decode().splitlines()
    _, done = _drain(first)
    assert line in b"".join(done.value).decode().splitlines()
    assert line in metrics.exposition()[0].decode().splitlines()


def test_the_registrys_other_families_follow_their_samples():
    """Counters and histograms outside the pair collectors: text kept while their
    samples stay, rendered again as soon as one moves."""
    metrics = M.Metrics(_App(_pairs(2, k=3)), registry=CollectorRegistry())
    line = 'avest_refused_batches_total{method="Score",reason="invalid_argument"}'
    first = metrics.exposition()[0].decode()
    assert f"{line} 0.0" in first
    metrics.refused("Score", "invalid_argument")
    metrics.rpc_duration.labels("Score", "OK").observe(0.25)
    second = metrics.exposition()[0].decode()
    assert f"{line} 1.0" in second and f"{line} 0.0" not in second
    assert 'avest_rpc_duration_seconds_count{code="OK",method="Score"} 1.0' in second
    assert _samples(second) == _samples(generate_latest(metrics.registry).decode())
