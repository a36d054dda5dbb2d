"""The engine core with the shared KV tier, on in-process backends: the real KVManager (with a store index) and
rule workers whose KV store is a dict (engine_fakes.StoreRuleWorker). A rule worker answers from the token ids
its page tables point at, so a request's tokens equal the reference only if every page it loaded from the store
holds what was computed there, and no page that failed to load is ever read as cached."""

from __future__ import annotations

from engine_fakes import InlineExecutor, InProcessKVManager, StoreRuleWorker, reference

from kvserve.common.wire.pages import PoolSpec
from kvserve.kvmanager import admin
from kvserve.kvmanager.hashing import chain_hashes
from kvserve.kvmanager.invariants import check_invariants
from kvserve.services.gateway.core import EngineCore, scheduler_config
from kvserve.services.gateway.request import Request, RequestParams

PROMPT = list(range(300, 322))  # 22 tokens: 5 full pages of 4 are cacheable


def stack(num_workers: int = 2, num_pages: int = 32, executor=None):
    kv, store = InProcessKVManager(store_capacity_bytes=1 << 20), {}
    cores = []
    for i in range(num_workers):
        worker = StoreRuleWorker(kv, store, f"w{i}", num_pages=num_pages)
        kv.register(PoolSpec.of(worker.info()))
        cfg = scheduler_config(worker.info(), max_num_seqs=4, max_num_batched_tokens=64,
                               reserve_ahead=executor is not None)
        cores.append(EngineCore(worker, worker.info(), kv, cfg, executor=executor))
    return kv, store, cores


def run(core: EngineCore, req_id: str, prompt=PROMPT, max_tokens: int = 5) -> Request:
    req = Request(req_id, "t", list(prompt), RequestParams(max_tokens=max_tokens))
    core.add(req)
    while core.has_work():
        core.step()
    return req


def assert_no_pages_held(kv) -> None:
    check_invariants(kv.mgr)
    assert all(p.num_used == 0 and p.num_requests == 0 for p in kv.mgr.pools.values())


def test_a_prefix_computed_on_one_worker_is_loaded_from_the_store_by_another():
    kv, store, (a, b) = stack()
    first = run(a, "first", max_tokens=7)
    assert first.output_token_ids == reference(PROMPT, 7)
    # every full page of prompt and output was written, the last one (committed with the free) by a writes-only
    # step after the request's end
    assert len(kv.mgr.tier) == len(store) == (22 + 7 - 1) // 4
    assert not a.worker.batches[-1].items and a.worker.batches[-1].store_writes
    second = run(b, "second")
    assert second.output_token_ids == reference(PROMPT, 5)
    assert second.num_cached_tokens == 20 and b.worker.num_loaded_pages == 5
    assert kv.mgr.tier.tenant_hits == {"t": 20}
    assert len(kv.mgr.pools["w1"].index) >= 5  # the loaded pages joined w1's pool once its first chunk computed
    assert_no_pages_held(kv)


def test_a_block_evicted_from_its_pool_is_loaded_back_from_the_store():
    kv, store, (a,) = stack(num_workers=1)
    run(a, "first")
    admin.evict_tenant(kv.mgr, "t", "w0")
    again = run(a, "again")
    assert again.output_token_ids == reference(PROMPT, 5) and again.num_cached_tokens == 20
    assert a.worker.num_loaded_pages == 5


def test_a_load_that_fails_recomputes_with_pool_hits_only_and_its_pages_are_never_served():
    kv, store, (a, b) = stack()
    run(a, "first")
    prompt_blocks = chain_hashes(kv.mgr.pools["w1"].seed_for("t"), tuple(PROMPT[:20]), 4)
    store.clear()  # the store lost every value; the index does not know yet
    second = run(b, "second")
    assert second.output_token_ids == reference(PROMPT, 5)
    assert second.skip_store and second.num_preemptions == 1 and second.num_cached_tokens == 0
    # the five it tried to load were reported missing and dropped, then written again by its recompute
    assert kv.mgr.tier.totals.num_dropped_missing == 5
    assert all(h in store and h in kv.mgr.tier for h in prompt_blocks)
    # what w1 computed afterwards is right, and nothing of the failed load was indexed in its pool
    third = run(b, "third")
    assert third.output_token_ids == reference(PROMPT, 5) and third.num_cached_tokens == 20
    assert_no_pages_held(kv)


def test_with_page_ops_overlapped_the_admission_reserved_ahead_loads_before_its_first_chunk():
    kv, store, (a, b) = stack(executor=InlineExecutor())
    run(a, "first", max_tokens=3)
    running = run(b, "other", prompt=list(range(600, 640)), max_tokens=1)  # keeps w1 busy for the next admission
    assert running.output_token_ids
    second = run(b, "second", max_tokens=3)
    assert second.output_token_ids == reference(PROMPT, 3) and second.num_cached_tokens == 20
    assert_no_pages_held(kv)


def test_the_measured_costs_reach_the_kvmanager_and_a_slow_store_is_not_used():
    kv, store, (a, b) = stack()
    run(a, "first")
    tier = b.scheduler.tier
    tier.load_s_per_page, tier.prefill_s_per_token = 10.0, 0.001  # a page loads in 10 s, computes in 4 ms
    second = run(b, "second")
    assert second.output_token_ids == reference(PROMPT, 5)
    assert second.num_cached_tokens == 0 and b.worker.num_loaded_pages == 0
