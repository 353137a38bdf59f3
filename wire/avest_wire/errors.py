"""The one error for input the contract refuses."""

from __future__ import annotations


class InvalidInput(ValueError):
    """Input outside the contract: wrong shape, non-finite, out of range.

    ``field`` names the offending argument so adapters can map it to a clear
    wire error (gRPC INVALID_ARGUMENT, HTTP 400) without parsing messages, and
    a sender can refuse a message before it sends it. Raised before any state
    changes, so a refused call leaves nothing behind.
    """

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem
