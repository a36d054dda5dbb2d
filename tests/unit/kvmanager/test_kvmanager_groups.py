"""Page groups in the kvmanager (issue 42): a pool for a model mixing full-attention and sliding-window layers
holds the full layers' pages and, apart, the sliding layers' (a second page-id space), each request with a page
table in each. Only the sliding group's pages fall out of the window.

    page_size 4, sliding_group_window 8, a prompt of 18 tokens hitting 4 cached blocks:
    page_table        [ 0 | 1 | 2 | 3 | 5 ]     the full layers: every hit held
    group_page_table  [ - | - | 2 | 3 | 5 ]     the sliding layers: the query at 16 reads 9..16 (pages 2, 3)
"""

from __future__ import annotations

import pytest
from kvmanager_steps import checked_step as step
from kvmanager_steps import manager_with

from kvserve.common.embedded_redis import EmbeddedRedis
from kvserve.common.errors import InvalidRequest
from kvserve.common.pages import HOLE
from kvserve.common.redis_client import connect
from kvserve.common.wire.pages import (
    OpStatus,
    PageAllocation,
    PageCommit,
    PageExtension,
    PageFree,
    PageRelease,
    PinPoint,
    PoolSpec,
    StepOps,
)
from kvserve.kvmanager import admin
from kvserve.kvmanager import snapshot as snapshot_format
from kvserve.kvmanager.call_log import CallLog
from kvserve.kvmanager.hashing import chain_hashes
from kvserve.kvmanager.invariants import check_invariants
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.pool import PagePool
from kvserve.kvmanager.service import KVService

PS = 4  # page size
WINDOW = 8  # the sliding layers' window: a query at p reads p - 7 .. p
PROMPT = tuple(range(100, 118))  # 18 tokens: 4 full pages and 2 tokens of a fifth


def gspec(worker="w0", epoch=1, num_pages=16, group_pages=12, **changes) -> PoolSpec:
    spec = PoolSpec(worker, epoch, num_pages, PS, "fp", "float32", 100, sliding_group_pages=group_pages,
                    sliding_group_window=WINDOW, sliding_group_bytes_per_token=40)
    return PoolSpec(**{**{f: getattr(spec, f) for f in spec.__dataclass_fields__}, **changes})


def mgr_with(*specs) -> KVManager:
    return manager_with(*(specs or (gspec(),)))



def alloc(m, req_id, tokens, worker="w0", chunk_tokens=0, tenant="t"):
    op = PageAllocation(req_id, tenant, tuple(tokens), worker, chunk_tokens=chunk_tokens)
    return step(m, allocations=[op]).allocations[0]


def commit(m, req_id, start, tokens, computed=None):
    op = PageCommit(req_id, start, tuple(tokens), computed if computed is not None else start + len(tokens))
    return step(m, commits=[op]).commits[0]


def cached_prompt(*specs) -> KVManager:
    """PROMPT's 4 full pages committed and freed: cached in both groups (pages 0..3 of each)."""
    m = mgr_with(*specs)
    alloc(m, "a", PROMPT)
    commit(m, "a", 0, PROMPT[:16], computed=18)
    step(m, frees=[PageFree("a")])
    return m


def evict_block(pool: PagePool, block_index: int) -> None:
    pool.evict(next(b.page_id for b in pool.index.values() if b.block_index == block_index))


# -- registration ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("changes", "message"), [
    ({"sliding_group_window": 2}, "sliding_group_window must be >= page_size 4"),
    ({"sliding_group_bytes_per_token": 0}, "sliding_group_bytes_per_token must be > 0"),
    ({"sliding_group_pages": (1 << 24) + 1}, "sliding_group_pages 16777217 is past what the kvmanager tracks"),
    ({"sliding_window": 8}, "sliding_window and attention_sinks must be 0"),
    ({"kv_store": True}, "page groups do not work with the shared KV tier yet"),
    ({"role": "prefill"}, "role must be \"both\""),
    ({"sliding_group_pages": -1}, "sliding_group_pages must be >= 0"),
    ({"sliding_group_pages": 0}, "sliding_group_window must be 0 without page groups"),
    ({"sliding_group_pages": 0, "sliding_group_window": 0}, "sliding_group_bytes_per_token must be 0 without"),
])
def test_a_bad_grouped_spec_is_refused_naming_the_field_and_nothing_is_registered(changes, message):
    m = KVManager()
    with pytest.raises(InvalidRequest, match=message):
        m.register_worker(gspec(**changes))
    assert m.pools == {}


