"""Tenant-aware eviction (fair_share.py) in a pool and in the shared tier: the noisy neighbour, weights, floors,
caps, inactive tenants, never refusing while pages can be evicted, and the global LRU kept for comparison.

    pool: 20 pages of PS=4 tokens; a prompt of 4k + 1 tokens caches k pages
"""

from __future__ import annotations

import pytest
from step_ids import next_step_id

from kvserve.common.wire.pages import OpStatus, PageAllocation, PageCommit, PageFree, PoolSpec, StepOps
from kvserve.common.wire.tier import StoredBlock, TierReport
from kvserve.kvmanager import admin
from kvserve.kvmanager.invariants import check_invariants
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.tenants import Amount, CachePolicy, TenantQuota, TenantsFileError, load_policy, parse_policy

PS = 4
NUM_PAGES = 20
MINUTE_MS = 60_000


def manager(policy: CachePolicy | None = None, num_pages: int = NUM_PAGES, **kw) -> KVManager:
    mgr = KVManager(policy=policy, **kw)
    mgr.register_worker(PoolSpec("w0", 1, num_pages, PS, "fp", "float32", 64, kv_store=bool(kw)))
    mgr.set_time(10 * MINUTE_MS)
    return mgr


def prompt(seed: int, pages: int) -> tuple[int, ...]:
    return tuple(range(seed * 1000, seed * 1000 + pages * PS + 1))


def run(mgr: KVManager, tenant: str, tokens: tuple[int, ...], pins=()) -> tuple[int, int]:
    """Admit, compute, commit its full pages, free: (num_cached_tokens, num_pinned_tokens)."""
    req_id = f"r{next_step_id(run)}"
    a = mgr.step(StepOps(next_step_id(mgr), allocations=(PageAllocation(req_id, tenant, tokens, "w0", pins=pins),)))
    a = a.allocations[0]
    assert a.status is OpStatus.OK
    full = len(tokens) // PS * PS
    out = mgr.step(StepOps(next_step_id(mgr), commits=(
        PageCommit(req_id, a.num_committed_tokens, tokens[a.num_committed_tokens:full], len(tokens)),),
        frees=(PageFree(req_id),)))
    check_invariants(mgr)
    return a.num_cached_tokens, out.commits[0].num_pinned_tokens


def noisy_neighbour(mgr: KVManager, rounds: int = 4) -> list[int]:
    """The quiet tenant's 5-page system prompt (plus a question), then unique noisy prompts worth 1.5x the pool
    between its visits: the quiet tenant's cached tokens on each revisit."""
    system = prompt(1, 5)[:-1]
    hits, seed = [], 100
    run(mgr, "quiet", system + (7,))
    for r in range(rounds):
        for _ in range(3):
            seed += 1
            run(mgr, "noisy", prompt(seed, 10))  # 3 x 10 pages = 1.5 x the pool
        hits.append(run(mgr, "quiet", system + (8 + r,))[0])
    return hits


def test_the_noisy_neighbour_evicts_the_quiet_tenant_under_the_global_lru_and_not_under_fair_share():
    assert noisy_neighbour(manager(CachePolicy("lru"))) == [0, 0, 0, 0]
    fair = manager()
    assert noisy_neighbour(fair) == [5 * PS] * 4
    pool = fair.pools["w0"]
    assert pool.num_evicted_from.get("quiet", 0) == 0 and pool.num_evicted_from["noisy"] > 0
    assert pool.num_evicted_by["noisy"] == pool.num_evicted_from["noisy"]  # it made room from its own pages


def test_an_inactive_tenant_gives_up_its_pages_first():
    mgr = manager()
    run(mgr, "old", prompt(1, 6))
    mgr.set_time(mgr.now_ms + 6 * MINUTE_MS)  # past the 5-minute active window: its share is 0
    run(mgr, "a", prompt(2, 7))
    run(mgr, "b", prompt(3, 7))
    run(mgr, "a", prompt(4, 6))  # 20 pages in use by now: the next allocation evicts
    evicted = mgr.pools["w0"].num_evicted_from
    assert evicted["old"] == 6 and "b" not in evicted  # then a, over its share, gives up its own


