"""Write a minimal source tree that satisfies a contract exactly (to test the checker itself)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from avest_client.vllm import contract as c


def _sig(params: tuple[str, ...]) -> str:
    return ", ".join(params)


def render(entries: tuple[c.Entry, ...] = c.ENTRIES) -> dict[str, str]:
    """path -> source text."""
    heads: dict[str, list[str]] = defaultdict(list)
    funcs: dict[str, list[str]] = defaultdict(list)
    classes: dict[tuple[str, str], dict] = {}

    def klass(path: str, name: str) -> dict:
        return classes.setdefault(
            (path, name), {"attrs": [], "init": [], "methods": {}, "body": defaultdict(list)}
        )

    for e in entries:
        if isinstance(e, c.ModuleName):
            heads[e.path].append(
                f"from {e.from_module} import {e.name}" if e.from_module else f"{e.name} = None"
            )
        elif isinstance(e, c.Constant):
            heads[e.path].append(f"{e.name} = {e.value!r}")
        elif isinstance(e, c.Function):
            funcs[e.path].append(f"def {e.name}({_sig(e.params)}):\n    return None\n")
        elif isinstance(e, c.Class):
            k = klass(e.path, e.name)
            k["attrs"] += e.class_attributes
            k["init"] += e.init_attributes
            for m in e.methods:
                k["methods"][m.name] = m.params
        elif isinstance(e, c.Call):
            klass(e.path, e.cls)["body"][e.method].append(f"{e.callee}({', '.join(e.args)})")
        elif isinstance(e, c.Statements) and not e.cls:  # a module-level function
            body = "".join(f"    {b}\n" for b in e.snippets)
            funcs[e.path].append(f"def {e.method}():\n{body}")
        elif isinstance(e, c.Statements):
            klass(e.path, e.cls)["body"][e.method].extend(e.snippets)
    out: dict[str, list[str]] = defaultdict(list)
    for path, lines in heads.items():
        out[path] += lines
    for path, fs in funcs.items():
        out[path] += fs
    for (path, name), k in classes.items():
        lines = [f"class {name}:"]
        lines += [f"    {a} = None" for a in k["attrs"]]
        methods = dict(k["methods"])
        if k["init"]:
            methods.setdefault("__init__", ("self",))
        for m in k["body"]:
            methods.setdefault(m, ("self",))
        for m, params in methods.items():
            lines.append(f"    def {m}({_sig(params)}):")
            body = list(k["body"].get(m, []))
            if m == "__init__":
                body += [f"self.{a} = None" for a in k["init"]]
            lines += [f"        {b}" for b in body or ["pass"]]
        out[path].append("\n".join(lines) + "\n")
    return {p: "\n".join(v) + "\n" for p, v in out.items()}


def write(root: Path, entries: tuple[c.Entry, ...] = c.ENTRIES) -> Path:
    for path, text in render(entries).items():
        f = root / path
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    (root / "vllm" / "__init__.py").touch()
    return root
