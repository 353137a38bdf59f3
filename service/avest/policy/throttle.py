"""Rates: token buckets for clients and pairs, and logging that cannot storm.

:class:`TokenBucket` refills at ``rate`` per second up to ``burst``.
:class:`LogLimiter` logs one line per key per interval and says how many it
held back; :class:`StormFilter` does the same for any logger's repeated
messages (asyncio's accept errors, gRPC's own warnings), so that no input can
make the service write more than a few lines per second.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any


class TokenBucket:
    def __init__(self, rate: float, burst: float) -> None:
        self.rate = float(rate)
        self.burst = max(float(burst), 1.0)
        self.tokens = self.burst
        self.stamp = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    def take(self, n: float = 1.0) -> bool:
        """Take ``n`` tokens if there are that many."""
        self._refill()
        if self.tokens >= n:
            self.tokens -= n
            return True
        return False

    def wait_s(self, n: float = 1.0) -> float:
        """Take ``n`` tokens now (going into debt); seconds to wait before the next call."""
        self._refill()
        self.tokens -= n
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


class KeyedRates:
    """One :class:`TokenBucket` per key (a client address, a pair), at most
    ``max_keys`` of them (the least recently used is forgotten first).

    ``rate`` per second with a burst of one second's worth; ``rate <= 0``: no limit.
    """

    def __init__(self, rate: float, max_keys: int = 10_000) -> None:
        self.rate = float(rate)
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def take(self, key: str) -> bool:
        if self.rate <= 0:
            return True
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(self.rate, self.rate)
            if len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        return bucket.take()


class LogLimiter:
    """At most one log line per key per ``interval_s``, with the count held back."""

    def __init__(self, logger: str = "avest", interval_s: float = 10.0) -> None:
        self.log = logging.getLogger(logger)
        self.interval_s = interval_s
        self._last: dict[str, tuple[float, int]] = {}

    def warning(self, key: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        last, held = self._last.get(key, (-1e18, 0))
        if now - last < self.interval_s:
            self._last[key] = (last, held + 1)
            return
        self._last[key] = (now, 0)
        if held:
            msg += " (and %d more like it in the last %.0fs)"
            args = (*args, held, self.interval_s)
        self.log.warning(msg, *args)


class StormFilter(logging.Filter):
    """Passes a message template at most ``per_interval`` times per ``interval_s``."""

    def __init__(self, interval_s: float = 10.0, per_interval: int = 5) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.per_interval = per_interval
        self._seen: OrderedDict[tuple[str, str], list[float]] = OrderedDict()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg)[:200])
        now = time.monotonic()
        entry = self._seen.get(key)
        if entry is None or now - entry[0] >= self.interval_s:
            held = int(entry[2]) if entry is not None else 0
            self._seen[key] = [now, 1.0, 0.0]
            self._seen.move_to_end(key)
            if len(self._seen) > 1000:
                self._seen.popitem(last=False)
            if held:
                record.msg = f"{record.msg} [{held} like it held back in {self.interval_s:.0f}s]"
            return True
        if entry[1] < self.per_interval:
            entry[1] += 1
            return True
        entry[2] += 1
        # Past the limit: drop the traceback of what is held back too.
        return False


def install_storm_filter(interval_s: float = 10.0, per_interval: int = 5) -> StormFilter:
    """Put one :class:`StormFilter` on every handler of the root logger."""
    f = StormFilter(interval_s, per_interval)
    for handler in logging.getLogger().handlers:
        handler.addFilter(f)
    return f
