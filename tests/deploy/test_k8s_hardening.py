"""The k8s manifests' hardening: the NetworkPolicies select pods that exist and name ports they have, and admit
exactly the connections the services make; every pod runs as non-root with a read-only root filesystem and
writes only to its volumes; every service's requests cite a benchmark figure; the TLS Component wires the
certificates of a Secret into every service (and its cert-manager example names the Services). Schema
validation of the rendered manifests is test_k8s_schema.py's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from k8s_manifests import (
    K8S_DIR,
    ROOT,
    all_containers,
    cli_env_names,
    container,
    env,
    kustomization,
    kustomize_with_component,
    load_docs,
    of_kind,
    one,
    pod_labels,
    selected_workloads,
    workload,
    workloads,
)

TLS_DIR = K8S_DIR / "tls"
TLS_SECRET = "kvserve-tls"
TLS_ENV = {"KVSERVE_TLS_CERT": "tls.crt", "KVSERVE_TLS_KEY": "tls.key", "KVSERVE_TLS_CA": "ca.crt"}
# The gateway dials the workers by pod IP: it verifies what it dials by a name of the shared certificate.
SERVER_NAME_ENV = "KVSERVE_TLS_SERVER_NAME"
PEER_SERVER_NAME_ENV = "KVSERVE_PEER_TLS_SERVER_NAME"  # a worker verifies the workers it pulls pages from by it
CLIENT_AUTH_ENV = "KVSERVE_TLS_CLIENT_AUTH"
# The kvserve services (workload, `kvserve` subcommand, gRPC port).
SERVICES = (("kvserve-kvmanager", "kvmanager", 50051), ("kvserve-worker", "worker", 50061),
            ("kvserve-gateway", "gateway", 50050))
KVSERVE_UID = 10001
REDIS_UID = 999  # the redis image's own user
# The workloads of the redis image: the state's Redis (with Sentinel) and the KV store. Plaintext behind their
# NetworkPolicies, outside the TLS Component.
REDIS_WORKLOADS = ("kvserve-redis", "kvserve-kv-store")
ADMIN_LABELS = {"kvserve.io/admin": "true"}
# Peers that select pods which no manifest makes, on purpose: the admin pod an operator starts with
# `kubectl run ... --labels=kvserve.io/admin=true` (networkpolicies.yaml) to run `kvserve admin`.
ON_DEMAND_PEERS = [ADMIN_LABELS]
# Prometheus' pods, in another namespace: the one peer with a namespaceSelector, and for metrics only.
MONITORING_PEER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                   "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
ANYONE = "anyone"
ADMIN = "admin pod"
BENCH_CITATION = re.compile(r"bench/results/[\w.-]+\.md")


def _policies(docs: list[dict] | None = None) -> list[dict]:
    return of_kind("NetworkPolicy", docs)


def _pod_ports(workload_doc: dict) -> dict[str | int, int]:
    """Every port of the pod's (long-running) containers, by number and by name."""
    found: dict[str | int, int] = {}
    for c in workload_doc["spec"]["template"]["spec"]["containers"]:
        for p in c.get("ports", []):
            found[p["containerPort"]] = p["containerPort"]
            if "name" in p:
                found[p["name"]] = p["containerPort"]
    return found


def _selected(selector: dict, docs: list[dict] | None = None) -> list[dict]:
    assert set(selector) <= {"matchLabels"}, f"only matchLabels are used here: {selector}"
    return selected_workloads(selector.get("matchLabels", {}), docs)


def _peer_sources(peer: dict, docs: list[dict] | None = None) -> set[str]:
    """Who an in-namespace `from` peer admits, as workload names (or ADMIN)."""
    assert set(peer) == {"podSelector"}, f"an in-namespace peer is a podSelector alone: {peer}"
    labels = peer["podSelector"].get("matchLabels", {})
    if labels in ON_DEMAND_PEERS:
        return {ADMIN}
    return {w["metadata"]["name"] for w in _selected(peer["podSelector"], docs)}


