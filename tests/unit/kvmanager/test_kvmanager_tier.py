"""The shared KV tier in the kvmanager: the store's index (entries only for values a worker reported written,
LRU within capacity, deletions queued), store hits in allocations (fresh pages to fill, not committed until the
first chunk computed), write orders at commit, placement, the load-or-recompute choice, admin, persistence.

    pool: 4 pages of PS=4 tokens; a 13-token prompt has 3 cacheable pages (its last token is always computed)
"""

from __future__ import annotations

import pytest
from step_ids import next_step_id

from kvserve.common.wire.pages import OpStatus, PageAllocation, PageCommit, PageFree, PoolSpec, StepOps
from kvserve.common.wire.tier import StoredBlock, TierCounters, TierReport
from kvserve.kvmanager import admin
from kvserve.kvmanager import snapshot as snapshot_format
from kvserve.kvmanager.call_log import apply as replay
from kvserve.kvmanager.call_log import encode as encode_record
from kvserve.kvmanager.hashing import chain_hashes
from kvserve.kvmanager.invariants import check_invariants
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.membership import MemberTable

PS = 4
PAGE_BYTES = 1000
PROMPT = tuple(range(100, 113))  # 13 tokens: 3 full cacheable pages


def spec(worker_id="w0", epoch=1, num_pages=8, kv_store=True) -> PoolSpec:
    return PoolSpec(worker_id, epoch, num_pages, PS, "fp", "float32", PAGE_BYTES // PS, kv_store=kv_store)


def manager(capacity=10 * PAGE_BYTES, **kw) -> KVManager:
    mgr = KVManager(store_capacity_bytes=capacity)
    mgr.register_worker(spec(**kw))
    return mgr


def step(mgr, **ops):
    return mgr.step(StepOps(next_step_id(mgr), **ops))


def run_prompt(mgr, req_id, prompt=PROMPT, worker_id="w0", **alloc):
    """Admit, compute the whole prompt, commit its full pages, free: as a gateway would."""
    a = step(mgr, allocations=(PageAllocation(req_id, "t", prompt, worker_id, **alloc),)).allocations[0]
    assert a.status is OpStatus.OK
    start, full = a.num_committed_tokens, len(prompt) // PS * PS
    out = step(mgr, commits=(PageCommit(req_id, start, prompt[start:full], len(prompt)),),
               frees=(PageFree(req_id),))
    return a, out


def written(mgr, blocks) -> TierReport:
    return TierReport("w0", 1, tuple(StoredBlock(h, "t", PAGE_BYTES) for h in blocks))


def chain(prompt=PROMPT, worker_id="w0", mgr=None):
    pool = mgr.pools[worker_id]
    return chain_hashes(pool.seed_for("t"), prompt[:len(prompt) // PS * PS], PS)


def test_a_commit_orders_writes_of_the_blocks_the_store_lacks_and_only_what_a_worker_reports_is_recorded():
    mgr = manager()
    _, out = run_prompt(mgr, "a")
    hashes = chain(mgr=mgr)
    assert [(o.worker_id, o.write.block_hash, o.write.tenant) for o in out.store_writes] == [
        ("w0", h, "t") for h in hashes]
    assert [o.write.namespace for o in out.store_writes] == [mgr.pools["w0"].seed_for("t")] * 3
    assert len(mgr.tier) == 0  # ordered, not written: nothing recorded (bytes before metadata)
    assert mgr.report_tier(written(mgr, hashes[:2])) == (2, 0)
    assert list(mgr.tier.entries) == hashes[:2]
    _, again = run_prompt(mgr, "b")  # the same prompt hits the pool: nothing new to commit, nothing to write
    assert again.store_writes == []


def test_no_writes_for_a_pool_without_a_store_or_with_the_tier_off():
    for mgr in (manager(kv_store=False), manager(capacity=0)):
        _, out = run_prompt(mgr, "a")
        assert out.store_writes == []


def test_past_the_pools_hit_an_allocation_takes_store_hits_as_fresh_pages_to_fill_committed_after_the_load():
    mgr = manager()
    run_prompt(mgr, "a")
    hashes = chain(mgr=mgr)
    mgr.report_tier(written(mgr, hashes))
    admin.evict_tenant(mgr, "t", "w0")  # the pool forgets the blocks; the store keeps them
    assert len(mgr.pools["w0"].index) == 0 and len(mgr.tier) == 3
    a = step(mgr, allocations=(PageAllocation("b", "t", PROMPT, "w0"),)).allocations[0]
    assert a.num_cached_tokens == 12 and a.num_committed_tokens == 0
    assert [x.block_hash for x in a.store_loads] == hashes
    assert [x.page_id for x in a.store_loads] == a.page_table[:3]
    req = mgr.requests["b"]
    assert req.block_hashes == [] and req.num_committed_tokens == 0
    assert mgr.tenants["t"].prefix_cache_hits == 12 and mgr.tier.tenant_hits == {"t": 12}
    # the gateway commits the loaded pages with its first computed ones: they join the pool, no write ordered
    out = step(mgr, commits=(PageCommit("b", 0, PROMPT[:12], 13),))
    assert out.store_writes == []
    assert set(mgr.pools["w0"].index) == set(hashes)
    check_invariants(mgr)


def test_a_pool_hit_then_the_store_continues_the_chain():
    mgr = manager()
    run_prompt(mgr, "a")
    hashes = chain(mgr=mgr)
    mgr.report_tier(written(mgr, hashes))
    pool = mgr.pools["w0"]
    pool.evict(pool.index[hashes[2]].page_id)  # the chain's tail leaves the pool first
    pool.evict(pool.index[hashes[1]].page_id)
    a = step(mgr, allocations=(PageAllocation("b", "t", PROMPT, "w0"),)).allocations[0]
    assert a.num_cached_tokens == 12 and a.num_committed_tokens == 4
    assert [x.block_hash for x in a.store_loads] == hashes[1:]
    assert mgr.requests["b"].block_hashes == hashes[:1]


def test_skip_store_and_a_measured_slower_load_take_pool_hits_only():
    mgr = manager()
    run_prompt(mgr, "a")
    mgr.report_tier(written(mgr, chain(mgr=mgr)))
    admin.evict_tenant(mgr, "t", "w0")
    slow = {"load_s_per_page": 0.5, "prefill_s_per_token": 0.01}  # a page loads in 0.5 s, recomputes in 0.04 s
    fast = {"load_s_per_page": 0.001, "prefill_s_per_token": 0.01}
    for req_id, kw, cached in (("b", {"skip_store": True}, 0), ("c", slow, 0), ("d", fast, 12)):
        a = step(mgr, allocations=(PageAllocation(req_id, "t", PROMPT, "w0", **kw),)).allocations[0]
        assert a.num_cached_tokens == cached, req_id
        step(mgr, frees=(PageFree(req_id),))


def test_the_store_index_is_an_lru_within_capacity_and_queues_deletions_of_what_it_drops():
    mgr = manager(capacity=2 * PAGE_BYTES)
    h = [bytes([i]) * 16 for i in range(4)]
    assert mgr.report_tier(written(mgr, h[:2])) == (2, 0)
    mgr.tier.touch([h[0]])  # h[1] is now the least recently used
    assert mgr.report_tier(written(mgr, h[2:3])) == (1, 1)
    assert list(mgr.tier.entries) == [h[0], h[2]] and mgr.tier.num_bytes == 2 * PAGE_BYTES
    assert mgr.tier.take_deleted() == [h[1]]
    mgr.report_tier(TierReport("w0", 1, missing=(h[0], h[3])))  # absent or damaged: dropped, deleted
    assert list(mgr.tier.entries) == [h[2]] and mgr.tier.take_deleted() == [h[0]]
    assert mgr.tier.totals.num_dropped_missing == 1


def test_a_worker_lost_keeps_the_store_so_another_worker_is_served_its_prefix():
    mgr = manager()
    mgr.register_worker(spec("w1"))
    run_prompt(mgr, "a", worker_id="w0")
    hashes = chain(mgr=mgr)
    mgr.report_tier(written(mgr, hashes))
    mgr.forget_pool("w0")
    assert mgr.place("t", PROMPT, {}).worker_id == "w1"
    a = step(mgr, allocations=(PageAllocation("b", "t", PROMPT, "w1"),)).allocations[0]
    assert a.num_cached_tokens == 12 and [x.block_hash for x in a.store_loads] == hashes


def test_placement_counts_a_store_hit_below_a_pool_hit_and_above_nothing():
    mgr = manager()
    mgr.register_worker(spec("w1"))
    mgr.register_worker(spec("w2", kv_store=False))
    run_prompt(mgr, "a", worker_id="w1")
    mgr.report_tier(written(mgr, chain(mgr=mgr, worker_id="w1")))
    assert mgr.place("t", PROMPT, {}).worker_id == "w1"  # the pool hit wins
    # w1 busy with one request: its 3-page pool hit (score 3 - 4) loses to w0's store hit (1.5), w2 gets nothing
    step(mgr, allocations=(PageAllocation("x", "t", (1, 2, 3), "w1"),))
    placed = mgr.place("t", PROMPT, {})
    assert (placed.worker_id, placed.num_cached_tokens) == ("w0", 12)


def test_admin_evict_over_every_pool_and_reset_drop_the_store_entries_and_queue_their_deletion():
    mgr = manager()
    run_prompt(mgr, "a")
    hashes = chain(mgr=mgr)
    mgr.report_tier(written(mgr, hashes))
    assert admin.evict_tenant(mgr, "t").num_evicted_blocks == 6  # 3 in the pool, 3 in the store
    assert len(mgr.tier) == 0 and sorted(mgr.tier.take_deleted()) == sorted(hashes)
    mgr.report_tier(written(mgr, hashes))
    admin.reset(mgr)
    assert len(mgr.tier) == 0 and sorted(mgr.tier.take_deleted()) == sorted(hashes)


def test_stats_show_the_tier_and_each_tenants_store_hits():
    mgr = manager()
    run_prompt(mgr, "a")
    hashes = chain(mgr=mgr)
    mgr.report_tier(TierReport("w0", 1, tuple(StoredBlock(h, "t", PAGE_BYTES) for h in hashes),
                               counters=TierCounters(num_written_pages=3, num_written_bytes=3000,
                                                     num_loaded_bytes=2_000_000, load_s=0.5)))
    admin.evict_tenant(mgr, "t", "w0")
    run_prompt(mgr, "b")
    s = admin.stats(mgr)
    assert (s.store.num_blocks, s.store.num_bytes, s.store.num_hit_pages) == (3, 3000, 3)
    assert s.store.num_written_pages == 3 and s.store.load_mb_per_s == pytest.approx(4.0)
    (t,) = s.tenants
    assert (t.prefix_cache_hits, t.store_hits, t.num_store_blocks) == (12, 12, 3)


def test_the_tier_survives_a_snapshot_and_a_replay_of_the_log():
    mgr = manager()
    records = []
    a_ops = StepOps(1, allocations=(PageAllocation("a", "t", PROMPT, "w0"),))
    c_ops = StepOps(2, commits=(PageCommit("a", 0, PROMPT[:12], 13),), frees=(PageFree("a"),))
    for ops in (a_ops, c_ops):
        mgr.step(ops)
        records.append(encode_record(("step", ops)))
    report = written(mgr, chain(mgr=mgr))
    mgr.report_tier(report)
    records.append(encode_record(("tier", report)))
    admin.evict_tenant(mgr, "t", "w0")
    records.append(encode_record(("admin", "evict_tenant", ("t", "w0"))))
    b_ops = StepOps(3, allocations=(PageAllocation("b", "t", PROMPT, "w0", load_s_per_page=0.001,
                                                   prefill_s_per_token=0.01),))
    answer = mgr.step(b_ops)
    records.append(encode_record(("step", b_ops)))

    replayed = KVManager(store_capacity_bytes=10 * PAGE_BYTES)
    replayed.register_worker(spec())
    members = MemberTable(5.0)
    for raw in records:
        replay(replayed, members, raw)
    assert list(replayed.tier.entries) == list(mgr.tier.entries)
    assert replayed.requests["b"] == mgr.requests["b"]
    assert replayed.requests["b"].last_ops["allocate"][1] == answer.allocations[0]

    restored = KVManager(store_capacity_bytes=10 * PAGE_BYTES)
    snapshot_format.decode(snapshot_format.encode(mgr, []), restored)
    assert list(restored.tier.entries) == list(mgr.tier.entries)
    assert restored.tier.totals == mgr.tier.totals and restored.tier.tenant_hits == mgr.tier.tenant_hits
    assert restored.requests["b"].last_ops == mgr.requests["b"].last_ops


@pytest.mark.parametrize("capacity", [2 * PAGE_BYTES, 0])
def test_a_restart_with_a_smaller_bound_evicts_the_least_recently_used_entries_down_to_it(capacity):
    mgr = manager(capacity=4 * PAGE_BYTES)
    h = [bytes([i]) * 16 for i in range(3)]
    mgr.report_tier(written(mgr, h))
    mgr.tier.touch([h[0]])
    mgr.tier.take_deleted()
    restored = KVManager(store_capacity_bytes=capacity)
    snapshot_format.decode(snapshot_format.encode(mgr, []), restored)
    kept = [h[2], h[0]][len([h[2], h[0]]) - capacity // PAGE_BYTES:] if capacity else []
    assert list(restored.tier.entries) == kept
    assert sorted(restored.tier.take_deleted()) == sorted(set(h) - set(kept))


def test_a_malformed_tier_report_is_refused_with_what_is_wrong():
    from kvserve.common.convert.tier import tier_report_to_proto
    from kvserve.common.errors import InvalidRequest
    from kvserve.kvmanager.convert import checked_tier_report

    good = TierReport("w0", 1, (StoredBlock(b"h" * 16, "t", 10),), (b"m" * 16,))
    assert checked_tier_report(tier_report_to_proto(good)) == good
    for bad, message in ((TierReport("", 1), "worker_id"), (TierReport("w0", 1, missing=(b"short",)), "16 bytes"),
                         (TierReport("w0", 1, (StoredBlock(b"h" * 16, "t", -1),)), ">= 0"),
                         (TierReport("w0", 1, counters=TierCounters(num_loaded_pages=-2)), ">= 0")):
        with pytest.raises(InvalidRequest, match=message):
            checked_tier_report(tier_report_to_proto(bad))
