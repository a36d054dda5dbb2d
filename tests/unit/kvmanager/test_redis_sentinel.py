"""The kvmanager's store on Redis Sentinel (tests/support/redis_sentinel.py's SentinelCluster: one primary, two
replicas, three sentinels, real processes): it follows a primary killed with SIGKILL to the promoted replica, an
acknowledged call survives the failover (WAIT 1), a write no replica acknowledged is answered UNAVAILABLE and
retried, a demoted primary (READONLY) is a retry, and the Sentinel URL is parsed with clear errors."""

from __future__ import annotations

import time
from collections import deque

import pytest
import redis
from kvmanager_histories import P, alloc, spec
from kvmanager_processes import kvmanager_process, populate, run_cli, stop_cleanly
from redis_sentinel import SentinelCluster

from kvserve.common.embedded_redis import EmbeddedRedis
from kvserve.common.redis_client import SentinelUrl, connect, parse_sentinel_url
from kvserve.common.wire.pages import PageCommit, PageFree, StepOps
from kvserve.kvmanager.call_log import CallLog
from kvserve.kvmanager.errors import StoreUnavailable
from kvserve.kvmanager.invariants import check_invariants
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.service import KVService

from kvmanager_soak import snapshot  # isort: skip

RETRY_DEADLINE_S = 30.0


class Load:
    """StepOps of a few live requests of tenant A: each step allocates a new one (prompt P, then 5 tokens of
    its own: index hits on P's 3 blocks), commits the previous one's 4 full pages and frees the one before."""

    def __init__(self):
        self.step_id = 0
        self.live: deque[str] = deque()

    def next(self, mgr: KVManager) -> StepOps:
        self.step_id += 1
        k = self.step_id
        tokens = P + [1000 + k] * 5
        commits = ()
        if self.live:  # its first 16 tokens, after those its prefix hit counts as committed already
            start = mgr.requests[self.live[-1]].num_committed_tokens
            commits = (PageCommit(self.live[-1], start, tuple(P + [1000 + k - 1] * 4)[start:], 17),)
        frees = (PageFree(self.live.popleft()),) if len(self.live) >= 2 else ()
        self.live.append(f"r{k}")
        return StepOps(k, allocations=(alloc(f"r{k}", "A", tokens),), commits=commits, frees=frees)


def call_until_ok(svc: KVService, ops: StepOps) -> tuple[object, int]:
    """Retries the same call (same step_id) while it answers UNAVAILABLE, as the gateway does; (answer, number
    of UNAVAILABLE answers)."""
    deadline, failures = time.monotonic() + RETRY_DEADLINE_S, 0
    while True:
        try:
            return svc.step(ops), failures
        except StoreUnavailable:
            failures += 1
            assert time.monotonic() < deadline, f"step {ops.step_id} still UNAVAILABLE after {RETRY_DEADLINE_S} s"
            time.sleep(0.05)  # the caller's retry pace, under a deadline


def loaded_from(url: str) -> KVManager:
    mgr = KVManager()
    CallLog(connect(url)).load(mgr)  # runs check_invariants
    return mgr


def page_tables_and_index(mgr: KVManager) -> dict:
    return {"page_tables": {r: list(req.page_table) for r, req in mgr.requests.items()},
            "index": {w: {h.hex(): b.page_id for h, b in pool.index.items()} for w, pool in mgr.pools.items()},
            "free": {w: sorted(pool.free) for w, pool in mgr.pools.items()}}


@pytest.fixture
def cluster(tmp_path):
    with SentinelCluster(tmp_path / "redis") as c:
        yield c


@pytest.mark.parametrize("background", [False, True], ids=["inline", "forked"])
def test_the_kvmanager_follows_a_primary_failover_and_keeps_every_acknowledged_call(cluster, background):
    store = CallLog(connect(cluster.url, timeout_s=1.0), snapshot_every=4, background=background,
                        wait_replicas=1)
    svc, load = KVService(KVManager(), store), Load()
    svc.register_worker(spec("w0", num_pages=64))
    for _ in range(10):
        svc.step(load.next(svc.manager))
    store.wait_snapshot()
    assert store.num_snapshots["forked" if background else "inline"] >= 1  # a forked one: its own Sentinel client
    for _ in range(3):
        svc.step(load.next(svc.manager))  # another child may be writing when the primary dies
    old = cluster.kill_primary()
    t_kill = time.monotonic()
    ops = load.next(svc.manager)
    with pytest.raises(StoreUnavailable):  # the dead primary: applied in memory, not acknowledged
        svc.step(ops)
    applied = list(svc.manager.requests[f"r{ops.step_id}"].page_table)
    new = cluster.wait_for_failover(old, timeout_s=30)
    t_promoted = time.monotonic()
    answer, failures = call_until_ok(svc, ops)
    t_served = time.monotonic()
    assert new != old and cluster.primary_port() == new
    assert answer.allocations[0].page_table == applied  # the remembered answer: nothing allocated twice
    check_invariants(svc.manager)  # no page held twice, ref_cnt = holders
    for _ in range(10):
        call_until_ok(svc, load.next(svc.manager))
    store.wait_snapshot()
    print(f"\nfailover ({'forked' if background else 'inline'} snapshots): sentinels promoted port {new} "
          f"{t_promoted - t_kill:.2f} s after the SIGKILL of {old}; the retried call was served "
          f"{t_served - t_kill:.2f} s after it ({failures} more UNAVAILABLE answers after the promotion)")
    loaded = loaded_from(cluster.url)  # a fresh kvmanager on the new primary: exactly the acknowledged state
    assert page_tables_and_index(loaded) == page_tables_and_index(svc.manager)
    assert snapshot(loaded) == snapshot(svc.manager)