def test_a_grouped_pool_has_a_sliding_group_of_its_own_pages_window_and_chains():
    pool = mgr_with().pools["w0"]
    group = pool.group
    assert (pool.spec.num_pages, group.spec.num_pages, group.spec.bytes_per_token) == (16, 12, 40)
    assert (pool.window.slides, group.window.window, group.group) == (False, WINDOW, None)
    assert group.spec.worker_id == "w0" and group.spec.page_size == PS
    assert group.seed_for("t") != pool.seed_for("t")  # its hash chains are its own
    assert mgr_with(gspec(group_pages=0, sliding_group_window=0, sliding_group_bytes_per_token=0)).pools[
        "w0"].group is None


# -- allocation, extension, commit, release, free -------------------------------------------------------------
def test_an_allocation_gives_both_tables_and_a_hit_holds_only_the_sliding_pages_its_window_reads():
    m = mgr_with()
    pool, group = m.pools["w0"], m.pools["w0"].group
    a = alloc(m, "a", PROMPT)
    assert (a.page_table, a.group_page_table, a.num_cached_tokens) == ([0, 1, 2, 3, 4], [0, 1, 2, 3, 4], 0)
    commit(m, "a", 0, PROMPT[:16], computed=18)
    req = m.requests["a"]
    assert req.group.block_hashes == chain_hashes(group.seed_for("t"), PROMPT[:16], PS)
    assert set(group.index) == set(req.group.block_hashes) and not set(group.index) & set(pool.index)
    b = alloc(m, "b", PROMPT)
    assert (b.num_cached_tokens, b.num_committed_tokens) == (16, 16)
    assert b.page_table == [0, 1, 2, 3, 5] and b.group_page_table == [HOLE, HOLE, 2, 3, 5]
    assert pool.ref_cnt[:6] == [2, 2, 2, 2, 1, 1] and group.ref_cnt[:6] == [1, 1, 2, 2, 1, 1]
    # its chain in the sliding group covers the hit, held or not: its commits continue it
    assert m.requests["b"].group.block_hashes == req.group.block_hashes
    assert m.tenants["t"].prefix_cache_hits == 16
    assert admin.page_table(m, "b").group_page_table == [HOLE, HOLE, 2, 3, 5]


def test_a_chunked_allocation_covers_its_first_chunk_in_the_sliding_group_and_extensions_grow_both():
    m = mgr_with()
    a = alloc(m, "a", range(200, 240), chunk_tokens=8)  # 40 tokens: 10 pages of full layers, 2 sliding
    assert a.page_table == list(range(10)) and a.group_page_table == [0, 1]
    e = step(m, extensions=[PageExtension("a", 16)]).extensions[0]
    assert (e.new_page_ids, e.group_new_page_ids, e.num_pages) == ([], [2, 3], 10)
    e = step(m, extensions=[PageExtension("a", 44)]).extensions[0]
    assert (e.new_page_ids, e.group_new_page_ids) == ([10], [4, 5, 6, 7, 8, 9, 10])
    assert len(m.requests["a"].page_table) == len(m.requests["a"].group.page_table) == 11
    with pytest.raises(InvalidRequest, match="more pages than the sliding group of pool"):  # a whole prompt
        alloc(m, "b", range(300, 352))


def test_commits_releases_and_frees_keep_both_groups_ref_cnts_and_lists_exact():
    m = mgr_with()
    pool, group = m.pools["w0"], m.pools["w0"].group
    alloc(m, "a", PROMPT)
    commit(m, "a", 0, PROMPT[:16], computed=18)
    e = step(m, extensions=[PageExtension("a", 21)]).extensions[0]
    assert (e.new_page_ids, e.group_new_page_ids) == ([5], [5])
    r = step(m, releases=[PageRelease("a", (1, 2))]).releases[0]
    assert (r.status, r.num_released) == (OpStatus.OK, 2)
    assert m.requests["a"].page_table == [0, 1, 2, 3, 4, 5]  # the full layers keep every page
    assert m.requests["a"].group.page_table == [0, HOLE, HOLE, 3, 4, 5]
    assert list(group.evictable) == [1, 2] and group.num_window_released == 2 and pool.num_window_released == 0
    assert pool.ref_cnt[:6] == [1] * 6 and group.ref_cnt[:6] == [1, 0, 0, 1, 1, 1]
    for bad, message in (((5,), "last page of its table"), ((6,), "outside its page table")):
        with pytest.raises(InvalidRequest, match=message):
            step(m, releases=[PageRelease("a", bad)])
    step(m, frees=[PageFree("a")])
    assert pool.ref_cnt == [0] * 16 and group.ref_cnt == [0] * 12
    # tail first in each group: the chain's end is evicted first; uncommitted pages go to the free list
    assert list(pool.evictable) == [3, 2, 1, 0] and list(pool.free)[-2:] == [5, 4]
    assert list(group.evictable) == [1, 2, 3, 0] and list(group.free)[-2:] == [5, 4]
    assert (pool.num_requests, group.num_requests) == (0, 0)