def admitted(docs: list[dict] | None = None) -> set[tuple[str, str, int]]:
    """Every (source, destination workload, container port) the policies of ``docs`` (default: the base's
    resources; or a rendering) admit from inside the namespace or from anywhere (source ANYONE); the monitoring
    peer is checked on its own."""
    allowed: set[tuple[str, str, int]] = set()
    for policy in _policies(docs):
        for dest in _selected(policy["spec"]["podSelector"], docs):
            ports = _pod_ports(dest)
            for rule in policy["spec"].get("ingress", []):
                peers = [p for p in rule.get("from", []) if p != MONITORING_PEER]
                if rule.get("from") and not peers:
                    continue
                sources = set().union(*(_peer_sources(p, docs) for p in peers)) if peers else {ANYONE}
                for port in rule["ports"]:
                    allowed |= {(s, dest["metadata"]["name"], ports[port["port"]]) for s in sources}
    return allowed


# --- NetworkPolicies ----------------------------------------------------------------------------------------------


def test_every_networkpolicy_selects_existing_pods_and_names_their_ports() -> None:
    policies = _policies()
    assert policies
    for policy in policies:
        name, spec = policy["metadata"]["name"], policy["spec"]
        assert spec["policyTypes"] == ["Ingress"], f"{name}: ingress-only (networkpolicies.yaml says why)"
        if spec["podSelector"] == {}:
            continue  # the default deny: every pod of the namespace
        targets = _selected(spec["podSelector"])
        assert targets, f"{name}: its podSelector selects no pod template"
        for rule in spec["ingress"]:
            assert rule["ports"], f"{name}: a rule without ports admits every port"
            for port in rule["ports"]:
                assert port.get("protocol", "TCP") == "TCP", name
                for target in targets:
                    assert port["port"] in _pod_ports(target), (
                        f"{name}: port {port['port']!r} is no containerPort of {target['metadata']['name']}")
            for peer in rule.get("from", []):
                if "namespaceSelector" in peer:
                    assert peer == MONITORING_PEER, f"{name}: {peer}"
                    assert [p["port"] for p in rule["ports"]] == ["metrics"], f"{name}: Prometheus scrapes only"
                    continue
                labels = peer["podSelector"].get("matchLabels", {})
                assert labels, f"{name}: an empty podSelector peer admits the whole namespace"
                if labels not in ON_DEMAND_PEERS:
                    assert _selected(peer["podSelector"]), f"{name}: from {labels} selects no pod template"


def test_the_namespace_denies_ingress_by_default() -> None:
    (deny,) = [p for p in _policies() if p["spec"]["podSelector"] == {}]
    assert deny["spec"] == {"podSelector": {}, "policyTypes": ["Ingress"]}


def test_every_pod_has_its_own_policy_and_prometheus_reaches_every_metrics_port() -> None:
    for w in workloads():
        mine = [p for p in _policies() if p["spec"]["podSelector"] and w in _selected(p["spec"]["podSelector"])]
        assert len(mine) == 1, f"{w['metadata']['name']}: {len(mine)} policies of its own"
        scraped = [r for r in mine[0]["spec"]["ingress"] if MONITORING_PEER in r.get("from", [])]
        assert bool(scraped) == ("metrics" in _pod_ports(w)), w["metadata"]["name"]


def test_the_policies_admit_exactly_the_connections_the_services_make() -> None:
    """Clients reach only the gateway; only the gateway (steps) and the workers themselves (page pulls:
    ReadPages) reach the workers' gRPC port; the gateway, the workers (membership), the kvmanager pods
    (`kubectl exec ... kvserve admin`) and the admin pod, all of this namespace, reach the kvmanager; only the
    kvmanager and the Redis pods themselves (replication, Sentinel) reach Redis; only the kvmanager (deletions)
    and the workers (pages) reach the KV store."""
    gw, wk, km, rd, ks = "kvserve-gateway", "kvserve-worker", "kvserve-kvmanager", "kvserve-redis", "kvserve-kv-store"
    assert admitted() == {
        (ANYONE, gw, 50050), (ANYONE, gw, 8000),
        (gw, wk, 50061), (wk, wk, 50061),
        (gw, km, 50051), (wk, km, 50051), (km, km, 50051), (ADMIN, km, 50051),
        (km, rd, 6379), (km, rd, 26379), (rd, rd, 6379), (rd, rd, 26379),
        (km, ks, 6379), (wk, ks, 6379),
    }


