"""A gzip body from independently compressed segments, so unchanged text is
compressed once.

The exposition's big parts (each family's per-pair text, joined) stay the same
bytes object from scrape to scrape while no pair changes. Each is compressed on
its own into a raw deflate segment ended by a sync flush: byte-aligned, with no
back-reference outside itself, so segments concatenate into one valid deflate
stream (as parallel gzip tools do). A gzip header, the segments, an empty final
block and the trailer (CRC-32 and length of the whole text) make the body. A
scrape then compresses only the small live parts (the registry's other
families, the global series, the family headers) and what changed.

Compression and the CRC run a chunk at a time; :func:`gzip_body` yields between
chunks so the caller can give the event loop back.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Generator

#: zlib level: the text is very repetitive, level 1 already shrinks it ~10x.
LEVEL = 1
#: Bytes compressed (or checksummed) between two yields.
CHUNK = 64 * 1024
#: Parts at least this long are compressed alone and kept for the next scrape.
KEEP_BYTES = 16 * 1024
#: gzip member header: deflate, no flags, no mtime, unknown OS.
HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
#: An empty final block (fixed Huffman, BFINAL set): ends the deflate stream.
FINAL = b"\x03\x00"


def accepts_gzip(accept_encoding: str) -> bool:
    """Whether an ``Accept-Encoding`` header allows gzip (``gzip;q=0`` does not)."""
    for item in accept_encoding.split(","):
        name, _, params = item.strip().partition(";")
        if name.strip().lower() not in ("gzip", "*"):
            continue
        q = params.strip()
        if q.startswith("q="):
            try:
                return float(q[2:]) > 0.0
            except ValueError:
                return False
        return True
    return False


def segment(data: bytes) -> Generator[None, None, bytes]:
    """``data`` as a self-contained, byte-aligned raw deflate segment."""
    comp = zlib.compressobj(LEVEL, zlib.DEFLATED, -15)
    out = []
    for start in range(0, len(data), CHUNK):
        out.append(comp.compress(data[start : start + CHUNK]))
        yield
    out.append(comp.flush(zlib.Z_SYNC_FLUSH))
    return b"".join(out)


class Segments:
    """Compressed segments of the big parts, kept while the same bytes come back."""

    def __init__(self) -> None:
        self._kept: dict[int, tuple[bytes, bytes]] = {}

    def gzip_body(self, parts: list[bytes]) -> Generator[None, None, list[bytes]]:
        """The gzip encoding of ``b"".join(parts)``, as a list of parts."""
        out = [HEADER]
        kept: dict[int, tuple[bytes, bytes]] = {}
        small: list[bytes] = []
        crc, size = 0, 0
        for part in parts:
            if not part:
                continue
            for start in range(0, len(part), CHUNK * 16):
                crc = zlib.crc32(part[start : start + CHUNK * 16], crc)
                yield
            size += len(part)
            if len(part) < KEEP_BYTES:
                small.append(part)
                continue
            if small:  # the live parts since the last big one, as one segment
                out.append((yield from segment(b"".join(small))))
                small = []
            hit = self._kept.get(id(part))
            if hit is None or hit[0] is not part:
                hit = (part, (yield from segment(part)))
            kept[id(part)] = hit
            out.append(hit[1])
        if small:
            out.append((yield from segment(b"".join(small))))
        self._kept = kept  # only what this body used: the rest changed
        out.append(FINAL)
        out.append(struct.pack("<II", crc & 0xFFFFFFFF, size & 0xFFFFFFFF))
        return out


__all__ = ["FINAL", "HEADER", "Segments", "accepts_gzip", "segment"]
