"""Leader election and fencing (kvserve/kvmanager/leader.py, fencing.py) on a real Redis: two kvmanagers' services, each
with its own call-log store and lease on one prefix. The elections are driven a turn at a time (Election.tick),
so each test decides exactly when a lease lapses, which is how a leader "paused" past its lease is simulated:
its key expires, the other acquires and claims the prefix, and only then does the paused one write.

- A deposed leader's late write (a step sent early, a registration, an admin call, an inline snapshot) is
  refused by the fencing token: nothing of it is in Redis, it is not acknowledged, and that leader stops
  answering at once and steps down.
- The new leader's state is everything the old one acknowledged, and it answers a retried call from memory.
- Renewal, loss of the lease (another holds it; Redis unreachable past the lease), release, and the first
  election (a dead holder's lease lapses, a live one's is renewed).
- Over gRPC: a standby answers UNAVAILABLE naming the leader, health follows the leadership, and a
  KVManagerClient over both addresses carries a retried StepPages over a leader change to the remembered answer.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvmanager_histories import alloc, spec
from polling import wait_for

from kvserve.common.embedded_redis import EmbeddedRedis
from kvserve.common.redis_client import connect
from kvserve.common.wire.pages import PageCommit, PageFree, StepOps
from kvserve.kvmanager import admin
from kvserve.kvmanager.call_log import CallLog
from kvserve.kvmanager.errors import Fenced, NotLeader
from kvserve.kvmanager.fencing import fenced_call, fenced_pipeline, fenced_rpush
from kvserve.kvmanager.leader import Election, LeaderLease
from kvserve.kvmanager.server import MANAGER_SERVICE, report_leadership, start_kvmanager_server
from kvserve.kvmanager.service import KVService
from kvserve.services.gateway.rpc.clients import KVManagerClient
from kvserve.v1 import kvmanager_pb2 as pb
from kvserve.v1 import kvmanager_pb2_grpc

from kvmanager_soak import snapshot  # isort: skip

PREFIX, TTL_S = "kvserve", 1.0
P = list(range(100, 112))  # 3 full pages of 4 tokens


@pytest.fixture
def redis_server(tmp_path):
    with EmbeddedRedis(tmp_path / "redis") as server:
        yield server


@dataclass
class Kvmanager:
    """One kvmanager process's domain half: its service, store, lease and election; ``roles`` what on_role
    was told."""

    service: KVService
    store: CallLog
    election: Election
    roles: list[bool] = field(default_factory=list)

    @property
    def lease(self) -> LeaderLease:
        return self.election.lease


def kvmanager(url: str, address: str, ttl_s: float = TTL_S, service: KVService | None = None) -> Kvmanager:
    service = service or KVService(store=CallLog(connect(url), PREFIX, background=False))
    store = service.store
    election = Election(LeaderLease(connect(url, timeout_s=0.25), PREFIX, address, ttl_s), service)
    km = Kvmanager(service, store, election)
    election.on_role = km.roles.append
    return km


def pause_past_the_lease(leader: Kvmanager) -> None:
    """What a leader paused for longer than its lease sees on waking: its key has expired (here: deleted)."""
    leader.lease.client.delete(leader.lease.key)


def redis_contents(client) -> dict[str, bytes]:
    """Every key and its serialised value: a write that was refused leaves all of it as it was."""
    return {key: client.dump(key) for key in sorted(client.scan_iter(match="*"))}


def history(svc: KVService) -> StepOps:
    """A pool, a request with a committed prompt, another allocated; returns the last (acknowledged) call."""
    svc.register_worker(spec("w0"))
    svc.step(StepOps(1, allocations=(alloc("a", "A", P + [1]),)))
    svc.step(StepOps(2, commits=(PageCommit("a", 0, tuple(P), 13),)))
    last = StepOps(3, allocations=(alloc("b", "A", P + [2]),))
    svc.step(last)
    return last


def late_write(km: Kvmanager, kind: str) -> None:
    """A write of the kind the deposed leader may still attempt."""
    svc = km.service
    if kind == "step (sent early)":
        svc.step(StepOps(4, allocations=(alloc("late", "A", P + [3]),)))
    elif kind == "registration":
        svc.register_worker(spec("w1"))
    elif kind == "admin call":
        svc.mutate(admin.pin, "A", tuple(P), "w0")
    elif kind == "inline snapshot":
        km.store.snapshot_every = 1  # due now: this call writes the snapshot (MULTI/EXEC) instead of its record
        svc.step(StepOps(4, allocations=(alloc("late", "A", P + [3]),)))
    elif kind == "reset":
        svc.mutate(admin.reset, True)


@pytest.mark.parametrize("kind", ["step (sent early)", "registration", "admin call", "inline snapshot", "reset"])
def test_a_deposed_leaders_late_write_is_refused_and_the_new_leader_has_every_acknowledged_call(redis_server,
                                                                                                 kind):
    old, new = kvmanager(redis_server.url, "old:1"), kvmanager(redis_server.url, "new:2")
    assert old.election.tick() == 0.0 and old.election.leading and old.roles == [True]
    new.election.tick()
    assert not new.election.leading and not new.service.leading
    with pytest.raises(NotLeader, match="is a standby; the leader is old:1"):
        new.service.read(admin.stats)
    last = history(old.service)
    acknowledged = snapshot(old.service.manager, clock=True, last_ops=True)
    first_answer = old.service.step(last)  # answered from memory: nothing new

    pause_past_the_lease(old)
    new.election.tick()  # acquires, claims the prefix, loads
    assert new.election.leading and new.roles == [True]
    assert snapshot(new.service.manager, clock=True, last_ops=True) == acknowledged
    client = connect(redis_server.url)
    before = redis_contents(client)
    with pytest.raises(NotLeader, match="refused by the fencing token"):
        late_write(old, kind)
    assert redis_contents(client) == before  # nothing of it applied
    assert not old.service.leading and old.election.wake.is_set()  # it stopped answering at once
    with pytest.raises(NotLeader):
        old.service.read(admin.stats)
    old.election.tick()  # and steps down: health off, its stale state dropped
    assert not old.election.leading and old.roles == [True, False] and not old.service.manager.pools
    with pytest.raises(NotLeader, match="is a standby; the leader is new:2"):
        old.service.step(last)
    assert new.lease.holder()[0] == "new:2"  # the old one's step-down left the new one's lease alone

    again = new.service.step(last)  # the retried call: the remembered answer, on the new leader
    assert again.allocations == first_answer.allocations
    assert snapshot(new.service.manager, clock=True, last_ops=True) == acknowledged
    new.service.step(StepOps(4, frees=(PageFree("a"), PageFree("b"))))  # the new leader carries on
    assert new.service.manager.pools["w0"].num_used == 0


def test_fenced_writes_apply_only_under_the_latest_token(redis_server):
    client = connect(redis_server.url)
    owner = f"{PREFIX}:owner"
    client.set(owner, 7)
    assert fenced_call(client, owner, 7, "HSET", "h", "f", "v") == 1 and client.hget("h", "f") == "v"
    values = [str(i) for i in range(2500)]  # more than one Lua unpack takes
    assert fenced_rpush(client, owner, 7, "l", values) == 2500 and client.lrange("l", 0, -1) == values
    before = redis_contents(client)
    for stale in (6, 8):
        with pytest.raises(Fenced, match=f"claimed by 7, not {stale}"):
            fenced_call(client, owner, stale, "HSET", "h", "f", "w")
        with pytest.raises(Fenced):
            fenced_rpush(client, owner, stale, "l", ["x"])
        with pytest.raises(Fenced), fenced_pipeline(client, owner, stale) as pipe:
            pipe.set("k", "v")
    with pytest.raises(Fenced, match="during the transaction"), fenced_pipeline(client, owner, 7) as pipe:
        pipe.set("k", "v")
        connect(redis_server.url).incr(owner)  # another kvmanager claims before EXEC
    client.decr(owner)
    assert redis_contents(client) == before
    with fenced_pipeline(client, owner, 7) as pipe:
        pipe.set("k", "v")
    assert client.get("k") == "v"


def test_renew_release_and_holder(redis_server):
    client = connect(redis_server.url)
    a, b = LeaderLease(client, PREFIX, "a:1", 1.0), LeaderLease(client, PREFIX, "b:2", 1.0)
    assert a.acquire() and not b.acquire()
    assert b.holder()[0] == "a:1" and 0 < b.holder()[1] <= 1000
    client.pexpire(a.key, 100)
    assert a.renew() and client.pttl(a.key) > 500  # a full lease again
    assert not b.renew() and not b.release() and client.get(a.key) == a.value  # b never touches a's lease
    assert a.release() and b.holder() == (None, 0)
    assert b.acquire() and not a.renew() and not a.release() and b.holder()[0] == "b:2"
    with pytest.raises(ValueError):
        LeaderLease(client, PREFIX, "c:3", 0)


def test_a_leader_whose_lease_another_holds_steps_down(redis_server):
    km = kvmanager(redis_server.url, "a:1")
    km.election.tick()
    history(km.service)
    km.lease.client.set(km.lease.key, "b:2 othernonce", px=5000)  # another holds the key now
    assert km.election.tick() == km.election.poll_s
    assert not km.election.leading and km.roles == [True, False]
    with pytest.raises(NotLeader, match="the leader is b:2"):
        km.service.step(StepOps(9, allocations=(alloc("x", "A", P),)))
    assert km.lease.client.get(km.lease.key) == "b:2 othernonce"


def test_a_leader_that_cannot_reach_redis_steps_down_once_its_lease_lapses_and_leads_again_after(redis_server):
    km = kvmanager(redis_server.url, "a:1", ttl_s=0.5)
    km.election.tick()
    history(km.service)
    acknowledged = snapshot(km.service.manager, clock=True, last_ops=True)
    redis_server.stop()
    stopped = time.monotonic()
    deadline = stopped + 10
    while km.election.leading and time.monotonic() < deadline:
        km.election.wake.wait(km.election.tick())  # the loop's own pacing
    assert not km.election.leading and km.roles == [True, False]
    assert time.monotonic() - stopped <= 0.5 + 1.0  # within its lease (and one renewal's timeouts)
    with pytest.raises(NotLeader, match="Redis is unreachable"):
        km.service.read(admin.stats)
    redis_server.start()
    assert km.election.tick() == 0.0 and km.election.leading  # its lease lapsed with Redis down: free again
    assert snapshot(km.service.manager, clock=True, last_ops=True) == acknowledged


def test_a_graceful_stop_releases_the_lease_and_the_standby_takes_over_at_its_next_poll(redis_server):
    old, new = kvmanager(redis_server.url, "old:1"), kvmanager(redis_server.url, "new:2")
    old.election.tick()
    history(old.service)
    new.election.tick()
    assert not new.election.leading
    old.election.close()
    assert new.election.tick() == 0.0 and new.election.leading
    assert new.service.manager.requests.keys() == {"a", "b"}


def test_the_first_election_waits_out_a_dead_holders_lease_but_not_a_live_leaders(redis_server):
    client = connect(redis_server.url)
    client.set(f"{PREFIX}:leader", "dead:1 nonce", px=600)  # a leader killed just before this restart
    km = kvmanager(redis_server.url, "a:1")
    t0 = time.monotonic()
    assert km.election.first(threading.Event())
    assert 0.3 < time.monotonic() - t0 < 1.5 and km.lease.holder()[0] == "a:1"

    km.election.spawn()  # a live leader renews
    try:
        standby = kvmanager(redis_server.url, "b:2")
        t0 = time.monotonic()
        assert not standby.election.first(threading.Event())
        assert time.monotonic() - t0 < TTL_S  # it saw a renewal, well before the lease could have lapsed
    finally:
        km.election.close()


# -- over gRPC ------------------------------------------------------------------------------------------------
def health_of(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=MANAGER_SERVICE),
                                                         timeout=5).status


def test_a_retried_step_pages_crosses_a_leader_change_to_the_remembered_answer(redis_server):
    services = [KVService(store=CallLog(connect(redis_server.url), PREFIX, background=False)) for _ in range(2)]
    for service in services:
        service.leading = False  # a standby until it wins (its server starts NOT_SERVING)
    servers = [start_kvmanager_server(service, admin_token="T") for service in services]
    try:
        kms = [kvmanager(redis_server.url, f"127.0.0.1:{server.port}", service=service)
               for service, server in zip(services, servers, strict=True)]
        for km, server in zip(kms, servers, strict=True):
            km.election.on_role = lambda leading, server=server: report_leadership(server, leading)
        old, new = kms
        ports = [s.port for s in servers]
        assert [health_of(p) for p in ports] == [health_pb2.HealthCheckResponse.NOT_SERVING] * 2
        old.election.tick()
        new.election.tick()
        assert [health_of(p) for p in ports] == [health_pb2.HealthCheckResponse.SERVING,
                                                 health_pb2.HealthCheckResponse.NOT_SERVING]
        with grpc.insecure_channel(f"127.0.0.1:{ports[1]}") as channel, pytest.raises(grpc.RpcError) as refused:
            kvmanager_pb2_grpc.KVManagerServiceStub(channel).Place(pb.PlaceRequest(tenant="A"), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"the leader is 127.0.0.1:{ports[0]}" in refused.value.details()

        client = KVManagerClient(f"127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}", timeout_s=5, retry_for_s=10)
        try:
            client.register(spec("w0"))
            step = StepOps(1, allocations=(alloc("a", "A", P + [1]),))
            first = client.step_pages(step)
            pause_past_the_lease(old)  # the answer was lost, say, and the leader paused past its lease
            new.election.tick()
            old.election.tick()
            assert not old.election.leading and new.election.leading
            wait_for(lambda: health_of(ports[0]) == health_pb2.HealthCheckResponse.NOT_SERVING,
                     "the deposed leader reports NOT_SERVING", timeout_s=5.0)
            again = client.step_pages(step)  # the gateway's retry, same step_id: on the new leader
            assert again.allocations == first.allocations
            assert new.service.manager.requests["a"].page_table == first.allocations[0].page_table
        finally:
            client.close()
    finally:
        for server in servers:
            server.stop(0)
