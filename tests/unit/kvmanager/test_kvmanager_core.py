"""The kvmanager domain on tiny real pools: exact page ids, ref_cnts, eviction order, and bad input."""

from __future__ import annotations

import pytest
from step_ids import next_step_id, step_id_for

from kvserve.common.errors import InvalidRequest, StaleEpoch
from kvserve.common.wire.pages import OpStatus, PageAllocation, PageCommit, PageExtension, PageFree, PoolSpec, StepOps
from kvserve.kvmanager import admin
from kvserve.kvmanager.errors import StaleStep, UnknownRequest, UnknownWorker
from kvserve.kvmanager.hashing import chain_hashes, namespace_seed
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.placement import Placement

PS = 4  # page size


def spec(worker="w0", epoch=1, num_pages=8, fingerprint="fp", kv_dtype="float32", kv_scales=""):
    return PoolSpec(worker, epoch, num_pages, PS, fingerprint, kv_dtype, 100, kv_scales)


def mgr_with(*specs) -> KVManager:
    m = KVManager()
    for s in specs or (spec(),):
        m.register_worker(s)
    return m


def alloc(m, req_id, tokens, tenant="t", worker="w0", step=None):
    op = PageAllocation(req_id, tenant, tuple(tokens), worker)
    return m.step(StepOps(step_id_for(m, step), allocations=(op,))).allocations[0]


def commit(m, req_id, start, tokens, computed=None, step=None):
    op = PageCommit(req_id, start, tuple(tokens), computed if computed is not None else start + len(tokens))
    return m.step(StepOps(step_id_for(m, step), commits=(op,))).commits[0]


def free(m, req_id, step=None):
    return m.step(StepOps(step_id_for(m, step), frees=(PageFree(req_id),))).frees[0]


def ref_cnts(m, worker="w0"):
    return list(m.pools[worker].ref_cnt)


def test_hash_chain_is_stable_and_namespaced():
    seed = namespace_seed("t", "fp", "float32", 4)
    tokens = list(range(10))
    assert chain_hashes(seed, tokens, 4) == chain_hashes(seed, tokens[:8], 4)  # partial tail ignored
    assert len(chain_hashes(seed, tokens, 4)) == 2 and len(seed) == 16
    # stable across processes and releases: a pinned value (xxh3-128 has no per-process seed), which an
    # unquantised pool's empty scale scheme leaves as it was, so the caches persisted before it stay valid
    assert seed.hex() == "954bc5e5f22a32b2e8d83369929e3c1d" == namespace_seed("t", "fp", "float32", 4, "").hex()
    others = [namespace_seed("u", "fp", "float32", 4), namespace_seed("t", "fp2", "float32", 4),
              namespace_seed("t", "fp", "bfloat16", 4), namespace_seed("t", "fp", "float32", 8),
              namespace_seed("t", "fp", "int8", 4, "token_head"), namespace_seed("t", "fp", "int8", 4, "tensor"),
              namespace_seed("t", "fp", "fp8_e4m3", 4, "token_head"),
              namespace_seed("t", "fp", "fp8_e5m2", 4, "token_head")]
    firsts = {chain_hashes(other, tokens, 4)[0] for other in [seed, *others]}
    assert len(firsts) == len(others) + 1  # all different
    # a block's hash depends on everything before it
    assert chain_hashes(seed, [9, 9, 9, 9] + tokens[4:8], 4)[1] != chain_hashes(seed, tokens, 4)[1]


def test_a_window_or_sinks_give_their_own_namespace_and_no_window_keeps_the_old_seed():
    dense = namespace_seed("t", "fp", "float32", 4)
    # both 0: byte-identical to the seed before windows existed (the pinned value above), so caches persisted
    # by dense pools stay valid
    assert namespace_seed("t", "fp", "float32", 4, "", 0, 0) == dense
    assert dense.hex() == "954bc5e5f22a32b2e8d83369929e3c1d"
    windowed = namespace_seed("t", "fp", "float32", 4, "", 1024, 0)
    sinks = namespace_seed("t", "fp", "float32", 4, "", 1024, 4)
    assert len({dense, windowed, sinks, namespace_seed("t", "fp", "float32", 4, "", 512, 0),
                namespace_seed("t", "fp", "int8", 4, "token_head", 1024, 4)}) == 5
    # a pool's seed follows its spec: the same tokens never hit across a windowed and a dense pool
    m = mgr_with(spec(), PoolSpec("w1", 1, 8, PS, "fp", "float32", 100, "", 1024, 4))
    assert m.pools["w0"].seed_for("t") == dense and m.pools["w1"].seed_for("t") == sinks