def test_out_of_pages_in_the_sliding_group_alone_takes_nothing_in_either_group():
    m = mgr_with(gspec(group_pages=6))
    pool, group = m.pools["w0"], m.pools["w0"].group
    alloc(m, "a", range(200, 212))  # 3 pages in each group: the sliding group has 3 left
    before = (list(pool.ref_cnt), list(pool.free), list(group.ref_cnt), list(group.free), m.clock)
    b = alloc(m, "b", PROMPT)  # 5 pages: the full layers have 13, the sliding 3
    assert (b.status, b.num_pages_short, b.page_table, b.group_page_table) == (OpStatus.OUT_OF_PAGES, 2, [], [])
    assert (list(pool.ref_cnt), list(pool.free), list(group.ref_cnt), list(group.free), m.clock) == before
    assert "b" not in m.requests
    alloc(m, "c", range(300, 308))  # 2 more: 1 left
    before = (list(pool.ref_cnt), list(pool.free), list(group.ref_cnt), list(group.free))
    e = step(m, extensions=[PageExtension("a", 20)]).extensions[0]  # 2 more pages in each group
    assert (e.status, e.num_pages_short, e.num_pages) == (OpStatus.OUT_OF_PAGES, 1, 3)
    assert (list(pool.ref_cnt), list(pool.free), list(group.ref_cnt), list(group.free)) == before
    assert len(m.requests["a"].page_table) == len(m.requests["a"].group.page_table) == 3


# -- the joint prefix hit ---------------------------------------------------------------------------------------
def test_an_evicted_full_block_shortens_the_hit_there():
    m = cached_prompt()
    evict_block(m.pools["w0"], 2)
    assert m.place("t", PROMPT, {}).num_cached_tokens == 8
    b = alloc(m, "b", PROMPT)
    assert b.num_cached_tokens == 8 and b.page_table[:2] == [0, 1]
    assert b.group_page_table[:2] == [0, 1]  # the query at 8 reads 1..8: sliding pages 0 and 1


def test_an_evicted_sliding_block_inside_the_window_of_the_hit_point_lowers_the_hit():
    m = cached_prompt()
    evict_block(m.pools["w0"].group, 3)  # the query at 16 reads pages 2, 3; at 12 pages 1, 2
    assert m.place("t", PROMPT, {}).num_cached_tokens == 12
    assert admin.probe(m, "t", PROMPT).num_cached_tokens == 12
    b = alloc(m, "b", PROMPT)
    assert (b.num_cached_tokens, b.num_committed_tokens) == (12, 12)
    assert b.page_table[:3] == [0, 1, 2] and b.page_table[3] not in (0, 1, 2, 3)  # block 3 is not used
    assert b.group_page_table[:3] == [HOLE, 1, 2] and HOLE not in b.group_page_table[3:]
    assert len(m.requests["b"].block_hashes) == len(m.requests["b"].group.block_hashes) == 3
    assert m.tenants["t"].prefix_cache_hits == 12


def test_an_evicted_sliding_block_outside_the_window_leaves_the_hit_whole():
    m = cached_prompt()
    evict_block(m.pools["w0"].group, 0)  # out of the window of the query at 16 (9..16)
    assert m.place("t", PROMPT, {}).num_cached_tokens == 16
    b = alloc(m, "b", PROMPT)
    assert b.num_cached_tokens == 16 and b.group_page_table[:4] == [HOLE, HOLE, 2, 3]
    # and once block 2 goes too, the hit falls back to the largest point whose window is whole: the query at 8
    # reads pages 0 (gone) and 1, at 4 page 0: nothing
    step(m, frees=[PageFree("b")])
    evict_block(m.pools["w0"].group, 2)
    assert m.place("t", PROMPT, {}).num_cached_tokens == 0


