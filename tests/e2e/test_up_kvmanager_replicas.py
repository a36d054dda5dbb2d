"""`kvserve up --kvmanager-replicas 2`: a leader and a standby kvmanager on the Redis `up` runs, the gateway given
both. A kill -9 of the leader stops nothing: the standby takes over, requests keep completing, and `up` starts
the killed kvmanager again on its port, where it comes back as a standby; a SIGTERM still stops the stack cleanly.
"""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import grpc
from gateway_stack import running_stack
from grpc_health.v1 import health_pb2
from polling import wait_for
from service_process import EXIT_TIMEOUT_S
from test_cli_process import cli_env, run_cli
from test_kvmanager_standby import health

from kvserve.services.client import Client

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
PROMPT = "The history of the railway in Europe began in the early nineteenth century, when the first steam " \
         "locomotives pulled coal wagons between mines and ports, and"  # 28 tokens: a full page to cache


def two_free_ports() -> int:
    """A port P with P and P + 1 free now (--kvmanager-port P gives the kvmanagers P and P + 1)."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise AssertionError("no two consecutive free ports")


def kvmanager_pids(up_pid: int) -> dict[int, int]:
    """port -> pid of each `kvserve kvmanager` child of `up`."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat[1]) == up_pid and b"kvmanager" in argv and b"--port" in argv and stat[0] != "Z":
            out[int(argv[argv.index(b"--port") + 1])] = int(entry.name)
    return out


def status(port: int) -> int | None:
    """The kvmanager's health on ``port``; None while nothing answers there (a restart)."""
    try:
        return health(port)
    except grpc.RpcError:
        return None


def test_up_with_two_kvmanagers_survives_a_kill9_of_the_leader(tmp_path):
    port = two_free_ports()
    with running_stack(tmp_path, cli_env(), "--kvmanager-replicas", "2", "--kvmanager-port", str(port),
                       "--num-pages", "64") as stack:
        both = f"127.0.0.1:{port},127.0.0.1:{port + 1}"
        assert f"(kvmanager {both}, " in stack.ready_line and f"--kvmanager {both}" in stack.ready_line
        assert [status(port), status(port + 1)] == [SERVING, NOT_SERVING]  # leader, standby
        with Client(stack.gateway, timeout_s=120) as client:
            before = client.complete(prompt=PROMPT, max_tokens=4, temperature=0.0)
            leader = kvmanager_pids(stack.proc.pid)[port]
            os.kill(leader, signal.SIGKILL)
            after = client.complete(prompt=PROMPT, max_tokens=4, temperature=0.0)  # on the new leader
            assert list(after.token_ids) == list(before.token_ids) and after.usage.cached_tokens == 16
        assert stack.proc.poll() is None  # the stack kept running
        restarted = wait_for(lambda: (kvmanager_pids(stack.proc.pid).get(port) or leader) != leader
                             and kvmanager_pids(stack.proc.pid)[port])
        assert restarted != leader
        # Back, and one of the two leads: the standby, or the restarted one if its first election caught the
        # dead leader's lease lapsing first (both poll for it; either may win, and neither loses a call).
        wait_for(lambda: sorted([status(port), status(port + 1)]) == sorted([SERVING, NOT_SERVING]))
        assert "kvmanager-0 exited with -9; starting it again (as a standby)" in stack.log()
        stats = run_cli("admin", "stats", "--json", "--kvmanager", both, "--data-dir", str(stack.data_dir))
        assert stats.returncode == 0, stats.stderr
        os.kill(stack.proc.pid, signal.SIGTERM)
        assert stack.proc.wait(timeout=EXIT_TIMEOUT_S * 3) == 0
