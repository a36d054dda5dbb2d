"""The k8s manifests: every file the kustomization lists loads and hangs together."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from opentelemetry.sdk.trace import TracerProvider

from kvserve.common.telemetry import tracing_enabled_by_env
from kvserve.services.cli import build_parser

K8S_DIR = Path(__file__).resolve().parent.parent / "k8s"
GATEWAY_PORT = 50050
GATEWAY_HTTP_PORT = 8000
WORKER_PORT = 50061
KVMANAGER_PORT = 50051
REDIS_PORT = 6379
# services/cli_gateway.run_gateway after SIGTERM: gateway.close(drain_s=5.0), then server.stop(2.0).
GATEWAY_DRAIN_S = 5.0
GATEWAY_STOP_GRACE_S = 2.0
API_KEYS_SECRET = "kvserve-api-keys"
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
# The three kvserve services (workload name, `kvserve` subcommand): each serves gRPC, metrics and traces.
SERVICES = (("kvserve-kvmanager", "kvmanager"), ("kvserve-worker", "worker"), ("kvserve-gateway", "gateway"))
DASHBOARD_CONFIGMAP = "kvserve-grafana-dashboard"
DASHBOARD_FILE = "grafana-dashboard.json"
SECRET_LIKE_ENV = re.compile(r"TOKEN|PASSWORD|SECRET|PASSWD|CREDENTIAL", re.IGNORECASE)


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


def _workloads() -> list[dict]:
    return [doc for doc in _resources() if doc["kind"] in WORKLOAD_KINDS]


def _workload(name: str) -> dict:
    """The Deployment or StatefulSet of that name, whichever kind it is."""
    found = [doc for doc in _workloads() if doc["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one workload {name}, found {[doc['kind'] for doc in found]}"
    return found[0]


def _all_containers(workload: dict) -> list[dict]:
    pod_spec = workload["spec"]["template"]["spec"]
    return pod_spec.get("initContainers", []) + pod_spec["containers"]


def _container_port(container: dict, port: int | str) -> int:
    """Resolves a Service targetPort or probe port (number or port name) against the container's ports."""
    if isinstance(port, int):
        assert port in [p["containerPort"] for p in container["ports"]], f"port {port} is no container port"
        return port
    named = {p["name"]: p["containerPort"] for p in container["ports"] if "name" in p}
    assert port in named, f"port name {port!r} not among the container's ports {sorted(named)}"
    return named[port]


def _env(container: dict) -> dict[str, dict]:
    return {env["name"]: env for env in container.get("env", [])}


def _ports(container: dict) -> dict[str, int]:
    """The container's ports by name."""
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def _metrics_port(container: dict) -> int:
    return int(_env(container)["KVSERVE_METRICS_PORT"]["value"])


def _generated_config_maps() -> list[dict]:
    """The ConfigMaps the kustomization's configMapGenerator makes (not resources: no file of their own)."""
    return _kustomization().get("configMapGenerator", [])


def _generator_files(generator: dict) -> dict[str, str]:
    """A generator's files as {ConfigMap key: file path}; an entry is `path` or `key=path`."""
    files: dict[str, str] = {}
    for entry in generator.get("files", []):
        key, _, path = entry.rpartition("=")
        files[key or Path(path).name] = path
    return files


def _assert_grpc_probes(container: dict, port: int) -> None:
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe in container, probe
        assert set(container[probe]) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, probe
        assert _container_port(container, container[probe]["grpc"]["port"]) == port, probe
        # The servers mark the overall health service "" SERVING; no probe should ask for another name.
        assert container[probe]["grpc"].get("service", "") == "", probe


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[command]


def _flag_for_env(name: str) -> str:
    assert name.startswith("KVSERVE_"), name
    return "--" + name.removeprefix("KVSERVE_").lower().replace("_", "-")


# --- the kustomization ----------------------------------------------------------------------------------------


