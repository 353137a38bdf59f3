"""A pair's cost curves per hardware label, inside the contract's limits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from avest.core.costs import CostTable
from avest_wire import limits
from avest_wire.errors import InvalidInput


@dataclass(frozen=True)
class CostCurves:
    hardware: str
    draft: tuple[tuple[int, float], ...]
    verify: tuple[tuple[int, float], ...]
    cudagraph_limit: int

    def table(self) -> CostTable:
        return CostTable.from_curves(
            list(self.draft), list(self.verify), cudagraph_limit=self.cudagraph_limit
        )

    def as_dict(self) -> dict[str, Any]:
        """As stored (JSON): what :meth:`from_dict` reads back."""
        return {
            "hardware": self.hardware,
            "draft": list(self.draft),
            "verify": list(self.verify),
            "cudagraph_limit": self.cudagraph_limit,
        }

    @classmethod
    def from_dict(cls, c: dict[str, Any]) -> CostCurves:
        return cls(
            c["hardware"],
            tuple(map(tuple, c["draft"])),
            tuple(map(tuple, c["verify"])),
            int(c["cudagraph_limit"]),
        )


def check_costs(curves: CostCurves) -> None:
    """Cost curves inside the contract's limits (before the table's own checks)."""
    if limits.byte_length(curves.hardware) > limits.MAX_HARDWARE_BYTES:
        raise InvalidInput("hardware", f"at most {limits.MAX_HARDWARE_BYTES} bytes")
    for name, curve in (("draft_curve", curves.draft), ("verify_curve", curves.verify)):
        if len(curve) > limits.MAX_COST_POINTS:
            raise InvalidInput(name, f"has {len(curve)} points, at most {limits.MAX_COST_POINTS}")
        for size, ms in curve:
            if not 0 <= size <= limits.MAX_COST_SIZE:
                raise InvalidInput(name, f"size {size} outside [0, {limits.MAX_COST_SIZE}]")
            if not 0.0 <= ms <= limits.MAX_COST_MS:  # also refuses NaN
                raise InvalidInput(name, f"ms {ms} outside [0, {limits.MAX_COST_MS:g}]")
