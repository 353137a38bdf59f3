"""``avest serve`` in a subprocess for the benchmarks: its addresses, RSS and log size."""

from __future__ import annotations

import re
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

WORKER_TOKEN = "bench-worker-token"
ADMIN_TOKEN = "bench-admin-token"


class Served:
    def __init__(self, proc: subprocess.Popen[bytes], grpc_address: str, http_url: str, log: Path):
        self.proc = proc
        self.grpc_address = grpc_address
        self.http_url = http_url
        self.log = log

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def log_bytes(self) -> int:
        return self.log.stat().st_size

    def stop(self) -> float:
        """SIGTERM; seconds until it exited."""
        t0 = time.monotonic()
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return time.monotonic() - t0


def serve(
    data_dir: Path,
    extra: Sequence[str] = (),
    *,
    nofile: int | None = None,
    tokens: bool = True,
) -> Served:
    """Start ``avest serve`` on free loopback ports; ``nofile`` caps its open files."""
    data_dir.mkdir(parents=True, exist_ok=True)
    log = data_dir / "serve.log"
    args = [
        sys.executable,
        "-c",
        "import sys; from avest.commands.cli import main; sys.exit(main())",
        "serve",
        "--grpc-address",
        "127.0.0.1:0",
        "--http-address",
        "127.0.0.1:0",
        "--data-dir",
        str(data_dir),
    ]
    if tokens:
        args += ["--worker-token", WORKER_TOKEN, "--admin-token", ADMIN_TOKEN]
    args += list(extra)

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    out = log.open("wb")
    proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, preexec_fn=limit)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = re.search(rb"avest serving grpc=(\S+) http=(https?://\S+)", log.read_bytes())
        if m:
            return Served(proc, m.group(1).decode(), m.group(2).decode(), log)
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"avest serve did not start:\n{log.read_text()[-2000:]}")