@pytest.mark.parametrize("window,sinks,message", [
    (-4, 0, "sliding_window must be >= 0"),
    (8, -1, "attention_sinks must be >= 0"),
    (0, 4, "attention_sinks needs sliding_window"),
    (PS - 1, 0, "a sliding window of 3 tokens is smaller than a page"),
])
def test_a_bad_window_is_refused_at_registration_and_registers_nothing(window, sinks, message):
    m = KVManager()
    with pytest.raises(InvalidRequest, match=message):
        m.register_worker(PoolSpec("w0", 1, 8, PS, "fp", "float32", 100, "", window, sinks))
    assert m.pools == {}
    m.register_worker(PoolSpec("w0", 1, 8, PS, "fp", "float32", 100, "", PS, 1))  # a one-page window, one sink
    assert m.pools["w0"].spec.sliding_window == PS


def test_allocate_fresh_pages_in_order():
    m = mgr_with()
    r = alloc(m, "a", range(10))  # 10 tokens -> 3 pages
    assert r.status == OpStatus.OK and r.page_table == [0, 1, 2] and r.num_cached_tokens == 0
    assert r.worker_id == "w0" and r.epoch == 1
    assert ref_cnts(m)[:4] == [1, 1, 1, 0]
    assert alloc(m, "b", range(5)).page_table == [3, 4]


def test_prefix_hit_reuses_committed_pages_and_caps_at_last_token():
    m = mgr_with()
    prompt = list(range(100, 112))  # 12 tokens = 3 full pages
    assert alloc(m, "a", prompt).page_table == [0, 1, 2]
    assert commit(m, "a", 0, prompt).num_committed_tokens == 12
    b = alloc(m, "b", prompt)  # same 12 tokens: the last page must be computed again (its last token's logits)
    assert b.num_cached_tokens == 8 and b.page_table == [0, 1, 3]
    assert ref_cnts(m)[:4] == [2, 2, 1, 1]
    c = alloc(m, "c", prompt + [7])  # 13 tokens: all 3 full pages hit
    assert c.num_cached_tokens == 12 and c.page_table == [0, 1, 2, 4]
    assert m.tenants["t"].prefix_cache_queries == 12 + 12 + 13 and m.tenants["t"].prefix_cache_hits == 20


def test_other_tenant_never_hits():
    m = mgr_with(spec(num_pages=12))
    prompt = list(range(13))
    alloc(m, "a", prompt, tenant="A")
    commit(m, "a", 0, prompt[:12])
    assert alloc(m, "b", prompt, tenant="B").num_cached_tokens == 0
    assert alloc(m, "c", prompt, tenant="A").num_cached_tokens == 12


def test_free_releases_tail_first_and_lru_evicts_chain_end_first():
    m = mgr_with(spec(num_pages=6))
    prompt = list(range(12))
    alloc(m, "a", prompt + [1])  # pages 0 1 2 3
    commit(m, "a", 0, prompt)  # blocks in pages 0 1 2; page 3 holds a partial page
    free(m, "a")
    pool = m.pools["w0"]
    assert list(pool.evictable) == [2, 1, 0]  # released tail first
    assert list(pool.free) == [4, 5, 3]  # the uncommitted page went back to the free list
    assert (pool.num_used, pool.num_cached, pool.num_free) == (0, 3, 3)
    r = alloc(m, "b", range(50, 66))  # 4 pages: 3 free, then evict the LRU head: page 2 (the chain's end)
    assert r.page_table == [4, 5, 3, 2] and pool.num_evicted == 1
    free(m, "b")
    c = alloc(m, "c", prompt + [1])
    assert c.num_cached_tokens == 8 and c.page_table[:2] == [0, 1]  # blocks 0 and 1 still hit


