"""Reading deploy/kubernetes without a cluster: YAML documents, a small
kustomize (resources, namespace, images, strategic-merge patches) enough for
the kustomizations shipped there, and the Kubernetes schemas offline."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from .harness import DEPLOY

KUBERNETES = DEPLOY / "kubernetes"
#: Kubernetes versions the manifests are validated against: the oldest the
#: probes' gRPC action and the StatefulSet fields need, and the newest schema
#: kubernetes-validate carries.
KUBE_VERSIONS = ("1.29.0", "1.37.0")

Doc = dict[str, Any]


def load_docs(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


#: Lists merged element by element on this key (as Kubernetes' strategic merge
#: does for containers, env, ports, volumes, volume mounts).
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "ports": "containerPort",
    "volumes": "name",
    "volumeMounts": "mountPath",
}


def strategic_merge(base: Any, patch: Any, key: str | None = None) -> Any:
    """A strategic-merge patch: maps merge (``null`` deletes), lists named in
    MERGE_KEYS merge by their key (patch elements first, as kubectl puts
    them), other lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = strategic_merge(out[k], v, k)
            else:
                out[k] = copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and key in MERGE_KEYS:
        field = MERGE_KEYS[key]
        by_key = {item.get(field): item for item in base}
        merged = []
        for item in patch:
            merged.append(strategic_merge(by_key.pop(item.get(field), {}), item))
        keep = {id(v) for v in by_key.values()}
        return merged + [item for item in base if id(item) in keep]
    return copy.deepcopy(patch)


def _matches(doc: Doc, target: dict[str, Any]) -> bool:
    return all(
        (doc["kind"] if k == "kind" else doc["metadata"].get(k)) == v for k, v in target.items()
    )


def build(directory: Path) -> list[Doc]:
    """The documents ``kubectl kustomize directory`` renders, for the fields
    the shipped kustomizations use."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kust) - {"apiVersion", "kind", "namespace", "resources", "patches", "images"}
    assert not unknown, f"{directory}: kustomization fields this reader does not apply: {unknown}"
    docs: list[Doc] = []
    for res in kust.get("resources", []):
        path = (directory / res).resolve()
        docs += build(path) if path.is_dir() else load_docs(path)
    for patch in kust.get("patches", []):
        (body,) = load_docs(directory / patch["path"])
        hits = [i for i, d in enumerate(docs) if _matches(d, patch["target"])]
        assert len(hits) == 1, f"{directory}: patch {patch} matches {len(hits)} documents"
        docs[hits[0]] = strategic_merge(docs[hits[0]], body)
    if "namespace" in kust:
        for d in docs:
            d["metadata"]["namespace"] = kust["namespace"]
    for image in kust.get("images", []):
        for d in docs:
            for c in pod_spec(d).get("containers", []) if pod_spec(d) else []:
                name, _, _tag = c["image"].partition(":")
                if name == image["name"]:
                    c["image"] = f"{image.get('newName', name)}:{image['newTag']}"
    return docs


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
