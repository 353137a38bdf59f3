"""``avest serve`` in a subprocess for the benchmarks: the tests' launcher
(:func:`tests.support.serve.serve`) with the benchmarks' tokens, a source tree to
run instead of this checkout, and an open-files cap.

The benchmarks run as scripts (``python bench/NAME.py``), so the repository root
is put on the import path here, once, for ``tests.support``.
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from tests.support.serve import CLI, Served  # noqa: E402
from tests.support.serve import serve as serve_avest  # noqa: E402

__all__ = ["ADMIN_TOKEN", "CLI", "WORKER_TOKEN", "Served", "serve", "tree_env"]

WORKER_TOKEN = "bench-worker-token"
ADMIN_TOKEN = "bench-admin-token"


def tree_env(tree: Path | None) -> dict[str, str] | None:
    """The environment that runs the source ``tree`` given (its ``service``, ``client``
    and ``wire`` first on the path) instead of this checkout; ``None`` for this one."""
    if tree is None:
        return None
    paths = [str(tree / "service"), str(tree / "client"), str(tree / "wire")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])}


def serve(
    data_dir: Path,
    extra: Sequence[str] = (),
    *,
    nofile: int | None = None,
    tokens: bool = True,
    tree: Path | None = None,
    command: Sequence[str] | None = None,
) -> Served:
    """Start ``avest serve`` on free loopback ports, its log in ``data_dir/serve.log``.
    ``tokens``: worker and admin tokens required; ``nofile`` caps its open files."""
    args = ["--worker-token", WORKER_TOKEN, "--admin-token", ADMIN_TOKEN] if tokens else []

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    data_dir.mkdir(parents=True, exist_ok=True)
    return serve_avest(
        data_dir,
        *args,
        *extra,
        command=command,
        env=tree_env(tree),
        log=data_dir / "serve.log",
        preexec_fn=limit,
    )
