"""The text exposition: each pair's lines rendered once per change, a scrape a join.

The service's gRPC server, its HTTP server and every pair's state share one
event loop. Rendering thousands of pairs' series on every scrape
(prometheus_client's ``generate_latest``) held that loop for seconds, and
every RPC waited. Here the per-pair collectors (the pair collector and the
worker tables) are rendered pair by pair, and each pair's lines are kept as
bytes, one chunk per family, with the pair's *stamp*: the counters that move
whenever anything its series read changes (steps, drafts, rounds, version,
last update, refits). A scrape re-renders only the pairs whose stamp moved
and joins everyone's cached bytes; a pair that did not change since the last
scrape costs a stamp comparison; each family's joined text is kept too, while
no pair changed. Series that are not per pair (the queue depth, open streams)
are computed on every scrape, the queue depth tallied pair by pair.

:meth:`Exposition.render` is a generator that yields whenever it has worked
for ``slice_s`` seconds, and the async caller gives the loop back at each
yield. A pair is always rendered whole between two yields, so its series are
consistent with each other; pairs may be read a few milliseconds apart.

Everything else in the registry (RPC histograms, counters, process metrics)
is small and rendered by prometheus_client itself, a collector and a family at
a time. The lines are those ``generate_latest`` writes (same escaping, label
order and number format); the sliced families come last. The body is a list
of parts, handed to the HTTP server in :data:`PIECE_BYTES` pieces, or gzipped
from segments compressed once per change (:mod:`avest.metrics.deflate`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Generator, Hashable, Iterable, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from avest.metrics.deflate import Segments

#: Longest stretch of rendering between two yields to the event loop.
SLICE_S = 0.0005
#: Bytes handed to the HTTP server at a time (:func:`pieces`).
PIECE_BYTES = 64 * 1024

_EMPTY = b""


class Sliced(Protocol):
    """A collector whose series are per pair, rendered by :class:`Exposition`."""

    #: While set, ``collect()`` yields nothing (the exposition renders it).
    paused: bool

    def families(self) -> dict[str, Any]: ...

    def pairs(self) -> list[Any]: ...

    def tally(self, pair: Any) -> float: ...

    def add_globals(self, f: Any, pairs: list[Any], tallied: float) -> None: ...

    def add_pair(self, f: Any, pair: Any) -> None: ...

    def stamp(self, pair: Any) -> Hashable: ...


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


def _header(family: Metric) -> bytes:
    """The ``# HELP`` and ``# TYPE`` lines of a family, from prometheus_client."""
    empty = Metric(family.name, family.documentation, family.type)
    return generate_latest(_Static([empty]))  # type: ignore[arg-type]


def _drain(families: dict[str, Any]) -> tuple[bytes, ...]:
    """Every family's pending samples as bytes (one chunk per family), then cleared."""
    out = []
    for family in families.values():
        if family.samples:
            out.append("".join(map(sample_line, family.samples)).encode())
            family.samples.clear()
        else:
            out.append(_EMPTY)
    return tuple(out)


#: A pair's cached text: (the pair object, its stamp, one chunk per family).
_Entry = tuple[Any, Hashable, tuple[bytes, ...]]


