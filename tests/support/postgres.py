"""A real PostgreSQL server for the tests: a cluster of its own, made with ``initdb``.

- ``postgres_cluster`` (session): one cluster in a temporary folder, listening on a
  free loopback port with its unix socket inside that folder, started with
  ``pg_ctl`` and stopped (and removed) after the last test.
- ``postgres_url``: a new empty database on it, as a ``postgresql://`` URL.

``initdb`` refuses to run as root: as root, the folder is given to ``nobody`` and
the server runs as ``nobody`` (``runuser``). Without the binaries (Debian's
``postgresql`` package: ``scripts/check`` installs it) or psycopg, the tests that
need them fail under CI (``CI`` set), where they must run, and are skipped elsewhere.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import pytest

from tests.support.helpers import free_port

#: The role the cluster is made with (trust authentication: loopback and its own socket).
USER = "avest"
#: The unprivileged account that owns the cluster when the tests run as root.
OWNER = "nobody"
#: Seconds ``pg_ctl`` may wait for the server to start or stop on a loaded machine.
PG_CTL_WAIT_S = 120
#: Starts tried: another process may take the free port between its pick and the bind.
START_TRIES = 3


def missing_postgres(reason: str) -> NoReturn:
    """Fail under CI, where PostgreSQL must be there; skip elsewhere."""
    reason += " (scripts/check installs Debian's postgresql package)"
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


def import_psycopg() -> ModuleType:
    """psycopg, for a test module that uses it throughout: without it (an environment
    installed before the server extra had it) the module fails under CI, is skipped
    elsewhere."""
    try:
        import psycopg
    except ModuleNotFoundError:
        reason = "psycopg is not installed (the server extra has it: pip install -e '.[test]')"
        if os.environ.get("CI"):
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason, allow_module_level=True)
    return psycopg


def find_bindir() -> Path | None:
    """The folder of ``initdb`` and ``pg_ctl``: on PATH, else Debian's newest version."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(found).resolve().parent
    for bindir in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if (Path(bindir) / "initdb").is_file() and (Path(bindir) / "pg_ctl").is_file():
            return Path(bindir)
    return None


class PostgresCluster:
    """One ``initdb`` cluster in ``root``, run by ``pg_ctl``."""

    def __init__(self, bindir: Path, root: Path) -> None:
        self.bindir = bindir
        self.root = root
        self.data = root / "data"
        self.socket_dir = root / "socket"
        self.log = root / "server.log"
        self.port = 0
        self._names = itertools.count(1)
        self._as_owner: list[str] = []
        if os.geteuid() == 0:
            runuser = shutil.which("runuser")
            if runuser is None:
                missing_postgres("running as root and runuser is missing (initdb refuses root)")
            self._as_owner = [runuser, "-u", OWNER, "--"]

    def _run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self._as_owner, *argv],
            capture_output=True,
            text=True,
            timeout=PG_CTL_WAIT_S + 60,
            check=False,
        )

    def start(self) -> None:
        self.socket_dir.mkdir(parents=True)
        if self._as_owner:
            for path in (self.root, self.socket_dir):
                shutil.chown(path, user=OWNER)
        made = self._run(
            str(self.bindir / "initdb"),
            "-D",
            str(self.data),
            "-U",
            USER,
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
        )
        if made.returncode != 0:
            pytest.fail(f"initdb failed:\n{made.stdout}\n{made.stderr}")
        for _ in range(START_TRIES):
            self.port = free_port()
            started = self._start()
            if started.returncode == 0:
                return
        log = self.log.read_text() if self.log.exists() else ""
        pytest.fail(f"pg_ctl start failed:\n{started.stdout}\n{started.stderr}\n{log[-3000:]}")

    def _start(self) -> subprocess.CompletedProcess[str]:
        options = (
            f"-c listen_addresses=127.0.0.1 -p {self.port} "
            f"-c unix_socket_directories={self.socket_dir}"
        )
        return self._run(
            str(self.bindir / "pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.log),
            "-w",
            "-t",
            str(PG_CTL_WAIT_S),
            "-o",
            options,
            "start",
        )

    @contextlib.contextmanager
    def outage(self) -> Iterator[None]:
        """The server stopped for the block (started again however the block ends: the
        session's other tests need it)."""
        self.stop()
        try:
            yield
        finally:
            self.resume()

    def resume(self) -> None:
        """Start the server again after :meth:`stop`, on the same port."""
        started = self._start()
        if started.returncode != 0:
            pytest.fail(f"pg_ctl start failed:\n{started.stdout}\n{started.stderr}")

    def restart(self) -> None:
        """Stop and start the server (fast shutdown: open connections are cut)."""
        done = self._run(
            str(self.bindir / "pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.log),  # the server's output there, not in this call's pipes
            "-m",
            "fast",
            "-w",
            "-t",
            str(PG_CTL_WAIT_S),
            "restart",
        )
        if done.returncode != 0:
            pytest.fail(f"pg_ctl restart failed:\n{done.stdout}\n{done.stderr}")

    def stop(self) -> None:
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")

    def url(self, database: str) -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A new empty database; its URL."""
        import psycopg

        name = f"avest_test_{next(self._names)}"
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[PostgresCluster]:
    try:
        import psycopg  # noqa: F401
    except ModuleNotFoundError:
        missing_postgres("psycopg is not installed (the server extra has it)")
    bindir = find_bindir()
    if bindir is None:
        missing_postgres("PostgreSQL's initdb and pg_ctl are not installed")
    root = Path(tempfile.mkdtemp(prefix="avest-postgres-"))
    cluster = PostgresCluster(bindir, root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def postgres_url(postgres_cluster: PostgresCluster) -> str:
    return postgres_cluster.create_database()