def test_weights_set_the_shares_and_a_tenant_under_its_weighted_share_keeps_its_pages():
    policy = CachePolicy(tenants={"big": TenantQuota(weight=3.0)})
    mgr = manager(policy)
    for i in range(12):  # big caches 12 pages, under its share of 15
        run(mgr, "big", prompt(10 + i, 1))
    for i in range(6):  # small floods 30 pages through the 8 left
        run(mgr, "small", prompt(40 + i, 4))
    pool = mgr.pools["w0"]
    assert pool.usage["big"] == 12 and "big" not in pool.num_evicted_from  # big lost nothing to small
    assert pool.num_evicted_from["small"] > 0
    assert mgr.fair.share("big", NUM_PAGES) == 15 and mgr.fair.share("small", NUM_PAGES) == 5


def test_a_tenant_under_its_floor_loses_pages_only_when_nobody_else_has_any_to_give():
    policy = CachePolicy(tenants={"floored": TenantQuota(floor=Amount(pages=6))})
    mgr = manager(policy)
    run(mgr, "floored", prompt(1, 6))
    mgr.set_time(mgr.now_ms + 6 * MINUTE_MS)  # inactive: share 0, but under its floor it is evicted last
    for i in range(4):
        run(mgr, "other", prompt(10 + i, 4))
    assert mgr.pools["w0"].num_evicted_from.get("floored", 0) == 0
    # a request needing every page: never refused while pages can be evicted, the floor gives way last
    cached, _ = run(mgr, "other", prompt(30, NUM_PAGES - 1))
    assert cached == 0 and mgr.pools["w0"].num_evicted_from["floored"] == 6


def test_a_tenant_at_its_cap_makes_room_from_its_own_pages_before_free_ones():
    policy = CachePolicy(tenants={"capped": TenantQuota(cap=Amount(share=0.25))})  # 5 pages
    mgr = manager(policy)
    run(mgr, "capped", prompt(1, 5))
    run(mgr, "capped", prompt(2, 3))  # at its cap: its own 4 oldest pages go though 15 pages are free
    pool = mgr.pools["w0"]
    assert pool.usage["capped"] == 4 and pool.num_evicted_from == {"capped": 4} and pool.num_free == 16
    assert run(mgr, "capped", prompt(1, 5))[0] == PS  # the oldest chain lost its end (evicted first), not its head


def test_a_cap_never_refuses_a_request_free_pages_can_serve():
    mgr = manager(CachePolicy(tenants={"capped": TenantQuota(cap=Amount(pages=2))}))
    cached, _ = run(mgr, "capped", prompt(1, 10))
    assert cached == 0 and mgr.pools["w0"].usage["capped"] == 10  # over its cap: the cap bounds what it keeps


def test_the_shared_tier_evicts_by_fair_share_in_bytes_and_never_a_pinned_entry():
    mgr = KVManager(store_capacity_bytes=10_000)
    mgr.set_time(10 * MINUTE_MS)
    mgr.fair.touch("quiet")
    mgr.fair.touch("noisy")
    tier = mgr.tier
    quiet = [bytes([1, i]) * 8 for i in range(3)]
    mgr.report_tier(TierReport("w0", 1, tuple(StoredBlock(h, "quiet", 1000) for h in quiet)))
    flood = [bytes([2, i]) * 8 for i in range(20)]
    mgr.report_tier(TierReport("w0", 1, tuple(StoredBlock(h, "noisy", 1000) for h in flood)))
    assert all(h in tier for h in quiet) and tier.usage == {"quiet": 3000, "noisy": 7000}
    assert tier.evicted_from == {"noisy": 13}
    mgr.pins.add(flood[-1], "noisy", 0, mgr.now_ms)  # an operator's pin on a noisy entry
    mgr.mark_pinned(flood[-1], True)
    lru = KVManager(store_capacity_bytes=10_000, policy=CachePolicy("lru"))
    lru.report_tier(TierReport("w0", 1, tuple(StoredBlock(h, "quiet", 1000) for h in quiet)))
    lru.report_tier(TierReport("w0", 1, tuple(StoredBlock(h, "noisy", 1000) for h in flood)))
    assert not any(h in lru.tier for h in quiet)  # the global LRU: the flood took the quiet tenant's entries
    check_invariants(mgr)


