"""The k8s manifests: every file the kustomization lists loads and hangs together, every variable is a CLI flag's,
observability is wired, and the gateway and workers run as configured. The high-availability parts (kvmanager
leader + standby, Redis Sentinel, worker membership and the HPA) are test_k8s_failover.py's."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
from pathlib import Path
from urllib.parse import urlparse

import pytest
from k8s_manifests import (
    AUTOSCALING_DIR,
    K8S_DIR,
    all_containers,
    cli_env_names,
    config_map_files,
    container,
    container_port,
    copy_of_k8s,
    env,
    env_value,
    generated_config_maps,
    generator_files,
    kubectl_kustomize,
    kustomization,
    load_docs,
    of_kind,
    one,
    ports,
    resources,
    selected_workloads,
    workload,
    workloads,
)
from opentelemetry.sdk.trace import TracerProvider

from kvserve.common.telemetry import tracing_enabled_by_env
from kvserve.services.cli import build_parser

GATEWAY_PORT = 50050
GATEWAY_HTTP_PORT = 8000
WORKER_PORT = 50061
KVMANAGER_PORT = 50051
# kvserve/services/cli_gateway.run_gateway after SIGTERM: gateway.close(drain_s=5.0), then server.stop(2.0).
GATEWAY_DRAIN_S = 5.0
GATEWAY_STOP_GRACE_S = 2.0
API_KEYS_SECRET = "kvserve-api-keys"
# The three kvserve services (workload name, `kvserve` subcommand): each serves gRPC, metrics and traces.
SERVICES = (("kvserve-kvmanager", "kvmanager"), ("kvserve-worker", "worker"), ("kvserve-gateway", "gateway"))
DASHBOARD_CONFIGMAP = "kvserve-grafana-dashboard"
DASHBOARD_FILE = "grafana-dashboard.json"
REDIS_CONFIGMAP = "kvserve-redis-config"
SECRET_LIKE_ENV = re.compile(r"TOKEN|PASSWORD|SECRET|PASSWD|CREDENTIAL", re.IGNORECASE)
# A variable Kubernetes fills from the pod (the downward API) only to be expanded into another one, $(NAME).
DOWNWARD_API_ENV = {"POD_IP": "status.podIP", "POD_NAME": "metadata.name"}
# A library's own variable that names a writable directory (the root filesystem is read-only): its value must be
# the mount path of an emptyDir of the pod. torch's cpp_extension build root, for the worker's CPU kernels.
WRITABLE_DIR_ENV = {"TORCH_EXTENSIONS_DIR"}
HASH_SUFFIX = re.compile(r"-[a-z0-9]{10}$")
needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not on PATH")


def _metrics_port(c: dict) -> int:
    return int(env_value(c, "KVSERVE_METRICS_PORT"))


def _assert_grpc_probes(c: dict, port: int) -> None:
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe in c, probe
        assert set(c[probe]) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, probe
        assert container_port(c, c[probe]["grpc"]["port"]) == port, probe
        # The servers mark the overall health service "" SERVING; a kvmanager standby does too (it is a ready
        # member) while it reports NOT_SERVING for kvserve.v1.KVManagerService: no probe asks for another name.
        assert c[probe]["grpc"].get("service", "") == "", probe


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[command]


def _flag_for_env(name: str) -> str:
    assert name.startswith("KVSERVE_"), name
    return "--" + name.removeprefix("KVSERVE_").lower().replace("_", "-")


def _kvserve_env(workload_name: str) -> dict[str, dict]:
    return {n: e for n, e in env(container(workload(workload_name))).items() if n.startswith("KVSERVE_")}


# --- the kustomization ----------------------------------------------------------------------------------------


def test_kustomization_lists_every_manifest_and_only_existing_ones() -> None:
    k = kustomization()
    assert k["kind"] == "Kustomization"
    listed = set(k["resources"])
    on_disk = {path.name for path in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    assert not list(K8S_DIR.rglob("*.yml")), "use the .yaml suffix, so the check above sees every manifest"
    # Every file a generator makes a ConfigMap of exists, and every file of k8s/redis/ is in one.
    generated = {K8S_DIR / p for g in generated_config_maps() for p in generator_files(g).values()}
    assert all(path.is_file() for path in generated), sorted(map(str, generated))
    assert set((K8S_DIR / "redis").iterdir()) <= generated


def test_autoscaling_component_lists_its_manifest_and_the_base_leaves_it_out() -> None:
    component = kustomization(AUTOSCALING_DIR)
    assert component["kind"] == "Component"
    assert component["resources"] == ["worker-hpa.yaml"]
    # The adapter's rules are config for the Prometheus Adapter, not a resource to apply.
    assert {p.name for p in AUTOSCALING_DIR.iterdir()} == {"kustomization.yaml", "worker-hpa.yaml",
                                                            "prometheus-adapter-rules.yaml"}
    assert "components" not in kustomization(), "the HPA is off by default: `kubectl scale` alone scales workers"
    assert "#   - autoscaling" in (K8S_DIR / "kustomization.yaml").read_text(), "say how to turn it on"


def _rendered_name(doc: dict) -> tuple[str, str]:
    """(kind, name) of a rendered resource, a generated ConfigMap's hash suffix dropped."""
    name = doc["metadata"]["name"]
    if doc["kind"] == "ConfigMap" and HASH_SUFFIX.search(name):
        name = HASH_SUFFIX.sub("", name)
    return doc["kind"], name


