"""Pages of the registry's pairs in pair id order: what ``ListPairs`` and
``GET /v1/pairs`` return one page at a time.

A page token is opaque to clients. It names the last pair id of the page before
(``after-<id>``, :data:`TOKEN_PATTERN`); the next page holds the pairs whose ids
follow that id, so pairs registered or deleted between two pages neither repeat
nor shift the listing (a pair registered meanwhile with an id below the token's
is not in a later page; one above it is). Every string the pattern admits is a
token the listing can resume from (pair ids are hex digests, and an id that is
no longer registered still has a place in the order), so the pattern, which the
admin API's schema states, is the whole check.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Mapping
from typing import TypeVar

from avest_wire import limits
from avest_wire.errors import InvalidInput

T = TypeVar("T")

#: Every page token, the empty one (the first page) aside.
TOKEN_PATTERN = rf"after-[0-9a-f]{{1,{limits.MAX_PAIR_ID_BYTES}}}"
_TOKEN = re.compile(TOKEN_PATTERN)


def page_token(last_id: str) -> str:
    """The token of the page after the one whose last pair is ``last_id``."""
    return f"after-{last_id}"


def token_after(token: str, field: str = "page_token") -> str:
    """The pair id a token resumes after ("" for the empty token, the first page).

    Raises :class:`InvalidInput` for a token :func:`page_token` did not make.
    """
    if not token:
        return ""
    if _TOKEN.fullmatch(token) is None:
        raise InvalidInput(field, f"{limits.echo(token)} is not a page token of this listing")
    return token[len("after-") :]


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
