"""The chaos run's stack, each part a separate process on loopback (bench/chaos_procs.py):

    Redis (Sentinel, or one embedded)  ──  kvmanager × 2 (leader + standby; 1 without a standby)
         ──  worker × 2 (small pools; they join the kvmanager)  ──  gateway (follows the membership)

Every feature is used unless the run is told to go without it (Features.all_but, `--without`): without worker
membership the workers are a static --workers list of the gateway, and a restarted worker binds its old port
again; without a standby one kvmanager runs and its fault is a restart on the same port.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import grpc
from chaos_procs import Processes, Service
from chaos_redis import make_redis

from kvserve.v1 import kvmanager_pb2, kvmanager_pb2_grpc

POLL_S = 0.05
ADMIN_TIMEOUT_S = 2.0
# With a static --workers list a worker declared dead is never dialled again, so the gateway's worker timeout must
# outlast a worker's restart (a model load: 10-20 s on 2 busy cores) for fault b to get its worker back.
STATIC_WORKERS_TIMEOUT_S = 45.0



@dataclass(frozen=True, slots=True)
class Features:
    membership: bool  # worker --kvmanager + ListWorkers: workers join, the gateway follows them (no --workers)
    standby: bool  # kvmanager --leader-lease: a second kvmanager on the same Redis waits as standby
    sentinel: bool  # three Redis under Sentinel, the kvmanagers on a redis+sentinel:// URL
    declare_dead: bool  # the gateway declares a worker lost for good dead; it leaves (KVManagerClient.leave_worker)

    @classmethod
    def all_but(cls, without: Sequence[str] = ()) -> Features:
        """Every feature, less those named in ``without`` (to run the fallbacks: a static worker list, one
        kvmanager, one Redis). Raises ValueError for an unknown name."""
        unknown = set(without) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown features {sorted(unknown)} (known: {[f.name for f in fields(cls)]})")
        return cls(**{f.name: f.name not in without for f in fields(cls)})

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class StackConfig:
    num_workers: int = 2
    num_pages: int = 128  # per worker: small pools
    page_size: int = 16
    worker_timeout_s: float = 5.0  # the gateway's --worker-timeout
    max_num_seqs: int = 16
    worker_threads: int = 1  # torch threads per worker: on a small machine two workers would fight over the cores
    replace_lost_worker: bool = True  # after fault c a fresh worker joins (with membership), so d has two
    admin_token: str = "chaos-admin-token"


class ChaosStack:
    """Starts and tracks the processes; answers what the faults and the figures need (leader, pools, pages)."""

    def __init__(self, procs: Processes, features: Features, cfg: StackConfig, data_dir: Path):
        self.procs, self.features, self.cfg, self.data_dir = procs, features, cfg, Path(data_dir)
        self.redis = None
        self.kvmanagers: list[Service] = []  # the addresses every client is given, in order
        self.workers: dict[str, Service] = {}  # live workers by worker_id
        self.gateway: Service | None = None
        self._next_worker = 0

    # -- start ------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.redis = make_redis(self.data_dir / "redis", self.features.sentinel)
        for _ in range(2 if self.features.standby else 1):
            self.kvmanagers.append(self.start_kvmanager())
        spawned = [self.procs.spawn(worker_id, self._worker_argv(worker_id, 0), self._worker_env)
                   for worker_id in (self._new_worker_id() for _ in range(self.cfg.num_workers))]
        for worker in spawned:  # their models load at the same time
            self.workers[worker.name] = self.procs.await_ready(worker)
        self.gateway = self.procs.start("gateway", self._gateway_argv())
        self.wait_kvmanager_answering(time.monotonic() + 30)

    @property
    def kv_spec(self) -> str:
        return ",".join(k.address for k in self.kvmanagers)

    @property
    def gateway_worker_timeout_s(self) -> float:
        return self.cfg.worker_timeout_s if self.features.membership else STATIC_WORKERS_TIMEOUT_S

    def start_kvmanager(self, port: int = 0) -> Service:
        argv = ["kvmanager", "--host", "127.0.0.1", "--port", str(port), "--redis-url", self.redis.url,
                "--admin-token", self.cfg.admin_token, "--data-dir",
                str(self.data_dir / f"kvmanager-{len(self.procs.started)}")]  # each its own, if it uses one
        return self.procs.start("kvmanager", argv)

    def _worker_argv(self, worker_id: str, port: int) -> list[str]:
        argv = ["worker", "--host", "127.0.0.1", "--port", str(port), "--worker-id", worker_id, "--num-pages",
                str(self.cfg.num_pages), "--page-size", str(self.cfg.page_size), "--metrics-port", "0"]
        return argv + (["--kvmanager", self.kv_spec] if self.features.membership else [])

    @property
    def _worker_env(self) -> dict[str, str]:
        return {"OMP_NUM_THREADS": str(self.cfg.worker_threads), "MKL_NUM_THREADS": str(self.cfg.worker_threads)}

    def start_worker(self, worker_id: str, port: int = 0) -> Service:
        worker = self.procs.start(worker_id, self._worker_argv(worker_id, port), self._worker_env)
        self.workers[worker_id] = worker
        return worker

    def add_worker(self) -> Service:
        """A worker with a new worker_id (worker-0, worker-1, ...)."""
        return self.start_worker(self._new_worker_id())

    def _new_worker_id(self) -> str:
        self._next_worker += 1
        return f"worker-{self._next_worker - 1}"

    def _gateway_argv(self) -> list[str]:
        argv = ["gateway", "--host", "127.0.0.1", "--port", "0", "--http-port", "0", "--kvmanager", self.kv_spec,
                "--worker-timeout", str(self.gateway_worker_timeout_s), "--max-num-seqs", str(self.cfg.max_num_seqs),
                "--metrics-port", "0"]
        if not self.features.membership:
            argv += ["--workers", ",".join(w.address for w in self.workers.values())]
        return argv

    # -- the kvmanager ----------------------------------------------------------------------------------
    def _admin(self, address: str, method: str, request, timeout_s: float = ADMIN_TIMEOUT_S):
        with grpc.insecure_channel(address) as channel:
            stub = kvmanager_pb2_grpc.KVAdminServiceStub(channel)
            return getattr(stub, method)(request, timeout=timeout_s,
                                         metadata=[("authorization", f"Bearer {self.cfg.admin_token}")])

    def leader(self) -> Service | None:
        """The kvmanager that answers admin calls (a standby answers UNAVAILABLE); None while none does."""
        for kvmanager in self.kvmanagers:
            if not kvmanager.alive():
                continue
            with contextlib.suppress(grpc.RpcError):
                self._admin(kvmanager.address, "Stats", kvmanager_pb2.StatsRequest(), timeout_s=0.5)
                return kvmanager
        return None

    def stats(self) -> kvmanager_pb2.ClusterStats:
        """Stats from the leader; raises grpc.RpcError when no kvmanager answers."""
        error = None
        for kvmanager in self.kvmanagers:
            try:
                return self._admin(kvmanager.address, "Stats", kvmanager_pb2.StatsRequest())
            except grpc.RpcError as e:
                error = e
        raise error

    def worker_of(self, req_id: str) -> str | None:
        """The worker a live request's pages are on, from the leader (None: not placed yet, or finished)."""
        leader = self.leader()
        if leader is None:
            return None
        try:
            return self._admin(leader.address, "GetPageTable", kvmanager_pb2.GetPageTableRequest(req_id=req_id)
                               ).worker_id
        except grpc.RpcError:
            return None

    def wait_kvmanager_answering(self, deadline: float) -> Service:
        """Polls until a kvmanager answers admin calls; raises TimeoutError at the deadline."""
        while time.monotonic() < deadline:
            leader = self.leader()
            if leader is not None:
                return leader
            time.sleep(POLL_S)  # polling a condition under a deadline
        raise TimeoutError("no kvmanager answered")

    def restart_kvmanager(self, dead: Service) -> Service:
        """A new kvmanager process on the dead one's port (the address every client was given)."""
        new = self.start_kvmanager(dead.port)
        self.kvmanagers[self.kvmanagers.index(dead)] = new
        return new

    # -- pools --------------------------------------------------------------------------------------------
    def pools(self) -> dict[str, kvmanager_pb2.PoolStats]:
        return {p.worker_id: p for p in self.stats().pools}

    def used_pages(self) -> dict[str, int]:
        """Used pages per live worker's pool (the pools of dead workers left out)."""
        return {w: p.num_used_pages for w, p in self.pools().items() if w in self.workers}

    def wait_pages_free(self, deadline: float) -> dict[str, int]:
        """Polls until every live pool has 0 used pages or the deadline passes; the last reading."""
        used: dict[str, int] = {}
        while True:
            with contextlib.suppress(grpc.RpcError):
                used = self.used_pages()
                if not any(used.values()):
                    return used
            if time.monotonic() >= deadline:
                return used
            time.sleep(POLL_S)  # polling a condition under a deadline

    def close(self) -> None:
        self.procs.close()
        if self.redis is not None:
            self.redis.stop()