def test_hit_moves_page_out_of_lru_and_back_to_its_end():
    m = mgr_with(spec(num_pages=6))
    p1, p2 = list(range(8)), list(range(20, 28))
    for rid, p in (("a", p1), ("b", p2)):
        alloc(m, rid, p + [0])
        commit(m, rid, 0, p)
        free(m, rid)
    pool = m.pools["w0"]
    assert list(pool.evictable) == [1, 0, 4, 3]
    alloc(m, "c", p1 + [5])  # hits pages 0, 1
    assert list(pool.evictable) == [4, 3] and pool.ref_cnt[0] == pool.ref_cnt[1] == 1
    free(m, "c")
    assert list(pool.evictable)[:2] == [4, 3] and set(list(pool.evictable)[2:]) == {0, 1}


def test_duplicate_block_is_deduplicated_not_indexed_twice():
    m = mgr_with()
    prompt = list(range(8))
    alloc(m, "a", prompt + [1])
    alloc(m, "b", prompt + [2])  # computed concurrently: no hit yet
    commit(m, "a", 0, prompt)
    commit(m, "b", 0, prompt)
    pool = m.pools["w0"]
    assert len(pool.index) == 2 and {b.page_id for b in pool.index.values()} == {0, 1}
    free(m, "b")
    assert list(pool.free)[-3:] == [5, 4, 3]  # b's duplicate pages are plain pages again


def test_out_of_pages_is_a_result_that_changes_nothing():
    m = mgr_with(spec(num_pages=4))
    alloc(m, "a", range(12))
    r = alloc(m, "b", range(8))
    assert r.status == OpStatus.OUT_OF_PAGES and r.num_pages_short == 1 and r.page_table == []
    assert "b" not in m.requests and ref_cnts(m) == [1, 1, 1, 0]
    alloc(m, "c", range(4))
    ext = m.step(StepOps(next_step_id(m), extensions=(PageExtension("a", 16),))).extensions[0]
    assert ext.status == OpStatus.OUT_OF_PAGES and ext.num_pages_short == 1
    assert m.requests["a"].page_table == [0, 1, 2]


def test_extend_appends_pages():
    m = mgr_with()
    alloc(m, "a", range(4))
    e = m.step(StepOps(next_step_id(m), extensions=(PageExtension("a", 4),))).extensions[0]
    assert e.new_page_ids == [] and e.num_pages == 1
    e = m.step(StepOps(next_step_id(m), extensions=(PageExtension("a", 9),))).extensions[0]
    assert e.new_page_ids == [1, 2] and e.num_pages == 3


def test_step_applies_frees_before_allocations():
    m = mgr_with(spec(num_pages=2))
    alloc(m, "a", range(8))
    out = m.step(StepOps(next_step_id(m), frees=(PageFree("a"),),
                         allocations=(PageAllocation("b", "t", tuple(range(8)), "w0"),)))
    assert out.allocations[0].status == OpStatus.OK and out.allocations[0].page_table == [1, 0]  # freed tail first
    assert out.pools[0].num_free_pages == 0


def test_retried_call_with_same_step_id_is_not_applied_twice():
    m = mgr_with()
    ops = StepOps(7, allocations=(PageAllocation("a", "t", tuple(range(6)), "w0"),))
    first = m.step(ops)
    again = m.step(ops)
    assert again.allocations[0] == first.allocations[0] and ref_cnts(m)[:3] == [1, 1, 0]
    ext = StepOps(8, extensions=(PageExtension("a", 12),))
    e1, e2 = m.step(ext).extensions[0], m.step(ext).extensions[0]
    assert e1.new_page_ids == e2.new_page_ids == [2] and len(m.requests["a"].page_table) == 3
    with pytest.raises(StaleStep, match="older than step 8"):
        m.step(StepOps(7, extensions=(PageExtension("a", 16),)))


