"""What every subcommand shares: ranged numbers, tokens, JSON output.

- :func:`integer` and :func:`number` are argparse types that refuse a value
  outside its domain at parse time, naming the range (``--workers 0``:
  "must be an integer >= 1, got '0'").
- :func:`add_token_arguments` / :func:`token` give every command that talks to
  a service ``--token`` and ``--token-file``, falling back on ``AVEST_TOKEN``
  (or ``AVEST_ADMIN_TOKEN`` for admin actions).
- :func:`dumps` writes JSON that is JSON: a non-finite float becomes ``null``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from typing import Any

TOKEN_ENV = "AVEST_TOKEN"
ADMIN_TOKEN_ENV = "AVEST_ADMIN_TOKEN"


def _range(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low:g}"
    assert high is not None
    return f"{'<' if high_open else '<='} {high:g}"


def _ranged(
    kind: type,
    low: float | None,
    high: float | None,
    low_open: bool,
    high_open: bool,
) -> Callable[[str], Any]:
    what = "an integer" if kind is int else "a number"
    domain = _range(low, high, low_open, high_open)

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if (
            value is None
            or (isinstance(value, float) and not math.isfinite(value))
            or (low is not None and (value <= low if low_open else value < low))
            or (high is not None and (value >= high if high_open else value > high))
        ):
            raise argparse.ArgumentTypeError(f"must be {what} {domain}, got {text!r}")
        return value

    parse.__name__ = f"{kind.__name__} {domain}"  # what argparse names in its errors
    return parse


def integer(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in ``[low, high]``."""
    return _ranged(int, low, high, False, False)


def number(
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> Callable[[str], float]:
    """An argparse type: a finite float between ``low`` and ``high`` (open ends if asked)."""
    return _ranged(float, low, high, low_open, high_open)


# -- tokens -----------------------------------------------------------------------


def add_token_arguments(p: argparse.ArgumentParser, admin: bool = False) -> None:
    first, then = (ADMIN_TOKEN_ENV, TOKEN_ENV) if admin else (TOKEN_ENV, ADMIN_TOKEN_ENV)
    env = f"{first}, else {then}"
    role = "admin bearer token" if admin else "bearer token (the worker or admin token)"
    p.add_argument("--token", default=None, help=f"{role} [env {env}]")
    p.add_argument(
        "--token-file",
        default=None,
        metavar="PATH",
        help="read the token from this file (a mounted Kubernetes secret, say)",
    )


class TokenFileError(OSError):
    """A ``--token-file`` that cannot be read."""


def token(args: argparse.Namespace, admin: bool = False) -> str:
    """``--token``, else ``--token-file``, else the environment: ``AVEST_TOKEN`` then
    ``AVEST_ADMIN_TOKEN`` (the admin token does what the worker token does), the
    other way round for an admin action; ``""`` for none."""
    if args.token:
        return str(args.token).strip()
    if args.token_file:
        try:
            with open(args.token_file, encoding="utf-8") as f:
                return f.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenFileError(f"--token-file {args.token_file}: {exc}") from None
    names = (ADMIN_TOKEN_ENV, TOKEN_ENV) if admin else (TOKEN_ENV, ADMIN_TOKEN_ENV)
    return next((os.environ[n].strip() for n in names if os.environ.get(n, "").strip()), "")


# -- JSON -------------------------------------------------------------------------


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by ``None`` (JSON's null)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """Strict JSON: a NaN or infinity is written ``null``, never bare ``NaN``."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)
