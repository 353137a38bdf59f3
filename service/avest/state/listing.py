"""Pages of the registry's pairs in pair id order: what ``ListPairs`` and
``GET /v1/pairs`` return one page at a time.

A page token is opaque to clients: the URL-safe base64 of a tag and the last pair
id of the page before. The next page holds the pairs whose ids follow that id,
so pairs registered or deleted between two pages neither repeat nor shift the
listing (a pair registered meanwhile with an id below the token's is not in a
later page; one above it is).
"""

from __future__ import annotations

import base64
import binascii
from bisect import bisect_right
from collections.abc import Mapping
from typing import TypeVar

from avest_wire import limits
from avest_wire.errors import InvalidInput

T = TypeVar("T")

#: Starts every decoded token: a token from another listing (or random text that
#: happens to be base64) is refused instead of being read as a pair id.
_TAG = b"avest.pairs.after:"


def page_token(last_id: str) -> str:
    """The token of the page after the one whose last pair is ``last_id``."""
    return base64.urlsafe_b64encode(_TAG + last_id.encode("ascii")).decode("ascii")


def token_after(token: str, field: str = "page_token") -> str:
    """The pair id a token resumes after ("" for the empty token, the first page).

    Raises :class:`InvalidInput` for a token :func:`page_token` did not make.
    """
    if not token:
        return ""
    # A token holds a tag and an id of at most MAX_PAIR_ID_BYTES, in base64 (4 chars per 3 bytes).
    if len(token) > 4 * ((len(_TAG) + limits.MAX_PAIR_ID_BYTES + 2) // 3):
        raise InvalidInput(field, f"{limits.echo(token)} is not a page token of this listing")
    try:
        raw = base64.urlsafe_b64decode(token.encode("ascii"))
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise InvalidInput(
            field, f"{limits.echo(token)} is not a page token of this listing"
        ) from None
    last = raw[len(_TAG) :]
    if (
        not raw.startswith(_TAG)
        or not last
        or not last.isascii()
        or not last.decode().isprintable()
    ):
        raise InvalidInput(field, f"{limits.echo(token)} is not a page token of this listing")
    return last.decode("ascii")


def page(items: Mapping[str, T], size: int, token: str = "") -> tuple[list[T], str]:
    """``(items, next_token)``: at most ``size`` (>= 1) items of ``items`` (keyed by
    pair id) in id order after the token's id; ``next_token`` is "" on the last page."""
    if size < 1:
        raise ValueError("a page holds at least one pair")
    after = token_after(token)
    ids = sorted(items)
    start = bisect_right(ids, after) if after else 0
    chosen = ids[start : start + size]
    more = start + len(chosen) < len(ids)
    return [items[i] for i in chosen], page_token(chosen[-1]) if more else ""
