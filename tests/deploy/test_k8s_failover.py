"""The k8s manifests' high availability: a kvmanager leader + standby with a PodDisruptionBudget, workers that join
the membership themselves (`kubectl scale` alone) with an HPA example, and Redis with Sentinel, every piece named
by stable pod DNS names. test_k8s_redis_scripts.py runs the Redis scripts themselves against real servers."""

from __future__ import annotations

import re
from urllib.parse import urlparse

import yaml
from k8s_manifests import (
    AUTOSCALING_DIR,
    K8S_DIR,
    config_map_files,
    container,
    container_port,
    env,
    env_value,
    kustomization,
    of_kind,
    one,
    pod_dns_names,
    pod_labels,
    resources,
    selected_workloads,
)

from kvserve.common.metrics import GATEWAY_METRICS

KVMANAGER_PORT = 50051
WORKER_PORT = 50061
REDIS_PORT = 6379
SENTINEL_PORT = 26379
REDIS_CONFIGMAP = "kvserve-redis-config"
MANAGER_SERVICE = "kvserve.v1.KVManagerService"


def _kvmanager() -> dict:
    return one("StatefulSet", "kvserve-kvmanager")


def _headless(service_name: str) -> dict:
    service = one("Service", service_name)
    assert service["spec"].get("clusterIP") == "None", f"{service_name}: pod DNS names need a headless Service"
    return service


def _anti_affinity_labels(pod_spec: dict) -> list[dict]:
    terms = pod_spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    return [(t["podAffinityTerm"]["topologyKey"], t["podAffinityTerm"]["labelSelector"]["matchLabels"]) for t in terms]


def _pdb_for(workload: dict) -> dict:
    """The one PodDisruptionBudget whose selector picks ``workload``'s pods, and no other workload's."""
    pdbs = [p for p in of_kind("PodDisruptionBudget")
            if p["spec"]["selector"]["matchLabels"].items() <= pod_labels(workload).items()]
    assert len(pdbs) == 1, f"{workload['metadata']['name']}: {len(pdbs)} PodDisruptionBudgets"
    assert selected_workloads(pdbs[0]["spec"]["selector"]["matchLabels"]) == [workload]
    return pdbs[0]