def test_an_allocation_older_than_the_call_that_freed_its_request_is_stale_not_a_new_request():
    """A gateway gave up on call 7 (admitting "a") and freed "a" in call 8; an attempt of call 7 still queued
    in the kvmanager must not allocate "a" again: nobody would ever free it."""
    m = mgr_with()
    admit = StepOps(7, allocations=(PageAllocation("a", "t", tuple(range(6)), "w0"),))
    m.step(admit)
    m.step(StepOps(8, frees=(PageFree("a"),)))
    with pytest.raises(StaleStep, match="older than step 8, which freed it"):
        m.step(admit)
    assert "a" not in m.requests and ref_cnts(m)[:3] == [0, 0, 0]
    # a newer call may reuse it
    again = m.step(StepOps(9, allocations=(PageAllocation("a", "t", tuple(range(6)), "w0"),)))
    assert again.allocations[0].status is OpStatus.OK and "a" in m.requests


def test_a_request_commits_its_last_pages_in_the_call_that_frees_it_and_a_retry_gets_the_same_answers():
    m = mgr_with()
    alloc(m, "a", range(10))  # pages 0, 1, 2
    ops = StepOps(5, commits=(PageCommit("a", 0, tuple(range(8)), 10),), frees=(PageFree("a"),))
    first = m.step(ops)
    assert first.commits[0].status is OpStatus.OK and first.commits[0].num_committed_tokens == 8
    assert "a" not in m.requests and ref_cnts(m)[:3] == [0, 0, 0]
    pool = m.pools["w0"]
    assert len(pool.index) == 2 and list(pool.evictable) == [1, 0]  # committed, then released tail first
    again = m.step(ops)  # the reply was lost: the same answers, nothing applied twice
    assert (again.commits, again.frees) == (first.commits, first.frees) and len(pool.index) == 2
    assert alloc(m, "b", range(12)).num_cached_tokens == 8  # the pages it committed on its way out serve b
    with pytest.raises(UnknownRequest, match="'a' is not live"):  # a later call is not a retry
        m.step(StepOps(9, commits=(PageCommit("a", 8, tuple(range(8, 12)), 12),)))

def test_reregistration_with_new_epoch_drops_old_pages_and_index():
    m = mgr_with()
    prompt = list(range(9))
    alloc(m, "a", prompt)
    commit(m, "a", 0, prompt[:8])
    res = m.register_worker(spec(epoch=2))
    assert res.previous_epoch == 1 and res.dropped_req_ids == ("a",)
    ext = m.step(StepOps(next_step_id(m), extensions=(PageExtension("a", 12),))).extensions[0]
    assert ext.status == OpStatus.STALE_EPOCH
    assert free(m, "a").status == OpStatus.STALE_EPOCH
    b = alloc(m, "b", prompt)
    assert b.epoch == 2 and b.num_cached_tokens == 0 and b.page_table == [0, 1, 2]
    with pytest.raises(StaleEpoch, match="older"):
        m.register_worker(spec(epoch=1))
    with pytest.raises(StaleEpoch, match="different pool"):
        m.register_worker(spec(epoch=2, num_pages=9))
    assert m.register_worker(spec(epoch=2)).dropped_req_ids == ()  # idempotent


def test_a_starting_scheduler_releases_what_a_dead_one_left_and_the_cache_stays():
    m = mgr_with(spec("w0"), spec("w1"))
    prompt = list(range(9))
    assert alloc(m, "a", prompt, worker="w0").page_table == [0, 1, 2]
    commit(m, "a", 0, prompt[:8])
    assert alloc(m, "b", range(50, 55), worker="w0").page_table == [3, 4]
    assert alloc(m, "c", range(60, 63), worker="w1").page_table == [0]
    assert m.register_worker(spec("w0")).released_req_ids == ()  # without the flag: nothing changes
    res = m.register_worker(spec("w0"), release_requests=True)
    assert res.released_req_ids == ("a", "b") and res.dropped_req_ids == () and res.previous_epoch == 1
    pool = m.pools["w0"]
    assert pool.num_requests == 0 and ref_cnts(m)[:5] == [0] * 5
    assert list(pool.evictable) == [1, 0] and list(pool.free)[-3:] == [2, 4, 3]  # as frees: tail first
    assert set(m.requests) == {"c"} and m.pools["w1"].num_requests == 1  # another worker's request stays
    assert free(m, "a").status == OpStatus.OK  # the dead scheduler's late free is harmless
    assert alloc(m, "a2", prompt, worker="w0").num_cached_tokens == 8  # the cache survived
    assert m.register_worker(spec("w0"), release_requests=True).released_req_ids == ("a2",)