def test_the_ports_the_policies_admit_are_the_ports_the_services_dial() -> None:
    """The kvmanager's address in the gateway and the workers, its Redis URL, and the KV store's URL name the
    ports admitted."""
    for name in ("kvserve-gateway", "kvserve-worker"):
        assert env(container(workload(name)))["KVSERVE_KVMANAGER"]["value"].endswith(":50051"), name
    redis_url = env(container(workload("kvserve-kvmanager"), "kvmanager"))["KVSERVE_REDIS_URL"]["value"]
    assert set(re.findall(r":(\d+)", redis_url)) == {"26379"}
    for name, command in (("kvserve-kvmanager", "kvmanager"), ("kvserve-worker", "worker")):
        store_url = env(container(workload(name), command))["KVSERVE_KV_STORE_URL"]["value"]
        assert set(re.findall(r":(\d+)", store_url)) == {"6379"}, name


def test_the_admin_pod_is_documented_and_carries_the_admitted_label() -> None:
    text = (K8S_DIR / "networkpolicies.yaml").read_text()
    (line,) = [ln for ln in text.splitlines() if "kubectl run" in ln]
    assert "--labels=" + ",".join(f"{k}={v}" for k, v in ADMIN_LABELS.items()) in line
    # No manifest makes an admin pod: the label selects nothing until an operator starts one.
    assert not [w for w in workloads() if ADMIN_LABELS.items() <= pod_labels(w).items()]


# --- security contexts --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("workload_doc", workloads(), ids=lambda w: w["metadata"]["name"])
def test_every_pod_runs_as_non_root_with_a_read_only_root(workload_doc: dict) -> None:
    name = workload_doc["metadata"]["name"]
    pod_spec = workload_doc["spec"]["template"]["spec"]
    uid = REDIS_UID if name in REDIS_WORKLOADS else KVSERVE_UID
    # A volume claim's group is checked at its top only (OnRootMismatch): a large AOF does not slow each start.
    claims = "volumeClaimTemplates" in workload_doc["spec"]
    assert pod_spec["securityContext"] == {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid,
                                           "fsGroup": uid, "seccompProfile": {"type": "RuntimeDefault"},
                                           **({"fsGroupChangePolicy": "OnRootMismatch"} if claims else {})}
    assert not pod_spec.get("hostNetwork") and not pod_spec.get("hostPID") and not pod_spec.get("hostIPC")
    for c in all_containers(workload_doc):
        assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                        "capabilities": {"drop": ["ALL"]}}, (name, c["name"])


