"""``avest serve`` as a subprocess on loopback, its addresses read back from its output.

:func:`serve` starts it and returns a :class:`Served` once the service has printed
its announcement, ``avest serving grpc=HOST:PORT http=URL`` (printed and flushed once
both listeners are up, so ports ``0`` resolve to the ones it bound). The process's
whole output, stdout and stderr, goes to a log file: nothing blocks on a full pipe,
and a service that does not start is reported with the end of its log.

Every subprocess service of the tests and the benchmarks starts here; ``command``
runs another build (an old release's ``avest``, a profiler around this one).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.support.helpers import http_get

#: This checkout's CLI, as ``python -c`` runs it (no console script needed).
CLI = "import sys; from avest.commands.cli import main; sys.exit(main())"
#: The announcement line. The log record of the same event has no URL scheme, so
#: only the printed line matches.
ANNOUNCE = re.compile(rb"avest serving grpc=(\S+) http=(https?://\S+)")
READ_ANNOUNCED = re.compile(rb"avest serving grpc=.* read=(\S+)")
#: Seconds between looks at the log while the service starts.
POLL_S = 0.02


def stop_process(proc: subprocess.Popen[bytes] | subprocess.Popen[str], grace: float = 30.0) -> int:
    """SIGTERM, up to ``grace`` seconds to exit, then SIGKILL: the process never outlives
    the caller. Its exit status (idempotent)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait(timeout=grace)


@dataclass
class Served:
    """A running ``avest serve``: its process, addresses and log."""

    proc: subprocess.Popen[bytes]
    grpc_address: str
    http_url: str
    log: Path

    def output(self) -> str:
        """Everything the service wrote so far (stdout and stderr)."""
        return self.log.read_text(errors="replace")

    @property
    def read_address(self) -> str:
        """The read port's address (``--read-address``), from the announcement; empty
        when it has none."""
        m = READ_ANNOUNCED.search(self.log.read_bytes())
        return m.group(1).decode() if m else ""

    def log_bytes(self) -> int:
        return self.log.stat().st_size

    def metrics_text(self) -> str:
        return http_get(self.http_url + "/metrics").decode()

    def rss_mib(self) -> float:
        """The process's resident memory (Linux ``/proc``), in MiB."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self, grace: float = 60.0) -> int:
        """SIGTERM (the service drains and saves), SIGKILL after ``grace`` seconds;
        the exit status."""
        return stop_process(self.proc, grace)

    def __enter__(self) -> Served:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(
    data_dir: str | Path,
    *args: str,
    grpc_address: str = "127.0.0.1:0",
    http_address: str = "127.0.0.1:0",
    command: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    log: Path | None = None,
    timeout: float = 60.0,
    preexec_fn: Callable[[], None] | None = None,
) -> Served:
    """Start ``avest serve`` over ``data_dir`` and wait for its announcement.

    ``args``: more ``avest serve`` flags. ``command``: what runs in front of ``serve``
    (default: this Python running this checkout's CLI). ``env``: the environment
    (default: this one). ``log``: where its output goes (default: next to
    ``data_dir``, so the data directory holds only what the service writes).
    ``preexec_fn`` runs in the child before the exec (resource limits).
    """
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    if log is None:
        log = data_dir.parent / f"{data_dir.name}-serve-{time.monotonic_ns()}.log"
    argv = [*(command or (sys.executable, "-c", CLI)), "serve"]
    argv += ["--grpc-address", grpc_address, "--http-address", http_address]
    argv += ["--data-dir", str(data_dir), *args]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"},
            preexec_fn=preexec_fn,  # noqa: PLW1509 - only resource limits
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = ANNOUNCE.search(log.read_bytes())
        if m:
            return Served(proc, m.group(1).decode(), m.group(2).decode().rstrip("/"), log)
        if proc.poll() is not None:
            break
        time.sleep(POLL_S)
    stop_process(proc, 10.0)
    tail = log.read_text(errors="replace")[-4000:]
    raise RuntimeError(f"avest serve did not announce itself ({' '.join(argv)}):\n{tail}")


def spawn(
    data_dir: str | Path, *args: str, grpc_address: str = "127.0.0.1:0"
) -> tuple[subprocess.Popen[bytes], str]:
    """:func:`serve` for tests that handle the process themselves (kill it, restart
    it): ``(process, gRPC address)``. The caller stops the process."""
    served = serve(data_dir, *args, grpc_address=grpc_address)
    return served.proc, served.grpc_address


def serve_subprocess(data_dir: str | Path, port: int = 0) -> tuple[subprocess.Popen[bytes], str]:
    """:func:`spawn` flushing every 20 ms on gRPC port ``port`` (``0``: any free one),
    refitting each round as it fills (``--min-refit-interval-ms 0``), so its refits
    match a replay of the same steps through the core, whatever the machine's speed."""
    return spawn(
        data_dir,
        "--flush-interval-ms",
        "20",
        "--min-refit-interval-ms",
        "0",
        grpc_address=f"127.0.0.1:{port}",
    )