def test_placement_prefers_the_longest_hit_balanced_against_load():
    m = mgr_with(spec("w0"), spec("w1"))
    prompt = list(range(13))

    def placed(req_id, tokens):  # as the gateway does it: Place, then the allocation names that worker
        return alloc(m, req_id, tokens, worker=m.place("t", tuple(tokens), {}).worker_id)

    assert placed("a", prompt).worker_id == "w0"  # tie: smallest worker_id
    commit(m, "a", 0, prompt[:12])
    assert placed("x", range(50, 53)).worker_id == "w1"  # no hit: the less loaded pool
    alloc(m, "y", range(60, 63), worker="w0")
    r = placed("b", prompt)  # 3-page hit on w0 (2 running) vs none on w1 (1 running): 3 - 8 < 0 - 4
    assert r.worker_id == "w1" and r.num_cached_tokens == 0
    m.load_penalty_pages = 1  # now 3 - 2 > 0 - 2 (b runs on w1): the hit wins
    r = placed("c", prompt)
    assert r.worker_id == "w0" and r.num_cached_tokens == 12


def test_pools_of_different_kv_formats_share_one_kvmanager_but_never_a_block():
    formats = {"w0": ("float32", ""), "w1": ("int8", "token_head"), "w2": ("int8", "tensor"),
               "w3": ("fp8_e4m3", "token_head")}
    m = mgr_with(*(spec(w, kv_dtype=d, kv_scales=s) for w, (d, s) in formats.items()))
    prompt = list(range(13))
    for i, worker in enumerate(formats):  # the same prompt written into every pool, each its own blocks
        r = alloc(m, f"r{i}", prompt, worker=worker)
        assert r.num_cached_tokens == 0, f"{worker} was served a block written under another KV format"
        commit(m, f"r{i}", 0, prompt[:12])
        free(m, f"r{i}")
    for worker in formats:  # now each pool hits only its own blocks
        assert alloc(m, f"again-{worker}", prompt, worker=worker).num_cached_tokens == 12
    hashes = {w: set(m.pools[w].index) for w in formats}
    assert all(len(h) == 3 for h in hashes.values())
    assert not set.intersection(*hashes.values())  # no block hash is shared between two formats
    stats = {p.worker_id: (p.kv_dtype, p.kv_scales) for p in admin.stats(m).pools}
    assert stats == formats


def test_an_allocation_names_its_worker_and_is_only_tried_there():
    m = mgr_with(spec("w0", num_pages=2), spec("w1"))
    with pytest.raises(InvalidRequest, match="worker_id must name the worker"):
        m.step(StepOps(next_step_id(m), allocations=(PageAllocation("a", "t", (1, 2, 3)),)))
    alloc(m, "a", range(8), worker="w0")  # w0 is full now, w1 empty
    r = alloc(m, "b", range(8), worker="w0")
    assert r.status is OpStatus.OUT_OF_PAGES and r.num_pages_short == 2  # not moved to w1



