"""The text exposition, rendered a slice at a time so a scrape never holds the event loop.

The service's gRPC server, its HTTP server and every pair's state share one
event loop. Rendering thousands of pairs' series in one go (prometheus_client's
``generate_latest``) held that loop for hundreds of milliseconds, and every RPC
waited. Here the per-pair families are rendered pair by pair; :func:`render`
is a generator that yields whenever it has worked for ``slice_s`` seconds, and
the async caller gives the loop back at each yield. A pair is always rendered
whole between two yields, so its series are consistent with each other; pairs
may be read a few milliseconds apart.

Everything else in the registry (RPC histograms, counters, process metrics) is
small and rendered by prometheus_client itself, with the pair collector paused.
The lines are those ``generate_latest`` writes (same escaping, label order and
number format); the pair families come last.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Generator, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from avest.http.collector import Families, PairCollector

#: Longest stretch of rendering between two yields to the event loop.
SLICE_S = 0.0005


class _Static:
    def __init__(self, metrics: Iterable[Metric]) -> None:
        self._metrics = list(metrics)

    def collect(self) -> Iterable[Metric]:
        return self._metrics


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def sample_line(s: Sample) -> str:
    """One sample as ``generate_latest`` writes it (no timestamps, legacy names)."""
    if s.labels:
        labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(s.labels.items()))
        return f"{s.name}{{{labels}}} {floatToGoString(s.value)}\n"
    return f"{s.name} {floatToGoString(s.value)}\n"


def _header(family: Metric) -> str:
    """The ``# HELP`` and ``# TYPE`` lines of a family, from prometheus_client."""
    empty = Metric(family.name, family.documentation, family.type)
    return generate_latest(_Static([empty])).decode()  # type: ignore[arg-type]


def _drain(families: Families, lines: dict[str, list[str]]) -> None:
    for name, family in families.items():
        if family.samples:
            lines[name].extend(map(sample_line, family.samples))
            family.samples.clear()


def render(
    registry: CollectorRegistry, collector: PairCollector, slice_s: float = SLICE_S
) -> Generator[None, None, bytes]:
    """Yield whenever ``slice_s`` of work is done; return the exposition's bytes."""
    collector.paused = True
    try:
        head = generate_latest(registry)
    finally:
        collector.paused = False
    families = collector.families()
    lines: dict[str, list[str]] = {name: [] for name in families}
    pairs = collector.pairs()
    collector.add_globals(families, pairs)
    _drain(families, lines)
    t0 = time.perf_counter()
    for pair in pairs:
        collector.add_pair(families, pair)
        _drain(families, lines)
        if time.perf_counter() - t0 >= slice_s:
            yield
            t0 = time.perf_counter()
    body = [head]
    for name, family in families.items():  # a family at a time: 100k+ lines at 1,000 pairs
        body.append((_header(family) + "".join(lines.pop(name))).encode())
        if time.perf_counter() - t0 >= slice_s:
            yield
            t0 = time.perf_counter()
    return b"".join(body)


def render_now(registry: CollectorRegistry, collector: PairCollector) -> bytes:
    """The same exposition in one go (tests, or callers off the event loop)."""
    gen = render(registry, collector)
    while True:
        try:
            next(gen)
        except StopIteration as done:
            body: bytes = done.value
            return body


async def render_async(
    registry: CollectorRegistry, collector: PairCollector, slice_s: float = SLICE_S
) -> bytes:
    """The exposition, giving the event loop back every ``slice_s`` seconds."""
    gen = render(registry, collector, slice_s)
    while True:
        try:
            next(gen)
        except StopIteration as done:
            body: bytes = done.value
            return body
        await asyncio.sleep(0)


__all__ = ["SLICE_S", "render", "render_async", "render_now", "sample_line"]
