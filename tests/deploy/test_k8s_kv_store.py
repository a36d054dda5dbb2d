"""The KV store in k8s/ (kv-store-statefulset.yaml): the shared KV tier's Redis of its own. The kvmanager and
every worker name the same store, which is not the state's Redis; it persists nothing and evicts by LRU above the
kvmanager's bound; the config it runs is one redis-server takes (checked on a real one)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from urllib.parse import urlparse

import pytest
import redis
from k8s_manifests import (
    K8S_DIR,
    container,
    container_port,
    env,
    kubectl_kustomize,
    of_kind,
    one,
    pod_labels,
    selected_workloads,
    workload,
)

from kvserve.common.embedded_redis import EmbeddedRedis
from kvserve.services.cli import build_parser

STORE = "kvserve-kv-store"
STATE_REDIS = "kvserve-redis"
STORE_USERS = (("kvserve-kvmanager", "kvmanager"), ("kvserve-worker", "worker"))
REDIS_OVERHEAD_BYTES = 64 << 20  # kvserve/services/cli_up_store.py: maxmemory = bound x 5/4 + 64 MiB


def _store_url(workload_name: str, command: str) -> str:
    return env(container(workload(workload_name), command))["KVSERVE_KV_STORE_URL"]["value"]


def _redis_args() -> dict[str, str]:
    """The store's redis-server options as {option: value}."""
    args = container(workload(STORE))["args"]
    assert args[0] == "redis-server" and len(args) % 2 == 1, args
    options = dict(zip(args[1::2], args[2::2], strict=True))
    assert all(o.startswith("--") for o in options), args
    return options


def _bytes(quantity: str) -> int:
    """A Kubernetes memory quantity (plain bytes, or Ki/Mi/Gi) in bytes."""
    number, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi)?", quantity).groups()
    return int(number) << {None: 0, "Ki": 10, "Mi": 20, "Gi": 30}[unit]


def _kv_store_bytes() -> int:
    value = env(container(workload("kvserve-kvmanager"), "kvmanager"))["KVSERVE_KV_STORE_BYTES"]["value"]
    return build_parser().parse_args(["kvmanager", "--kv-store-bytes", value]).kv_store_bytes


def test_the_kvmanager_and_every_worker_name_the_same_store_through_its_service() -> None:
    urls = {name: _store_url(name, command) for name, command in STORE_USERS}
    assert len(set(urls.values())) == 1, urls
    url = urlparse(urls["kvserve-worker"])
    assert url.scheme == "redis" and url.password is None
    service = one("Service", url.hostname)
    (target,) = selected_workloads(service["spec"]["selector"])
    assert target["metadata"]["name"] == STORE
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == url.port]
    assert container_port(container(target), port["targetPort"]) == 6379
    # the gateway never touches the KV bytes
    assert "KVSERVE_KV_STORE_URL" not in env(container(workload("kvserve-gateway")))


def test_the_store_is_not_the_state_redis() -> None:
    store = urlparse(_store_url("kvserve-kvmanager", "kvmanager"))
    state_url = env(container(workload("kvserve-kvmanager"), "kvmanager"))["KVSERVE_REDIS_URL"]["value"]
    state_hosts = {h.split(":")[0] for h in re.findall(r"[\w.-]+:\d+", state_url)}
    assert state_hosts and store.hostname not in state_hosts
    assert store.hostname != STATE_REDIS and not store.hostname.endswith(f".{STATE_REDIS}")
    assert one("StatefulSet", STORE)["spec"]["selector"] != one("StatefulSet", STATE_REDIS)["spec"]["selector"]


def test_the_kvmanager_bounds_the_tier_and_redis_evicts_only_above_that_bound() -> None:
    bound = _kv_store_bytes()
    assert bound > 0, "KVSERVE_KV_STORE_BYTES 0 would turn the tier off"
    options = _redis_args()
    assert options["--maxmemory-policy"] == "allkeys-lru"
    maxmemory = int(options["--maxmemory"])
    assert maxmemory == bound * 5 // 4 + REDIS_OVERHEAD_BYTES  # as `kvserve up` sizes its own store
    resources = container(workload(STORE))["resources"]
    limit = _bytes(resources["limits"]["memory"])
    assert _bytes(resources["requests"]["memory"]) == limit, "an OOM kill empties the store: request = limit"
    assert limit > maxmemory


def test_the_store_persists_nothing_and_writes_only_its_empty_dir() -> None:
    options = _redis_args()
    assert (options["--appendonly"], options["--save"]) == ("no", "")
    store = one("StatefulSet", STORE)
    assert store["spec"]["replicas"] == 1 and "volumeClaimTemplates" not in store["spec"]
    volumes = {v["name"]: v for v in store["spec"]["template"]["spec"]["volumes"]}
    (mount,) = container(store)["volumeMounts"]
    assert mount["mountPath"] == options["--dir"]
    assert volumes[mount["name"]]["emptyDir"]["sizeLimit"]


def test_only_the_kvmanager_and_the_workers_reach_the_store() -> None:
    labels = pod_labels(workload(STORE))
    (policy,) = [p for p in of_kind("NetworkPolicy")
                 if p["spec"]["podSelector"] and p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
    (rule,) = policy["spec"]["ingress"]
    sources = {w["metadata"]["name"] for peer in rule["from"]
               for w in selected_workloads(peer["podSelector"]["matchLabels"])}
    assert sources == {name for name, _ in STORE_USERS}
    assert [p["port"] for p in rule["ports"]] == ["redis"]


def test_redis_server_runs_the_stores_options(tmp_path: Path) -> None:
    """The manifest's options on a real redis-server (port and directory the test's own): it starts, and reports
    them back as set."""
    options = {k: v for k, v in _redis_args().items() if k not in ("--port", "--dir")}
    server = EmbeddedRedis(tmp_path, args=tuple(x for kv in options.items() for x in kv))
    try:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        got = {k: client.config_get(k)[k] for k in ("appendonly", "save", "maxmemory", "maxmemory-policy",
                                                     "protected-mode")}
        client.close()
    finally:
        server.stop()
    assert got == {"appendonly": "no", "save": "", "maxmemory": options["--maxmemory"],
                   "maxmemory-policy": "allkeys-lru", "protected-mode": "no"}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not on PATH")
def test_kubectl_kustomize_renders_the_store_and_both_users_name_it() -> None:
    rendered = kubectl_kustomize(K8S_DIR)
    one("StatefulSet", STORE, rendered)
    one("Service", STORE, rendered)
    one("NetworkPolicy", STORE, rendered)
    for name, command in STORE_USERS:
        (w,) = [d for d in rendered if d["metadata"]["name"] == name and d["kind"] == "StatefulSet"]
        assert env(container(w, command))["KVSERVE_KV_STORE_URL"]["value"] == f"redis://{STORE}:6379/0"
