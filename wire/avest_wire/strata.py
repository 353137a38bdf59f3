"""A request's stratum: which coefficient set of its pair predicts its drafts.

A stratum is chosen only from what a request declares before drafting (its
sampling temperature, and optionally a label the operator maps from it, such as
its LoRA adapter), never from a drafted token: each draft's survival then still
depends only on its prefix, so trimming stays lossless (docs/design.md §3, §6).
The client and the service import the same function and constants, so a stratum
named by a worker is the one the service fits.

Names: ``greedy`` for greedy sampling, ``t<E0``, ``tE0-E1``, ..., ``t>=En`` for
the temperature buckets between the edges, each prefixed with ``LABEL/`` when a
label is given (``code/greedy``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from avest_wire.errors import InvalidInput
from avest_wire.limits import byte_length

#: A temperature below this samples greedily: vLLM's ``_SAMPLING_EPS``
#: (``SamplingParams`` turns such a request into a greedy one).
GREEDY_TEMPERATURE = 1e-5
#: The greedy stratum's name.
GREEDY = "greedy"
#: Temperature bucket edges of the sampled requests: below 0.5 (near-greedy,
#: sharp distributions), [0.5, 1) (the common "creative but safe" range, e.g.
#: 0.7 and 0.8), and 1 and above (the model's own distribution or flatter).
#: Slopes measured on the shared traces: about 1.0 greedy, 0.67 at T = 0.7.
DEFAULT_EDGES: tuple[float, ...] = (0.5, 1.0)
#: Most strata one pair fits. Each costs O(K) sums per round on the worker's
#: device and one round summary on the wire, and names one series in the metrics,
#: so the bound keeps all three small; 16 holds greedy and three temperature
#: buckets for four labels. A stratum past it is predicted with the pair's pooled
#: coefficients (counted), never refused.
MAX_STRATA = 16
#: Longest stratum name, in UTF-8 bytes (a metric label value and a trace string).
MAX_STRATUM_BYTES = 64
#: Most temperature edges: greedy and the ``edges + 1`` buckets fit in :data:`MAX_STRATA`.
MAX_EDGES = MAX_STRATA - 2
#: Separates a label from the temperature part of a name (so a label has none).
LABEL_SEPARATOR = "/"


def check_edges(edges: Sequence[float]) -> tuple[float, ...]:
    """``edges`` as a tuple, when finite, above the greedy threshold and strictly
    increasing (at most :data:`MAX_EDGES`); raises :class:`InvalidInput` otherwise."""
    out = tuple(float(e) for e in edges)
    if len(out) > MAX_EDGES:
        raise InvalidInput("edges", f"has {len(out)} edges, at most {MAX_EDGES}")
    for e in out:
        if not math.isfinite(e) or e <= GREEDY_TEMPERATURE:
            raise InvalidInput("edges", f"must be finite and > {GREEDY_TEMPERATURE:g}, got {e!r}")
    if any(b <= a for a, b in zip(out, out[1:], strict=False)):
        raise InvalidInput("edges", f"must be strictly increasing, got {list(out)}")
    return out


def check_stratum(name: str) -> str:
    """A stratum name: a non-empty string of at most :data:`MAX_STRATUM_BYTES`
    bytes without control characters; raises :class:`InvalidInput` otherwise."""
    if not isinstance(name, str) or not name:
        raise InvalidInput("stratum", f"must be a non-empty string, got {name!r}")
    if byte_length(name) > MAX_STRATUM_BYTES:
        raise InvalidInput("stratum", f"is {byte_length(name)} bytes, at most {MAX_STRATUM_BYTES}")
    if not name.isprintable():
        raise InvalidInput("stratum", f"has a control character: {name!r}")
    return name


def _edge(value: float) -> str:
    return f"{value:g}"


def bucket_names(edges: Sequence[float] = DEFAULT_EDGES) -> tuple[str, ...]:
    """Every name :func:`stratum_of` gives without a label, greedy first."""
    e = check_edges(edges)
    if not e:
        return (GREEDY, "sampled")
    inner = tuple(f"t{_edge(lo)}-{_edge(hi)}" for lo, hi in zip(e, e[1:], strict=False))
    return (GREEDY, f"t<{_edge(e[0])}", *inner, f"t>={_edge(e[-1])}")


def stratum_of(
    temperature: float, edges: Sequence[float] = DEFAULT_EDGES, label: str | None = None
) -> str:
    """The stratum of a request that samples at ``temperature``.

    Greedy below :data:`GREEDY_TEMPERATURE`; otherwise the bucket ``[E_i, E_i+1)``
    of ``edges`` holding it (no edges: one ``sampled`` bucket). ``label`` (an
    operator's name for the request's kind, without ``/``) prefixes the name.
    """
    t = float(temperature)
    if not math.isfinite(t) or t < 0.0:
        raise InvalidInput("temperature", f"must be finite and >= 0, got {temperature!r}")
    names = bucket_names(edges)
    if t < GREEDY_TEMPERATURE:
        name = names[0]
    else:
        e = check_edges(edges)
        name = names[1 + sum(1 for edge in e if t >= edge)]
    if label is None:
        return name
    if not label or LABEL_SEPARATOR in label:
        raise InvalidInput("label", f"must be non-empty without {LABEL_SEPARATOR!r}, got {label!r}")
    return check_stratum(f"{label}{LABEL_SEPARATOR}{name}")
