"""The one error the core raises for bad input: the contract's own (:mod:`avest_wire.errors`)."""

from __future__ import annotations

from avest_wire.errors import InvalidInput

__all__ = ["InvalidInput"]
