"""Resident memory of each kvserve service as the k8s manifests run it, for their memory requests: the
kvmanager (no Redis: its own state is what grows, see snapshots-*.md), one worker with the manifests' 1 GiB KV
pool (KVSERVE_KV_CACHE_BYTES) on the default model, and the gateway, each a real process started by the CLI,
measured once it reports SERVING (gRPC health) and has settled, idle.

    python bench/service_rss.py [--out bench/results/rss-DATE.md]

The worker runs the reference attention backend, so that no CPU-kernel build (minutes, the same memory once
loaded) precedes the measurement. VmRSS and VmHWM from /proc/<pid>/status, in MiB.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

POOL_BYTES = 1 << 30  # k8s/worker-statefulset.yaml's KVSERVE_KV_CACHE_BYTES
SETTLE_S = 3.0


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free ports: the probe sockets stay bound until all are picked, so none comes back twice."""
    with contextlib.ExitStack() as stack:
        probes = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in probes:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in probes]


def _wait_serving(port: int, proc: subprocess.Popen, deadline_s: float = 600.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args} exited with {proc.returncode}")
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"port {port} never served")


def _memory_mib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) // 1024
    return fields


def measure() -> dict[str, dict[str, int]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSERVE_", "OTEL_"))}
    cli = [sys.executable, "-m", "kvserve.services.cli"]
    km, wk, gw, http = _free_ports(4)
    commands = {
        "kvmanager": ["kvmanager", "--port", str(km), "--no-persistence", "--admin-token", "bench"],
        "worker": ["worker", "--port", str(wk), "--kvmanager", f"127.0.0.1:{km}", "--worker-id", "w0",
                   "--kv-cache-bytes", str(POOL_BYTES), "--attention-backend", "reference"],
        "gateway": ["gateway", "--port", str(gw), "--http-port", str(http), "--kvmanager", f"127.0.0.1:{km}"],
    }
    ports = {"kvmanager": km, "worker": wk, "gateway": gw}
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, args in commands.items():
            procs[name] = subprocess.Popen(cli + args, env=env, stdout=subprocess.DEVNULL)
            _wait_serving(ports[name], procs[name])
        time.sleep(SETTLE_S)  # idle: let start-up garbage go before reading the resident set
        return {name: _memory_mib(p.pid) for name, p in procs.items()}
    finally:
        for p in reversed(list(procs.values())):
            p.terminate()
            p.wait(60)


def main() -> None:
    today = dt.date.today().isoformat()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / f"rss-{today}.md")
    args = parser.parse_args()
    found = measure()
    rows = "\n".join(f"| {name} | {m['VmRSS']} | {m['VmHWM']} |" for name, m in found.items())
    when = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    args.out.write_text(
        f"# Resident memory of the services, idle once serving ({when})\n\n"
        f"The worker with a {POOL_BYTES} B KV pool (k8s/worker-statefulset.yaml) on SmolLM2-135M-Instruct, "
        "float32; the kvmanager without Redis and with no state yet; the gateway with its tokenizer. "
        "`python bench/service_rss.py`.\n\n"
        f"| service | VmRSS MiB | VmHWM MiB |\n|---|---:|---:|\n{rows}\n")
    print(args.out.read_text())


if __name__ == "__main__":
    main()
