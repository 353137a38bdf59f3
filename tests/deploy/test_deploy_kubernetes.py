"""deploy/kubernetes: every manifest and every kustomization as ``kubectl
kustomize`` renders it against the Kubernetes schemas (offline,
kubernetes-validate), the Prometheus Operator objects by structure (their CRD
schemas are not available offline), the generated PrometheusRule and the
dashboard ConfigMap (kustomize's configMapGenerator) equal to their sources,
and the objects consistent with one another and with the image."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from .harness import ALERTS, DASHBOARDS, PROMETHEUS_HINT, REPO, readmes, require_tool
from .kube import (
    KUBE_VERSIONS,
    KUBERNETES,
    Doc,
    build,
    by_kind,
    env_of,
    load_docs,
    merge_patch,
    pod_spec,
)

pytestmark = pytest.mark.slow

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate",
    reason="kubernetes-validate is not installed: pip install -e '.[test]' (scripts/check does)",
)

BASE = KUBERNETES / "base"
TLS = KUBERNETES / "tls"
VLLM = KUBERNETES / "vllm"
REPLICAS = KUBERNETES / "replicas"
#: The kustomizations shipped, each rendered and validated as a whole
#: (test_deploy_replicas.py checks the replicas' objects further).
KUSTOMIZATIONS = (BASE, TLS, VLLM, REPLICAS)
#: Files that are not whole objects: patches and Helm values.
PARTIAL = {
    TLS / "statefulset-tls.yaml",
    TLS / "servicemonitor-tls.yaml",
    VLLM / "shim-patch.yaml",
    VLLM / "production-stack-values.yaml",
}
#: Kinds with no schema offline: checked by structure below.
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}
TOKEN_SECRET = "avest-tokens"


def validate(doc: Doc) -> None:
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(
                f"{doc['kind']}/{doc['metadata'].get('name')} against Kubernetes {version}: "
                f"{exc.message} at {'.'.join(map(str, exc.path))}"
            ) from None


def all_manifests() -> list[Path]:
    return sorted(
        p for p in KUBERNETES.rglob("*.yaml") if p.name != "kustomization.yaml" and p not in PARTIAL
    )


def test_every_manifest_file_is_known_to_this_test() -> None:
    """Every YAML file under deploy/kubernetes is a whole manifest validated
    below, a kustomization, or a known partial (patch, values)."""
    files = set(KUBERNETES.rglob("*.yaml"))
    assert files >= PARTIAL
    assert {d / "kustomization.yaml" for d in KUSTOMIZATIONS} <= files
    assert len(all_manifests()) >= 6


@pytest.mark.parametrize("path", all_manifests(), ids=lambda p: str(p.relative_to(KUBERNETES)))
def test_each_manifest_validates_against_the_kubernetes_schemas(path: Path) -> None:
    docs = load_docs(path)
    assert docs, path
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue  # structure checked below
        validate(doc)


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: p.name)
def test_each_kustomization_renders_to_valid_objects(directory: Path) -> None:
    docs = build(directory)
    assert docs
    for doc in docs:
        if doc["kind"] not in CRD_KINDS:
            validate(doc)


def test_the_schema_check_refuses_a_broken_manifest() -> None:
    """The validation is real: a misspelt field and a string replica count fail."""
    (sts,) = load_docs(BASE / "statefulset.yaml")
    broken = merge_patch(sts, {"spec": {"replicas": "one"}})
    with pytest.raises(AssertionError, match="replicas"):
        validate(broken)
    typo = merge_patch(sts, {"spec": {"template": {"spec": {"restartPolicyy": "Always"}}}})
    with pytest.raises(AssertionError):
        validate(typo)


# -- the sidecar -------------------------------------------------------------------


def base() -> dict[str, Doc]:
    return by_kind(build(BASE))


def test_the_sidecar_is_one_statefulset_replica_with_its_own_volume() -> None:
    sts = base()["StatefulSet"]
    assert sts["spec"]["replicas"] == 1
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    (c,) = pod_spec(sts)["containers"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    env = env_of(c)
    assert mounts[env["AVEST_DATA_DIR"]["value"]] == claim["metadata"]["name"]
    assert "Deployment" not in base() and "HorizontalPodAutoscaler" not in base()
    # Said where an operator looks.
    assert re.search(r"ONE REPLICA", (BASE / "statefulset.yaml").read_text())
    assert re.search(r"SQLite.{0,200}one replica", readmes(), re.S | re.I)


def test_the_sidecar_has_probes_requests_and_runs_as_the_images_user() -> None:
    sts = base()["StatefulSet"]
    spec = pod_spec(sts)
    (c,) = spec["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["readinessProbe"]["httpGet"]["port"] in ("http", ports["http"])
    # Liveness reads /healthz, answered off the service's event loop (its heartbeat).
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["livenessProbe"]["httpGet"]["port"] in ("http", ports["http"])
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert set(c["resources"]["requests"]) == {"cpu", "memory"}
    assert "memory" in c["resources"]["limits"]
    env = env_of(c)
    assert env["AVEST_GRPC_ADDRESS"]["value"].endswith(f":{ports['grpc']}")
    assert env["AVEST_HTTP_ADDRESS"]["value"].endswith(f":{ports['http']}")
    # The image's user (Dockerfile USER) owns the volume.
    dockerfile = (REPO / "Dockerfile").read_text()
    uid = re.findall(r"(?m)^USER (\d+)", dockerfile)[-1]
    assert str(spec["securityContext"]["runAsUser"]) == uid
    assert str(spec["securityContext"]["fsGroup"]) == uid
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_settings_in_the_manifests_are_avest_settings() -> None:
    """Every AVEST_* variable the sidecar gets is an ``avest serve`` setting or
    one of the token and TLS settings."""
    from avest.settings import Settings, env_name

    known = {env_name(f) for f in Settings.model_fields}
    known |= {"AVEST_WORKER_TOKEN", "AVEST_ADMIN_TOKEN", "AVEST_TLS_CERT", "AVEST_TLS_KEY"}
    known |= {"AVEST_TLS_CLIENT_CA"}
    for directory in (BASE, TLS):
        sts = by_kind(build(directory))["StatefulSet"]
        (c,) = pod_spec(sts)["containers"]
        names = set(env_of(c))
        assert names <= known, names - known


def test_tokens_come_from_the_secret_the_example_shows() -> None:
    (secret,) = load_docs(KUBERNETES / "secret.example.yaml")
    assert secret["metadata"]["name"] == TOKEN_SECRET
    keys = set(secret["stringData"])
    (c,) = pod_spec(base()["StatefulSet"])["containers"]
    env = env_of(c)
    for name in ("AVEST_WORKER_TOKEN", "AVEST_ADMIN_TOKEN"):
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == TOKEN_SECRET and ref["key"] in keys
        assert ref.get("optional") is not True, "the sidecar must not start without its tokens"
    sm = base()["ServiceMonitor"]
    for ep in sm["spec"]["endpoints"]:
        cred = ep["authorization"]["credentials"]
        assert cred["name"] == TOKEN_SECRET and cred["key"] == "worker-token"


def test_the_service_selects_the_sidecar_pod_and_names_its_ports() -> None:
    docs = base()
    svc, sts = docs["Service"], docs["StatefulSet"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    (c,) = pod_spec(sts)["containers"]
    cports = {p["name"] for p in c["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} == cports == {"grpc", "read", "http"}
    # Each listen address is on its named container port.
    env = {e["name"]: e.get("value") for e in c["env"]}
    port = {p["name"]: p["containerPort"] for p in c["ports"]}
    for name, var in (("grpc", "AVEST_GRPC_ADDRESS"), ("read", "AVEST_READ_ADDRESS")):
        assert env[var] == f"0.0.0.0:{port[name]}", var


def test_the_image_is_set_by_the_kustomization() -> None:
    kust = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    (image,) = kust["images"]
    (sts,) = load_docs(BASE / "statefulset.yaml")
    (c,) = pod_spec(sts)["containers"]
    assert c["image"] == image["name"]
    (rendered,) = pod_spec(base()["StatefulSet"])["containers"]
    assert rendered["image"] == f"{image['newName']}:{image['newTag']}"


def test_the_tls_overlay_mounts_the_certificate_and_probes_over_https() -> None:
    docs = by_kind(build(TLS))
    spec = pod_spec(docs["StatefulSet"])
    (c,) = spec["containers"]
    env = env_of(c)
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    for name in ("AVEST_TLS_CERT", "AVEST_TLS_KEY"):
        path = Path(env[name]["value"])
        (vol,) = [v for v, m in mounts.items() if path.parent == Path(m)]
        assert volumes[vol]["secret"]["secretName"] == "avest-tls"
    assert "data" in mounts and "tmp" in mounts  # the base's mounts are kept
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["scheme"] == "HTTPS", probe
        assert "grpc" not in c[probe], probe
    (ep,) = docs["ServiceMonitor"]["spec"]["endpoints"]
    assert ep["scheme"] == "https" and ep["tlsConfig"]["ca"]["secret"]["name"] == "avest-tls"


# -- Prometheus Operator and Grafana ------------------------------------------------


def test_the_servicemonitor_scrapes_the_services_metrics_port() -> None:
    docs = base()
    sm, svc = docs["ServiceMonitor"], docs["Service"]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(sm["spec"]) <= {"selector", "endpoints", "jobLabel", "namespaceSelector"}
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    port_names = {p["name"] for p in svc["spec"]["ports"]}
    allowed = {"port", "path", "interval", "scrapeTimeout", "scheme", "authorization", "tlsConfig"}
    for ep in sm["spec"]["endpoints"]:
        assert set(ep) <= allowed, set(ep) - allowed
        assert ep["port"] in port_names and ep["path"] == "/metrics"
        for key in ("interval", "scrapeTimeout"):
            assert re.fullmatch(r"\d+[smh]", ep[key]), ep[key]
    assert sm["metadata"]["labels"].get("release"), "kube-prometheus-stack selects on release"


def test_the_prometheusrule_carries_exactly_the_alerts_of_alerts_yml() -> None:
    rule = base()["PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(rule["spec"]) == {"groups"}
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]
    assert rule["metadata"]["labels"].get("release")
    for group in rule["spec"]["groups"]:
        assert set(group) <= {"name", "interval", "rules"} and group["rules"]
        for r in group["rules"]:
            assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}, r
            assert isinstance(r["expr"], str)


def test_the_prometheusrule_passes_promtool(tmp_path: Path) -> None:
    promtool = require_tool("promtool", PROMETHEUS_HINT)
    rule = base()["PrometheusRule"]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    r = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_dashboard_configmap_carries_the_dashboard_for_grafanas_sidecar() -> None:
    cm = base()["ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    (name,) = cm["data"]
    assert json.loads(cm["data"][name]) == json.loads((DASHBOARDS / name).read_text())


def test_the_generated_manifests_are_up_to_date() -> None:
    r = subprocess.run(
        [sys.executable, str(KUBERNETES / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, r.stderr


# -- vLLM workers ------------------------------------------------------------------


def sidecar_address() -> str:
    docs = base()
    svc = docs["Service"]
    port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")
    return f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local:{port}"


def check_worker_env(env: list[dict[str, Any]]) -> None:
    by_name = {e["name"]: e for e in env}
    assert by_name["AVEST_ADDRESS"]["value"] == sidecar_address()
    ref = by_name["AVEST_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": TOKEN_SECRET, "key": "worker-token"}


def test_the_shim_patch_adds_the_shim_to_a_vllm_deployment() -> None:
    (deploy,) = build(VLLM)
    (c,) = pod_spec(deploy)["containers"]
    check_worker_env(c["env"])
    assert "HF_TOKEN" in env_of(c), "the Deployment's own variables are kept"
    assert c["image"].rsplit(":", 1)[0].endswith("/avest-vllm")
    assert c["args"][0] == "Qwen/Qwen3-8B"


def test_the_production_stack_values_give_every_engine_the_shim() -> None:
    values = yaml.safe_load((VLLM / "production-stack-values.yaml").read_text())
    specs = values["servingEngineSpec"]["modelSpec"]
    assert specs
    for spec in specs:
        assert {"name", "repository", "tag", "modelURL"} <= set(spec)
        assert spec["repository"].endswith("/avest-vllm")
        check_worker_env(spec["env"])
        # What the chart renders from them is a valid container.
        container = {
            "name": "vllm",
            "image": f"{spec['repository']}:{spec['tag']}",
            "command": ["vllm", "serve", spec["modelURL"], *spec["vllmConfig"]["extraArgs"]],
            "env": spec["env"],
        }
        validate(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "engine"},
                "spec": {"containers": [container]},
            }
        )


def test_the_kubernetes_delivery_is_documented() -> None:
    text = readmes()
    for needle in (
        "deploy/kubernetes/base",
        "grafana_dashboard",
        "servingEngineSpec",
        "shim-patch.yaml",
        "AVEST_ADDRESS",
        "avest-tokens",
    ):
        assert needle in text, needle


def test_every_readme_a_manifest_points_to_exists() -> None:
    """The manifests' comments name READMEs by relative path: each one is there."""
    named = []
    for path in sorted((REPO / "deploy").rglob("*.yaml")):
        for ref in re.findall(r"(?<![\w/.])((?:\.\./)*[\w./-]*README\.md)", path.read_text()):
            named.append(ref)
            assert (path.parent / ref).resolve().is_file(), f"{path.relative_to(REPO)}: {ref}"
    assert len(named) >= 3, named
