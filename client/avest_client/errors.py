"""The client's exceptions: one class per gRPC status the service uses.

Every RPC error is translated into an :class:`AvestError` subclass carrying
the status ``code`` and the server's ``message`` (which names the offending
field), so callers never need to catch ``grpc.RpcError``.
"""

from __future__ import annotations

import grpc

_S = grpc.StatusCode


#: The class of each status code (filled by each class's definition).
_BY_CODE: dict[grpc.StatusCode, type[AvestError]] = {}


class AvestError(Exception):
    """An RPC to the avest service failed.

    ``code`` is the :class:`grpc.StatusCode`, ``message`` the server's status
    message (or the transport's, for UNAVAILABLE / DEADLINE_EXCEEDED), and
    ``method`` the RPC name.
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init_subclass__(cls, code: grpc.StatusCode | None = None, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code
            _BY_CODE[code] = cls

    def __init__(self, message: str, code: grpc.StatusCode | None = None, method: str = "") -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.method = method

    def __str__(self) -> str:
        where = f"{self.method}: " if self.method else ""
        return f"{where}{self.code.name}: {self.message}"


class InvalidArgumentError(AvestError, ValueError, code=_S.INVALID_ARGUMENT):
    """INVALID_ARGUMENT: a malformed or out-of-range request (the message names the field)."""


class NotFoundError(AvestError, LookupError, code=_S.NOT_FOUND):
    """NOT_FOUND: unknown pair."""


class FailedPreconditionError(AvestError, code=_S.FAILED_PRECONDITION):
    """FAILED_PRECONDITION: the pair's state does not allow the request (e.g. no cost curves)."""


class ResourceExhaustedError(AvestError, code=_S.RESOURCE_EXHAUSTED):
    """RESOURCE_EXHAUSTED: a server limit (message size, rows, number of pairs)."""


class UnavailableError(AvestError, ConnectionError, code=_S.UNAVAILABLE):
    """UNAVAILABLE: the service cannot be reached (down, restarting, draining)."""


class DeadlineExceededError(AvestError, TimeoutError, code=_S.DEADLINE_EXCEEDED):
    """DEADLINE_EXCEEDED: the call's deadline passed."""


class CancelledError(AvestError, code=_S.CANCELLED):
    """CANCELLED: the call was cancelled (e.g. the client was closed)."""


class UnauthenticatedError(AvestError, PermissionError, code=_S.UNAUTHENTICATED):
    """UNAUTHENTICATED: no token, or one the service does not know (``AVEST_TOKEN``)."""


class PermissionDeniedError(AvestError, PermissionError, code=_S.PERMISSION_DENIED):
    """PERMISSION_DENIED: the token's role does not allow this call (admin actions)."""


class WorkerIdCollisionError(AvestError, code=_S.ALREADY_EXISTS):
    """ALREADY_EXISTS: another open stream sends as this worker id; give each
    sender its own ``worker_id``."""


class WorkerIdReusedError(FailedPreconditionError):
    """A forwarder set to fail (``reused_worker_id="fail"``) found steps of an
    earlier sender of its worker id applied at or above its own first sequence:
    sending would have its steps ignored as duplicates. Give each sender its own
    ``worker_id``, or let the forwarder continue above them."""


def from_rpc_error(exc: grpc.RpcError, method: str = "") -> AvestError:
    """The :class:`AvestError` for a failed call (sync ``grpc.RpcError`` or ``grpc.aio.AioRpcError``)."""
    code_fn = getattr(exc, "code", None)
    details_fn = getattr(exc, "details", None)
    code = code_fn() if callable(code_fn) else grpc.StatusCode.UNKNOWN
    message = (details_fn() if callable(details_fn) else None) or str(exc)
    cls = _BY_CODE.get(code, AvestError)
    return cls(message, code, method)