def test_a_value_that_only_pinned_entries_could_make_room_for_is_rejected_and_counted():
    mgr = KVManager(store_capacity_bytes=2000)
    pinned = [bytes([3, i]) * 8 for i in range(2)]
    for h in pinned:
        mgr.pins.add(h, "a", 0, 0)
    mgr.report_tier(TierReport("w0", 1, tuple(StoredBlock(h, "a", 1000) for h in pinned)))
    assert mgr.report_tier(TierReport("w0", 1, (StoredBlock(b"\x09" * 16, "b", 1000),))) == (0, 0)
    assert mgr.tier.rejected == {"b": 1} and mgr.tier.totals.num_rejected == 1
    assert b"\x09" * 16 in mgr.tier.take_deleted()  # its value is deleted, not left behind
    stats = {t.tenant: t for t in admin.stats(mgr).tenants}
    assert stats["b"].num_store_rejected == 1 and stats["a"].num_pin_blocks == 2
    check_invariants(mgr)


def test_admin_stats_show_each_tenants_pages_against_its_share_floor_and_cap():
    policy = CachePolicy(tenants={"a": TenantQuota(weight=3.0, floor=Amount(pages=2), cap=Amount(share=0.5))})
    mgr = manager(policy)
    run(mgr, "a", prompt(1, 3))
    run(mgr, "b", prompt(2, 2))
    s = {t.tenant: t for t in admin.stats(mgr).tenants}
    assert (s["a"].num_pages, s["a"].share_pages, s["a"].floor_pages, s["a"].cap_pages, s["a"].weight) == (
        3, 15, 2, 10, 3.0)
    assert (s["b"].num_pages, s["b"].share_pages, s["b"].active) == (2, 5, True)


# -- the tenants file ------------------------------------------------------------------------------------------
def test_a_tenants_file_gives_weights_floors_caps_and_budgets(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text('active_window = "90s"\n[default]\nweight = 2\n[tenant.acme]\nweight = 3\nfloor = "20%"\n'
                    'cap = 4000\npin_budget = "5%"\nstore_floor = "1GiB"\nstore_cap = "2GiB"\n')
    policy = load_policy(path)
    acme = policy.quota("acme")
    assert policy.active_window_ms == 90_000 and policy.quota("other").weight == 2
    assert (acme.weight, acme.floor.of(1000), acme.cap.of(1000), acme.pin_budget.of(1000)) == (3, 200, 4000, 50)
    assert (acme.store_floor_bytes, acme.store_cap_bytes) == (1 << 30, 2 << 30)


@pytest.mark.parametrize("doc, says", [
    ({"tenant": {"a": {"weight": 0}}}, "weight must be a positive number"),
    ({"tenant": {"a": {"floor": "120%"}}}, "floor must be a page count"),
    ({"tenant": {"a": {"floor": "50%", "cap": "20%"}}}, "cap 20% is below floor 50%"),
    ({"tenant": {"a": {"store_cap": "lots"}}}, "store_cap: not a byte size"),
    ({"tenant": {"a": {"wieght": 2}}}, "unknown keys ['wieght']"),
    ({"active_window": "soon"}, "active_window must be a duration"),
])
def test_a_bad_tenants_file_is_refused_naming_what_is_wrong(doc, says):
    with pytest.raises(TenantsFileError, match=None) as e:
        parse_policy(doc)
    assert says in str(e.value)


def test_an_unreadable_tenants_file_names_the_file(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text("[tenant.a\nweight = 1")
    with pytest.raises(TenantsFileError) as e:
        load_policy(path)
    assert str(path) in str(e.value)


def test_a_tenants_eviction_counts_survive_its_worker_restarting():
    """The per-tenant counters are totals: a pool dropped (a new epoch) hands its counts to the manager, which a
    snapshot keeps."""
    from kvserve.kvmanager import snapshot as snapshot_format

    mgr = manager()
    noisy_neighbour(mgr, rounds=2)
    before = {t.tenant: (t.num_evicted_pages, t.num_evictions_caused) for t in admin.stats(mgr).tenants}
    assert before["noisy"][0] > 0
    mgr.register_worker(PoolSpec("w0", 2, NUM_PAGES, PS, "fp", "float32", 64))  # restarted: its pool is new
    after = {t.tenant: (t.num_evicted_pages, t.num_evictions_caused) for t in admin.stats(mgr).tenants}
    assert after == before
    loaded = KVManager()
    snapshot_format.decode(snapshot_format.encode(mgr, []), loaded)
    assert {t.tenant: (t.num_evicted_pages, t.num_evictions_caused) for t in admin.stats(loaded).tenants} == before
