"""The service's metrics as the tests read them: a trace as Observe messages, a scrape
parsed into samples, and a registry of made-up pairs for the exposition."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from avest.core.estimator import OnlineEstimator
from avest.state.pairs import Pair
from avest_wire.pair import PairKey
from tests.support.live import Live

Samples = dict[str, list[Sample]]


def scrape(live: Live) -> Samples:
    r = httpx.get(live.http_url + "/metrics", timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def select(samples: Samples, name: str, **labels: str) -> list[Sample]:
    return [
        s for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())
    ]


def value(samples: Samples, name: str, **labels: str) -> float:
    found = select(samples, name, **labels)
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return float(found[0].value)


class StubApp:
    """What the metrics collector reads of the app: its hooks and its pairs."""

    def __init__(self, pairs: list[Pair]) -> None:
        self.hooks = SimpleNamespace(refit=[], removed=[])
        self.registry = SimpleNamespace(pairs={p.id: p for p in pairs})


def escaped_pairs(n: int, k: int = 3) -> list[Pair]:
    """``n`` trained pairs whose label values need escaping in the exposition."""
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


def samples_by_family(text: str) -> dict[str, list[tuple[str, tuple, str]]]:
    """Every family's samples (values by repr: NaN equals NaN), process metrics left
    out (they move between two reads)."""
    return {
        f.name: sorted((s.name, tuple(sorted(s.labels.items())), repr(s.value)) for s in f.samples)
        for f in text_string_to_metric_families(text)
        if not f.name.startswith("process_")
    }