def test_placement_counts_the_joint_hit_not_the_full_groups():
    """w0 (grouped) holds PROMPT's 4 full-layer blocks but only sliding blocks 0 and 1; w1 (dense) holds 3
    blocks: the joint hit (2 pages) loses to w1's 3 pages."""
    m = cached_prompt(gspec("w0"), PoolSpec("w1", 1, 16, PS, "fp", "float32", 100))
    for i in (2, 3):
        evict_block(m.pools["w0"].group, i)
    alloc(m, "d", PROMPT[:13], worker="w1")
    commit(m, "d", 0, PROMPT[:12], computed=13)
    step(m, frees=[PageFree("d")])
    assert m.place("t", PROMPT, {}).worker_id == "w1"
    assert m.place("t", PROMPT, {}, only=("w0",)).num_cached_tokens == 8
    hits = {h.worker_id: h.num_cached_tokens for h in admin.probe(m, "t", PROMPT).hits}
    assert hits == {"w0": 8, "w1": 12}


def test_a_grouped_pool_is_no_peer_to_pull_from():
    m = cached_prompt(gspec("w0"), PoolSpec("w1", 1, 16, PS, "fp", "float32", 100))
    op = PageAllocation("p", "t", PROMPT, "w1", pull_peers=True)
    a = step(m, allocations=[op]).allocations[0]
    assert (a.num_cached_tokens, a.peer_loads) == (0, [])


# -- persistence ---------------------------------------------------------------------------------------------
def pool_state(pool: PagePool) -> tuple:
    blocks = {h: (b.parent_hash, b.tenant, b.page_id, b.block_index, b.last_used, b.pinned)
              for h, b in pool.index.items()}
    return (pool.spec, list(pool.ref_cnt), list(pool.free), list(pool.evictable), blocks, list(pool.owner),
            {t: n for t, n in pool.usage.items() if n}, pool.num_requests, pool.num_evicted,
            pool.num_window_released)


def exact(m: KVManager) -> tuple:
    """Everything a restart must reproduce, both groups of every pool."""
    pools = {w: (pool_state(p), pool_state(p.group) if p.group is not None else None) for w, p in m.pools.items()}
    return pools, dict(m.requests), dict(m.stale), dict(m.tenants), m.clock, dict(m.recent)


def grouped_history(svc: KVService) -> None:
    """Allocations with hits and holes, a chunked prefill, commits, extensions, window releases, an eviction of
    sliding blocks by a new request, frees, and a stale request after a new epoch; every call through ``svc``."""
    svc.register_worker(gspec("w0", num_pages=20, group_pages=10))
    svc.register_worker(gspec("w1", num_pages=8, group_pages=8))
    svc.step(StepOps(1, allocations=(PageAllocation("a", "t", PROMPT, "w0"),
                                     PageAllocation("c", "u", tuple(range(900, 910)), "w1"))))
    svc.step(StepOps(2, commits=(PageCommit("a", 0, PROMPT[:16], 18),), extensions=(PageExtension("a", 21),)))
    svc.step(StepOps(3, releases=(PageRelease("a", (0, 1)),)))
    r = svc.step(StepOps(4, allocations=(PageAllocation("b", "t", PROMPT, "w0"),)))
    assert r.allocations[0].group_page_table == [HOLE, HOLE, 2, 3, 6]
    svc.step(StepOps(5, frees=(PageFree("a"),)))
    # e takes the sliding group's free pages, then evicts a's released block 0 from its LRU
    r = svc.step(StepOps(6, allocations=(PageAllocation("e", "u", tuple(range(700, 740)), "w0", chunk_tokens=8),)))
    assert r.allocations[0].group_page_table == [7, 8] and svc.manager.pools["w0"].group.num_evicted == 0
    r = svc.step(StepOps(7, extensions=(PageExtension("e", 24),)))
    assert r.extensions[0].group_new_page_ids == [9, 5, 4, 0]
    assert svc.manager.pools["w0"].group.num_evicted == 1
    svc.register_worker(gspec("w1", epoch=2, num_pages=8, group_pages=8))  # c becomes stale
    assert svc.step(StepOps(8, releases=(PageRelease("c", (0,)),))).releases[0].status is OpStatus.STALE_EPOCH
    # f hits all 4 blocks (b holds its window's, 2 and 3) and evicts block 1, out of its window, for a page
    r = svc.step(StepOps(9, allocations=(PageAllocation("f", "t", PROMPT, "w0"),)))
    assert r.allocations[0].num_cached_tokens == 16 and r.allocations[0].group_page_table == [HOLE, HOLE, 2, 3, 1]