@pytest.mark.parametrize(("workload_name", "command", "port"), SERVICES)
def test_kvserve_services_write_only_to_their_tmp_volume(workload_name: str, command: str, port: int) -> None:
    """With the root read-only, /tmp is an emptyDir; every writable mount is an emptyDir; the Secrets and the
    ConfigMap are mounted read-only."""
    pod_spec = workload(workload_name)["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    for c in all_containers(workload(workload_name)):
        for mount in c.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            if "emptyDir" not in volume:
                assert mount.get("readOnly") is True, (c["name"], mount["name"])
            else:
                assert volume["emptyDir"].get("sizeLimit"), mount["name"]
    mounts = {m["mountPath"]: m["name"] for m in container(workload(workload_name)).get("volumeMounts", [])}
    assert "emptyDir" in volumes[mounts["/tmp"]], workload_name


def test_worker_kernels_are_copied_into_the_writable_extensions_dir() -> None:
    """torch's cpp_extension locks its build directory even to load a prebuilt extension: the worker's
    TORCH_EXTENSIONS_DIR is an emptyDir, which the init container `kernels` fills from the image's own
    TORCH_EXTENSIONS_DIR (it must keep the image's value, so it sets none)."""
    w = one("StatefulSet", "kvserve-worker")
    target = env(container(w))["TORCH_EXTENSIONS_DIR"]["value"]
    kernels = container(w, "kernels")
    assert kernels["image"] == container(w)["image"]
    assert "TORCH_EXTENSIONS_DIR" not in env(kernels)
    assert f'cp -a "$src/." {target}/' in kernels["command"][-1]
    (mount,) = [m for m in kernels["volumeMounts"] if m["mountPath"] == target]
    assert {m["name"]: m["mountPath"] for m in container(w)["volumeMounts"]}[mount["name"]] == target


def test_redis_writes_only_to_its_volume_claim() -> None:
    redis = one("StatefulSet", "kvserve-redis")
    claims = {t["metadata"]["name"] for t in redis["spec"]["volumeClaimTemplates"]}
    data_dir = env(container(redis, "config"))["DATA_DIR"]["value"]
    for c in all_containers(redis):
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == data_dir]
        assert mount["name"] in claims and not mount.get("readOnly"), c["name"]
    for conf in ("redis.conf", "sentinel.conf"):
        assert re.search(r"^dir @DATA_DIR@$", (K8S_DIR / "redis" / conf).read_text(), re.M), conf


# --- requests from benchmark figures --------------------------------------------------------------------------------


@pytest.mark.parametrize(("workload_name", "container_name"), [
    ("kvserve-kvmanager", "kvmanager"), ("kvserve-worker", "worker"), ("kvserve-gateway", "gateway"),
    ("kvserve-redis", "redis"), ("kvserve-kv-store", "redis")])
def test_every_service_request_cites_a_benchmark_figure(workload_name: str, container_name: str) -> None:
    """The comment right above the service container's `resources:` names the figure and the file under
    bench/results/ it comes from, and that file exists."""
    c = container(workload(workload_name), container_name)
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    path = {"kvserve-kvmanager": "kvmanager-statefulset.yaml", "kvserve-worker": "worker-statefulset.yaml",
            "kvserve-gateway": "gateway-deployment.yaml", "kvserve-redis": "redis-statefulset.yaml",
            "kvserve-kv-store": "kv-store-statefulset.yaml"}[workload_name]
    lines = (K8S_DIR / path).read_text().splitlines()
    # The container's entry (its name, then its image), not a port or a volume of the same name.
    start = next(i for i, ln in enumerate(lines[:-1]) if ln.strip() == f"- name: {container_name}"
                 and lines[i + 1].strip().startswith("image:"))
    at = next(i for i in range(start, len(lines)) if lines[i].strip() == "resources:")
    comment = []
    for ln in reversed(lines[:at]):
        if not ln.strip().startswith("#"):
            break
        comment.insert(0, ln.strip().lstrip("# "))
    cited = BENCH_CITATION.findall(" ".join(comment))
    assert cited, f"{workload_name}: no bench/results/ figure above its requests"
    for cite in cited:
        assert (ROOT / cite).is_file(), cite


# --- the TLS Component ----------------------------------------------------------------------------------------------


def _tls_env(command: str) -> set[str]:
    extra = {"gateway": {SERVER_NAME_ENV, CLIENT_AUTH_ENV}, "worker": {PEER_SERVER_NAME_ENV}}
    return set(TLS_ENV) | extra.get(command, set())


def _with_tls(tmp_path: Path) -> list[dict]:
    return kustomize_with_component(tmp_path, "tls")


def test_tls_component_is_off_by_default_and_lists_its_patches() -> None:
    component = kustomization(TLS_DIR)
    assert component["kind"] == "Component"
    assert "components" not in kustomization()
    patched = {load_docs(TLS_DIR / p["path"])[0]["metadata"]["name"] for p in component["patches"]}
    assert patched == {name for name, _, _ in SERVICES}
    # The cert-manager example needs cert-manager's CRDs: documented, not applied with the Component.
    assert "certificate.yaml" not in str(component)


