"""Gzip bodies from separately compressed segments decode to the same text, with any
gzip reader, and reuse the segments of parts that did not change."""

from __future__ import annotations

import gzip
import zlib

import httpx
import numpy as np

from avest.metrics import deflate
from tests.support.live import Live


def _run(gen):  # noqa: ANN001, ANN202
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value


def test_segments_make_one_valid_gzip_stream() -> None:
    rng = np.random.default_rng(0)
    big = "".join(f'avest_x{{pair="{i:016x}"}} {rng.random()}\n' for i in range(3000)).encode()
    parts = [b"# HELP a\n", b"", big, b"a 1.0\n", b"b 2.0\n", big[:20000], b"tail\n"]
    text = b"".join(parts)
    segments = deflate.Segments()
    body = b"".join(_run(segments.gzip_body(parts)))
    assert gzip.decompress(body) == text
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)  # a single-member reader (httpx's way)
    assert d.decompress(body) + d.flush() == text and d.eof and not d.unused_data
    assert len(body) < len(text) / 3

    # the same big part again: its segment is reused, not compressed again
    calls = []
    real = deflate.segment

    def counting(data: bytes):  # noqa: ANN202
        calls.append(len(data))
        return real(data)

    deflate.segment = counting  # type: ignore[assignment]
    try:
        again = b"".join(_run(segments.gzip_body(parts)))
    finally:
        deflate.segment = real  # type: ignore[assignment]
    assert again == body
    assert len(big) not in calls and len(big[:20000]) not in calls  # the kept parts
    assert gzip.decompress(b"".join(_run(segments.gzip_body([])))) == b""


def test_accept_encoding() -> None:
    assert deflate.accepts_gzip("gzip")
    assert deflate.accepts_gzip("deflate, gzip;q=0.5, br")
    assert deflate.accepts_gzip("*")
    assert not deflate.accepts_gzip("gzip;q=0")
    assert not deflate.accepts_gzip("identity")
    assert not deflate.accepts_gzip("")


def test_metrics_are_gzipped_when_the_scraper_accepts_it(live: Live) -> None:
    plain = httpx.get(live.http_url + "/metrics", headers={"Accept-Encoding": "identity"})
    assert "content-encoding" not in plain.headers
    assert int(plain.headers["content-length"]) == len(plain.content)
    url = live.http_url + "/metrics"
    with httpx.stream("GET", url, headers={"Accept-Encoding": "gzip"}) as zipped:
        raw = b"".join(zipped.iter_raw())
        assert zipped.headers["content-encoding"] == "gzip"
        assert zipped.headers["vary"] == "Accept-Encoding"
        assert int(zipped.headers["content-length"]) == len(raw)
    text = gzip.decompress(raw).decode()
    assert len(raw) < len(text) / 3

    def pair_lines(t: str) -> list[str]:
        return sorted(x for x in t.splitlines() if x.startswith(("avest_pairs", "# HELP avest_")))

    assert pair_lines(text) == pair_lines(plain.text)
    assert "avest_rpc_duration_seconds_bucket" in text


def test_a_gzip_scrape_is_the_text_scrape_compressed() -> None:
    import asyncio

    from prometheus_client import CollectorRegistry

    from avest.metrics import registry as M
    from tests.support.metrics import StubApp as _App
    from tests.support.metrics import escaped_pairs as _pairs
    from tests.support.metrics import samples_by_family as _samples

    pairs = _pairs(40, k=4)
    metrics = M.Metrics(_App(pairs), registry=CollectorRegistry())
    for _ in range(2):  # the second time from kept segments
        parts, _ = asyncio.run(metrics.exposition_async(gzip=True))
        text = gzip.decompress(b"".join(parts)).decode()
        assert _samples(text) == _samples(metrics.exposition()[0].decode())
