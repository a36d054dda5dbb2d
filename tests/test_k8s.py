"""The k8s manifests: every file the kustomization lists loads and hangs together."""

from __future__ import annotations

from pathlib import Path

import yaml

K8S_DIR = Path(__file__).resolve().parent.parent / "k8s"
WORKER_PORT = 50061


def _kustomization() -> dict:
    return yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())


def _resources() -> list[dict]:
    docs: list[dict] = []
    for name in _kustomization()["resources"]:
        docs += [doc for doc in yaml.safe_load_all((K8S_DIR / name).read_text()) if doc is not None]
    return docs


def _one(kind: str, name: str) -> dict:
    found = [doc for doc in _resources() if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def _container_port(container: dict, port: int | str) -> int:
    """Resolves a Service targetPort or probe port (number or port name) against the container's ports."""
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in container["ports"] if "name" in p}
    assert port in named, f"port name {port!r} not among the container's ports {sorted(named)}"
    return named[port]


def test_kustomization_lists_every_manifest_and_only_existing_ones() -> None:
    kustomization = _kustomization()
    assert kustomization["kind"] == "Kustomization"
    listed = set(kustomization["resources"])
    on_disk = {path.name for path in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


def test_every_resource_has_api_version_kind_and_name() -> None:
    docs = _resources()
    assert docs
    for doc in docs:
        assert doc.get("apiVersion") and doc.get("kind"), doc
        assert doc.get("metadata", {}).get("name"), doc


def test_worker_deployment_runs_the_worker_with_grpc_probes() -> None:
    deployment = _one("Deployment", "kvserve-worker")
    spec = deployment["spec"]
    pod = spec["template"]
    assert spec["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    assert container["image"] == "kvserve:latest"
    assert container["command"] == ["kvserve", "worker", "--host", "0.0.0.0", "--port", str(WORKER_PORT)]
    assert [p["containerPort"] for p in container["ports"]] == [WORKER_PORT]
    assert {"KVSERVE_MODEL", "KVSERVE_KV_CACHE_BYTES"} <= {env["name"] for env in container["env"]}
    assert container["resources"]["requests"]["cpu"] and container["resources"]["limits"]["memory"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert set(container[probe]) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, probe
        assert _container_port(container, container[probe]["grpc"]["port"]) == WORKER_PORT, probe


def test_worker_service_targets_the_container_port_of_the_selected_pods() -> None:
    deployment = _one("Deployment", "kvserve-worker")
    service = _one("Service", "kvserve-worker")
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    # Headless: the gateway needs every worker's own address, not a load-balanced one.
    assert service["spec"]["clusterIP"] == "None"
    (port,) = service["spec"]["ports"]
    assert port["port"] == WORKER_PORT
    assert _container_port(container, port["targetPort"]) == WORKER_PORT
