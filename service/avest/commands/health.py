"""``avest health``: probe a running service's ``/healthz`` the way it is served.

Probe /healthz (or /readyz) of the service that `avest serve` with the same flags or
AVEST_* environment runs: HTTPS when AVEST_TLS_CERT is set.

Reads the same settings as ``avest serve`` (flags or ``AVEST_*``): the HTTP
address (a wildcard bind is probed on loopback) and TLS. With TLS on it speaks
HTTPS; the probe checks that the service answers, not who it is, so the
certificate is not verified unless ``--ca`` is given. With mutual TLS it
presents a client certificate: ``--client-cert``/``--client-key``
(``AVEST_HEALTH_CERT``/``AVEST_HEALTH_KEY``), by default the service's own
certificate and key (which pass when one CA signs both). Exit status 0 when
healthy, 1 when not (the reason on stderr), 2 on bad settings: what a
container's HEALTHCHECK wants.
"""

from __future__ import annotations

import argparse
import os
import sys

from avest.commands.options import add_token_arguments, number, token

HEALTH_CERT_ENV = "AVEST_HEALTH_CERT"
HEALTH_KEY_ENV = "AVEST_HEALTH_KEY"


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument("--http-address", default=None, help="HOST:PORT [env AVEST_HTTP_ADDRESS]")
    p.add_argument("--ready", action="store_true", help="probe /readyz instead of /healthz")
    p.add_argument("--ca", default=None, help="PEM CA: verify the service's certificate with it")
    p.add_argument(
        "--client-cert",
        default=None,
        help=f"PEM client certificate for mutual TLS [env {HEALTH_CERT_ENV}; default: the "
        "service's own --tls-cert]",
    )
    p.add_argument("--client-key", default=None, help=f"its key [env {HEALTH_KEY_ENV}]")
    p.add_argument(
        "--timeout", type=number(0, low_open=True), default=4.0, help="seconds (default 4)"
    )
    add_token_arguments(p)  # the probes are open: a token is sent, and ignored there
    p.set_defaults(func=run)


def _split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` as :func:`avest.settings.split_address` reads it (without pydantic)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address must be HOST:PORT, got {address!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


class _EnvSettings:
    """The settings the probe reads, straight from ``AVEST_*`` (a client-only install has
    no pydantic for :class:`avest.settings.Settings`); the same names and defaults."""

    def __init__(self) -> None:
        env = os.environ
        self.http_address = env.get("AVEST_HTTP_ADDRESS", "127.0.0.1:8000")
        self.tls_cert = env.get("AVEST_TLS_CERT", "")
        self.tls_key = env.get("AVEST_TLS_KEY", "")
        self.tls_client_ca = env.get("AVEST_TLS_CLIENT_CA", "")


def probe_url(http_address: str, tls: bool, path: str = "/healthz") -> str:
    """The URL to probe: a wildcard bind (0.0.0.0, ::, empty) on loopback."""
    host, port = _split_address(http_address)
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"{'https' if tls else 'http'}://{host}:{port}{path}"


def run(args: argparse.Namespace) -> int:
    import ssl
    import urllib.error
    import urllib.request

    try:
        from avest.settings import Settings
    except ModuleNotFoundError:  # client-only install
        Settings = _EnvSettings  # type: ignore[assignment,misc]  # noqa: N806
    try:
        s = Settings()
    except Exception as exc:
        print(f"avest health: settings: {exc}", file=sys.stderr)
        return 2
    tls = bool(s.tls_cert)
    try:
        url = probe_url(
            args.http_address or s.http_address, tls, "/readyz" if args.ready else "/healthz"
        )
    except ValueError as exc:
        print(f"avest health: {exc}", file=sys.stderr)
        return 2
    context = None
    if tls:
        context = ssl.create_default_context(cafile=args.ca)
        if args.ca is None:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if s.tls_client_ca:
            cert = args.client_cert or os.environ.get(HEALTH_CERT_ENV) or s.tls_cert
            key = args.client_key or os.environ.get(HEALTH_KEY_ENV) or s.tls_key
            try:
                context.load_cert_chain(cert, key)
            except (OSError, ssl.SSLError) as exc:
                print(f"avest health: client certificate {cert}: {exc}", file=sys.stderr)
                return 2
    request = urllib.request.Request(url)
    bearer = token(args)
    if bearer:
        request.add_header("Authorization", f"Bearer {bearer}")
    try:
        with urllib.request.urlopen(request, timeout=args.timeout, context=context) as resp:
            status = resp.status
            body = resp.read(200).decode(errors="replace")
    except urllib.error.HTTPError as exc:
        print(f"avest health: {url}: HTTP {exc.code}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError, ssl.SSLError) as exc:
        print(f"avest health: {url}: {exc}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"avest health: {url}: HTTP {status}", file=sys.stderr)
        return 1
    print(f"{url}: {body.strip()}")
    return 0
