"""The seam between the vLLM-facing shim and the network client.

The shim hands each step's verdicts to a :class:`Sink` and reads pooled
coefficients from it; it never touches the network. The gRPC client
(``avest_client.EstimatorClient`` with its background forwarder) implements
this protocol; tests use an in-memory fake.

Threading: ``submit`` is called from the shim's forwarder thread, the other
members from vLLM's step (rank 0 only). All of them must return at once:
no network round trip, no lock held across I/O.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from avest_client.types import Served
from avest_wire.summary import RoundSummary


@runtime_checkable
class Sink(Protocol):
    def submit(
        self,
        features: np.ndarray,
        num_verified: np.ndarray,
        num_accepted: np.ndarray,
        exclude: np.ndarray | None,
    ) -> None:
        """Queue one step's rows; non-blocking.

        ``features`` float32 [R, K], ``num_verified`` int32 [R], ``num_accepted``
        int32 [R], ``exclude`` bool [R] (rows whose target sampling is transformed)
        or None when unknown. The arrays are owned by the sink after the call.
        """
        ...

    def submit_summary(self, summary: RoundSummary) -> None:
        """Queue one round summary (summary mode); non-blocking. Called from the
        shim's summary sender thread, once per round.

        With strata (``AVEST_STRATA=1``) the shim calls ``submit_summary(summary,
        stratum)`` for a summary of one stratum's drafts (docs/strata.md), and reads
        ``latest_strata()`` (name -> :class:`Served`, pushed with the latest
        coefficients; the same object until it changes) where the sink has it."""
        ...

    def latest_coefficients(self) -> Served | None:
        """The newest coefficients pushed by the sidecar, or None; non-blocking.

        Called on every step boundary (rank 0): keep it cheap. The shim
        re-validates only when the value changes (identity, then equality).
        """
        ...

    @property
    def connected(self) -> bool:
        """Whether the sidecar is reachable now (pooled coefficients may govern)."""
        ...

    def close(self, timeout: float | None = None) -> None:
        """Stop background work, waiting at most ``timeout`` s (None: the sink's own
        default) for what is queued; called once at shutdown."""
        ...


class SinkFactory(Protocol):
    def __call__(self, config: object, pair_key: object) -> Sink: ...