def test_place_answers_like_allocation_would_counting_queued_requests_without_side_effects():
    m = mgr_with(spec("w0"), spec("w1"))
    prompt = list(range(13))
    alloc(m, "a", prompt, worker="w1")
    commit(m, "a", 0, prompt[:12])
    free(m, "a")
    lru_before, counters_before = list(m.pools["w1"].evictable), dict(m.tenants)
    assert m.place("t", tuple(prompt), {}) == Placement("w1", 12)  # the 3-page hit
    assert m.place("u", tuple(prompt), {}) == Placement("w0", 0)  # another tenant: no hit, tie -> w0
    assert m.place("t", tuple(prompt), {"w1": 1}) == Placement("w0", 0)  # 3 - 4 * 1 < 0
    assert list(m.pools["w1"].evictable) == lru_before and m.tenants == counters_before
    with pytest.raises(InvalidRequest, match="tenant must not be empty"):
        m.place("", (1,), {})
    with pytest.raises(UnknownWorker, match="no worker is registered"):
        KVManager().place("t", (1,), {})

BAD = [
    (StepOps(2, allocations=(PageAllocation("a", "", (1,), "w0"),)), InvalidRequest, "tenant must not be empty"),
    (StepOps(2, allocations=(PageAllocation("a", "t", (), "w0"),)), InvalidRequest, "token_ids must not be empty"),
    (StepOps(2, allocations=(PageAllocation("a", "t", (-1,), "w0"),)), InvalidRequest, "token id -1 is not a uint32"),
    (StepOps(2, allocations=(PageAllocation("a", "t", (1,), "nope"),)), UnknownWorker, "no pool is registered"),
    (StepOps(2, allocations=(PageAllocation("a", "t", tuple(range(40)), "w0"),)), InvalidRequest,
     "more pages than pool 'w0' has"),
    (StepOps(2, allocations=(PageAllocation("live", "t", (1,), "w0"),)), InvalidRequest, "already live"),
    (StepOps(2, extensions=(PageExtension("ghost", 4),)), UnknownRequest, "'ghost' is not live"),
    (StepOps(2, extensions=(PageExtension("live", -4),)), InvalidRequest, "num_tokens must be > 0"),
    (StepOps(2, extensions=(PageExtension("live", 10**6),)), InvalidRequest, "exceeds the pool"),
    (StepOps(2, commits=(PageCommit("live", 0, (1, 2, 3), 3),)), InvalidRequest, "not a whole number of pages"),
    (StepOps(2, commits=(PageCommit("live", 4, (1, 2, 3, 4), 8),)), InvalidRequest, "must equal the 0 tokens"),
    (StepOps(2, commits=(PageCommit("live", 0, (1, 2, 3, 4), 2),)), InvalidRequest, "num_computed_tokens"),
    (StepOps(2, commits=(PageCommit("ghost", 0, (1, 2, 3, 4), 4),)), UnknownRequest, "not live"),
    (StepOps(2, frees=(PageFree("x"), PageFree("x"))), InvalidRequest, "appears twice"),
    (StepOps(2, frees=(PageFree("live"),), extensions=(PageExtension("live", 8),)), InvalidRequest, "another list"),
    (StepOps(0), InvalidRequest, "step_id must be >= 1, got 0"),
    (StepOps(-1), InvalidRequest, "step_id must be >= 1, got -1"),
]


@pytest.mark.parametrize("ops,error,message", BAD, ids=[b[2] for b in BAD])
def test_bad_input_is_rejected_and_changes_nothing(ops, error, message):
    m = mgr_with()
    alloc(m, "live", range(6))
    # a valid op in the same call must not be applied either
    ops = StepOps(ops.step_id, ops.allocations, ops.extensions, ops.commits, ops.frees + (PageFree("other"),))
    before = (ref_cnts(m), list(m.pools["w0"].free), dict(m.requests["live"].__dict__ if hasattr(
        m.requests["live"], "__dict__") else {}), m.requests["live"].page_table[:])
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        m.step(ops)
    assert (ref_cnts(m), list(m.pools["w0"].free), {}, m.requests["live"].page_table) == before
    assert set(m.requests) == {"live"}


def test_bad_registration():
    m = KVManager()
    with pytest.raises(InvalidRequest, match="num_pages must be > 0"):
        m.register_worker(spec(num_pages=0))
    with pytest.raises(InvalidRequest, match="worker_id must not be empty"):
        m.register_worker(spec(worker=""))
    with pytest.raises(UnknownWorker, match="no pool is registered for worker .w0."):
        alloc(m, "a", [1])