@needs_kubectl
def test_kubectl_kustomize_renders_every_resource_with_the_common_label() -> None:
    rendered = kubectl_kustomize(K8S_DIR)
    assert sorted(map(_rendered_name, rendered)) == sorted(
        [(d["kind"], d["metadata"]["name"]) for d in resources()]
        + [("ConfigMap", g["name"]) for g in generated_config_maps()])
    (dashboard,) = [d for d in rendered if (d["kind"], d["metadata"]["name"]) == ("ConfigMap", DASHBOARD_CONFIGMAP)]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"][DASHBOARD_FILE]) == json.loads((K8S_DIR / DASHBOARD_FILE).read_text())
    for doc in rendered:
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvserve", doc["metadata"]["name"]


@needs_kubectl
def test_kubectl_kustomize_points_the_pods_at_the_hashed_redis_config() -> None:
    """The Redis config's ConfigMap is renamed by its content's hash, so a changed script rolls its pods: the
    rendered volumes must name the renamed ConfigMap, and it must hold the files as they are on disk."""
    rendered = kubectl_kustomize(K8S_DIR)
    (config,) = [d for d in rendered if _rendered_name(d) == ("ConfigMap", REDIS_CONFIGMAP)]
    assert HASH_SUFFIX.search(config["metadata"]["name"])
    assert config["data"] == {key: path.read_text() for key, path in config_map_files(REDIS_CONFIGMAP).items()}
    users = {}
    for doc in rendered:
        for volume in doc.get("spec", {}).get("template", {}).get("spec", {}).get("volumes", []):
            if "configMap" in volume and volume["configMap"]["name"].startswith(REDIS_CONFIGMAP):
                users[doc["metadata"]["name"]] = volume["configMap"]["name"]
    assert users == {"kvserve-redis": config["metadata"]["name"], "kvserve-kvmanager": config["metadata"]["name"]}