def _advertises_pod_ip(c: dict, port: int) -> None:
    assert env(c)["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env_value(c, "KVSERVE_ADVERTISE_ADDRESS") == f"$(POD_IP):{port}"
    assert container_port(c, "grpc") == port


# --- kvmanager: leader + standby ----------------------------------------------------------------------------------


def test_kvmanager_runs_a_leader_and_a_standby_with_stable_names() -> None:
    """Two replicas of a StatefulSet (stable pod names for the clients' address list), started in parallel, and
    nothing left of the single-replica setup (no Deployment, no Recreate)."""
    assert [d["kind"] for d in resources() if d["metadata"]["name"] == "kvserve-kvmanager"
            and d["kind"] in ("Deployment", "StatefulSet")] == ["StatefulSet"]
    spec = _kvmanager()["spec"]
    assert spec["replicas"] == 2
    assert spec["podManagementPolicy"] == "Parallel"
    assert spec.get("updateStrategy", {"type": "RollingUpdate"})["type"] == "RollingUpdate"
    text = (K8S_DIR / "kvmanager-statefulset.yaml").read_text()
    assert "never scale it up" not in text.lower() and "Recreate" not in text


def test_kvmanager_pdb_keeps_one_pod_through_voluntary_disruptions() -> None:
    pdb = _pdb_for(_kvmanager())
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"] == {"minAvailable": 1, "selector": pdb["spec"]["selector"]}


def test_kvmanager_readiness_is_overall_health_so_the_standby_counts() -> None:
    """Both pods are Ready once they serve, the standby too: a readiness probe on kvserve.v1.KVManagerService
    (NOT_SERVING on a standby) would leave the PDB counting the leader alone (never evictable) and stall every
    rollout (the new standby never Ready). Clients find the leader by its answers instead."""
    c = container(_kvmanager(), "kvmanager")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"].get("service", "") == "", probe
    assert MANAGER_SERVICE in (K8S_DIR / "kvmanager-statefulset.yaml").read_text(), "say why not"


def test_kvmanager_pods_prefer_different_nodes() -> None:
    pod = _kvmanager()["spec"]["template"]
    assert ("kubernetes.io/hostname", {"app.kubernetes.io/name": "kvserve-kvmanager"}) in _anti_affinity_labels(
        pod["spec"])
    assert pod["metadata"]["labels"]["app.kubernetes.io/name"] == "kvserve-kvmanager"


def test_kvmanager_service_is_headless_and_names_every_pod_even_before_ready() -> None:
    service = _headless(_kvmanager()["spec"]["serviceName"])
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= pod_labels(_kvmanager()).items()
    (port,) = service["spec"]["ports"]
    assert port["port"] == KVMANAGER_PORT
    assert container_port(container(_kvmanager(), "kvmanager"), port["targetPort"]) == KVMANAGER_PORT


def test_kvmanager_settings_for_the_lease_workers_and_its_address() -> None:
    c = container(_kvmanager(), "kvmanager")
    assert float(env_value(c, "KVSERVE_LEADER_LEASE")) > 0
    assert float(env_value(c, "KVSERVE_WORKER_TIMEOUT")) > 0
    assert int(env_value(c, "KVSERVE_REDIS_WAIT_REPLICAS")) >= 1
    _advertises_pod_ip(c, KVMANAGER_PORT)


def test_gateway_and_workers_reach_every_kvmanager_pod() -> None:
    """KVSERVE_KVMANAGER is the kvmanager's headless Service as one dns:/// target (re-resolved by gRPC when a
    pod comes back with a new IP, which a list of names resolved once would miss), the same for both clients."""
    gateway = container(one("Deployment", "kvserve-gateway"))
    worker = container(one("StatefulSet", "kvserve-worker"))
    statefulset = _kvmanager()
    (port,) = _headless(statefulset["spec"]["serviceName"])["spec"]["ports"]
    assert env_value(gateway, "KVSERVE_KVMANAGER") == f"dns:///{statefulset['spec']['serviceName']}:{port['port']}"
    assert env_value(worker, "KVSERVE_KVMANAGER") == env_value(gateway, "KVSERVE_KVMANAGER")


def test_worker_and_gateway_agree_with_the_kvmanager_on_the_worker_timeout() -> None:
    gateway = container(one("Deployment", "kvserve-gateway"))
    kvmanager = container(_kvmanager(), "kvmanager")
    assert env_value(gateway, "KVSERVE_WORKER_TIMEOUT") == env_value(kvmanager, "KVSERVE_WORKER_TIMEOUT")


# --- workers: membership, `kubectl scale`, the HPA ------------------------------------------------------------------


def test_gateway_has_no_worker_list_and_follows_the_membership() -> None:
    gateway = container(one("Deployment", "kvserve-gateway"))
    assert "KVSERVE_WORKERS" not in env(gateway)
    assert "--workers" not in gateway["command"]


def test_workers_join_the_kvmanager_at_their_pod_ip_and_drain_within_the_grace_period() -> None:
    statefulset = one("StatefulSet", "kvserve-worker")
    c = container(statefulset)
    _advertises_pod_ip(c, WORKER_PORT)
    assert env(c)["KVSERVE_WORKER_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    drain_s = float(env_value(c, "KVSERVE_DRAIN_TIMEOUT"))
    # The drain, then leaving the membership and the server's stop, before the kubelet's SIGKILL.
    assert statefulset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= drain_s + 10
    assert "kubectl scale statefulset/kvserve-worker --replicas=N" in (K8S_DIR / "worker-statefulset.yaml").read_text()


def test_worker_statefulset_gives_each_pod_a_stable_name() -> None:
    """Stable pod names = stable worker ids (a restarted worker re-registers under its old id with a new epoch,
    so the kvmanager drops the old pool), and pod DNS names through the governing headless Service."""
    assert [d["kind"] for d in resources() if d["metadata"]["name"] == "kvserve-worker"
            and d["kind"] in ("Deployment", "StatefulSet")] == ["StatefulSet"]
    spec = one("StatefulSet", "kvserve-worker")["spec"]
    service = _headless(spec["serviceName"])
    assert service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    assert port["port"] == WORKER_PORT
    assert spec["podManagementPolicy"] == "Parallel"
    assert spec["replicas"] == 2


def _adapter_rule() -> dict:
    (rule,) = yaml.safe_load((AUTOSCALING_DIR / "prometheus-adapter-rules.yaml").read_text())["externalRules"]
    return rule


def test_hpa_scales_the_worker_statefulset_on_a_kvserve_metric() -> None:
    (hpa,) = of_kind("HorizontalPodAutoscaler", resources(AUTOSCALING_DIR))
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    statefulset = one("StatefulSet", target["name"])
    assert (target["apiVersion"], target["kind"]) == (statefulset["apiVersion"], "StatefulSet")
    assert target["name"] == "kvserve-worker"
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["target"]["type"] == "AverageValue"  # per worker: the sum / the replicas
    assert float(metric["external"]["target"]["averageValue"]) > 0
    # The Prometheus Adapter rule serves that name from a series the gateway really exports.
    rule = _adapter_rule()
    assert rule["name"]["as"] == metric["external"]["metric"]["name"]
    (series,) = re.findall(r'__name__="([^"]+)"', rule["seriesQuery"])
    assert series in GATEWAY_METRICS
    assert re.fullmatch(rule["name"]["matches"], series)
    assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}
    assert "<<.Series>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]


def test_autoscaling_component_hands_the_replicas_to_the_hpa() -> None:
    (patch,) = kustomization(AUTOSCALING_DIR)["patches"]
    assert patch["target"]["kind"] == "StatefulSet" and patch["target"]["name"] == "kvserve-worker"
    assert yaml.safe_load(patch["patch"]) == [{"op": "remove", "path": "/spec/replicas"}]


# --- Redis with Sentinel ------------------------------------------------------------------------------------------


def _redis() -> dict:
    return one("StatefulSet", "kvserve-redis")


def _redis_dns_names() -> list[str]:
    return pod_dns_names(_redis())


def _template(name: str) -> str:
    return config_map_files(REDIS_CONFIGMAP)[name].read_text()


def _directives(text: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_redis_runs_three_pods_of_redis_and_sentinel_on_one_volume() -> None:
    statefulset = _redis()
    spec = statefulset["spec"]
    assert spec["replicas"] == 3
    assert spec.get("podManagementPolicy", "OrderedReady") == "OrderedReady"  # pod 0 up before its replicas
    redis, sentinel = (container(statefulset, n) for n in ("redis", "sentinel"))
    for c in (redis, sentinel):
        assert c["image"] == "redis:7"
        assert {m["name"]: m["mountPath"] for m in c["volumeMounts"]} == {"data": "/data"}
    assert redis.get("args") == ["redis-server", "/data/redis.conf"] and "command" not in redis
    assert sentinel.get("args") == ["redis-server", "/data/sentinel.conf", "--sentinel"] and "command" not in sentinel
    assert (container_port(redis, "redis"), container_port(sentinel, "sentinel")) == (REDIS_PORT, SENTINEL_PORT)
    (claim,) = spec["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data" and claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert ("kubernetes.io/hostname", {"app.kubernetes.io/name": "kvserve-redis"}) in _anti_affinity_labels(
        spec["template"]["spec"])
    assert _pdb_for(statefulset)["spec"]["maxUnavailable"] == 1


def test_redis_probes_run_redis_cli_ping() -> None:
    for name, port_flag in (("redis", ""), ("sentinel", f"-p {SENTINEL_PORT} ")):
        c = container(_redis(), name)
        for probe in ("readinessProbe", "livenessProbe"):
            assert set(c[probe]) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"exec"}, probe
            assert f"redis-cli {port_flag}ping" in " ".join(c[probe]["exec"]["command"]), (name, probe)


def test_redis_service_names_every_pod_and_both_ports_before_ready() -> None:
    service = _headless(_redis()["spec"]["serviceName"])
    assert service["spec"]["publishNotReadyAddresses"] is True  # a Sentinel resolves every name at start
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"redis": REDIS_PORT,
                                                                        "sentinel": SENTINEL_PORT}


def test_redis_config_init_names_the_pods_by_their_dns_names() -> None:
    """init.sh's environment: this pod, pod 0 as the first primary, every Sentinel, all by DNS name."""
    init = container(_redis(), "config")
    assert init["command"] == ["sh", "/etc/redis-config/init.sh"]
    e = {name: spec.get("value") for name, spec in env(init).items()}
    service = _redis()["spec"]["serviceName"]
    assert env(init)["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert e["POD_HOST"] == f"$(POD_NAME).{service}"
    assert e["PRIMARY_AT_START"] == _redis_dns_names()[0]
    assert e["SENTINELS"].split(",") == [f"{name}:{SENTINEL_PORT}" for name in _redis_dns_names()]
    assert (int(e["REDIS_PORT"]), int(e["SENTINEL_PORT"])) == (REDIS_PORT, SENTINEL_PORT)
    assert e["DATA_DIR"] == "/data"
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    assert mounts == {"config": e["CONFIG_DIR"], "data": "/data"}
    volumes = {v["name"]: v for v in _redis()["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == REDIS_CONFIGMAP
    # Every variable init.sh reads is set; nothing it does not read.
    read = set(re.findall(r"\$\{?([A-Z_]+)", _template("init.sh")))
    assert read == set(e) - {"POD_NAME"}, read ^ set(e)


def test_sentinel_config_monitors_and_announces_by_name() -> None:
    directives = _directives(_template("sentinel.conf"))
    names = [d[:3] for d in directives]
    assert ["sentinel", "resolve-hostnames", "yes"] in names and ["sentinel", "announce-hostnames", "yes"] in names
    assert ["sentinel", "announce-ip", "@POD_HOST@"] in directives
    (monitor,) = [d for d in directives if d[:2] == ["sentinel", "monitor"]]
    assert monitor == ["sentinel", "monitor", "@MASTER_NAME@", "@PRIMARY@", "@PRIMARY_PORT@", "2"]
    # resolve-hostnames must come before the monitor line, which resolves its host as it is read.
    assert names.index(["sentinel", "resolve-hostnames", "yes"]) < directives.index(monitor)
    assert ["port", "@SENTINEL_PORT@"] in directives


def test_redis_config_persists_to_an_aof_and_announces_the_replica_by_name() -> None:
    directives = _directives(_template("redis.conf"))
    for expected in (["appendonly", "yes"], ["appendfsync", "everysec"], ["save", '""'], ["port", "@REDIS_PORT@"],
                     ["dir", "@DATA_DIR@"], ["replica-announce-ip", "@POD_HOST@"], ["protected-mode", "no"]):
        assert expected in directives, expected
    assert not [d for d in directives if d[0] in ("replicaof", "slaveof")], "init.sh adds replicaof to replicas"


def test_kvmanager_redis_url_lists_every_sentinel_and_names_the_primary() -> None:
    """redis+sentinel://H:P[,H:P...]/SERVICE_NAME/DB: every Redis pod's Sentinel by DNS name, and the Sentinels'
    name for the primary; the init container waits on the same URL."""
    urls = {c["name"]: env_value(c, "KVSERVE_REDIS_URL") for c in
            (container(_kvmanager(), "kvmanager"), container(_kvmanager(), "wait-for-redis"))}
    assert len(set(urls.values())) == 1, f"the containers disagree on the Redis URL: {urls}"
    url = urlparse(urls["kvmanager"])
    assert url.scheme == "redis+sentinel"
    assert url.netloc.split(",") == [f"{name}:{SENTINEL_PORT}" for name in _redis_dns_names()]
    service_name, db = url.path.strip("/").split("/")
    assert service_name == env_value(container(_redis(), "config"), "MASTER_NAME")
    assert db == "0"


def test_kvmanager_waits_for_a_primary_with_the_replicas_it_waits_for() -> None:
    init = container(_kvmanager(), "wait-for-redis")
    assert init["image"] == "redis:7"
    assert init["command"] == ["sh", "/etc/redis-config/wait-for-primary.sh"]
    assert env_value(init, "KVSERVE_REDIS_WAIT_REPLICAS") == env_value(container(_kvmanager(), "kvmanager"),
                                                                       "KVSERVE_REDIS_WAIT_REPLICAS")
    (mount,) = init["volumeMounts"]
    volumes = {v["name"]: v for v in _kvmanager()["spec"]["template"]["spec"]["volumes"]}
    assert volumes[mount["name"]]["configMap"]["name"] == REDIS_CONFIGMAP
    assert mount["mountPath"] == "/etc/redis-config"
