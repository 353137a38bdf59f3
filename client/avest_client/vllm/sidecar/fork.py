"""Fork handling for the sidecar sink: a forked child disarms the sinks it inherits."""

from __future__ import annotations

import os
import weakref
from typing import Protocol


class Armed(Protocol):
    """A sink a forked child must disarm."""

    def disarm(self) -> None:
        """Claim no connection, serve no coefficients, take no steps from now."""


#: Sinks of this process, so a forked child can disarm the copies it inherits.
LIVE: weakref.WeakSet[Armed] = weakref.WeakSet()


def after_fork_in_child() -> None:
    # The parent's threads and channel do not exist here: an inherited sink
    # must neither claim a connection nor serve coefficients nobody updates.
    for sink in list(LIVE):
        sink.disarm()
    LIVE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=after_fork_in_child)