def test_a_snapshot_round_trip_restores_both_groups_and_every_requests_group_exactly():
    svc = KVService()  # NullStore: the snapshot is encoded by the test
    grouped_history(svc)
    assert svc.manager.requests["b"].group is not None
    loaded = KVManager()
    snapshot_format.decode(snapshot_format.encode(svc.manager, []), loaded)  # runs check_invariants
    assert exact(loaded) == exact(svc.manager)
    assert loaded.requests["b"].group.page_table == [HOLE, HOLE, 2, 3, 6]
    # the reloaded manager carries on as the original does
    ops = StepOps(10, commits=(PageCommit("b", 16, (*PROMPT[16:], 1, 2), 20),), extensions=(PageExtension("b", 25),),
                  releases=(PageRelease("b", (2,)),), frees=(PageFree("e"),))
    out = svc.manager.step(ops)
    assert loaded.step(ops) == out and out.extensions[0].status is OpStatus.OK
    check_invariants(loaded)
    assert exact(loaded) == exact(svc.manager)


@pytest.fixture
def redis_url(tmp_path):
    with EmbeddedRedis(tmp_path / "redis") as server:
        yield server.url


@pytest.mark.parametrize("snapshot_every", [1000, 3])
def test_a_restart_replays_the_call_log_into_the_same_grouped_state(redis_url, snapshot_every):
    store = CallLog(connect(redis_url), snapshot_every=snapshot_every, background=False)
    svc = KVService(KVManager(), store)
    grouped_history(svc)
    assert (store.gen == 0) == (snapshot_every == 1000)  # the replay alone, or snapshots then the log
    loaded = KVManager()
    CallLog(connect(redis_url)).load(loaded)  # runs check_invariants
    assert exact(loaded) == exact(svc.manager)
    assert loaded.pools["w0"].group.num_window_released == 2 and loaded.stale["c"].group is not None


def test_admin_stats_and_page_table_show_the_sliding_group_over_the_wire_and_in_the_cli():
    """What `kvserve admin stats` and `page-table` print for a grouped pool: a "w0/sliding" row counted from the
    sliding pool, and both of a request's tables, the sliding one with its holes."""
    from types import SimpleNamespace

    from kvserve.kvmanager.convert import page_table_to_proto, stats_to_proto
    from kvserve.services.cli_admin import RENDER

    m = cached_prompt()
    alloc(m, "b", PROMPT)  # a hit: the sliding group holds only the pages its window reads
    step(m, releases=[PageRelease("b", (2,))])
    stats = stats_to_proto(admin.stats(m), store_ok=True)
    (pool,) = stats.pools
    assert pool.sliding_group.sliding_window == WINDOW and pool.sliding_group.num_pages == 12
    assert (pool.sliding_group.num_used_pages, pool.sliding_group.num_window_released_pages) == (2, 1)
    assert (pool.num_used_pages, pool.num_window_released_pages) == (5, 0)
    rows = [line.split() for line in RENDER["stats"](stats, SimpleNamespace()).splitlines()]
    assert [r[0] for r in rows[2:4]] == ["w0", "w0/sliding"] and rows[3][-3:] == [str(WINDOW), "-", "1"]
    t = page_table_to_proto(admin.page_table(m, "b"))
    assert list(t.group_page_table) == [HOLE, HOLE, HOLE, 3, 5]
    assert [p.kind for p in t.group_pages] == ["released"] * 3 + ["held"] * 2
    out = RENDER["page-table"](t, SimpleNamespace())
    assert "full layers" in out and "sliding layers" in out and "(3 released by its window)" in out


