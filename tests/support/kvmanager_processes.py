"""`kvserve kvmanager` as a real process (shared by the e2e and service tests that need one): its environment,
its ready line, a populated pool, a clean stop."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from pathlib import Path

import grpc
from service_process import EXIT_TIMEOUT_S, KVSERVE, service_process

from kvserve.common.tokens import le_uint32
from kvserve.v1 import kvmanager_pb2 as pb
from kvserve.v1 import kvmanager_pb2_grpc

PS = 4
P1 = list(range(100, 112))  # 3 full pages
READY_TIMEOUT_S = 30.0
READY = re.compile(r"^kvserve kvmanager ready on 127\.0\.0\.1:(\d+) \((?:leader, )?redis: (.+)\) admin token: (.+)$")


def cli_env(tmp_path: Path) -> dict[str, str]:
    """No stray KVSERVE_* settings; the cache dir (default data dir) inside the test's folder."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVE_")}
    return env | {"KVSERVE_CACHE_DIR": str(tmp_path / "cache")}


def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([KVSERVE, *args], capture_output=True, text=True, env=cli_env(tmp_path), timeout=60,
                          stdin=subprocess.DEVNULL)


@contextlib.contextmanager
def kvmanager_process(tmp_path: Path, *args: str):
    """Runs `kvserve kvmanager --port 0 ARGS`; yields (process, ready-line match) once it is ready."""
    with service_process(["kvmanager", "--port", "0", *args], READY, cli_env(tmp_path),
                         tmp_path / "kvmanager.stderr", READY_TIMEOUT_S) as running:
        yield running


def populate(port: int) -> None:
    """One pool; tenant A's prompt P1 cached (3 blocks, ref_cnt 0); tenant B's request running (2 pages)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = kvmanager_pb2_grpc.KVManagerServiceStub(channel)
        stub.RegisterWorker(pb.PoolSpec(worker_id="w0", epoch=1, num_pages=8, page_size=PS,
                                        model_fingerprint="fp", kv_dtype="float32",
                                        bytes_per_token=100), timeout=10)
        steps = [pb.StepOps(step_id=1, allocations=[pb.PageAllocation(req_id="a", tenant="A", worker_id="w0",
                                                                              packed_token_ids=le_uint32(P1 + [1]))]),
                 pb.StepOps(step_id=2, commits=[pb.PageCommit(req_id="a", packed_token_ids=le_uint32(P1),
                                                              num_computed_tokens=12)]),
                 pb.StepOps(step_id=3, frees=[pb.PageFree(req_id="a")], allocations=[
                     pb.PageAllocation(req_id="b", tenant="B", worker_id="w0", packed_token_ids=le_uint32(range(5)))])]
        for step in steps:
            stub.StepPages(step, timeout=10)


def stop_cleanly(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=EXIT_TIMEOUT_S) == 0
