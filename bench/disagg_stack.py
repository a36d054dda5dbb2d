"""bench_disagg.py's stacks: `kvserve up` with two workers, each worker pinned to one core and computing on one
thread, and what the run reads of the kvmanager (transfer counters, pools).

One thread per worker: up runs with OMP_NUM_THREADS=1 and MKL_NUM_THREADS=1 in its environment, which its
workers inherit (no worker calls torch.set_num_threads; torch sizes its intra-op pool from the variable). One core
per worker: once the stack is ready, every thread of each worker process gets sched_setaffinity to its core
(threads started later inherit it from the thread that starts them). The gateway, the kvmanager and the client
are left to float over both cores.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.common.channels import kvmanager_channel
from kvserve.common.processes import die_with_parent
from kvserve.v1 import kvmanager_pb2, kvmanager_pb2_grpc

READY = re.compile(r"^kvserve up ready: gateway on (?P<gateway>[^\s,]+), OpenAI API at \S+ "
                   r"\(kvmanager (?P<kvm>[^\s,]+),")
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
TRANSFER_FIELDS = ("num_pulls", "num_pages", "num_ok", "num_failed", "num_expired", "num_bytes", "seconds",
                   "num_moved", "num_holds")
PREEMPTED = re.compile(r"out of pages, preempted (\d+) requests")
POOL_FIELDS = ("role", "num_requests", "num_used_pages", "num_cached_pages", "num_free_pages")


def children_of(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc/*/stat's ppid)."""
    parent = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        found += kids
        frontier += kids
    return found


def worker_pids(up_pid: int) -> dict[str, int]:
    """worker_id -> pid of the `kvserve worker` processes under ``up_pid`` (by their --worker-id argument)."""
    out = {}
    for pid in children_of(up_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--worker-id" in argv:
            out[argv[argv.index(b"--worker-id") + 1].decode()] = pid
    return out


def pin(pid: int, core: int) -> dict:
    """Every thread of ``pid`` onto ``core``; what the process then shows: its threads, the cores each may run
    on, and the thread variables it started with."""
    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, {core})
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
    cores = {tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir(f"/proc/{pid}/task")}
    return {"core": core, "num_threads": len(tids), "thread_cores": sorted(cores),
            **{k: env.get(k) for k in ONE_THREAD}}


@dataclass
class Up:
    """One `kvserve up` on free ports, its data and log under ``log_dir``."""

    name: str
    args: list[str]
    log_dir: Path
    proc: subprocess.Popen | None = None
    gateway: str = ""
    kvmanager: str = ""
    token: str = ""
    pinned: dict = field(default_factory=dict)

    @property
    def data_dir(self) -> Path:
        return self.log_dir / f"data-{self.name}"

    def spawn(self) -> Up:
        self.log = self.log_dir / f"up-{self.name}.log"
        argv = [sys.executable, "-m", "kvserve.services.cli", "up", "--port", "0", "--kvmanager-port", "0",
                "--http-port", "0", "--data-dir", str(self.data_dir), *self.args]
        with self.log.open("w") as stderr:
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL,
                                         text=True, env={**os.environ, **ONE_THREAD}, preexec_fn=die_with_parent)
        return self

    def ready(self, cores: dict[str, int]) -> Up:
        """Waits for up's ready line, then pins each worker (``cores``: worker_id -> core)."""
        m = READY.match(self.proc.stdout.readline())
        if not m:
            self.proc.kill()
            raise RuntimeError(f"kvserve up ({self.name}) did not start:\n{self.log.read_text()[-3000:]}")
        self.gateway, self.kvmanager = m["gateway"], m["kvm"]
        self.token = (self.data_dir / "admin_token").read_text().strip()
        pids = worker_pids(self.proc.pid)
        assert set(pids) == set(cores), f"{self.name}: workers {sorted(pids)}, expected {sorted(cores)}"
        self.pinned = {w: pin(pid, cores[w]) for w, pid in pids.items()}
        return self

    def stats(self) -> kvmanager_pb2.ClusterStats:
        with kvmanager_channel(self.kvmanager) as channel:
            return kvmanager_pb2_grpc.KVAdminServiceStub(channel).Stats(
                kvmanager_pb2.StatsRequest(), timeout=10, metadata=[("authorization", f"Bearer {self.token}")])

    def transfers(self) -> dict:
        t = self.stats().transfers
        return {f: getattr(t, f) for f in TRANSFER_FIELDS}

    def pools(self) -> dict[str, dict]:
        return {p.worker_id: {f: getattr(p, f) for f in POOL_FIELDS} for p in self.stats().pools}

    def num_preempted(self) -> int:
        """Requests the gateway preempted for want of pages so far (from up's log)."""
        return sum(int(n) for n in PREEMPTED.findall(self.log.read_text()))

    def settle(self, limit_s: float = 30.0) -> bool:
        """Waits until no request is live on any pool and no pull holds pages; whether that happened."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            s = self.stats()
            if all(p.num_requests == 0 for p in s.pools) and s.transfers.num_holds == 0:
                return True
            time.sleep(0.2)  # polling a condition under a deadline
        return False

    def stop(self) -> None:
        """SIGTERM (up stops its children in order), SIGKILL after 120 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def delta(after: dict, before: dict) -> dict:
    """Counter differences (num_holds: the later reading, a gauge)."""
    return {k: after[k] if k == "num_holds" else after[k] - before[k] for k in after}
