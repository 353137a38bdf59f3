"""Refusals: the core's and registry's errors as gRPC status codes."""

from __future__ import annotations

import contextlib
from typing import Any

import grpc

from avest.state.errors import Conflict, Exhausted, NotFound, Unavailable
from avest_wire.errors import InvalidInput
from avest_wire.matrix import MatrixError


def reason_of(code: grpc.StatusCode) -> str:
    return str(code.name).lower()


class Refused(Exception):
    """A refusal with its gRPC status code (and trailing metadata); raised before any
    state changes."""

    def __init__(
        self, code: grpc.StatusCode, message: str, metadata: tuple[tuple[str, str], ...] = ()
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        #: Trailing metadata sent with the status (e.g. the refused step's sequence).
        self.metadata = metadata
        #: The metrics' ``reason`` label: the code's name in lower case, as every
        #: refusal counts it (the metrics fold names outside their list into ``other``).
        self.reason = reason_of(code)


def over_pair_rate(rate: float, pair_id: str) -> Exhausted:
    """The refusal of a call over its pair's rate (``--pair-rate``), on either port."""
    return Exhausted(
        "pair_id", f"more than {rate:g} calls per second for pair {pair_id}; retry later"
    )


@contextlib.contextmanager
def refusals() -> Any:
    """Translate the core's and the registry's errors into :class:`Refused`."""
    try:
        yield
    except (InvalidInput, MatrixError) as exc:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
    except NotFound as exc:
        raise Refused(grpc.StatusCode.NOT_FOUND, str(exc.args[0])) from None
    except Exhausted as exc:
        raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
    except Conflict as exc:
        raise Refused(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
    except Unavailable as exc:
        raise Refused(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
