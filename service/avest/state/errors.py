"""The registry's refusals (the adapters map them to status codes)."""

from __future__ import annotations


class NotFound(LookupError):
    """No pair with that id."""


class Conflict(RuntimeError):
    """A request that contradicts the pair's settled configuration."""

    def __init__(self, field_name: str, problem: str) -> None:
        super().__init__(f"{field_name}: {problem}")
        self.field = field_name


class Unavailable(RuntimeError):
    """The store cannot answer now (unreachable): try again later; nothing changed."""


class Exhausted(RuntimeError):
    """A configured limit (pairs, rows, message size) would be exceeded."""

    def __init__(self, field_name: str, problem: str) -> None:
        super().__init__(f"{field_name}: {problem}")
        self.field = field_name
