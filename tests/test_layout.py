"""The tests' own layout, checked over their source (every import, lazy ones too).

- No module imports a test module (``test_*.py``) or a ``conftest.py``: fixtures
  reach tests through conftest files and the ``tests.support.fixtures`` plugin,
  shared helpers through ``tests.support``.
- Code shared by two test folders lives in ``tests.support``: a module imports
  another folder's modules only from there. A folder's own helper modules (not
  ``test_*``) stay next to its tests.
- ``tests.support`` imports nothing of the tests outside it, and the benchmarks
  import the tests only through it.
- Nothing under ``tests/`` is loaded by file path.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
#: Top-level names under which a test folder's modules can be imported (pytest
#: puts ``tests/`` on the path, so ``tests/shim/fakes.py`` is ``shim.fakes``).
FOLDERS = {p.name for p in TESTS.iterdir() if (p / "__init__.py").is_file()}


def python_files(base: Path) -> Iterator[Path]:
    for path in sorted(base.rglob("*.py")):
        if "cpu_lift" not in path.parts:  # the engine test's plugin, installed into vLLM's env
            yield path


def module_of(path: Path) -> str:
    """The name a tests file is imported under: ``shim.fakes`` for tests/shim/fakes.py,
    ``tests.support.x`` for tests/support/x.py, ``conftest`` for tests/conftest.py."""
    rel = path.relative_to(TESTS).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["tests", *parts] if parts[:1] == ["support"] else parts)


def imports(path: Path) -> Iterator[str]:
    """Every module ``path`` imports (relative imports resolved), with each imported
    name as a possible submodule (``from . import synthetic_vllm``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_of(path).split(".") if path.is_relative_to(TESTS) else []
    package = here if path.name == "__init__.py" else here[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def is_test_code(name: str) -> bool:
    """Whether ``name`` is a module of the tests."""
    top = name.split(".")[0]
    return top in FOLDERS or top == "conftest" or name == "tests" or name.startswith("tests.")


def is_module(name: str) -> bool:
    """Whether ``name`` is a module (or package) of the tests, not a name inside one."""
    if not is_test_code(name):
        return False
    parts = name.split(".")
    base = ROOT.joinpath(*parts) if parts[0] == "tests" else TESTS.joinpath(*parts)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def folder_of(name: str) -> str:
    """The test folder a module of the tests belongs to (``support`` for tests.support)."""
    parts = name.split(".")
    return parts[1] if parts[0] == "tests" and len(parts) > 1 else parts[0]


def violations() -> set[tuple[str, str]]:
    found = set()
    for path in [*python_files(TESTS), *python_files(ROOT / "bench")]:
        rel = path.relative_to(ROOT).as_posix()
        mine = folder_of(module_of(path)) if path.is_relative_to(TESTS) else "bench"
        for name in imports(path):
            if not is_module(name) or (mine != "bench" and name == module_of(path)):
                continue
            leaf = name.split(".")[-1]
            theirs = folder_of(name)
            if (
                name.split(".")[0] == "support"
                or leaf.startswith("test_")
                or leaf == "conftest"
                or theirs != "support"
                and theirs != mine
                and not is_module_itself(name)
                or mine == "support"
                and theirs != "support"
            ):  # tests.support under a second name
                found.add((rel, name))
    return found


def is_module_itself(name: str) -> bool:
    """``tests`` or a folder package itself (``from tests import support`` is fine)."""
    return name in ("tests", "tests.support") or name in FOLDERS


def test_no_module_imports_a_test_module_or_another_folders_helpers() -> None:
    unexpected = sorted(violations())
    assert not unexpected, "\n".join(f"{path} imports {name}" for path, name in unexpected)


def test_nothing_under_tests_is_loaded_by_file_path() -> None:
    loaded = []
    for path in python_files(TESTS):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "spec_from_file_location"
            ):
                segment = ast.get_source_segment(text, node) or ""
                if "conftest" in segment or "tests" in segment:
                    loaded.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not loaded, loaded