class Exposition:
    """Renders a registry whose per-pair collectors are sliced and cached by stamp."""

    def __init__(self, registry: CollectorRegistry, collectors: Sequence[Sliced]) -> None:
        self.registry = registry
        self.collectors = list(collectors)
        #: Per collector: pair id -> cached entry.
        self._texts: list[dict[str, _Entry]] = [{} for _ in self.collectors]
        self._headers: dict[str, bytes] = {}
        #: Per collector: the pair ids of the last scrape and every family's
        #: per-pair text, joined; reused while no pair is added, removed or changed.
        self._sections: list[tuple[list[str], int, tuple[bytes, ...]] | None] = [
            None for _ in self.collectors
        ]
        #: Per collector: bumped whenever a pair's text is replaced (a section
        #: joined at an older generation may miss it).
        self._generation = [0 for _ in self.collectors]
        #: The other collectors' families: their samples and text at the last scrape.
        self._other_texts: dict[str, tuple[Hashable, bytes]] = {}
        #: Compressed segments of the big parts, for gzip bodies.
        self._segments = Segments()
        #: Ids of the pairs the last scrape rendered (the others' text was cached).
        self.rendered: set[str] = set()

    def forget(self, pair_id: str) -> None:
        """Drop a pair's cached text (it was removed)."""
        for texts in self._texts:
            texts.pop(pair_id, None)

    def _others(self) -> list[Any]:
        """The registry's other collectors (RPC histograms, counters, process)."""
        names = getattr(self.registry, "_collector_to_names", None)
        lock = getattr(self.registry, "_lock", None)
        if names is None or lock is None:  # another registry layout: read them in one go
            return [_Static(self._read_others())]
        with lock:
            found = list(names)
        return [c for c in found if all(c is not mine for mine in self.collectors)]

    def _read_others(self) -> list[Metric]:
        for c in self.collectors:
            c.paused = True
        try:
            return list(self.registry.collect())
        finally:
            for c in self.collectors:
                c.paused = False

    def _header(self, name: str, family: Metric) -> bytes:
        h = self._headers.get(name)
        if h is None:
            h = self._headers[name] = _header(family)
        return h

    def render(self, slice_s: float = SLICE_S) -> Generator[None, None, list[bytes]]:
        """Yield whenever ``slice_s`` of work is done; return the exposition's
        bytes as a list of parts (joined, they are the text)."""
        t0 = time.perf_counter()
        body = []
        kept = self._other_texts
        self._other_texts = {}
        for other in self._others():  # a collector at a time, then a family at a time
            for metric in other.collect():
                # The same samples as last time (most counters, the idle methods'
                # histograms): the same text.
                key = (metric.type, tuple(
                    (x.name, tuple(x.labels.items()), x.value, x.timestamp) for x in metric.samples
                ))  # fmt: skip
                hit = kept.get(metric.name)
                text = hit[1] if hit is not None and hit[0] == key else None
                if text is None:
                    text = generate_latest(_Static([metric]))  # type: ignore[arg-type]
                self._other_texts[metric.name] = (key, text)
                body.append(text)
                if time.perf_counter() - t0 >= slice_s:
                    yield
                    t0 = time.perf_counter()
            if time.perf_counter() - t0 >= slice_s:
                yield
                t0 = time.perf_counter()
        rendered: set[str] = set()
        for n, collector in enumerate(self.collectors):
            texts = self._texts[n]
            families = collector.families()
            pairs = collector.pairs()
            chunks: list[tuple[bytes, ...]] = []
            tallied = 0.0
            generation = self._generation[n]  # the chunks below are at least this new
            own = 0
            ids = []
            for pair in pairs:
                pid = pair.id
                ids.append(pid)
                stamp = collector.stamp(pair)
                entry = texts.get(pid)
                if entry is None or entry[0] is not pair or entry[1] != stamp:
                    collector.add_pair(families, pair)
                    entry = texts[pid] = (pair, stamp, _drain(families))
                    rendered.add(pid)
                    self._generation[n] += 1
                    own += 1
                chunks.append(entry[2])
                tallied += collector.tally(pair)
                if time.perf_counter() - t0 >= slice_s:
                    yield
                    t0 = time.perf_counter()
            collector.add_globals(families, pairs, tallied)
            globals_ = _drain(families)
            if len(texts) > len(pairs):  # pairs removed without a hook: forget them
                live = set(ids)
                for pid in [pid for pid in texts if pid not in live]:
                    del texts[pid]
            section = self._sections[n]
            if section is not None and section[:2] == (ids, self._generation[n]):
                joined = section[2]
            else:
                parts = []
                for i in range(len(families)):
                    parts.append(b"".join([c[i] for c in chunks]))
                    if time.perf_counter() - t0 >= slice_s:
                        yield
                        t0 = time.perf_counter()
                joined = tuple(parts)
                if self._generation[n] == generation + own:  # no other scrape rendered
                    generation = self._generation[n]
                self._sections[n] = (ids, generation, joined)
            for i, (name, family) in enumerate(families.items()):
                body.append(self._header(name, family))
                body.append(globals_[i])
                body.append(joined[i])
        self.rendered = rendered
        return body

    def render_now(self) -> bytes:
        """The same exposition in one go (tests, or callers off the event loop)."""
        gen = self.render()
        while True:
            try:
                next(gen)
            except StopIteration as done:
                return b"".join(done.value)

    async def render_async(self, slice_s: float = SLICE_S, gzip: bool = False) -> list[bytes]:
        """The exposition's parts, giving the event loop back every ``slice_s``
        seconds; ``gzip``: the parts of its gzip encoding (:mod:`avest.metrics.deflate`)."""
        parts: list[bytes] = await _drive(self.render(slice_s))
        if gzip:
            parts = await _drive(self._segments.gzip_body(parts))
        return parts


async def _drive(gen: Generator[None, None, list[bytes]]) -> list[bytes]:
    """Run a generator to its end, giving the event loop back at each yield."""
    while True:
        try:
            next(gen)
        except StopIteration as done:
            result: list[bytes] = done.value
            return result
        await asyncio.sleep(0)


async def pieces(parts: list[bytes], size: int = PIECE_BYTES) -> AsyncIterator[bytes]:
    """The parts re-cut into pieces of at most ``size`` bytes, for a streamed
    response: the HTTP server copies (and the loop waits for) one piece at a time."""
    for part in parts:
        for start in range(0, len(part), size):
            yield part[start : start + size]


__all__ = ["PIECE_BYTES", "SLICE_S", "Exposition", "Sliced", "pieces", "sample_line"]
