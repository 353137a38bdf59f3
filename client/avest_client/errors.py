"""The client's exceptions: one class per gRPC status the service uses.

Every RPC error is translated into an :class:`AvestError` subclass carrying
the status ``code`` and the server's ``message`` (which names the offending
field), so callers never need to catch ``grpc.RpcError``.
"""

from __future__ import annotations

import grpc


class AvestError(Exception):
    """An RPC to the avest service failed.

    ``code`` is the :class:`grpc.StatusCode`, ``message`` the server's status
    message (or the transport's, for UNAVAILABLE / DEADLINE_EXCEEDED), and
    ``method`` the RPC name.
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None, method: str = "") -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.method = method

    def __str__(self) -> str:
        where = f"{self.method}: " if self.method else ""
        return f"{where}{self.code.name}: {self.message}"


class InvalidArgumentError(AvestError, ValueError):
    """INVALID_ARGUMENT: a malformed or out-of-range request (the message names the field)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(AvestError, LookupError):
    """NOT_FOUND: unknown pair."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPreconditionError(AvestError):
    """FAILED_PRECONDITION: the pair's state does not allow the request (e.g. no cost curves)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhaustedError(AvestError):
    """RESOURCE_EXHAUSTED: a server limit (message size, rows, number of pairs)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(AvestError, ConnectionError):
    """UNAVAILABLE: the service cannot be reached (down, restarting, draining)."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(AvestError, TimeoutError):
    """DEADLINE_EXCEEDED: the call's deadline passed."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class CancelledError(AvestError):
    """CANCELLED: the call was cancelled (e.g. the client was closed)."""

    code = grpc.StatusCode.CANCELLED


class UnauthenticatedError(AvestError, PermissionError):
    """UNAUTHENTICATED: no token, or one the service does not know (``AVEST_TOKEN``)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(AvestError, PermissionError):
    """PERMISSION_DENIED: the token's role does not allow this call (admin actions)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class WorkerIdCollisionError(AvestError):
    """ALREADY_EXISTS: another open stream sends as this worker id; give each
    sender its own ``worker_id``."""

    code = grpc.StatusCode.ALREADY_EXISTS


_BY_CODE: dict[grpc.StatusCode, type[AvestError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        NotFoundError,
        FailedPreconditionError,
        ResourceExhaustedError,
        UnavailableError,
        DeadlineExceededError,
        CancelledError,
        UnauthenticatedError,
        PermissionDeniedError,
        WorkerIdCollisionError,
    )
}


def from_rpc_error(exc: grpc.RpcError, method: str = "") -> AvestError:
    """The :class:`AvestError` for a failed call (sync ``grpc.RpcError`` or ``grpc.aio.AioRpcError``)."""
    code_fn = getattr(exc, "code", None)
    details_fn = getattr(exc, "details", None)
    code = code_fn() if callable(code_fn) else grpc.StatusCode.UNKNOWN
    message = (details_fn() if callable(details_fn) else None) or str(exc)
    cls = _BY_CODE.get(code, AvestError)
    return cls(message, code, method)
