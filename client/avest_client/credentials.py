"""How the client proves who it is: a bearer token and TLS.

:class:`Credentials` holds a token (sent as ``authorization: Bearer <token>``
on every call) and, for a service that serves TLS, the CA bundle to verify
it by (plus a client certificate and key for mutual TLS). Anything not
given as an argument comes from the environment:

=================  =================================================
``AVEST_TOKEN``     the worker (or admin) token
``AVEST_TLS_CA``    PEM CA bundle: connect with TLS, verifying the service
``AVEST_TLS_CERT``  PEM client certificate (mutual TLS), with ``AVEST_TLS_KEY``
=================  =================================================

Without a CA the channel is plaintext (a service on loopback, or behind a
mesh that does TLS). :func:`sync_channel` and :func:`aio_channel` build the
channel every client, forwarder and watcher uses.
"""

from __future__ import annotations

import os
from collections import namedtuple
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

TOKEN_ENV = "AVEST_TOKEN"
TLS_CA_ENV = "AVEST_TLS_CA"
TLS_CERT_ENV = "AVEST_TLS_CERT"
TLS_KEY_ENV = "AVEST_TLS_KEY"


@dataclass(frozen=True)
class Credentials:
    token: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""

    @classmethod
    def resolve(
        cls,
        token: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> Credentials:
        """Arguments first, then ``AVEST_TOKEN`` / ``AVEST_TLS_*``."""
        env = os.environ if environ is None else environ
        return cls(
            token=(env.get(TOKEN_ENV, "") if token is None else token).strip(),
            tls_ca=env.get(TLS_CA_ENV, "") if tls_ca is None else tls_ca,
            tls_cert=env.get(TLS_CERT_ENV, "") if tls_cert is None else tls_cert,
            tls_key=env.get(TLS_KEY_ENV, "") if tls_key is None else tls_key,
        )

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls_ca:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=Path(self.tls_ca).read_bytes(),
            private_key=Path(self.tls_key).read_bytes() if self.tls_key else None,
            certificate_chain=Path(self.tls_cert).read_bytes() if self.tls_cert else None,
        )


class _SyncToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the token to a synchronous call's metadata, whatever its kind."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata

    def _intercept(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(
            _CallDetails(
                details.method,
                details.timeout,
                tuple(details.metadata or ()) + self.metadata,
                details.credentials,
                getattr(details, "wait_for_ready", None),
                getattr(details, "compression", None),
            ),
            request,
        )

    intercept_unary_unary = intercept_unary_stream = _intercept
    intercept_stream_unary = intercept_stream_stream = _intercept


class _CallDetails(
    namedtuple(  # gRPC's own idiom for a ClientCallDetails of one's own
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,  # type: ignore[misc]
):
    pass


class _AioToken:
    """Adds the token to a ``grpc.aio`` call's metadata; one subclass per call kind.

    ``grpc.aio`` files each interceptor under the first call kind it implements
    (unary-unary, then unary-stream, ...), so one object implementing all four
    would run on unary-unary calls only and every stream would go out without
    the token: :func:`_aio_token_interceptors` gives one interceptor per kind.
    """

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata

    async def _intercept(self, continuation: Any, details: Any, request: Any) -> Any:
        metadata = grpc.aio.Metadata(*(tuple(details.metadata or ()) + self.metadata))
        return await continuation(
            grpc.aio.ClientCallDetails(
                details.method,
                details.timeout,
                metadata,
                details.credentials,
                details.wait_for_ready,
            ),
            request,
        )


class _AioUnaryUnaryToken(_AioToken, grpc.aio.UnaryUnaryClientInterceptor):
    intercept_unary_unary = _AioToken._intercept


class _AioUnaryStreamToken(_AioToken, grpc.aio.UnaryStreamClientInterceptor):
    intercept_unary_stream = _AioToken._intercept


class _AioStreamUnaryToken(_AioToken, grpc.aio.StreamUnaryClientInterceptor):
    intercept_stream_unary = _AioToken._intercept


class _AioStreamStreamToken(_AioToken, grpc.aio.StreamStreamClientInterceptor):
    intercept_stream_stream = _AioToken._intercept


def _aio_token_interceptors(
    metadata: tuple[tuple[str, str], ...],
) -> list[grpc.aio.ClientInterceptor]:
    """The token on every kind of ``grpc.aio`` call: one interceptor per kind."""
    return [
        _AioUnaryUnaryToken(metadata),
        _AioUnaryStreamToken(metadata),
        _AioStreamUnaryToken(metadata),
        _AioStreamStreamToken(metadata),
    ]


def sync_channel(
    address: str, options: Sequence[tuple[str, Any]], credentials: Credentials | None
) -> grpc.Channel:
    """A synchronous channel: TLS when a CA is known, the token on every call."""
    creds = credentials or Credentials()
    tls = creds.channel_credentials()
    if tls is None:
        channel = grpc.insecure_channel(address, options=list(options))
    else:
        channel = grpc.secure_channel(address, tls, options=list(options))
    if creds.token:
        channel = grpc.intercept_channel(channel, _SyncToken(creds.metadata))
    return channel


def aio_channel(
    address: str, options: Sequence[tuple[str, Any]], credentials: Credentials | None
) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel: TLS when a CA is known, the token on every call."""
    creds = credentials or Credentials()
    tls = creds.channel_credentials()
    interceptors = _aio_token_interceptors(creds.metadata) if creds.token else None
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
    return grpc.aio.secure_channel(address, tls, options=list(options), interceptors=interceptors)
