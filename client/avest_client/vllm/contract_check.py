"""Check :mod:`avest_client.vllm.contract` against vLLM's source, by AST, never importing vLLM.

A source is a folder that holds the ``vllm/`` package (or the package folder
itself), or a wheel read member by member with :mod:`zipfile`. Also a small
run-time check of a live class (``inspect``), used by the plugin before it
patches anything.

Command line, for a CI preflight or before deploying onto a vLLM install::

    python -m avest_client.vllm.contract_check [PATH]   # PATH: wheel or folder; default: installed vllm
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import sys
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from avest_client.vllm import contract as c

#: Names a source: a wheel (``*.whl``/``*.zip``) or a folder.
SOURCE_ENV = "AVEST_VLLM_SOURCE"


class SourceTree:
    """Read-only access to vLLM source files by path relative to the package root."""

    def __init__(self, description: str) -> None:
        self.description = description

    def read(self, path: str) -> str | None:  # pragma: no cover - interface
        raise NotImplementedError


class FolderSource(SourceTree):
    def __init__(self, root: Path) -> None:
        super().__init__(f"folder {root}")
        self.root = root

    def read(self, path: str) -> str | None:
        p = self.root / path
        return p.read_text(encoding="utf-8") if p.is_file() else None


class WheelSource(SourceTree):
    def __init__(self, wheel: Path) -> None:
        super().__init__(f"wheel {wheel}")
        self._zip = zipfile.ZipFile(wheel)
        self._names = set(self._zip.namelist())

    def read(self, path: str) -> str | None:
        if path not in self._names:
            return None
        return self._zip.read(path).decode("utf-8")


def open_source(path: str | os.PathLike[str]) -> SourceTree:
    """A wheel file, a folder holding ``vllm/``, or the ``vllm`` package folder itself."""
    p = Path(path).expanduser()
    if p.is_file():
        if not zipfile.is_zipfile(p):
            raise ValueError(f"{p} is a file but not a wheel/zip")
        return WheelSource(p)
    if (p / "vllm" / "__init__.py").is_file() or (p / "vllm" / "v1").is_dir():
        return FolderSource(p)
    if p.name == "vllm" and p.is_dir():
        return FolderSource(p.parent)
    raise ValueError(f"{p} is neither a wheel nor a folder containing the vllm package")


def find_source(environ: os._Environ[str] | dict[str, str] | None = None) -> SourceTree | None:
    """``$AVEST_VLLM_SOURCE`` if set (an error if it names nothing usable), else an
    installed ``vllm`` located without importing it, else None."""
    env = os.environ if environ is None else environ
    named = env.get(SOURCE_ENV)
    if named:
        return open_source(named)
    spec = importlib.util.find_spec("vllm")  # top-level: locates, does not execute
    if spec is None or not spec.submodule_search_locations:
        return None
    pkg = Path(next(iter(spec.submodule_search_locations)))
    tree = FolderSource(pkg.parent)
    tree.description = f"installed package {pkg}"
    return tree


def source_version(source: SourceTree) -> str | None:
    """``__version__`` from ``vllm/_version.py`` (read, not imported), if present."""
    text = source.read("vllm/_version.py")
    if text is None:
        return None
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets
        ):
            try:
                return str(ast.literal_eval(node.value))
            except ValueError:
                return None
    return None


# --------------------------------------------------------------------- AST
def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args)]
    if a.vararg:
        names.append("*" + a.vararg.arg)
    names.extend(x.arg for x in a.kwonlyargs)
    if a.kwarg:
        names.append("**" + a.kwarg.arg)
    return tuple(names)


def _top(tree: ast.Module, name: str, kind: type | tuple[type, ...]) -> ast.AST | None:
    for node in tree.body:
        if isinstance(node, kind) and getattr(node, "name", None) == name:
            return node
    return None


def _class_methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def _class_body_names(cls: ast.ClassDef) -> set[str]:
    out: set[str] = set()
    for n in cls.body:
        if isinstance(n, ast.Assign):
            out.update(t.id for t in n.targets if isinstance(t, ast.Name))
        elif isinstance(n, ast.AnnAssign | ast.AugAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
    return out


def _self_assigned(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    out: set[str] = set()
    for n in ast.walk(fn):
        targets: Iterable[ast.expr] = ()
        if isinstance(n, ast.Assign):
            targets = n.targets
        elif isinstance(n, ast.AnnAssign | ast.AugAssign):
            targets = (n.target,)
        for t in targets:
            for sub in ast.walk(t):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                ):
                    out.add(sub.attr)
    return out


def _module_names(tree: ast.Module) -> dict[str, str | None]:
    """Module-level bound names -> the module they were imported from (None if defined)."""
    out: dict[str, str | None] = {}
    for n in tree.body:
        if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            for a in n.names:
                out[a.asname or a.name] = n.module
        elif isinstance(n, ast.Import):
            for a in n.names:
                out[a.asname or a.name.split(".")[0]] = a.name
        elif isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out[n.name] = None
        elif isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = None
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out[n.target.id] = None
    return out


class _Checker:
    def __init__(self, source: SourceTree) -> None:
        self.source = source
        self._cache: dict[str, ast.Module | None] = {}

    def module(self, path: str) -> ast.Module | None:
        if path not in self._cache:
            text = self.source.read(path)
            self._cache[path] = None if text is None else ast.parse(text, filename=path)
        return self._cache[path]

    def method(self, path: str, cls: str, method: str) -> tuple[ast.AST | None, str | None]:
        """``cls.method``, or the module-level function ``method`` when ``cls`` is empty."""
        tree = self.module(path)
        if tree is None:
            return None, f"{path}: file missing"
        if not cls:
            func = _top(tree, method, (ast.FunctionDef, ast.AsyncFunctionDef))
            return (func, None) if func is not None else (None, f"{path}: {method} missing")
        node = _top(tree, cls, ast.ClassDef)
        if not isinstance(node, ast.ClassDef):
            return None, f"{path}: class {cls} missing"
        fn = _class_methods(node).get(method)
        if fn is None:
            return None, f"{path}: {cls}.{method} missing"
        return fn, None

    def check(self, e: c.Entry) -> list[str]:
        checks: dict[type, Callable[[Any], list[str]]] = {
            c.Class: self._class,
            c.Function: self._function,
            c.ModuleName: self._module_name,
            c.Constant: self._constant,
            c.Call: self._call,
            c.Statements: self._statements,
        }
        check = checks.get(type(e))
        if check is None:
            raise TypeError(f"unknown contract entry {e!r}")
        return check(e)

    def _class(self, e: c.Class) -> list[str]:
        tree = self.module(e.path)
        if tree is None:
            return [f"{e.path}: file missing"]
        node = _top(tree, e.name, ast.ClassDef)
        if not isinstance(node, ast.ClassDef):
            return [f"{e.path}: class {e.name} missing"]
        errs: list[str] = []
        methods = _class_methods(node)
        for m in e.methods:
            fn = methods.get(m.name)
            if fn is None:
                errs.append(f"{e.path}: {e.name}.{m.name} missing")
            elif _params(fn) != m.params:
                errs.append(
                    f"{e.path}: {e.name}.{m.name} parameters {_params(fn)} != expected {m.params}"
                )
        if e.init_attributes:
            init = methods.get("__init__")
            assigned = _self_assigned(init) if init else set()
            for a in e.init_attributes:
                if a not in assigned:
                    errs.append(f"{e.path}: {e.name}.__init__ does not assign self.{a}")
        body = _class_body_names(node)
        for a in e.class_attributes:
            if a not in body:
                errs.append(f"{e.path}: {e.name} has no class attribute/field {a}")
        return errs

    def _function(self, e: c.Function) -> list[str]:
        tree = self.module(e.path)
        if tree is None:
            return [f"{e.path}: file missing"]
        fn = _top(tree, e.name, (ast.FunctionDef, ast.AsyncFunctionDef))
        if fn is None:
            return [f"{e.path}: function {e.name} missing"]
        assert isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        if _params(fn) != e.params:
            return [f"{e.path}: {e.name} parameters {_params(fn)} != expected {e.params}"]
        return []

    def _module_name(self, e: c.ModuleName) -> list[str]:
        tree = self.module(e.path)
        if tree is None:
            return [f"{e.path}: file missing"]
        names = _module_names(tree)
        if e.name not in names:
            return [f"{e.path}: no module-level name {e.name}"]
        if e.from_module is not None and names[e.name] != e.from_module:
            return [
                f"{e.path}: {e.name} bound from {names[e.name]!r}, expected "
                f"'from {e.from_module} import {e.name}'"
            ]
        return []

    def _constant(self, e: c.Constant) -> list[str]:
        tree = self.module(e.path)
        if tree is None:
            return [f"{e.path}: file missing"]
        for n in tree.body:
            if isinstance(n, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == e.name for t in n.targets
            ):
                try:
                    value = ast.literal_eval(n.value)
                except ValueError:
                    return [f"{e.path}: {e.name} is not a literal"]
                if value != e.value:
                    return [f"{e.path}: {e.name} = {value!r}, expected {e.value!r}"]
                return []
        return [f"{e.path}: constant {e.name} missing"]

    def _call(self, e: c.Call) -> list[str]:
        fn, err = self.method(e.path, e.cls, e.method)
        if err:
            return [err]
        seen: list[tuple[str, ...]] = []
        for n in ast.walk(fn):  # type: ignore[arg-type]
            if isinstance(n, ast.Call) and ast.unparse(n.func) == e.callee:
                args = tuple(ast.unparse(a) for a in n.args)
                if args == e.args and not n.keywords:
                    return []
                seen.append(args + tuple(f"{k.arg}=..." for k in n.keywords))
        what = f"called with {seen}" if seen else "never called"
        return [f"{e.path}: in {e.cls}.{e.method}, {e.callee}{e.args} expected; {what}"]

    def _statements(self, e: c.Statements) -> list[str]:
        fn, err = self.method(e.path, e.cls, e.method)
        if err:
            return [err]
        found = {ast.unparse(n) for n in ast.walk(fn) if isinstance(n, ast.stmt | ast.expr)}  # type: ignore[arg-type]
        return [
            f"{e.path}: {f'{e.cls}.' if e.cls else ''}{e.method} no longer contains `{s}`"
            for s in e.snippets
            if s not in found
        ]


def check_source(source: SourceTree, entries: Iterable[c.Entry] = c.ENTRIES) -> list[str]:
    """Every violation of ``entries`` in ``source``, as readable lines; empty when it holds."""
    checker = _Checker(source)
    errors: list[str] = []
    for e in entries:
        errors.extend(checker.check(e))
    return errors


def check_entry(source: SourceTree, entry: c.Entry) -> list[str]:
    return _Checker(source).check(entry)


# ---------------------------------------------------------------- run time
def check_live_class(cls: object, entry: c.Class = c.ESTIMATOR) -> list[str]:
    """Compare a live class with a contract entry: methods, their parameters, class attributes.

    ``__init__`` attributes can only be checked on an instance (the shim does
    so after constructing the base)."""
    if not inspect.isclass(cls):
        return [f"{entry.name} is {type(cls).__name__}, not a class"]
    errs: list[str] = []
    for m in entry.methods:
        fn = getattr(cls, m.name, None)
        if fn is None or not callable(fn):
            errs.append(f"{entry.name}.{m.name} missing")
            continue
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            errs.append(f"{entry.name}.{m.name}: no signature")
            continue
        got = []
        for p in sig.parameters.values():
            prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
            got.append(prefix + p.name)
        if tuple(got) != m.params:
            errs.append(f"{entry.name}.{m.name} parameters {tuple(got)} != expected {m.params}")
    for a in entry.class_attributes:
        if not hasattr(cls, a):
            errs.append(f"{entry.name} has no class attribute {a}")
    return errs


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    source = open_source(args[0]) if args else find_source()
    if source is None:
        print(f"no vLLM source: install vllm or set {SOURCE_ENV}", file=sys.stderr)
        return 2
    errors = check_source(source)
    for line in errors:
        print(line)
    n = len(c.ENTRIES)
    version = source_version(source) or "unknown"
    print(
        f"{source.description} (vLLM {version}; contract written for {c.VLLM_VERSION}): "
        f"{n} entries, {len(errors)} violation(s)"
    )
    return 1 if errors else 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
