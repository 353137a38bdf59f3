"""ARCHITECTURE.md's import rules, checked over the source (every import, lazy ones too).

Each part of the project may import the parts its row of the table names in its
"may import" cell (in backticks); this test reads that table, so the map and the
code cannot drift apart. Besides the table: the core stays pure (it imports only
the wire's pure modules, which import neither protobuf nor grpc), the client
never imports the service, and no module imports one that imports it back.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"avest": ROOT / "service", "avest_client": ROOT / "client", "avest_wire": ROOT / "wire"}
#: Part name (as the table writes it) -> the modules it covers, by prefix.
PARTS = {
    "wire": ("avest_wire",),
    "core": ("avest.core",),
    "state": ("avest.state",),
    "policy": ("avest.policy",),
    "metrics": ("avest.metrics",),
    "grpc": ("avest.grpc",),
    "http": ("avest.http",),
    "offline": ("avest.offline",),
    "server": ("avest.server", "avest.settings"),  # one row: the process
    "commands": ("avest.commands",),
    "vllm": ("avest_client.vllm",),
    "client": ("avest_client",),
}
#: The wire's modules without protobuf or grpc: the only ones the core may import.
#: Read from the core's row of ARCHITECTURE.md: "`wire`'s pure modules (`bins`, ...)".
_CORE_ROW = next(
    line
    for line in (ROOT / "ARCHITECTURE.md").read_text().splitlines()
    if line.startswith("| `service/avest/core/` |")
)
PURE_WIRE = {
    f"avest_wire.{name}"
    for name in re.findall(r"`(\w+)`", _CORE_ROW.split("pure modules (", 1)[1].split(")", 1)[0])
}
assert len(PURE_WIRE) >= 5, PURE_WIRE


def modules() -> Iterator[tuple[str, Path]]:
    for package, base in PACKAGES.items():
        for path in sorted((base / package).rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            yield name, path


def imports(path: Path, top_level_only: bool = False) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def part_of(module: str) -> str | None:
    for name, prefixes in PARTS.items():  # vllm before client: the longer prefix first
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return name
    return None


def table() -> dict[str, set[str]]:
    """Part -> the parts its "may import" cell names, from ARCHITECTURE.md."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        first = re.findall(r"`([^`]+)`", cells[0])
        owners = {part_of(_module_of(p)) for p in first} - {None}
        if len(owners) != 1:
            continue
        named = set(re.findall(r"`([a-z]+)`", cells[2])) & set(PARTS)
        out[owners.pop()] = named | ({"*"} if "everything" in cells[2] else set())
    return out


def _module_of(path: str) -> str:
    """``service/avest/core/`` -> ``avest.core``; ``client/avest_client/vllm/`` -> ...vllm."""
    p = path.strip("/").removesuffix(".py")
    for package in PACKAGES:
        if package in p.split("/"):
            tail = p.split("/")[p.split("/").index(package) :]
            return ".".join(tail)
    return p


def test_the_table_names_every_part() -> None:
    assert set(table()) == set(PARTS)


def test_every_import_is_one_the_table_allows() -> None:
    allowed = table()
    wrong = []
    for module, path in modules():
        own = part_of(module)
        if own is None:  # the package's own __init__ (its version): imports nothing of it
            assert not {part_of(t) for t in imports(path)} - {None}, module
            continue
        for target in imports(path):
            other = part_of(target)
            if other is None or other == own or "*" in allowed[own]:
                continue
            if other not in allowed[own]:
                wrong.append(f"{module} imports {target} ({own} may not import {other})")
    assert not wrong, "\n".join(wrong)


def test_the_core_imports_only_numpy_and_the_pure_wire() -> None:
    wrong = []
    for module, path in modules():
        if part_of(module) != "core":
            continue
        for target in imports(path):
            top = target.split(".")[0]
            if top in {"avest_client", "grpc", "google", "pydantic", "sqlite3", "asyncio"}:
                wrong.append(f"{module} imports {target}")
            if top == "avest" and part_of(target) != "core" and target != "avest":
                wrong.append(f"{module} imports {target}")
            if top == "avest_wire" and not any(
                target == m or target.startswith(m + ".") for m in PURE_WIRE
            ):
                wrong.append(f"{module} imports {target} (not one of the wire's pure modules)")
    assert not wrong, "\n".join(wrong)


def test_the_pure_wire_modules_import_no_protobuf() -> None:
    for module, path in modules():
        if module in PURE_WIRE:
            for target in imports(path):
                assert target.split(".")[0] not in {"grpc", "google"}, (module, target)
                if target.startswith("avest_wire"):
                    assert any(target.startswith(m) for m in PURE_WIRE), (module, target)


def test_the_client_never_imports_the_service() -> None:
    for module, path in modules():
        if module.startswith("avest_client"):
            bad = {t for t in imports(path) if t == "avest" or t.startswith("avest.")}
            assert not bad, (module, bad)


def test_no_module_imports_one_that_imports_it_back() -> None:
    """Cycles through module-level imports (lazy imports inside functions are how a
    module defers a heavy or optional dependency, and cannot deadlock an import)."""
    known = dict(modules())
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in known.items():
        for target in imports(path, top_level_only=True):
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != module:
                graph[module].add(target)
    cycles = [c for c in _strongly_connected(graph, list(known)) if len(c) > 1]
    assert not cycles, cycles


def _strongly_connected(graph: dict[str, set[str]], nodes: list[str]) -> list[list[str]]:
    """Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    out.append(component)
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out