def test_kustomization_lists_every_manifest_and_only_existing_ones() -> None:
    kustomization = _kustomization()
    assert kustomization["kind"] == "Kustomization"
    listed = set(kustomization["resources"])
    on_disk = {path.name for path in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    assert not list(K8S_DIR.glob("*.yml")), "use the .yaml suffix, so the check above sees every manifest"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not on PATH")
def test_kubectl_kustomize_renders_every_resource_with_the_common_label() -> None:
    out = subprocess.run(["kubectl", "kustomize", str(K8S_DIR)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rendered = [doc for doc in yaml.safe_load_all(out.stdout) if doc is not None]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in rendered) == sorted(
        [(d["kind"], d["metadata"]["name"]) for d in _resources()]
        + [("ConfigMap", g["name"]) for g in _generated_config_maps()])
    (dashboard,) = [d for d in rendered if (d["kind"], d["metadata"]["name"]) == ("ConfigMap", DASHBOARD_CONFIGMAP)]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"][DASHBOARD_FILE]) == json.loads((K8S_DIR / DASHBOARD_FILE).read_text())
    for doc in rendered:
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvserve", doc["metadata"]["name"]


def test_every_resource_has_api_version_kind_and_name() -> None:
    docs = _resources()
    assert docs
    for doc in docs:
        assert doc.get("apiVersion") and doc.get("kind"), doc
        assert doc.get("metadata", {}).get("name"), doc
    names = [(doc["kind"], doc["metadata"]["name"]) for doc in docs]
    assert len(names) == len(set(names)), "duplicate kind/name"


def test_every_workload_selects_its_own_pods_and_has_resources() -> None:
    for workload in _workloads():
        spec = workload["spec"]
        assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
        for container in _all_containers(workload):
            resources = container["resources"]
            assert resources["requests"]["cpu"] and resources["requests"]["memory"], container["name"]
            assert resources["limits"]["memory"], container["name"]


def test_every_service_selects_exactly_one_workload_and_targets_its_container_ports() -> None:
    services = [doc for doc in _resources() if doc["kind"] == "Service"]
    assert services
    for service in services:
        selector = service["spec"]["selector"]
        matched = [w for w in _workloads() if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matched) == 1, f"Service {service['metadata']['name']} selects {len(matched)} workloads"
        containers = matched[0]["spec"]["template"]["spec"]["containers"]
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            hits = [c for c in containers if any(target in (p["containerPort"], p.get("name")) for p in c["ports"])]
            assert len(hits) == 1, f"Service {service['metadata']['name']} targetPort {target!r}"
            assert _container_port(hits[0], target) == port["port"]


def test_no_secret_values_are_committed() -> None:
    for path in K8S_DIR.glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                assert doc.get("kind") != "Secret", f"{path.name} commits a Secret"
                assert doc.get("kind") != "Kustomization" or not doc.get("secretGenerator"), path.name
    for workload in _workloads():
        for container in _all_containers(workload):
            joined = " ".join(container.get("command", []) + container.get("args", []))
            assert "--admin-token" not in joined and "--requirepass" not in joined, container["name"]
            for name, env in _env(container).items():
                if SECRET_LIKE_ENV.search(name):
                    assert "value" not in env, f"{container['name']}: {name} has a literal value"
                    assert "secretKeyRef" in env["valueFrom"], name
                if "value" in env and env["value"].startswith("redis"):
                    assert urlparse(env["value"]).password is None, f"{name}: a password in a Redis URL"


# --- workers ----------------------------------------------------------------------------------------------------


def test_worker_statefulset_runs_the_worker_with_grpc_probes() -> None:
    statefulset = _one("StatefulSet", "kvserve-worker")
    spec = statefulset["spec"]
    pod = spec["template"]
    assert spec["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    assert container["image"] == "kvserve:latest"
    assert container["command"] == ["kvserve", "worker", "--host", "0.0.0.0", "--port", str(WORKER_PORT)]
    assert _ports(container) == {"grpc": WORKER_PORT, "metrics": _metrics_port(container)}
    assert {"KVSERVE_MODEL", "KVSERVE_KV_CACHE_BYTES"} <= set(_env(container))
    assert container["resources"]["requests"]["cpu"] and container["resources"]["limits"]["memory"]
    _assert_grpc_probes(container, WORKER_PORT)


def test_worker_service_targets_the_container_port_of_the_selected_pods() -> None:
    statefulset = _one("StatefulSet", "kvserve-worker")
    service = _one("Service", "kvserve-worker")
    pod = statefulset["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    # Headless: the gateway needs every worker's own address, not a load-balanced one.
    assert service["spec"]["clusterIP"] == "None"
    (port,) = service["spec"]["ports"]
    assert port["port"] == WORKER_PORT
    assert _container_port(container, port["targetPort"]) == WORKER_PORT


def test_worker_statefulset_gives_each_pod_a_stable_name_and_worker_id() -> None:
    """Stable pod names = stable worker ids (a restarted worker re-registers under its old id with a new
    epoch, so the kvmanager drops the old pool) and stable DNS names for the gateway's worker list."""
    assert [doc["kind"] for doc in _workloads() if doc["metadata"]["name"] == "kvserve-worker"] == ["StatefulSet"]
    spec = _one("StatefulSet", "kvserve-worker")["spec"]
    service = _one("Service", spec["serviceName"])
    assert service["spec"]["clusterIP"] == "None", "pod DNS names need a headless Service"
    assert service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    assert spec["podManagementPolicy"] == "Parallel"
    assert spec["replicas"] == 2
    (container,) = spec["template"]["spec"]["containers"]
    assert _env(container)["KVSERVE_WORKER_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}


# --- environment variables are real CLI flags -------------------------------------------------------------------


@pytest.mark.parametrize(("workload", "command"), [("kvserve-kvmanager", "kvmanager"), ("kvserve-worker", "worker"),
                                                   ("kvserve-gateway", "gateway")])
def test_env_names_are_flags_the_cli_reads(workload: str, command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each KVSERVE_X of the container is a --x flag of its subcommand, and setting the variable gives the
    same parsed value as passing the flag (so the flag really falls back to that variable)."""
    (container,) = _workload(workload)["spec"]["template"]["spec"]["containers"]
    assert container["command"][:2] == ["kvserve", command]
    env = {name: e for name, e in _env(container).items() if name.startswith("KVSERVE_")}
    assert env
    for name in [n for n in os.environ if n.startswith("KVSERVE_")]:
        monkeypatch.delenv(name)
    parser = build_parser()
    actions = {s: a for a in _subparser(parser, command)._actions + parser._actions for s in a.option_strings}
    for name, spec in env.items():
        flag = _flag_for_env(name)
        assert flag in actions, f"{workload}: {name} has no {flag} flag in `kvserve {command}` ({sorted(actions)})"
        value = spec.get("value", f"from-{name.lower()}")  # valueFrom: any string stands in
        by_flag = getattr(build_parser().parse_args([command, flag, value]), actions[flag].dest)
        with monkeypatch.context() as m:
            m.setenv(name, value)
            by_env = getattr(build_parser().parse_args([command]), actions[flag].dest)
        assert by_env == by_flag, f"{name}={value!r} parses to {by_env!r}, {flag} {value!r} to {by_flag!r}"


# --- observability: metrics and traces ---------------------------------------------------------------------------


@pytest.mark.parametrize(("workload", "command"), SERVICES)
def test_service_serves_metrics_on_its_named_port_and_the_pod_is_annotated_for_scraping(workload: str,
                                                                                       command: str) -> None:
    """KVSERVE_METRICS_PORT (--metrics-port) is the container's `metrics` port, and the pod template's
    prometheus.io/* annotations point a kubernetes_sd scrape at that same port and path."""
    pod = _workload(workload)["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    port = _metrics_port(container)
    assert _container_port(container, "metrics") == port
    assert port != _container_port(container, "grpc")
    # The metrics server binds the service's --host: it must listen on the pod IP, not loopback.
    argv = container["command"]
    assert argv[:2] == ["kvserve", command] and argv[argv.index("--host") + 1] == "0.0.0.0"
    annotations = pod["metadata"].get("annotations", {})
    assert annotations.get("prometheus.io/scrape") == "true"
    # Annotation values are strings: an unquoted number would not even be accepted by the API server.
    assert annotations.get("prometheus.io/port") == str(port)
    assert annotations.get("prometheus.io/path") == "/metrics"


@pytest.mark.parametrize(("workload", "command"), SERVICES)
def test_service_exports_traces_over_otlp_with_a_sampler(workload: str, command: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The container's OTEL_* environment turns tracing on (common/telemetry.py) and names a sampler the
    OpenTelemetry SDK recognises (an unknown name or a bad ratio only logs a warning and samples everything)."""
    (container,) = _workload(workload)["spec"]["template"]["spec"]["containers"]
    env = {name: e["value"] for name, e in _env(container).items() if name.startswith("OTEL_")}
    endpoint = urlparse(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
    assert endpoint.scheme in ("http", "https") and endpoint.hostname and endpoint.port, endpoint.geturl()
    sampler = env["OTEL_TRACES_SAMPLER"]
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert tracing_enabled_by_env()
    description = TracerProvider().sampler.get_description()
    if sampler.startswith("parentbased_"):
        assert description.startswith("ParentBased{"), description
    if sampler.endswith("traceidratio"):
        ratio = float(env["OTEL_TRACES_SAMPLER_ARG"])
        assert 0 < ratio <= 1, ratio
        assert f"TraceIdRatioBased{{{ratio}}}" in description, description
    else:
        assert sampler in ("always_on", "always_off", "parentbased_always_on", "parentbased_always_off"), sampler


def test_services_agree_on_the_collector_and_the_gateway_alone_samples() -> None:
    """One collector; the gateway decides which requests are traced (a ratio), and the kvmanager and workers,
    which only ever see the traceparents of sampled requests, keep all of them."""
    envs = {w: _env(_workload(w)["spec"]["template"]["spec"]["containers"][0]) for w, _ in SERVICES}
    assert len({env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] for env in envs.values()}) == 1
    for workload, env in envs.items():
        sampler = env["OTEL_TRACES_SAMPLER"]["value"]
        if workload == "kvserve-gateway":
            assert sampler == "parentbased_traceidratio" and 0 < float(env["OTEL_TRACES_SAMPLER_ARG"]["value"]) <= 1
        else:
            assert sampler == "parentbased_always_on" and "OTEL_TRACES_SAMPLER_ARG" not in env, workload


@pytest.mark.parametrize(("workload", "command"), SERVICES)
def test_service_env_is_kvserve_flags_or_opentelemetry(workload: str, command: str) -> None:
    """test_env_names_are_flags_the_cli_reads checks KVSERVE_* only; anything else must be OTEL_* (read by
    the OpenTelemetry SDK), so a misspelt prefix cannot slip past both."""
    (container,) = _workload(workload)["spec"]["template"]["spec"]["containers"]
    for name in _env(container):
        assert name.startswith(("KVSERVE_", "OTEL_")), f"{workload}: {name}"


def test_kustomization_ships_the_grafana_dashboard_to_the_grafana_sidecar() -> None:
    """A configMapGenerator, not a resource: it makes the ConfigMap from grafana-dashboard.json on disk, with
    the label the Grafana sidecar looks for, under a fixed name."""
    (generator,) = [g for g in _generated_config_maps() if g["name"] == DASHBOARD_CONFIGMAP]
    files = _generator_files(generator)
    assert files == {DASHBOARD_FILE: DASHBOARD_FILE}
    dashboard = json.loads((K8S_DIR / files[DASHBOARD_FILE]).read_text())
    assert dashboard["panels"], "the dashboard has no panels"
    options = generator["options"]
    assert options["labels"]["grafana_dashboard"] == "1"
    assert options["disableNameSuffixHash"] is True
    assert DASHBOARD_FILE not in _kustomization()["resources"]


# --- kvmanager --------------------------------------------------------------------------------------------------


def _assert_one_replica_never_two(name: str) -> None:
    """One replica, replaced by Recreate (never two at once during a rollout), and no autoscaler on it."""
    spec = _one("Deployment", name)["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    hpas = [doc for doc in _resources() if doc["kind"] == "HorizontalPodAutoscaler"]
    assert not [h for h in hpas if h["spec"]["scaleTargetRef"]["name"] == name]


def test_kvmanager_is_a_single_replica_never_two_at_once() -> None:
    _assert_one_replica_never_two("kvserve-kvmanager")


def test_kvmanager_deployment_runs_the_kvmanager_with_grpc_probes() -> None:
    pod = _one("Deployment", "kvserve-kvmanager")["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["image"] == "kvserve:latest"
    assert container["command"] == ["kvserve", "kvmanager", "--host", "0.0.0.0", "--port", str(KVMANAGER_PORT)]
    assert _ports(container) == {"grpc": KVMANAGER_PORT, "metrics": _metrics_port(container)}
    _assert_grpc_probes(container, KVMANAGER_PORT)


def test_kvmanager_admin_token_comes_from_the_secret() -> None:
    (container,) = _one("Deployment", "kvserve-kvmanager")["spec"]["template"]["spec"]["containers"]
    token = _env(container)["KVSERVE_ADMIN_TOKEN"]
    assert token["valueFrom"] == {"secretKeyRef": {"name": "kvserve-admin", "key": "token"}}
    # Documented, not committed: the manifest says how to create it.
    assert "kubectl create secret generic kvserve-admin --from-literal=token=" in (
        K8S_DIR / "kvmanager-deployment.yaml").read_text()


def _cluster_ip_port(name: str, port_name: str | None = None) -> dict:
    """The one port (or the port named ``port_name``) of Service ``name``: a ClusterIP (not headless) in front
    of Deployment ``name``'s pods."""
    pod = _one("Deployment", name)["spec"]["template"]
    service = _one("Service", name)
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert service["spec"].get("clusterIP") != "None"
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (port,) = [p for p in service["spec"]["ports"] if port_name in (None, p["name"])]
    return port


def test_kvmanager_service_is_cluster_ip_on_the_grpc_port() -> None:
    pod = _one("Deployment", "kvserve-kvmanager")["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    port = _cluster_ip_port("kvserve-kvmanager")
    assert port["port"] == KVMANAGER_PORT
    assert _container_port(container, port["targetPort"]) == KVMANAGER_PORT


def test_kvmanager_redis_url_names_the_statefulset_pod_through_its_headless_service() -> None:
    statefulset = _one("StatefulSet", "kvserve-redis")
    service = _one("Service", statefulset["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None", "pod DNS names need a headless Service"
    (redis,) = statefulset["spec"]["template"]["spec"]["containers"]
    (service_port,) = service["spec"]["ports"]
    deployment = _one("Deployment", "kvserve-kvmanager")
    urls = {c["name"]: _env(c)["KVSERVE_REDIS_URL"]["value"] for c in _all_containers(deployment)
            if "KVSERVE_REDIS_URL" in _env(c)}
    assert "kvmanager" in urls
    assert len(set(urls.values())) == 1, f"the containers disagree on the Redis URL: {urls}"
    url = urlparse(urls["kvmanager"])
    assert url.scheme == "redis"
    assert statefulset["spec"]["replicas"] >= 1
    assert url.hostname == f"{statefulset['metadata']['name']}-0.{service['metadata']['name']}"
    assert url.port == service_port["port"]
    assert _container_port(redis, service_port["targetPort"]) == REDIS_PORT
    assert url.path in ("", "/0")


# --- gateway ----------------------------------------------------------------------------------------------------


def _gateway_container() -> dict:
    (container,) = _one("Deployment", "kvserve-gateway")["spec"]["template"]["spec"]["containers"]
    return container


def test_gateway_deployment_runs_the_gateway_with_grpc_probes() -> None:
    container = _gateway_container()
    assert container["image"] == "kvserve:latest"
    assert container["command"] == ["kvserve", "gateway", "--host", "0.0.0.0", "--port", str(GATEWAY_PORT),
                                    "--http-port", str(GATEWAY_HTTP_PORT)]
    assert _ports(container) == {"grpc": GATEWAY_PORT, "http": GATEWAY_HTTP_PORT, "metrics": _metrics_port(container)}
    _assert_grpc_probes(container, GATEWAY_PORT)


def test_gateway_is_a_single_replica_never_two_at_once() -> None:
    # One scheduling loop per worker: two gateways would each batch for every worker as if alone.
    _assert_one_replica_never_two("kvserve-gateway")


def test_gateway_has_time_to_drain_after_sigterm() -> None:
    pod_spec = _one("Deployment", "kvserve-gateway")["spec"]["template"]["spec"]
    assert pod_spec.get("terminationGracePeriodSeconds", 30) > GATEWAY_DRAIN_S + GATEWAY_STOP_GRACE_S


def test_gateway_workers_are_the_statefulset_pods_by_their_stable_dns_names() -> None:
    statefulset = _one("StatefulSet", "kvserve-worker")
    service = _one("Service", statefulset["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None", "pod DNS names need a headless Service"
    (service_port,) = service["spec"]["ports"]
    (worker,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert _container_port(worker, service_port["targetPort"]) == WORKER_PORT
    expected = [f"{statefulset['metadata']['name']}-{i}.{service['metadata']['name']}:{service_port['port']}"
                for i in range(statefulset["spec"]["replicas"])]
    assert _env(_gateway_container())["KVSERVE_WORKERS"]["value"].split(",") == expected


def test_gateway_kvmanager_address_names_the_kvmanager_service_and_port() -> None:
    host, _, port = _env(_gateway_container())["KVSERVE_KVMANAGER"]["value"].rpartition(":")
    service = _one("Service", host)
    (service_port,) = service["spec"]["ports"]
    assert int(port) == service_port["port"]
    kvmanager = _one("Deployment", "kvserve-kvmanager")
    assert service["spec"]["selector"].items() <= kvmanager["spec"]["template"]["metadata"]["labels"].items()
    (container,) = kvmanager["spec"]["template"]["spec"]["containers"]
    assert _container_port(container, service_port["targetPort"]) == KVMANAGER_PORT


def test_gateway_serves_the_workers_model() -> None:
    (worker,) = _one("StatefulSet", "kvserve-worker")["spec"]["template"]["spec"]["containers"]
    assert _env(_gateway_container())["KVSERVE_MODEL"]["value"] == _env(worker)["KVSERVE_MODEL"]["value"]


def test_gateway_api_keys_come_from_a_secret_volume() -> None:
    pod_spec = _one("Deployment", "kvserve-gateway")["spec"]["template"]["spec"]
    container = _gateway_container()
    volumes = {v["name"]: v for v in pod_spec["volumes"] if v.get("secret", {}).get("secretName") == API_KEYS_SECRET}
    assert len(volumes) == 1, f"expected one volume from the Secret {API_KEYS_SECRET}"
    (volume,) = volumes.values()
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert mount.get("readOnly") is True
    keys_file = Path(_env(container)["KVSERVE_API_KEYS_FILE"]["value"])
    assert keys_file.is_absolute()
    assert keys_file.is_relative_to(mount["mountPath"]), f"{keys_file} is not under {mount['mountPath']}"
    relative = keys_file.relative_to(mount["mountPath"])
    items = volume["secret"].get("items")
    if items is not None:
        assert {"key": "keys.json", "path": str(relative)} in items
    else:
        assert str(relative) == "keys.json"
    # Documented, not committed: the manifest says how to create it.
    assert f"kubectl create secret generic {API_KEYS_SECRET} --from-file=keys.json" in (
        K8S_DIR / "gateway-deployment.yaml").read_text()
    assert "KVSERVE_API_KEYS" not in _env(container), "keys in a plain env var would be committed"


def test_gateway_service_is_cluster_ip_on_the_grpc_port() -> None:
    pod = _one("Deployment", "kvserve-gateway")["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    port = _cluster_ip_port("kvserve-gateway", "grpc")
    assert (port["port"], port["name"], port.get("appProtocol")) == (GATEWAY_PORT, "grpc", "grpc")
    assert _container_port(container, port["targetPort"]) == GATEWAY_PORT
    assert {p["name"] for p in _one("Service", "kvserve-gateway")["spec"]["ports"]} == {"grpc", "http"}


def test_gateway_service_carries_the_openai_http_port() -> None:
    pod = _one("Deployment", "kvserve-gateway")["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    port = _cluster_ip_port("kvserve-gateway", "http")
    assert (port["port"], port.get("appProtocol")) == (GATEWAY_HTTP_PORT, "http")
    assert _container_port(container, port["targetPort"]) == GATEWAY_HTTP_PORT


# --- redis ------------------------------------------------------------------------------------------------------


def test_redis_statefulset_persists_an_append_only_file_on_a_volume_claim() -> None:
    spec = _one("StatefulSet", "kvserve-redis")["spec"]
    assert spec["replicas"] == 1
    (container,) = spec["template"]["spec"]["containers"]
    assert container["image"] == "redis:7"
    argv = container.get("command", []) + container.get("args", [])
    assert argv == ["redis-server", "--appendonly", "yes", "--appendfsync", "everysec", "--save", ""]
    (claim,) = spec["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["spec"]["resources"]["requests"]["storage"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == "/data"
    assert [p["containerPort"] for p in container["ports"]] == [REDIS_PORT]


def test_redis_probes_run_redis_cli_ping() -> None:
    (container,) = _one("StatefulSet", "kvserve-redis")["spec"]["template"]["spec"]["containers"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert set(container[probe]) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"exec"}, probe
        assert "redis-cli ping" in " ".join(container[probe]["exec"]["command"]), probe