@pytest.mark.parametrize(("workload_name", "command", "port"), SERVICES)
def test_tls_component_mounts_the_secret_and_points_the_flags_at_it(tmp_path: Path, workload_name: str,
                                                                    command: str, port: int) -> None:
    rendered = _with_tls(tmp_path)
    (w,) = [d for d in rendered if d["metadata"]["name"] == workload_name and d["kind"] in ("Deployment",
                                                                                          "StatefulSet")]
    c = container(w, command)
    volumes = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
    (mount,) = [m for m in c["volumeMounts"] if volumes[m["name"]].get("secret", {}).get("secretName") == TLS_SECRET]
    assert mount["readOnly"] is True
    for name, key in TLS_ENV.items():
        assert env(c)[name]["value"] == f"{mount['mountPath']}/{key}", name
    # Everything of the base is still there (a strategic merge adds; it replaces nothing but the probes).
    base = container(workload(workload_name), command)
    assert set(env(base)) | set(_tls_env(command)) == set(env(c))
    if command == "gateway":
        (leaf,) = [d for d in load_docs(TLS_DIR / "certificate.yaml") if d["spec"].get("secretName") == TLS_SECRET]
        assert env(c)[SERVER_NAME_ENV]["value"] in leaf["spec"]["dnsNames"]
        assert env(c)[CLIENT_AUTH_ENV]["value"] == "false"  # API clients: TLS and a key, no certificate
    if command == "worker":  # workers dial each other by pod IP: the name they verify must be the certificate's
        (leaf,) = [d for d in load_docs(TLS_DIR / "certificate.yaml") if d["spec"].get("secretName") == TLS_SECRET]
        assert env(c)[PEER_SERVER_NAME_ENV]["value"] in leaf["spec"]["dnsNames"]
    # The kubelet's gRPC probes cannot speak TLS: tcpSocket on the same port instead.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "grpc" not in c[probe] and c[probe]["tcpSocket"] == {"port": port}, probe
        assert {k: v for k, v in c[probe].items() if k != "tcpSocket"} == {
            k: v for k, v in base[probe].items() if k != "grpc"}, probe


@pytest.mark.parametrize(("workload_name", "command", "port"), SERVICES)
def test_tls_component_env_names_are_flags_the_cli_reads(workload_name: str, command: str, port: int) -> None:
    """--tls-cert, --tls-key, --tls-ca of every service, and the gateway's --tls-server-name (with their
    KVSERVE_ env defaults)."""
    unknown = _tls_env(command) - cli_env_names(command)
    assert not unknown, f"`kvserve {command}` has no flag for {sorted(unknown)}"


def test_cert_manager_example_issues_the_mounted_secret_for_every_service_name() -> None:
    docs = load_docs(TLS_DIR / "certificate.yaml")
    assert {d["apiVersion"] for d in docs} == {"cert-manager.io/v1"}
    certs = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Certificate"}
    issuers = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Issuer"}
    (leaf,) = [spec for spec in certs.values() if spec["secretName"] == TLS_SECRET]
    assert not leaf.get("isCA") and {"server auth", "client auth"} <= set(leaf["usages"])
    # Issued by a CA Issuer (which writes ca.crt into the Secret) whose CA is the self-signed bootstrap's.
    ca_issuer = issuers[leaf["issuerRef"]["name"]]
    (ca,) = [spec for spec in certs.values() if spec["secretName"] == ca_issuer["ca"]["secretName"]]
    assert ca["isCA"] is True and "selfSigned" in issuers[ca["issuerRef"]["name"]]
    names = set(leaf["dnsNames"])
    for service in of_kind("Service"):
        name = service["metadata"]["name"]
        if name in REDIS_WORKLOADS:
            continue  # Redis and the KV store stay plaintext, behind their NetworkPolicies
        assert name in names, name
        if service["spec"].get("clusterIP") == "None":
            assert f"*.{name}" in names, f"the pods through the headless Service {name}"