@needs_kubectl
def test_kubectl_kustomize_with_the_autoscaling_component(tmp_path: Path) -> None:
    """Turned on as k8s/kustomization.yaml says (uncommenting `components`), the HPA joins, labelled like the
    rest, and the worker StatefulSet loses its replicas to it."""
    base = copy_of_k8s(tmp_path)
    text = (base / "kustomization.yaml").read_text()
    (base / "kustomization.yaml").write_text(text.replace("# components:\n#   - autoscaling",
                                                          "components:\n  - autoscaling"))
    rendered = kubectl_kustomize(base)
    (hpa,) = of_kind("HorizontalPodAutoscaler", rendered)
    assert hpa["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvserve"
    assert "replicas" not in one("StatefulSet", "kvserve-worker", rendered)["spec"]
    assert one("StatefulSet", "kvserve-kvmanager", rendered)["spec"]["replicas"] == 2
    assert len(rendered) == len(kubectl_kustomize(K8S_DIR)) + 1


def test_every_resource_has_api_version_kind_and_name() -> None:
    docs = resources()
    assert docs
    for doc in docs:
        assert doc.get("apiVersion") and doc.get("kind"), doc
        assert doc.get("metadata", {}).get("name"), doc
    names = [(doc["kind"], doc["metadata"]["name"]) for doc in docs]
    assert len(names) == len(set(names)), "duplicate kind/name"


def test_every_workload_selects_its_own_pods_and_has_resources() -> None:
    for w in workloads():
        spec = w["spec"]
        assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
        for c in all_containers(w):
            assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"], c["name"]
            assert c["resources"]["limits"]["memory"], c["name"]


def test_every_service_selects_exactly_one_workload_and_targets_its_container_ports() -> None:
    services = of_kind("Service")
    assert services
    for service in services:
        name = service["metadata"]["name"]
        matched = selected_workloads(service["spec"]["selector"])
        assert len(matched) == 1, f"Service {name} selects {len(matched)} workloads"
        containers = matched[0]["spec"]["template"]["spec"]["containers"]
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            hits = [c for c in containers if any(target in (p["containerPort"], p.get("name")) for p in c["ports"])]
            assert len(hits) == 1, f"Service {name} targetPort {target!r}"
            assert container_port(hits[0], target) == port["port"]
            # A port name says what it carries: the same name on the Service and on the container it reaches.
            assert {p["name"] for p in hits[0]["ports"] if p["containerPort"] == port["port"]} == {port["name"]}


def test_every_configmap_volume_is_made_by_a_generator() -> None:
    generated = {g["name"] for g in generated_config_maps()}
    for w in workloads():
        for volume in w["spec"]["template"]["spec"].get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in generated, (w["metadata"]["name"], volume["name"])


def test_no_secret_values_are_committed() -> None:
    for path in K8S_DIR.rglob("*.yaml"):
        for doc in load_docs(path):
            assert doc.get("kind") != "Secret", f"{path.name} commits a Secret"
            assert doc.get("kind") != "Kustomization" or not doc.get("secretGenerator"), path.name
    for w in workloads():
        for c in all_containers(w):
            joined = " ".join(c.get("command", []) + c.get("args", []))
            assert "--admin-token" not in joined and "--requirepass" not in joined, c["name"]
            for name, e in env(c).items():
                if SECRET_LIKE_ENV.search(name):
                    assert "value" not in e, f"{c['name']}: {name} has a literal value"
                    assert "secretKeyRef" in e["valueFrom"], name
                if "value" in e and e["value"].startswith("redis"):
                    assert urlparse(e["value"]).password is None, f"{name}: a password in a Redis URL"
    for path in (K8S_DIR / "redis").iterdir():
        assert not re.search(r"^\s*(requirepass|masterauth|sentinel auth-pass)\b", path.read_text(), re.M), path


# --- environment variables are real CLI flags -------------------------------------------------------------------


@pytest.mark.parametrize(("workload_name", "command"), SERVICES)
def test_env_names_are_flags_the_cli_reads(workload_name: str, command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each KVSERVE_X of the container is a --x flag of its subcommand, and setting the variable gives the
    same parsed value as passing the flag (so the flag really falls back to that variable)."""
    c = container(workload(workload_name))
    assert c["command"][:2] == ["kvserve", command]
    kvserve_env = _kvserve_env(workload_name)
    assert kvserve_env
    for name in [n for n in os.environ if n.startswith("KVSERVE_")]:
        monkeypatch.delenv(name)
    parser = build_parser()
    actions = {s: a for a in _subparser(parser, command)._actions + parser._actions for s in a.option_strings}
    for name, spec in kvserve_env.items():
        flag = _flag_for_env(name)
        assert flag in actions, f"{workload_name}: {name} has no {flag} flag in `kvserve {command}`"
        value = spec.get("value", f"from-{name.lower()}")  # valueFrom: any string stands in
        by_flag = getattr(build_parser().parse_args([command, flag, value]), actions[flag].dest)
        with monkeypatch.context() as m:
            m.setenv(name, value)
            by_env = getattr(build_parser().parse_args([command]), actions[flag].dest)
        assert by_env == by_flag, f"{name}={value!r} parses to {by_env!r}, {flag} {value!r} to {by_flag!r}"


@pytest.mark.parametrize(("workload_name", "command"), SERVICES)
def test_env_names_are_env_defaults_in_the_cli_source(workload_name: str, command: str) -> None:
    """The same from the source: every KVSERVE_X a container sets is an ``_env("x")``/``env_default("x")`` of its
    subcommand's CLI module (kvserve/services/cli_<command>.py, or cli_flags.py's shared flags); a manifest and the
    flags cannot drift apart, whichever of the two is edited."""
    unknown = set(_kvserve_env(workload_name)) - cli_env_names(command)
    assert not unknown, f"{workload_name} sets {sorted(unknown)}, which no flag of `kvserve {command}` reads"


def test_cli_source_parser_finds_the_flags_it_should() -> None:
    """cli_env_names reads what it claims to: known flags of each subcommand, the shared --metrics-port, and a
    variable read outside argparse (the gateway's KVSERVE_API_KEYS)."""
    assert {"KVSERVE_REDIS_URL", "KVSERVE_ADMIN_TOKEN", "KVSERVE_METRICS_PORT"} <= cli_env_names("kvmanager")
    assert {"KVSERVE_WORKER_ID", "KVSERVE_KV_CACHE_BYTES", "KVSERVE_MODEL"} <= cli_env_names("worker")
    assert {"KVSERVE_KVMANAGER", "KVSERVE_API_KEYS_FILE", "KVSERVE_API_KEYS"} <= cli_env_names("gateway")
    assert "KVSERVE_REDIS_URL" not in cli_env_names("gateway")


@pytest.mark.parametrize(("workload_name", "command"), SERVICES)
def test_service_env_is_kvserve_flags_opentelemetry_or_the_downward_api(workload_name: str, command: str) -> None:
    """test_env_names_are_flags_the_cli_reads checks KVSERVE_* only; anything else must be OTEL_* (read by the
    OpenTelemetry SDK), a downward-API value that a later variable expands as $(NAME), or a library's directory
    variable that names an emptyDir of the pod, so a misspelt prefix cannot slip past both."""
    c = container(workload(workload_name))
    names = [e["name"] for e in c["env"]]
    pod_spec = workload(workload_name)["spec"]["template"]["spec"]
    empty_dirs = {v["name"] for v in pod_spec.get("volumes", []) if "emptyDir" in v}
    for i, name in enumerate(names):
        if name.startswith(("KVSERVE_", "OTEL_")):
            continue
        if name in WRITABLE_DIR_ENV:
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            assert mounts.get(env(c)[name]["value"]) in empty_dirs, f"{workload_name}: {name} is no emptyDir mount"
            continue
        assert name in DOWNWARD_API_ENV, f"{workload_name}: {name}"
        assert env(c)[name]["valueFrom"] == {"fieldRef": {"fieldPath": DOWNWARD_API_ENV[name]}}, name
        # Kubernetes expands $(NAME) only from variables defined earlier in the list.
        later = [env(c)[n].get("value", "") for n in names[i + 1:]]
        assert any(f"$({name})" in value for value in later), f"{workload_name}: {name} is never expanded"
    for i, name in enumerate(names):
        for ref in re.findall(r"\$\(([A-Z_]+)\)", env(c)[name].get("value", "")):
            assert ref in names[:i], f"{workload_name}: {name} expands $({ref}), not defined before it"


# --- observability: metrics and traces ---------------------------------------------------------------------------


@pytest.mark.parametrize(("workload_name", "command"), SERVICES)
def test_service_serves_metrics_on_its_named_port_and_the_pod_is_annotated_for_scraping(workload_name: str,
                                                                                       command: str) -> None:
    """KVSERVE_METRICS_PORT (--metrics-port) is the container's `metrics` port, and the pod template's
    prometheus.io/* annotations point a kubernetes_sd scrape at that same port and path."""
    pod = workload(workload_name)["spec"]["template"]
    c = container(workload(workload_name))
    port = _metrics_port(c)
    assert container_port(c, "metrics") == port
    assert port != container_port(c, "grpc")
    # The metrics server binds the service's --host: it must listen on the pod IP, not loopback.
    argv = c["command"]
    assert argv[:2] == ["kvserve", command] and argv[argv.index("--host") + 1] == "0.0.0.0"
    annotations = pod["metadata"].get("annotations", {})
    assert annotations.get("prometheus.io/scrape") == "true"
    # Annotation values are strings: an unquoted number would not even be accepted by the API server.
    assert annotations.get("prometheus.io/port") == str(port)
    assert annotations.get("prometheus.io/path") == "/metrics"


@pytest.mark.parametrize(("workload_name", "command"), SERVICES)
def test_service_exports_traces_over_otlp_with_a_sampler(workload_name: str, command: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The container's OTEL_* environment turns tracing on (kvserve/common/telemetry.py) and names a sampler the
    OpenTelemetry SDK recognises (an unknown name or a bad ratio only logs a warning and samples everything)."""
    otel = {n: e["value"] for n, e in env(container(workload(workload_name))).items() if n.startswith("OTEL_")}
    endpoint = urlparse(otel["OTEL_EXPORTER_OTLP_ENDPOINT"])
    assert endpoint.scheme in ("http", "https") and endpoint.hostname and endpoint.port, endpoint.geturl()
    sampler = otel["OTEL_TRACES_SAMPLER"]
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    for name, value in otel.items():
        monkeypatch.setenv(name, value)
    assert tracing_enabled_by_env()
    description = TracerProvider().sampler.get_description()
    if sampler.startswith("parentbased_"):
        assert description.startswith("ParentBased{"), description
    if sampler.endswith("traceidratio"):
        ratio = float(otel["OTEL_TRACES_SAMPLER_ARG"])
        assert 0 < ratio <= 1, ratio
        assert f"TraceIdRatioBased{{{ratio}}}" in description, description
    else:
        assert sampler in ("always_on", "always_off", "parentbased_always_on", "parentbased_always_off"), sampler


def test_services_agree_on_the_collector_and_the_gateway_alone_samples() -> None:
    """One collector; the gateway decides which requests are traced (a ratio), and the kvmanager and workers,
    which only ever see the traceparents of sampled requests, keep all of them."""
    envs = {w: env(container(workload(w))) for w, _ in SERVICES}
    assert len({e["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] for e in envs.values()}) == 1
    for workload_name, e in envs.items():
        sampler = e["OTEL_TRACES_SAMPLER"]["value"]
        if workload_name == "kvserve-gateway":
            assert sampler == "parentbased_traceidratio" and 0 < float(e["OTEL_TRACES_SAMPLER_ARG"]["value"]) <= 1
        else:
            assert sampler == "parentbased_always_on" and "OTEL_TRACES_SAMPLER_ARG" not in e, workload_name


def test_kustomization_ships_the_grafana_dashboard_to_the_grafana_sidecar() -> None:
    """A configMapGenerator, not a resource: it makes the ConfigMap from grafana-dashboard.json on disk, with
    the label the Grafana sidecar looks for, under a fixed name."""
    (generator,) = [g for g in generated_config_maps() if g["name"] == DASHBOARD_CONFIGMAP]
    files = generator_files(generator)
    assert files == {DASHBOARD_FILE: DASHBOARD_FILE}
    dashboard = json.loads((K8S_DIR / files[DASHBOARD_FILE]).read_text())
    assert dashboard["panels"], "the dashboard has no panels"
    options = generator["options"]
    assert options["labels"]["grafana_dashboard"] == "1"
    assert options["disableNameSuffixHash"] is True
    assert DASHBOARD_FILE not in kustomization()["resources"]


# --- the services' containers -------------------------------------------------------------------------------------


def test_worker_statefulset_runs_the_worker_with_grpc_probes() -> None:
    c = container(one("StatefulSet", "kvserve-worker"))
    assert c["image"] == "kvserve:latest"
    assert c["command"] == ["kvserve", "worker", "--host", "0.0.0.0", "--port", str(WORKER_PORT)]
    assert ports(c) == {"grpc": WORKER_PORT, "metrics": _metrics_port(c)}
    assert {"KVSERVE_MODEL", "KVSERVE_KV_CACHE_BYTES"} <= set(env(c))
    _assert_grpc_probes(c, WORKER_PORT)


def test_kvmanager_runs_the_kvmanager_with_grpc_probes() -> None:
    c = container(one("StatefulSet", "kvserve-kvmanager"), "kvmanager")
    assert c["image"] == "kvserve:latest"
    assert c["command"] == ["kvserve", "kvmanager", "--host", "0.0.0.0", "--port", str(KVMANAGER_PORT)]
    assert ports(c) == {"grpc": KVMANAGER_PORT, "metrics": _metrics_port(c)}
    _assert_grpc_probes(c, KVMANAGER_PORT)


def test_kvmanager_admin_token_comes_from_the_secret() -> None:
    c = container(one("StatefulSet", "kvserve-kvmanager"), "kvmanager")
    assert env(c)["KVSERVE_ADMIN_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "kvserve-admin", "key": "token"}}
    # Documented, not committed: the manifest says how to create it.
    assert "kubectl create secret generic kvserve-admin --from-literal=token=" in (
        K8S_DIR / "kvmanager-statefulset.yaml").read_text()


def test_gateway_deployment_runs_the_gateway_with_grpc_probes() -> None:
    c = container(one("Deployment", "kvserve-gateway"))
    assert c["image"] == "kvserve:latest"
    assert c["command"] == ["kvserve", "gateway", "--host", "0.0.0.0", "--port", str(GATEWAY_PORT),
                            "--http-port", str(GATEWAY_HTTP_PORT)]
    assert ports(c) == {"grpc": GATEWAY_PORT, "http": GATEWAY_HTTP_PORT, "metrics": _metrics_port(c)}
    _assert_grpc_probes(c, GATEWAY_PORT)


def test_gateway_is_a_single_replica_never_two_at_once() -> None:
    """One scheduling loop per worker: two gateways would each batch for every worker as if alone. One replica,
    replaced by Recreate (never two at once during a rollout), and no autoscaler on it."""
    spec = one("Deployment", "kvserve-gateway")["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    hpas = of_kind("HorizontalPodAutoscaler", resources()) + of_kind("HorizontalPodAutoscaler",
                                                                      resources(AUTOSCALING_DIR))
    assert not [h for h in hpas if h["spec"]["scaleTargetRef"]["name"] == "kvserve-gateway"]


def test_gateway_has_time_to_drain_after_sigterm() -> None:
    pod_spec = one("Deployment", "kvserve-gateway")["spec"]["template"]["spec"]
    assert pod_spec.get("terminationGracePeriodSeconds", 30) > GATEWAY_DRAIN_S + GATEWAY_STOP_GRACE_S


def test_gateway_serves_the_workers_model() -> None:
    worker = container(one("StatefulSet", "kvserve-worker"))
    gateway = container(one("Deployment", "kvserve-gateway"))
    assert env_value(gateway, "KVSERVE_MODEL") == env_value(worker, "KVSERVE_MODEL")


def test_gateway_api_keys_come_from_a_secret_volume() -> None:
    pod_spec = one("Deployment", "kvserve-gateway")["spec"]["template"]["spec"]
    c = container(one("Deployment", "kvserve-gateway"))
    volumes = {v["name"]: v for v in pod_spec["volumes"] if v.get("secret", {}).get("secretName") == API_KEYS_SECRET}
    assert len(volumes) == 1, f"expected one volume from the Secret {API_KEYS_SECRET}"
    (volume,) = volumes.values()
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == volume["name"]]
    assert mount.get("readOnly") is True
    keys_file = Path(env_value(c, "KVSERVE_API_KEYS_FILE"))
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
    assert "KVSERVE_API_KEYS" not in env(c), "keys in a plain env var would be committed"


def _cluster_ip_port(name: str, port_name: str) -> dict:
    """The port named ``port_name`` of Service ``name``: a ClusterIP (not headless) in front of Deployment
    ``name``'s pods."""
    pod = one("Deployment", name)["spec"]["template"]
    service = one("Service", name)
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert service["spec"].get("clusterIP") != "None"
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == port_name]
    return port


def test_gateway_service_is_cluster_ip_on_the_grpc_port() -> None:
    c = container(one("Deployment", "kvserve-gateway"))
    port = _cluster_ip_port("kvserve-gateway", "grpc")
    assert (port["port"], port["name"], port.get("appProtocol")) == (GATEWAY_PORT, "grpc", "grpc")
    assert container_port(c, port["targetPort"]) == GATEWAY_PORT
    assert {p["name"] for p in one("Service", "kvserve-gateway")["spec"]["ports"]} == {"grpc", "http"}


def test_gateway_service_carries_the_openai_http_port() -> None:
    c = container(one("Deployment", "kvserve-gateway"))
    port = _cluster_ip_port("kvserve-gateway", "http")
    assert (port["port"], port.get("appProtocol")) == (GATEWAY_HTTP_PORT, "http")
    assert container_port(c, port["targetPort"]) == GATEWAY_HTTP_PORT
