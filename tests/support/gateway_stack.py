"""`kvserve up` as a real process tree (embedded Redis, kvmanager, workers, gateway) for the end-to-end tests,
and small helpers to talk to it: the SDK for the gateway, the admin RPCs for the pool's state."""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path

from service_process import service_process

from kvserve.common.channels import kvmanager_channel
from kvserve.v1 import kvmanager_pb2, kvmanager_pb2_grpc

READY = re.compile(r"^kvserve up ready: gateway on (?P<gateway>[^\s,]+), OpenAI API at (?P<http>\S+) "
                   r"\(kvmanager (?P<kvmanager>\S+), ")  # one host:port, or a list (--kvmanager-replicas)
READY_TIMEOUT_S = 180.0  # kvmanager + model load per worker on 2 busy cores


@dataclass
class Stack:
    gateway: str
    http: str  # the OpenAI API's base URL, http://host:port/v1
    kvmanager: str
    data_dir: Path
    stderr_path: Path
    proc: object
    ready_line: str

    def admin_stats(self) -> kvmanager_pb2.ClusterStats:
        token = (self.data_dir / "admin_token").read_text().strip()
        with kvmanager_channel(self.kvmanager) as channel:
            stub = kvmanager_pb2_grpc.KVAdminServiceStub(channel)
            return stub.Stats(kvmanager_pb2.StatsRequest(), timeout=10,
                              metadata=[("authorization", f"Bearer {token}")])

    def used_pages(self) -> int:
        return sum(p.num_used_pages for p in self.admin_stats().pools)

    def live_requests(self) -> int:
        return sum(p.num_requests for p in self.admin_stats().pools)

    def log(self) -> str:
        return self.stderr_path.read_text()


@contextlib.contextmanager
def running_stack(tmp_path: Path, env: dict[str, str], *args: str):
    """`kvserve up` on free ports with its data under tmp_path; killed (with every child) afterwards."""
    data_dir = tmp_path / "data"
    argv = ["up", "--port", "0", "--kvmanager-port", "0", "--http-port", "0", "--data-dir", str(data_dir), *args]
    stderr_path = tmp_path / "up.stderr"
    with service_process(argv, READY, env, stderr_path, READY_TIMEOUT_S) as (proc, match):
        yield Stack(match["gateway"], match["http"], match["kvmanager"], data_dir, stderr_path, proc, match.string)
