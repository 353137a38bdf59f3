"""Install the avest shim into a vLLM image without moving vLLM's dependencies.

Used by deploy/vllm/Dockerfile::

    python3 install_shim.py /tmp/avest-src

1. Records the installed versions of the packages vLLM must keep (torch,
   protobuf, grpcio, numpy — those present) as a pip constraints file.
2. Installs the ``avest`` base package (client + vLLM plugin, no server
   extra) from the source directory under those constraints, with pip if the
   interpreter has it, else ``uv pip install --system``.
3. Fails unless every recorded version is unchanged, the ``vllm.general_plugins``
   entry point ``avest`` is registered, and the plugin module imports.

``--check`` runs step 3 alone (against pins written earlier, or none).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import os
import shutil
import subprocess
import sys
from pathlib import Path

#: Packages whose versions belong to vLLM: the shim must fit around them.
KEEP = ("torch", "protobuf", "grpcio", "numpy")
ENTRY_POINT = ("vllm.general_plugins", "avest", "avest_client.vllm.plugin:register")


def installed_versions(names: tuple[str, ...] = KEEP) -> dict[str, str]:
    out = {}
    for name in names:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            continue
    return out


def write_pins(path: Path, pins: dict[str, str]) -> None:
    path.write_text("".join(f"{n}=={v}\n" for n, v in sorted(pins.items())))


def read_pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().split():
        name, _, version = line.partition("==")
        pins[name] = version
    return pins


def install_command(source: str, constraints: Path) -> list[str]:
    pip_ok = (
        subprocess.run(
            [sys.executable, "-m", "pip", "--version"], capture_output=True, check=False
        ).returncode
        == 0
    )
    if pip_ok:
        return [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-cache-dir",
            "--constraint",
            str(constraints),
            source,
        ]
    uv = shutil.which("uv")
    if uv is None:
        raise SystemExit("neither pip nor uv is available for this interpreter")
    return [
        uv,
        "pip",
        "install",
        "--python",
        sys.executable,
        "--system",
        "--no-cache",
        "--constraint",
        str(constraints),
        source,
    ]


def check(pins: dict[str, str]) -> list[str]:
    """Problems with the installed shim (empty: all good)."""
    problems = []
    now = installed_versions(tuple(pins))
    for name, version in sorted(pins.items()):
        if now.get(name) != version:
            problems.append(f"{name} changed: {version} -> {now.get(name)}")
    group, name, value = ENTRY_POINT
    found = [e.value for e in md.entry_points(group=group) if e.name == name]
    if found != [value]:
        problems.append(f"entry point {group}:{name} is {found}, expected [{value!r}]")
    try:
        importlib.import_module(value.partition(":")[0])
    except Exception as exc:  # noqa: BLE001 - reported as a problem
        problems.append(f"cannot import the plugin: {exc!r}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", nargs="?", help="avest source directory (repository root)")
    parser.add_argument("--pins", type=Path, default=Path("/tmp/avest-pins.txt"))
    parser.add_argument("--check", action="store_true", help="only verify an existing install")
    args = parser.parse_args(argv)
    if args.check:
        pins = read_pins(args.pins) if args.pins.is_file() else {}
    else:
        if not args.source:
            parser.error("source is required unless --check")
        pins = installed_versions()
        write_pins(args.pins, pins)
        print("keeping:", ", ".join(f"{n}=={v}" for n, v in sorted(pins.items())), flush=True)
        # vLLM's images install into the system interpreter: allow pip/uv to
        # add a package there (PEP 668), as vLLM's own image build does.
        env = dict(os.environ, PIP_BREAK_SYSTEM_PACKAGES="1", UV_BREAK_SYSTEM_PACKAGES="true")
        subprocess.run(install_command(args.source, args.pins), check=True, env=env)
    problems = check(pins)
    for p in problems:
        print("avest shim install:", p, file=sys.stderr)
    if not problems:
        print("avest shim installed; versions kept:", pins)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