def test_a_tenants_evictions_in_the_sliding_group_are_its_own_and_outlive_its_pool():
    """A sliding group smaller than the full one evicts there first: tenant b's allocation takes tenant a's cached
    sliding pages while the full pool still has free ones. Admin stats count those evictions as a's (evicted) and
    b's (caused), and keep them when the pool is dropped (a new epoch), as for the full pool's."""
    m = cached_prompt(gspec(group_pages=6))  # a's 4 blocks cached in each group: the sliding group has 2 free
    pool, group = m.pools["w0"], m.pools["w0"].group
    alloc(m, "b", range(300, 316), tenant="b")  # 4 pages in each group: 2 of a's sliding blocks go
    assert (group.num_evicted_from, group.num_evicted_by) == ({"t": 2}, {"b": 2})
    assert pool.num_evicted_from == {}  # the full pool had room
    def counts():
        return {t.tenant: (t.num_evicted_pages, t.num_evictions_caused) for t in admin.stats(m).tenants}

    assert counts()["t"] == (2, 0) and counts()["b"] == (0, 2)
    step(m, frees=[PageFree("b")])
    m.register_worker(gspec(epoch=2, group_pages=6))  # restarted: both groups are new
    assert counts()["t"] == (2, 0) and counts()["b"] == (0, 2)


# -- pins ------------------------------------------------------------------------------------------------------
PINNED = tuple(range(500, 524))  # 6 full pages: the query after them (at 24) reads blocks 4 and 5 in the window


def flood_sliding_group(m, tenant="b") -> None:
    """Another tenant's prompt that takes every sliding page it can (evicting every unpinned cached block there),
    computed, committed and freed."""
    tokens = tuple(range(900, 900 + PS * m.pools["w0"].group.num_free + PS * m.pools["w0"].group.num_evictable))
    alloc(m, "flood", tokens, tenant=tenant)
    commit(m, "flood", 0, tokens[:len(tokens) // PS * PS], computed=len(tokens))
    step(m, frees=[PageFree("flood")])


def sliding_pinned(m) -> list[int]:
    return sorted(b.block_index for b in m.pools["w0"].group.index.values() if b.pinned)


def test_a_pinned_prefix_keeps_the_sliding_window_its_hit_reads_and_only_that():
    """A request's pin over a grouped pool pins the full layers' chain and, in the sliding group, the window the
    query after the pinned prefix reads (blocks 4 and 5 of 6, window 8): a flood of the sliding group evicts the
    rest, and the next request still hits the whole pinned prefix (without the window pinned, the joint hit would
    fall to 0)."""
    m = mgr_with(gspec(num_pages=32, group_pages=8))
    op = PageAllocation("a", "t", PINNED + (7,), "w0", pins=(PinPoint(len(PINNED), 60),))
    a = step(m, allocations=[op]).allocations[0]
    assert a.status is OpStatus.OK and a.num_pinned_tokens == 0
    assert commit(m, "a", 0, PINNED, computed=25).num_pinned_tokens == len(PINNED)
    step(m, frees=[PageFree("a")])
    assert sliding_pinned(m) == [4, 5]
    flood_sliding_group(m)
    assert sliding_pinned(m) == [4, 5] and len(m.pools["w0"].group.index) == 2 + 6  # the flood's 6 blocks
    hit = alloc(m, "again", PINNED + (8, 9))
    assert hit.num_cached_tokens == len(PINNED)


def test_an_admin_pin_takes_the_window_and_an_unpin_releases_every_sliding_pin():
    """An operator's or a soft admin pin on a grouped pool pins the window too (and a snapshot keeps it); its unpin
    removes the pins of every sliding block of the prefix."""
    m = mgr_with(gspec(num_pages=32, group_pages=8))
    alloc(m, "a", PINNED + (7,))
    commit(m, "a", 0, PINNED, computed=25)
    step(m, frees=[PageFree("a")])
    result = admin.pin(m, "t", PINNED, ttl_s=60)
    assert result.num_pinned_tokens == len(PINNED) and sliding_pinned(m) == [4, 5]
    check_invariants(m)
    loaded = KVManager()  # a snapshot keeps the sliding pins
    snapshot_format.decode(snapshot_format.encode(m, []), loaded)
    check_invariants(loaded)
    assert sliding_pinned(loaded) == [4, 5]
    flood_sliding_group(m)
    assert alloc(m, "again", PINNED + (8, 9)).num_cached_tokens == len(PINNED)
    step(m, frees=[PageFree("again")])
    assert admin.unpin(m, "t", PINNED) == 6
    assert sliding_pinned(m) == [] and not m.pins
    check_invariants(m)
