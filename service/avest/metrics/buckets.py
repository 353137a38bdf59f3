"""Histogram buckets of the service's two timing metrics (see :mod:`avest.metrics.names`).

Both step ``1, 2.5, 5`` per decade: three buckets for each factor of ten, so a quantile
read from them is placed within a bucket whose bounds differ by a factor of 2 or 2.5,
while a histogram series keeps about twenty buckets.
"""

import math


def one_two_five(first: float, last: float) -> tuple[float, ...]:
    """``1, 2.5, 5`` times each power of ten, from ``first`` to ``last`` inclusive.

    Each bound is parsed from its decimal text, so it is the float the literal
    (``0.00025``) would be, not a product carrying a rounding error.
    """
    decades = range(math.floor(math.log10(first)), math.floor(math.log10(last)) + 1)
    bounds = (float(f"{m}e{e}") for e in decades for m in ("1", "2.5", "5"))
    return tuple(b for b in bounds if first <= b <= last)


#: Buckets of :data:`~avest.metrics.names.RPC_DURATION`: unary calls take 0.1 ms to tens of ms,
#: streams (Observe, WatchCoefficients) last seconds to hours.
RPC_BUCKETS = (*one_two_five(0.0001, 10.0), 30.0, 60.0, 300.0, 900.0, 3600.0)
#: Buckets of :data:`~avest.metrics.names.REFIT_DURATION` (one Newton step on K+1 parameters).
REFIT_BUCKETS = (*one_two_five(0.00001, 0.25), 1.0)
#: The event loop's heartbeat lateness: a millisecond on an idle loop, up to seconds
#: when it saturates; past 10 s /healthz reports it wedged.
LOOP_LAG_BUCKETS = (*one_two_five(0.001, 10.0), 30.0)
