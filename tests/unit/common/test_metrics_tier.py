"""The kvmanager's metrics of the two KV tiers (kvserve/common/metrics.py), scraped from a real KVManager: blocks, bytes
and capacity per tier, each tenant's hit tokens per tier, the store's own counters and the workers' reported ones.

    pool w0: 8 pages of PS=4 tokens, 1000 bytes a page; a 13-token prompt has 3 cacheable pages
"""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from step_ids import next_step_id

from kvserve.common.metrics import KVMANAGER_METRICS, REPORTED_TIER_COUNTERS, TIER_COUNTERS, KVManagerMetrics
from kvserve.common.wire.pages import PageAllocation, PageCommit, PageFree, PoolSpec, StepOps
from kvserve.common.wire.tier import StoredBlock, TierCounters, TierReport
from kvserve.kvmanager import admin
from kvserve.kvmanager.hashing import chain_hashes
from kvserve.kvmanager.manager import KVManager

PS = 4
PAGE_BYTES = 1000
PROMPT = tuple(range(100, 113))


def scrape(mgr: KVManager) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of every kvserve sample the kvmanager's registry exports."""
    text = generate_latest(KVManagerMetrics(lambda: admin.stats(mgr)).registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def tier(name: str, samples: dict, **labels: str) -> dict[str, float]:
    """{tier: value} of one family's samples, those with ``labels``."""
    out = {}
    for (sample, sample_labels), value in samples.items():
        d = dict(sample_labels)
        if sample == name and labels.items() <= d.items():
            out[d["tier"]] = value
    return out


def run_prompt(mgr: KVManager, req_id: str) -> None:
    """Admit, compute and commit the prompt's full pages, free: as a gateway would."""
    (a,) = mgr.step(StepOps(next_step_id(mgr), allocations=(PageAllocation(req_id, "t", PROMPT, "w0"),))).allocations
    start = a.num_committed_tokens
    mgr.step(StepOps(next_step_id(mgr), commits=(PageCommit(req_id, start, PROMPT[start:12], len(PROMPT)),),
                     frees=(PageFree(req_id),)))


def a_store_hit() -> KVManager:
    """A prompt run on w0, its 3 blocks written to the store (the worker's counters with the report), evicted from
    the pool, then run again: its 12 cached tokens are loaded from the store."""
    mgr = KVManager(store_capacity_bytes=10 * PAGE_BYTES)
    mgr.register_worker(PoolSpec("w0", 1, 8, PS, "fp", "float32", PAGE_BYTES // PS, kv_store=True))
    run_prompt(mgr, "a")
    hashes = chain_hashes(mgr.pools["w0"].seed_for("t"), PROMPT[:12], PS)
    counters = TierCounters(num_loaded_pages=5, num_loaded_bytes=5000, load_s=0.25, num_failed_loads=1,
                            num_verify_failures=2, num_written_pages=3, num_written_bytes=3000, num_dropped_writes=4)
    mgr.report_tier(TierReport("w0", 1, tuple(StoredBlock(h, "t", PAGE_BYTES) for h in hashes), (), counters))
    admin.evict_tenant(mgr, "t", "w0")
    run_prompt(mgr, "b")
    return mgr


def test_blocks_bytes_and_capacity_per_tier():
    mgr = a_store_hit()
    got = scrape(mgr)
    # the pool: the 3 blocks loaded, committed and cached again (3 pages of 1000 bytes) of 8000
    assert tier("kvserve:kv_tier_blocks", got) == {"pool": 3, "store": 3}
    assert tier("kvserve:kv_tier_bytes", got) == {"pool": 3000, "store": 3000}
    assert tier("kvserve:kv_tier_capacity_bytes", got) == {"pool": 8000, "store": 10_000}
    # a running request's 4 pages, nothing committed: bytes in use, no block
    mgr.step(StepOps(next_step_id(mgr), allocations=(PageAllocation("d", "u", PROMPT, "w0"),)))
    got = scrape(mgr)
    assert tier("kvserve:kv_tier_blocks", got) == {"pool": 3, "store": 3}
    assert tier("kvserve:kv_tier_bytes", got) == {"pool": 7000, "store": 3000}


def test_hit_tokens_per_tenant_and_tier_sum_to_the_prefix_cache_hits():
    got = scrape(a_store_hit())
    assert tier("kvserve:prefix_cache_tier_hits_total", got, tenant="t") == {"pool": 0, "store": 12}
    assert got[("kvserve:prefix_cache_hits_total", (("tenant", "t"),))] == 12
    mgr = a_store_hit()
    run_prompt(mgr, "c")  # now a pool hit: its blocks are cached on w0
    got = scrape(mgr)
    assert tier("kvserve:prefix_cache_tier_hits_total", got, tenant="t") == {"pool": 12, "store": 12}
    assert got[("kvserve:prefix_cache_hits_total", (("tenant", "t"),))] == 24


def test_the_stores_counters_and_the_workers_reported_ones():
    got = scrape(a_store_hit())
    assert tier("kvserve:kv_tier_added_blocks_total", got) == {"store": 3}
    assert tier("kvserve:kv_tier_evicted_blocks_total", got) == {"pool": 3, "store": 0}  # w0's, by admin evict
    assert tier("kvserve:kv_tier_dropped_missing_total", got) == {"store": 0}
    reported = {field: tier(f"{name}_total", got) for field, (name, _) in REPORTED_TIER_COUNTERS.items()}
    assert reported == {"num_loaded_pages": {"store": 5}, "num_loaded_bytes": {"store": 5000},
                        "load_s": {"store": 0.25}, "num_failed_loads": {"store": 1},
                        "num_verify_failures": {"store": 2}, "num_written_pages": {"store": 3},
                        "num_written_bytes": {"store": 3000}, "num_dropped_writes": {"store": 4}}


def test_a_value_reported_missing_is_counted_and_leaves_the_store():
    mgr = a_store_hit()
    missing = chain_hashes(mgr.pools["w0"].seed_for("t"), PROMPT[:12], PS)[2]
    mgr.report_tier(TierReport("w0", 1, (), (missing,)))
    got = scrape(mgr)
    assert tier("kvserve:kv_tier_dropped_missing_total", got) == {"store": 1}
    assert tier("kvserve:kv_tier_blocks", got) == {"pool": 3, "store": 2}
    assert tier("kvserve:kv_tier_bytes", got)["store"] == 2000


def test_without_a_store_the_pool_alone_and_the_reported_names_are_not_the_workers():
    mgr = KVManager()  # the tier off: its store reads 0 of 0
    got = scrape(mgr)
    assert tier("kvserve:kv_tier_capacity_bytes", got) == {"pool": 0, "store": 0}
    stats = admin.stats(mgr)
    stats.store = None  # a ClusterStats without the tier's part
    text = generate_latest(KVManagerMetrics(lambda: stats).registry).decode()
    assert 'tier="store"' not in text and 'kvserve:kv_tier_blocks{tier="pool"} 0.0' in text
    # A sum over every scraped series must not count a worker's load twice: the kvmanager's names are its own.
    worker_names = {f"{name}_total" for name, _ in TIER_COUNTERS.values()}
    assert not worker_names & set(KVMANAGER_METRICS)
    assert {f"{name}_total" for name, _ in REPORTED_TIER_COUNTERS.values()} <= set(KVMANAGER_METRICS)


def test_each_tenants_pages_shares_pins_and_evictions_are_exported():
    """The tenant families (fair share): a tenant flooding a small pool shows its pages, its evictions caused and
    suffered; the other its pins against its budget."""
    from kvserve.common.wire.pages import PinPoint

    mgr = KVManager()
    mgr.register_worker(PoolSpec("w0", 1, 8, PS, "fp", "float32", PAGE_BYTES // PS))
    mgr.set_time(1_000_000)
    mgr.step(StepOps(next_step_id(mgr), allocations=(
        PageAllocation("q", "quiet", PROMPT, "w0", pins=(PinPoint(8, 300),)),)))
    mgr.step(StepOps(next_step_id(mgr), commits=(PageCommit("q", 0, PROMPT[:12], len(PROMPT)),),
                     frees=(PageFree("q"),)))
    for i in range(3):
        flood = tuple(range(1000 * (i + 1), 1000 * (i + 1) + 13))
        mgr.step(StepOps(next_step_id(mgr), allocations=(PageAllocation(f"n{i}", "noisy", flood, "w0"),)))
        mgr.step(StepOps(next_step_id(mgr), commits=(PageCommit(f"n{i}", 0, flood[:12], 13),),
                         frees=(PageFree(f"n{i}"),)))
    samples = scrape(mgr)

    def value(name: str, tenant: str) -> float:
        return samples[(name, (("tenant", tenant),))]

    assert value("kvserve:tenant_pinned_blocks", "quiet") == value("kvserve:tenant_soft_pinned_blocks", "quiet") == 2
    assert value("kvserve:tenant_pin_budget_blocks", "quiet") == 2  # half its share of 4 pages
    assert value("kvserve:tenant_share_pages", "noisy") == 4 and value("kvserve:tenant_pages", "noisy") == 4
    assert value("kvserve:tenant_pages", "quiet") == 3  # under its share: the flood took none of its pages
    assert value("kvserve:tenant_evictions_caused_total", "noisy") == value("kvserve:tenant_evicted_pages_total",
                                                                              "noisy") > 0
    assert value("kvserve:tenant_evicted_pages_total", "quiet") == 0