def test_a_write_no_replica_acknowledged_is_unavailable_until_a_replica_is_back(cluster):
    store = CallLog(connect(cluster.url), background=False, wait_replicas=1, wait_timeout_ms=300)
    svc, load = KVService(KVManager(), store), Load()
    svc.register_worker(spec("w0", num_pages=64))
    svc.step(load.next(svc.manager))
    replicas = cluster.replica_ports()
    for port in replicas:
        cluster.kill(port)
    ops = load.next(svc.manager)
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match="NotReplicated: WAIT 1 300: 0 of 1 replica"):
        svc.step(ops)
    elapsed_s = time.monotonic() - t0
    assert 0.3 <= elapsed_s < 2.0 and store.resync  # WAIT's timeout; the next write rewrites the whole state
    with pytest.raises(StoreUnavailable, match="NotReplicated"):  # still none: the retry is refused as well
        svc.step(ops)
    cluster.restart(replicas[0])
    answer, _ = call_until_ok(svc, ops)
    assert answer.allocations[0].page_table == list(svc.manager.requests[f"r{ops.step_id}"].page_table)
    assert not store.resync and store.num_snapshots["inline"] >= 1
    svc.step(load.next(svc.manager))  # an append again, acknowledged by the replica that is back
    print(f"\nWAIT refusal after {elapsed_s:.2f} s (timeout 0.3 s)")
    assert snapshot(loaded_from(cluster.url)) == snapshot(svc.manager)


def test_a_demoted_primary_answers_readonly_and_the_retry_succeeds_once_it_is_writable(tmp_path):
    """A plain redis:// URL whose node became a replica (of a node that is not there, so it keeps its data):
    READONLY is UNAVAILABLE, the connection is dropped, and the retry reaches a primary again."""
    with EmbeddedRedis(tmp_path / "redis") as server:
        store = CallLog(connect(server.url), background=False)
        svc, load = KVService(KVManager(), store), Load()
        svc.register_worker(spec("w0", num_pages=64))
        admin_client = redis.Redis("127.0.0.1", server.port)
        with EmbeddedRedis(tmp_path / "gone") as gone:
            gone_port = gone.port  # closed once stopped: nothing listens there
        admin_client.replicaof("127.0.0.1", gone_port)
        ops = load.next(svc.manager)
        with pytest.raises(StoreUnavailable, match="read-only replica"):
            svc.step(ops)
        admin_client.replicaof("NO", "ONE")
        answer, _ = call_until_ok(svc, ops)
        assert answer.allocations[0].page_table == list(svc.manager.requests["r1"].page_table)
        assert snapshot(loaded_from(server.url)) == snapshot(svc.manager)


def test_sentinel_urls_parse_and_bad_ones_say_what_is_wrong():
    assert parse_sentinel_url("redis+sentinel://10.0.0.1:26380,[::1]:5000,sentinel/kv-main/2?password=pw") == \
        SentinelUrl((("10.0.0.1", 26380), ("::1", 5000), ("sentinel", 26379)), "kv-main", 2, "pw", None)
    assert parse_sentinel_url("redis+sentinel://h:1/svc?sentinel_password=s").sentinel_password == "s"
    bad = {"redis+sentinel://h:1": "no service name",
           "redis+sentinel://h:1/": "no service name",
           "redis+sentinel:///svc": "no sentinel address",
           "redis+sentinel://h:port/svc": "bad port 'port' in sentinel address 'h:port'",
           "redis+sentinel://h:1,h:70000/svc": "bad port '70000'",
           "redis+sentinel://h:1,/svc": "empty sentinel host",
           "redis+sentinel://h:1/svc/x": "/SERVICE_NAME/DB (DB a number)",
           "redis+sentinel://h:1/svc/0/more": "the path must be",
           "redis+sentinel://h:1/svc?db=1": "unknown option(s) db",
           "redis+sentinel://u:pw@h:1/svc": "?password="}
    for url, message in bad.items():
        with pytest.raises(ValueError) as e:
            connect(url)
        assert message in str(e.value) and repr(url) in str(e.value), (url, str(e.value))


def test_kvserve_kvmanager_serves_on_a_sentinel_url_and_refuses_bad_settings(cluster, tmp_path):
    with kvmanager_process(tmp_path, "--redis-url", cluster.url, "--admin-token", "T") as (proc, m):
        assert m.group(2) == (f"{cluster.url}/0 (the primary of sentinel service 'kvserve'), WAIT for 1 "
                              "replica(s) within 500 ms after each write")
        populate(int(m.group(1)))
        stop_cleanly(proc)
    assert sorted(loaded_from(cluster.url).requests) == ["b"]
    bad_url = run_cli(tmp_path, "kvmanager", "--port", "0", "--admin-token", "T", "--redis-url",
                      "redis+sentinel://127.0.0.1:1/")
    assert bad_url.returncode == 2 and "no service name" in bad_url.stderr and "Traceback" not in bad_url.stderr
    no_replicas = run_cli(tmp_path, "kvmanager", "--port", "0", "--admin-token", "T", "--redis-wait-replicas", "1")
    assert no_replicas.returncode == 2 and "the embedded Redis has no replicas" in no_replicas.stderr
