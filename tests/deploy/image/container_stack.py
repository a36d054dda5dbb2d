"""Runs the rendered k8s/ manifests' pods from the image with podman or docker on this host (`make image-test`):
init containers to completion, then each container with its manifest's command, args and env, as the pod's uid,
with a read-only root filesystem, its emptyDirs and volume claims as tmpfs or volumes, and its Secrets and
ConfigMaps as read-only folders. Only addresses and ports are substituted (host networking: every container
shares the host's loopback, so each port is a free one and each Service or pod name a loopback address)."""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from free_ports import free_port

READY = re.compile(r"kvserve \S+(?: \S+)? ready on ")
POD_IP = "127.0.0.1"


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def named(items: list[dict], name: str) -> dict:
    found = [i for i in items if i["name"] == name]
    assert len(found) == 1, f"expected one {name}, found {len(found)}"
    return found[0]


@dataclass
class Substitutions:
    """Service addresses (host:port as the manifests write them) and container ports, mapped to this host's."""
    hosts: dict[str, str] = field(default_factory=dict)   # "kvserve-kvmanager:50051" -> "127.0.0.1:41234"
    secrets: dict[tuple[str, str], str] = field(default_factory=dict)  # (secret, key) -> value

    def value(self, text: str, ports: dict[int, int]) -> str:
        for host, local in self.hosts.items():
            text = text.replace(host, local)
        if text.isdigit() and int(text) in ports:
            return str(ports[int(text)])
        return re.sub(r"127\.0\.0\.1:(\d+)\b", lambda m: f"127.0.0.1:{ports.get(int(m[1]), int(m[1]))}", text)


def container_env(c: dict, pod_name: str, subs: Substitutions, ports: dict[int, int]) -> dict[str, str]:
    """The container's env as the kubelet gives it: fieldRefs and secretKeyRefs resolved, $(VAR) expanded."""
    env: dict[str, str] = {}
    fields = {"metadata.name": pod_name, "status.podIP": POD_IP}
    for e in c.get("env", []):
        if "value" in e:
            raw = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), e["value"])
        elif "fieldRef" in e["valueFrom"]:
            raw = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            raw = subs.secrets.get((ref["name"], ref["key"]), f"image-test-{ref['key']}")
        env[e["name"]] = subs.value(raw, ports)
    return env


