"""Who may do what: bearer tokens, two roles, and the table of worker actions.

Both adapters ask :class:`Access` with what they know of a call (a gRPC
method, or an HTTP method and path, plus the ``Authorization`` value) and
get back ``None`` (allowed) or a :class:`Denied` (why not). The rule:

- **open** (no token needed, a token sent is ignored): health (``/healthz``,
  ``/readyz``, ``grpc.health.v1.Health``) and ``/metrics``, so that probes and
  Prometheus scrapes keep working; a ServiceMonitor that sends a token is
  accepted too.
- **worker**: the gRPC methods in :data:`WORKER_METHODS` and every HTTP
  ``GET``/``HEAD``. Allowed with the worker token or the admin token; without
  a worker token configured, allowed to anyone (the service then refuses to
  listen beyond loopback unless started with ``--insecure``).
- **admin**: everything else (an allow-list for workers, so an RPC or route
  added later is admin until listed here). Needs the admin token; without an
  admin token configured, refused.

Tokens are compared in constant time.
"""

from __future__ import annotations

import enum
import hmac
import ipaddress
from dataclasses import dataclass

_ESTIMATOR = "/avest.v1.EstimatorService/"

#: gRPC methods a worker may call: register, observe, read, and add the cost
#: curves of a hardware label that has none (vLLM measures them at start-up;
#: replacing curves that differ needs the admin token, checked by the servicer:
#: :func:`may_replace_costs`). Everything else (any reset or delete, anything
#: added later) needs the admin token.
WORKER_METHODS = frozenset(
    _ESTIMATOR + name
    for name in (
        "RegisterPair",
        "Observe",
        "GetCoefficients",
        "WatchCoefficients",
        "Score",
        "Budget",
        "ListPairs",
        "GetPair",
        "GetSchedule",
        "SetCostCurves",
    )
) | frozenset(
    {
        # Server reflection describes the contract only (buf curl, grpcurl).
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    }
)
#: gRPC methods open to anyone.
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
#: HTTP paths open to anyone (any method FastAPI routes there).
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
#: HTTP methods that only read: worker role.
READ_HTTP_METHODS = frozenset({"GET", "HEAD"})


class Role(enum.IntEnum):
    OPEN = 0
    WORKER = 1
    ADMIN = 2


@dataclass(frozen=True)
class Denied:
    """A refused call: ``unauthenticated`` (no or unknown token) or not allowed."""

    unauthenticated: bool
    message: str


def grpc_role(method: str) -> Role:
    if method in OPEN_METHODS:
        return Role.OPEN
    if method in WORKER_METHODS:
        return Role.WORKER
    return Role.ADMIN


def http_role(method: str, path: str) -> Role:
    if path in OPEN_PATHS:
        return Role.OPEN
    if method.upper() in READ_HTTP_METHODS:
        return Role.WORKER
    return Role.ADMIN


def bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value (scheme case-insensitive)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


#: How a refused caller passes a token, in the UNAUTHENTICATED (401) message.
HOW_TO_SEND = (
    "send authorization: Bearer <token> (avest commands: --token, --token-file or "
    "AVEST_TOKEN / AVEST_ADMIN_TOKEN; the Python client: EstimatorClient(..., token=...) "
    "or AVEST_TOKEN)"
)


class Access:
    """The configured tokens and the decision for one call."""

    def __init__(self, worker_token: str = "", admin_token: str = "") -> None:
        self.worker_token = worker_token
        self.admin_token = admin_token

    @property
    def any_token(self) -> bool:
        return bool(self.worker_token or self.admin_token)

    def role_of(self, token: str | None) -> Role | None:
        """The role a token grants (``None``: no token, or not a known one)."""
        if token is None:
            return None
        if self.admin_token and _same(token, self.admin_token):
            return Role.ADMIN
        if self.worker_token and _same(token, self.worker_token):
            return Role.WORKER
        return None

    def check(self, needed: Role, authorization: str | None) -> Denied | None:
        if needed == Role.OPEN:
            return None
        token = bearer(authorization)
        held = self.role_of(token)
        if needed == Role.WORKER:
            if held is not None or not self.worker_token:
                return None
            if token is None:
                return Denied(True, f"a worker or admin token is required: {HOW_TO_SEND}")
            return Denied(True, "unknown token")
        if not self.admin_token:
            return Denied(False, "admin actions are disabled: the service has no admin token")
        if held == Role.ADMIN:
            return None
        if token is None:
            return Denied(True, f"the admin token is required: {HOW_TO_SEND}")
        if held == Role.WORKER:
            return Denied(False, "the worker token does not allow this; it needs the admin token")
        return Denied(True, "unknown token")


def is_loopback(host: str) -> bool:
    """Whether a listen host is reachable only from this machine."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def may_replace_costs(access: Access, authorization: str | None) -> bool:
    """Whether a caller may replace a pair's existing, different cost curves: admin only."""
    return access.role_of(bearer(authorization)) == Role.ADMIN
