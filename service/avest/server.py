"""``avest serve``: grpc.aio and the admin HTTP API in one asyncio process.

:class:`Server` starts everything on the running loop, reports the bound
addresses (port 0 picks free ports), and :meth:`Server.stop` drains: health
NOT_SERVING, a final durable snapshot whose acknowledgements reach the open
Observe streams, streams closed, then the store closed — all within
``grace_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import signal
import socket
import ssl
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from avest.grpc.gate import Gate
from avest.grpc.interceptor import RpcInterceptor
from avest.grpc.reads import Published, ReadServer, add_port
from avest.grpc.relay import FrontReads, RelayServer, server_credentials
from avest.grpc.service import EstimatorService
from avest.http.api import build_http
from avest.http.bridge import Heartbeat, HttpThread, LoopBridge
from avest.http.protocol import guarded_protocol, quiet_loop_errors
from avest.metrics.registry import Metrics
from avest.policy.access import Access, is_loopback
from avest.settings import Settings, split_address
from avest.state.app import Avest
from avest_wire.v1 import estimator_pb2 as pb
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc

log = logging.getLogger("avest")
#: Share of the grace period the final snapshot may use; the rest closes streams and sockets.
FLUSH_SHARE = 0.6
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["EstimatorService"].full_name
#: The services the main port serves.
SERVICES = (
    pb.DESCRIPTOR.services_by_name["EstimatorService"],
    health_pb2.DESCRIPTOR.services_by_name["Health"],
    reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
)


class BindError(OSError):
    """A listen address cannot be bound (in use, or not an address of this host)."""


class Server:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.app = Avest(settings.state_config())
        self.metrics = Metrics(self.app)
        self.access = Access(settings.worker_token, settings.admin_token)
        self.service = EstimatorService(
            self.app,
            settings.stream_limits(),
            on_refused=self.metrics.refused,
            access=self.access,
        )
        self.metrics.set_open_streams(lambda: self.service.open_streams)
        self.health = health.aio.HealthServicer()
        self.grpc_port = 0
        self.http_port = 0
        self.max_connections = settings.max_connections
        #: Listeners whose traffic (tokens, or open writes) is readable on the network.
        self.exposure: list[str] = []
        self._grpc: grpc.aio.Server | RelayServer | None = None
        #: Each pair as the read port serves it (its GetCoefficients response and served
        #: model), kept when there is a read port or a gRPC front (which answers
        #: GetCoefficients from a copy of it).
        self.published = (
            Published(self.app) if settings.read_address or settings.grpc_process else None
        )
        self._reads: ReadServer | None = None
        self.read_port = 0
        self._http: HttpThread | None = None
        #: The event loop's heartbeat, which /healthz reads on the HTTP thread.
        self.heartbeat = Heartbeat(late=self.metrics.loop_lag.observe)
        self._stopped = asyncio.Event()
        #: Stopped by a failure rather than asked to (the process exits with 1).
        self.failed = False
        self._stopping: asyncio.Future[None] | None = None

    @property
    def grpc_address(self) -> str:
        return f"{split_address(self.settings.grpc_address)[0]}:{self.grpc_port}"

    @property
    def read_address(self) -> str:
        """The read port's bound address; empty when there is none."""
        if not self.settings.read_address:
            return ""
        return f"{split_address(self.settings.read_address)[0]}:{self.read_port}"

    @property
    def http_address(self) -> str:
        return f"{split_address(self.settings.http_address)[0]}:{self.http_port}"

    def _listeners(self, names: tuple[str, str, str]) -> list[tuple[str, str]]:
        """The gRPC, admin HTTP and read (when set) addresses, under ``names``."""
        s = self.settings
        addresses = (s.grpc_address, s.http_address, s.read_address)
        return [(name, a) for name, a in zip(names, addresses, strict=True) if a]

    def check_exposure(self) -> None:
        """Refuse to listen beyond loopback with nobody's token required."""
        s = self.settings
        if s.insecure or s.worker_token:
            return
        for name, address in self._listeners(("grpc_address", "http_address", "read_address")):
            host = split_address(address)[0]
            if not is_loopback(host):
                raise PermissionError(
                    f"{name} {address} is reachable beyond this machine but no worker token "
                    "is set: anyone could write to every pair. Set AVEST_WORKER_TOKEN "
                    "(--worker-token) and AVEST_ADMIN_TOKEN, or pass --insecure"
                )

    def plaintext_exposure(self) -> list[str]:
        """What travels readable on the network: one line per listener beyond loopback
        without TLS that carries a token, or that --insecure leaves open to anyone."""
        s = self.settings
        if s.tls_cert:
            return []
        tokens = [
            flag
            for flag, token in (
                ("--worker-token", s.worker_token),
                ("--admin-token", s.admin_token),
            )
            if token
        ]
        found = []
        for name, address in self._listeners(("gRPC", "admin HTTP", "read port")):
            if is_loopback(split_address(address)[0]):
                continue
            if tokens:
                found.append(
                    f"{name} listens on {address} without TLS: the bearer token(s) of "
                    f"{' and '.join(tokens)} travel in plaintext to anyone on the network "
                    "path. Set --tls-cert and --tls-key (AVEST_TLS_CERT, AVEST_TLS_KEY), or "
                    "listen on loopback behind a TLS proxy"
                )
            elif s.insecure:
                found.append(
                    f"{name} listens on {address} without TLS and, by --insecure, without a "
                    "worker token: anyone who reaches it can "
                    + ("read" if name == "read port" else "write to")
                    + " every pair. Set --worker-token (AVEST_WORKER_TOKEN) with --tls-cert "
                    "and --tls-key"
                )
        return found

    async def start(self) -> None:
        self.check_exposure()
        self.exposure = self.plaintext_exposure()
        for line in self.exposure:
            log.warning("%s", line)
        # Each listener may hold half the descriptors, less a reserve for the
        # store, logs and the process itself.
        self.max_connections = min(
            self.settings.max_connections, max(16, (raise_fd_limit() - 128) // 2)
        )
        quiet_loop_errors(asyncio.get_running_loop())
        await self.app.start()
        s = self.settings
        limit = s.max_message_bytes
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),
            ("grpc.max_allowed_incoming_connections", self.max_connections),
            ("grpc.max_concurrent_streams", 1024),
            # A connection that does not finish its handshake, or never
            # acknowledges the server's HTTP/2 settings (a socket that sends
            # nothing), is closed after handshake_timeout_s.
            ("grpc.server_handshake_timeout_ms", int(s.handshake_timeout_s * 1000)),
            ("grpc.http2.settings_timeout", int(s.handshake_timeout_s * 1000)),
            ("grpc.max_connection_idle_ms", int(s.idle_timeout_s * 1000)),
            # Ping idle transports so dead peers are found; allow the client's
            # keepalive pings (avest_client pings every 30 s).
            ("grpc.keepalive_time_ms", 60_000),
            ("grpc.keepalive_timeout_ms", 20_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.http2.max_ping_strikes", 3),
        ]
        interceptors = [
            RpcInterceptor(self.metrics.rpc_duration),
            Gate(self.access, self.metrics.refused, rpc_rate=s.rpc_rate),
        ]
        server: grpc.aio.Server | RelayServer
        if s.grpc_process:
            server = RelayServer(interceptors, options, s.max_streams, SERVICES)
        else:
            server = grpc.aio.server(
                interceptors=interceptors, options=options, maximum_concurrent_rpcs=s.max_streams
            )
        self._grpc = server
        pb_grpc.add_EstimatorServiceServicer_to_server(self.service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection([d.full_name for d in SERVICES], server)
        host, port = split_address(self.settings.grpc_address)
        credentials = grpc_credentials(s)
        if isinstance(server, RelayServer):
            assert self.published is not None
            server.host.answered = self._answered_in_front
            self.published.listeners.append(server.publish)
            reads = FrontReads(
                (s.worker_token, s.admin_token), s.rpc_rate, self.published.coefficients
            )
            self.grpc_port = await server.listen(f"{host}:{port}", tls_files(s), reads)
            server.lost.add_done_callback(self._front_lost)
        else:
            self.grpc_port = add_port(server, f"{host}:{port}", credentials)
        if self.grpc_port == 0:
            await self._abandon_start()
            raise BindError(
                f"cannot listen on {self.settings.grpc_address} (gRPC, --grpc-address): "
                "the address is in use or not available here"
            )
        if s.read_address:
            assert self.published is not None
            self._reads = ReadServer(
                self.published,
                self.access,
                self.metrics.refused,
                self._answered,
                options,
                self.service.limits,
                s.rpc_rate,
            )
            self.read_port = self._reads.bind(s.read_address, credentials)
            if self.read_port == 0:
                await self._abandon_start()
                raise BindError(
                    f"cannot listen on {s.read_address} (read port, --read-address): "
                    "the address is in use or not available here"
                )
        await self._grpc.start()
        if self._reads is not None:
            self._reads.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)

        http_host, http_port = split_address(self.settings.http_address)
        sock = socket.socket(socket.AF_INET6 if ":" in http_host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((http_host, http_port))
        except OSError as exc:
            sock.close()
            await self._abandon_start()
            raise BindError(
                f"cannot listen on {self.settings.http_address} (admin HTTP, --http-address): "
                f"{exc.strerror or exc}"
            ) from None
        self.http_port = sock.getsockname()[1]
        api = build_http(self.app, self.metrics, self.settings, self.access)
        config = uvicorn.Config(
            LoopBridge(api, asyncio.get_running_loop(), self.heartbeat),
            log_level=self.settings.log_level if self.settings.log_level != "info" else "warning",
            log_config=None,
            lifespan="off",
            access_log=False,
            http=guarded_protocol(self.max_connections),
            limit_concurrency=self.max_connections + 1,  # our cap closes idle ones first
            timeout_keep_alive=max(1, int(s.handshake_timeout_s)),
            **http_tls(s),
        )
        self.heartbeat.start(asyncio.get_running_loop())
        self._http = HttpThread(config, sock)
        await self._http.start()
        log.debug(  # `avest serve` and `avest demo` print their own "avest serving" line
            "avest serving grpc=%s http=%s data=%s",
            self.grpc_address,
            self.http_address,
            self.app.store.location,
        )

    def _answered(self, method: str, code: str, seconds: float) -> None:
        self.metrics.rpc_duration.labels(method, code).observe(seconds)

    def _answered_in_front(
        self, method: str, code: str, seconds: float, reason: str | None
    ) -> None:
        """A call the gRPC front answered itself (GetCoefficients), in the metrics."""
        if reason is not None:
            self.metrics.refused(method, reason)
        self._answered(method, code, seconds)

    def _front_lost(self, _: object) -> None:
        """The gRPC front process died: stop, and exit with an error (``failed``)."""
        self.failed = True
        asyncio.ensure_future(self.stop())  # kept as self._stopping

    async def _abandon_start(self) -> None:
        """Undo a start that cannot complete (a listen address taken): stop what runs."""
        with contextlib.suppress(Exception):
            await self.stop()

    async def stop(self) -> None:
        """Drain within the grace period (``grace_s`` for all of it); idempotent: a
        second call waits for the first's drain.

        The final snapshot gets most of the grace period and writes only the
        pairs that changed, in chunks; what it cannot write in time was never
        acknowledged, so workers resend it to the next process.
        """
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop())
        await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        self._stopped.set()
        started = time.monotonic()
        grace = self.settings.grace_s
        deadline = started + grace

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        self.app.draining = True
        await self.health.enter_graceful_shutdown()
        self.service.stop_applying()
        try:
            # Make every applied step durable so its acknowledgement goes out
            # on the streams before they close.
            await asyncio.wait_for(
                self.app.flush(deadline=started + FLUSH_SHARE * grace), timeout=left()
            )
        except asyncio.TimeoutError:
            log.warning("final flush before draining timed out")
        except Exception as exc:
            # A store that refuses writes is already reported (readyz, the metric), and
            # the final snapshot names it in one line: say nothing more here.
            if not self.app.store_error:
                log.warning("final flush before draining failed: %s", exc)
        await self.service.drain()
        reads_stopped = None
        if self._reads is not None:
            reads_stopped = self._reads.stop(min(left(), 1.0))
        if self._grpc is not None:
            await self._grpc.stop(min(left(), 1.0))
        # A chunk under way when the deadline passes still finishes: leave it room.
        await self.app.close(deadline=deadline - min(1.0, 0.2 * grace))
        if self._http is not None:
            await self._http.stop(left())
        self.metrics.close()
        if reads_stopped is not None:
            # its calls in flight had their grace: end its threads once it says so
            await asyncio.get_running_loop().run_in_executor(None, reads_stopped.wait, 2.0)
            self._reads.close()
        self.heartbeat.stop()
        log.info("avest stopped in %.2fs", time.monotonic() - started)

    async def wait(self) -> None:
        await self._stopped.wait()