@dataclass
class Runner:
    tool: str
    image: str
    prefix: str
    started: list[str] = field(default_factory=list)
    volumes: list[str] = field(default_factory=list)

    def cli(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([self.tool, *args], capture_output=True, text=True, check=check, timeout=timeout)

    def volume(self, name: str) -> str:
        full = f"{self.prefix}-{name}"
        self.cli("volume", "create", full)
        self.volumes.append(full)
        return full

    def run_args(self, name: str, pod: dict, c: dict, env: dict[str, str], mounts: dict[str, str]) -> list[str]:
        """podman run flags for one manifest container: uid/gid, read-only root, the mounts, env, command."""
        sc = pod.get("securityContext", {})
        args = ["run", "--name", f"{self.prefix}-{name}", "--network", "host",
                "--user", f"{sc['runAsUser']}:{sc['runAsGroup']}", "--cap-drop", "ALL",
                "--security-opt", "no-new-privileges"]
        if c.get("securityContext", {}).get("readOnlyRootFilesystem"):
            args += ["--read-only", "--read-only-tmpfs=false"]
        for path, source in mounts.items():
            src, _, options = source.partition(":")  # "volume:U", "/host/dir:ro": options follow the path
            args += ["--tmpfs", f"{path}:rw,mode=1777"] if source == "tmpfs" else \
                ["-v", f"{src}:{path}" + (f":{options}" if options else "")]
        for key, value in env.items():
            args += ["-e", f"{key}={value}"]
        command = [*c.get("command", []), *c.get("args", [])]  # no command: the image's entrypoint ran args
        return [*args, "--entrypoint", command[0], self.image, *command[1:]]

    def start(self, args: list[str], name: str, ready: re.Pattern = READY, timeout: float = 600) -> str:
        """Starts a container detached and waits for its ready line (or any line matching `ready`)."""
        full = f"{self.prefix}-{name}"
        self.cli(args[0], "-d", *args[1:])
        self.started.append(full)
        return self.wait_log(full, ready, timeout)

    def wait_log(self, full: str, pattern: re.Pattern, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            logs = self.logs(full)
            if pattern.search(logs):
                return logs
            state = self.cli("inspect", "--format", "{{.State.Status}}", full).stdout.strip()
            assert state == "running", f"{full} is {state} before it was ready:\n{logs[-4000:]}"
            assert time.monotonic() < deadline, f"{full} not ready in {timeout}s:\n{logs[-4000:]}"
            time.sleep(0.2)  # polling the container's log for its ready line, with a deadline

    def logs(self, full: str) -> str:
        out = self.cli("logs", full, check=False)
        return out.stdout + out.stderr

    def stop(self, full: str, grace_s: int = 60) -> int:
        """SIGTERM (podman stop sends the image's stop signal, TERM), then the exit status."""
        self.cli("stop", "-t", str(grace_s), full, timeout=grace_s + 30)
        return int(self.cli("inspect", "--format", "{{.State.ExitCode}}", full).stdout.strip())

    def cleanup(self) -> None:
        for full in reversed(self.started):
            print(f"--- {full}\n{self.logs(full)[-3000:]}")  # shown by pytest when a test failed
            self.cli("rm", "-f", full, check=False)
        for v in self.volumes:
            self.cli("volume", "rm", "-f", v, check=False)


def mounts(pod: dict, c: dict, shared: dict[str, str], folders: dict[str, Path]) -> dict[str, str]:
    """The container's volumeMounts as run flags: a volume claim or an emptyDir that two containers of the pod
    share is a podman volume (chowned to the pod's user, as fsGroup makes it writable there), any other emptyDir
    a tmpfs, a Secret or a ConfigMap a read-only folder of its files."""
    out = {}
    for m in c.get("volumeMounts", []):
        if m["name"] in shared:
            out[m["mountPath"]] = f"{shared[m['name']]}:U"
            continue
        volume = named(pod.get("volumes", []), m["name"])
        if "emptyDir" in volume:
            out[m["mountPath"]] = "tmpfs"
        elif "secret" in volume:
            out[m["mountPath"]] = f"{folders[volume['secret']['secretName']]}:ro"
        elif "configMap" in volume:
            out[m["mountPath"]] = f"{folders[volume['configMap']['name']]}:ro"
        else:
            raise AssertionError(f"no stand-in for volume {volume}")
    return out


@dataclass
class Pods:
    """Starts the manifests' pods as containers: init containers run to completion in order, then each container
    until its ready line, as the kubelet would (and a StatefulSet, one pod after the other)."""
    runner: Runner
    subs: Substitutions
    folders: dict[str, Path]

    def run_init(self, pod: dict, pod_name: str, ports: dict[int, int], shared: dict[str, str],
                 timeout: float = 120) -> None:
        for init in pod.get("initContainers", []):
            args = self.runner.run_args(f"{pod_name}-{init['name']}", pod, init,
                                        container_env(init, pod_name, self.subs, ports),
                                        mounts(pod, init, shared, self.folders))
            done = self.runner.cli(*args, check=False, timeout=timeout)
            self.runner.started.append(f"{self.runner.prefix}-{pod_name}-{init['name']}")
            assert done.returncode == 0, f"init container {init['name']} of {pod_name}:\n{done.stdout}{done.stderr}"

    def start(self, pod: dict, pod_name: str, name: str, ports: dict[int, int], shared: dict[str, str],
              ready: re.Pattern = READY, timeout: float = 600) -> str:
        c = named(pod["containers"], name)
        ports = {**ports, 9100: free_port()}
        c = {**c, **{k: [self.subs.value(arg, ports) for arg in c[k]] for k in ("command", "args") if k in c}}
        args = self.runner.run_args(f"{pod_name}-{name}", pod, c, container_env(c, pod_name, self.subs, ports),
                                    mounts(pod, c, shared, self.folders))
        return self.runner.start(args, f"{pod_name}-{name}", ready, timeout)


def redis_hosts(count: int) -> tuple[dict[str, str], list[dict[int, int]]]:
    """Each Redis pod's DNS name and ports, on this host: pod i is 127.0.0.(i+1) (all of 127/8 is loopback, and
    a pod's own name must differ from the primary's, as init.sh decides its role by it) with ports of its own."""
    ports = [{6379: free_port(), 26379: free_port()} for _ in range(count)]
    hosts = {}
    for i, p in enumerate(ports):  # host:port first, the bare name after: replaced in this order
        hosts[f"kvserve-redis-{i}.kvserve-redis:26379"] = f"127.0.0.{i + 1}:{p[26379]}"
        hosts[f"kvserve-redis-{i}.kvserve-redis:6379"] = f"127.0.0.{i + 1}:{p[6379]}"
    hosts |= {f"kvserve-redis-{i}.kvserve-redis": f"127.0.0.{i + 1}" for i in range(count)}
    return hosts, ports


def start_redis(pods: Pods, redis: dict, redis_ports: list[dict[int, int]]) -> list[str]:
    """The Redis StatefulSet: each pod's init container `config` (init.sh picks its role), Redis and Sentinel,
    pod 0 first, as OrderedReady starts them. Returns the pods' names."""
    pod, names = pod_spec(redis), []
    for i, ports in enumerate(redis_ports):
        pod_name, shared = f"kvserve-redis-{i}", {"data": pods.runner.volume(f"kvserve-redis-{i}-data")}
        pods.run_init(pod, pod_name, ports, shared)
        pods.start(pod, pod_name, "redis", ports, shared, re.compile("Ready to accept connections"), 60)
        pods.start(pod, pod_name, "sentinel", ports, shared, re.compile(r"\+monitor master"), 60)
        names.append(pod_name)
    return names


def write_config_map(directory: Path, config_map: dict) -> Path:
    """A rendered ConfigMap's files in a folder, as the kubelet mounts them."""
    directory.mkdir(parents=True, exist_ok=True)
    for key, text in config_map["data"].items():
        (directory / key).write_text(text)
        (directory / key).chmod(0o644)
    directory.chmod(0o755)
    return directory


def write_keys(directory: Path, keys: dict[str, str]) -> Path:
    import json

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "keys.json").write_text(json.dumps(keys))
    directory.chmod(0o755)
    (directory / "keys.json").chmod(0o644)
    return directory