def grpc_credentials(s: Settings) -> grpc.ServerCredentials | None:
    tls = tls_files(s)
    return None if tls is None else server_credentials(*tls)


def tls_files(s: Settings) -> tuple[bytes, bytes, bytes | None] | None:
    """The key, certificate and client CA (or None) that gRPC serves TLS with."""
    if not s.tls_cert:
        return None
    ca = Path(s.tls_client_ca).read_bytes() if s.tls_client_ca else None
    return Path(s.tls_key).read_bytes(), Path(s.tls_cert).read_bytes(), ca


def http_tls(s: Settings) -> dict[str, object]:
    if not s.tls_cert:
        return {}
    tls: dict[str, object] = {"ssl_certfile": s.tls_cert, "ssl_keyfile": s.tls_key}
    if s.tls_client_ca:
        tls.update(ssl_ca_certs=s.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return tls


def raise_fd_limit() -> int:
    """Use the hard limit on open files; returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        target = max(soft, 1 << 20) if hard == resource.RLIM_INFINITY else hard
        if soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    except (ValueError, OSError):  # pragma: no cover - not allowed here
        log.debug("cannot raise the open-file limit", exc_info=True)
    return int(soft)


async def serve(settings: Settings, announce: bool = True, exit_when_stopped: bool = False) -> None:
    """Run until SIGTERM or SIGINT, then drain.

    ``exit_when_stopped``: end the process as soon as the drain is over (the store
    is closed), rather than spend the grace period tearing down the interpreter
    (freeing every pair's arrays and the loop's leftovers takes a second or more).
    """
    server = Server(settings)
    server.check_exposure()
    await server.start()
    # Before the announcement: whoever reads it may send SIGTERM at once.
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if announce:
        print(
            f"avest serving grpc={server.grpc_address} "
            f"http={'https' if settings.tls_cert else 'http'}://{server.http_address} "
            f"data={server.app.store.location}"
            + (f" read={server.read_address}" if server.read_address else ""),
            flush=True,
        )
    # SIGTERM or SIGINT, or the server stopping on its own (its gRPC front died)
    await asyncio.wait(
        (asyncio.ensure_future(stop.wait()), asyncio.ensure_future(server.wait())),
        return_when=asyncio.FIRST_COMPLETED,
    )
    await server.stop()
    if exit_when_stopped:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1 if server.failed else 0)
