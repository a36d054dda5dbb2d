"""Soft pins (pins.py): taken as a request's blocks are cached, TTLs on an injected clock (lapse, refresh on every
hit), budgets (over budget: not taken, reported), held in every pool and in the shared tier, admin pins with and
without a TTL, and pins with their expiry surviving a restart through the call log.

    pool: 20 pages of PS=4 tokens; a prompt of 4k + 1 tokens caches k pages
"""

from __future__ import annotations

import pytest
from kvmanager_soak import snapshot
from step_ids import next_step_id

from kvserve.common.embedded_redis import EmbeddedRedis
from kvserve.common.redis_client import connect
from kvserve.common.wire.pages import OpStatus, PageAllocation, PageCommit, PageFree, PinPoint, PoolSpec, StepOps
from kvserve.common.wire.tier import StoredBlock, TierReport
from kvserve.kvmanager import admin
from kvserve.kvmanager import snapshot as snapshot_format
from kvserve.kvmanager.call_log import CallLog
from kvserve.kvmanager.hashing import chain_hashes
from kvserve.kvmanager.invariants import check_invariants
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.service import KVService
from kvserve.kvmanager.tenants import Amount, CachePolicy, TenantQuota

PS = 4
NUM_PAGES = 20
T0 = 1_800_000_000_000  # the injected wall clock's start (Unix ms)
S = 1000


def spec(epoch: int = 1, kv_store: bool = False) -> PoolSpec:
    return PoolSpec("w0", epoch, NUM_PAGES, PS, "fp", "float32", 64, kv_store=kv_store)


def manager(policy: CachePolicy | None = None, **kw) -> KVManager:
    mgr = KVManager(policy=policy, **kw)
    mgr.register_worker(spec(kv_store=bool(kw)))
    mgr.set_time(T0)
    return mgr


def prompt(seed: int, pages: int) -> tuple[int, ...]:
    return tuple(range(seed * 1000, seed * 1000 + pages * PS + 1))


def run(mgr, tenant: str, tokens: tuple[int, ...], pins=(), step=None) -> tuple[int, int, int]:
    """Admit, compute, commit its full pages, free: (cached tokens, pinned tokens at allocation, after commit)."""
    step = step or mgr.step
    req_id = f"r{next_step_id(run)}"
    a = step(StepOps(next_step_id(step), allocations=(PageAllocation(req_id, tenant, tokens, "w0", pins=pins),)))
    a = a.allocations[0]
    assert a.status is OpStatus.OK
    full = len(tokens) // PS * PS
    out = step(StepOps(next_step_id(step), commits=(
        PageCommit(req_id, a.num_committed_tokens, tokens[a.num_committed_tokens:full], len(tokens)),),
        frees=(PageFree(req_id),)))
    return a.num_cached_tokens, a.num_pinned_tokens, out.commits[0].num_pinned_tokens


def flood(mgr, tenant: str = "t", rounds: int = 3, first: int = 100) -> None:
    for i in range(rounds):
        run(mgr, tenant, prompt(first + i, 10))


def hashes(mgr, tenant: str, tokens) -> list[bytes]:
    pool = mgr.pools["w0"]
    return chain_hashes(pool.seed_for(tenant), tokens[:len(tokens) // PS * PS], PS)


def test_a_pin_keeps_its_prefix_through_a_flood_until_its_ttl_lapses():
    mgr = manager()
    system = prompt(1, 5)
    assert run(mgr, "t", system, pins=(PinPoint(3 * PS + 2, 60),)) == (0, 0, 3 * PS)  # whole pages only
    flood(mgr)
    assert run(mgr, "t", system)[0] == 3 * PS  # the pinned head survived; its unpinned tail did not
    check_invariants(mgr)
    mgr.set_time(T0 + 59 * S)
    assert len(mgr.pins) == 3
    mgr.set_time(T0 + 61 * S)  # 60 s after the hit at T0 (the run above was at T0 too)
    assert len(mgr.pins) == 0 and not any(b.pinned for b in mgr.pools["w0"].index.values())
    check_invariants(mgr)
    flood(mgr, first=200)
    assert run(mgr, "t", system)[0] == 0  # lapsed: evictable like any other block


def test_every_hit_pushes_a_pins_expiry_to_now_plus_its_ttl():
    mgr = manager()
    system = prompt(1, 4)
    run(mgr, "t", system, pins=(PinPoint(0, 60),))  # 0: the whole prompt
    mgr.set_time(T0 + 50 * S)
    assert run(mgr, "t", system)[0] == 4 * PS  # a hit without pins of its own still refreshes them
    assert {p.expires_ms for p in mgr.pins.pins.values()} == {T0 + 110 * S}
    mgr.set_time(T0 + 100 * S)
    assert len(mgr.pins) == 4
    mgr.set_time(T0 + 110 * S)
    assert len(mgr.pins) == 0


def test_each_block_takes_the_longest_ttl_of_the_pins_covering_it():
    mgr = manager()
    run(mgr, "t", prompt(1, 4), pins=(PinPoint(2 * PS, 3600), PinPoint(4 * PS, 300)))
    ttls = [mgr.pins.get(h).ttl_ms for h in hashes(mgr, "t", prompt(1, 4))]
    assert ttls == [3600 * S, 3600 * S, 300 * S, 300 * S]


def test_pins_over_the_tenants_budget_are_not_taken_and_the_answer_says_so():
    mgr = manager(CachePolicy(tenants={"t": TenantQuota(pin_budget=Amount(pages=7))}))
    assert run(mgr, "t", prompt(1, 5), pins=(PinPoint(0, 300),))[2] == 5 * PS
    assert run(mgr, "t", prompt(2, 5), pins=(PinPoint(0, 300),))[2] == 2 * PS  # 2 blocks left in its budget
    assert run(mgr, "t", prompt(3, 5), pins=(PinPoint(0, 300),))[2] == 0
    assert mgr.pins.num_soft == {"t": 7}
    assert run(mgr, "t", prompt(1, 5), pins=(PinPoint(0, 300),))[1] == 5 * PS  # re-pinning what it holds is free
    other = run(mgr, "u", prompt(1, 5), pins=(PinPoint(0, 300),))  # default: half its fair share (5 of 10)
    assert other[2] == 5 * PS and mgr.pins.num_soft == {"t": 7, "u": 5}
    check_invariants(mgr)


def test_a_pin_holds_the_block_in_the_shared_tier_and_in_any_pool_that_caches_it_again():
    mgr = manager(store_capacity_bytes=4000)
    system = prompt(1, 3)
    run(mgr, "t", system, pins=(PinPoint(0, 300),))
    blocks = hashes(mgr, "t", system)
    mgr.report_tier(TierReport("w0", 1, tuple(StoredBlock(h, "t", 1000) for h in blocks)))
    assert all(mgr.tier.entries[h].pinned for h in blocks)
    flood_values = [bytes([9, i]) * 8 for i in range(10)]
    mgr.report_tier(TierReport("w0", 1, tuple(StoredBlock(h, "t", 1000) for h in flood_values)))
    assert all(h in mgr.tier for h in blocks)  # the flood evicted only unpinned entries
    mgr.register_worker(spec(epoch=2, kv_store=True))  # the worker restarted: its pool is gone
    assert not mgr.pools["w0"].index and len(mgr.pins) == 3
    cached, _, _ = run(mgr, "t", system, step=lambda ops: mgr.step(ops))  # served from the tier...
    assert cached == 3 * PS
    assert all(mgr.pools["w0"].index[h].pinned for h in blocks)  # ...and pinned again in the new pool
    check_invariants(mgr)


def test_admin_pins_with_a_ttl_are_budgeted_and_without_one_are_the_operators():
    mgr = manager(CachePolicy(tenants={"t": TenantQuota(pin_budget=Amount(pages=2))}))
    run(mgr, "t", prompt(1, 4))
    soft = admin.pin(mgr, "t", prompt(1, 4), "", 90)
    assert (soft.num_pinned_blocks, soft.num_pinned_tokens, soft.num_over_budget_blocks) == (2, 2 * PS, 2)
    assert soft.expires_ms == T0 + 90 * S
    mgr.set_time(T0 + 10 * S)
    assert admin.pin(mgr, "t", prompt(1, 4), "", 30).expires_ms == T0 + 100 * S  # its longer TTL, from now
    hard = admin.pin(mgr, "t", prompt(1, 4))
    assert (hard.num_pinned_blocks, hard.expires_ms, hard.num_over_budget_blocks) == (4, 0, 0)
    assert mgr.pins.num_soft == {} and all(p.ttl_ms == 0 for p in mgr.pins.pins.values())
    mgr.set_time(T0 + 3600 * S)
    assert len(mgr.pins) == 4  # an operator's pin never lapses
    assert admin.unpin(mgr, "t", prompt(1, 4)) == 4 and len(mgr.pins) == 0
    check_invariants(mgr)


def test_admin_evict_with_include_pinned_drops_the_tenants_pins():
    mgr = manager()
    run(mgr, "t", prompt(1, 3), pins=(PinPoint(0, 300),))
    run(mgr, "u", prompt(1, 3), pins=(PinPoint(0, 300),))
    assert admin.evict_tenant(mgr, "t").num_evicted_blocks == 0  # pinned: kept
    assert admin.evict_tenant(mgr, "t", "", True).num_evicted_blocks == 3
    assert {p.tenant for p in mgr.pins.pins.values()} == {"u"}
    check_invariants(mgr)


def test_bad_pins_are_refused_before_anything_is_applied():
    from kvserve.common.errors import InvalidRequest

    mgr = manager()
    with pytest.raises(InvalidRequest, match="ttl_s"):
        admin.pin(mgr, "t", prompt(1, 2), "", -1)


@pytest.fixture
def redis_url(tmp_path):
    with EmbeddedRedis(tmp_path / "redis") as server:
        yield server.url


def test_pins_and_their_expiry_survive_a_restart_through_the_call_log(redis_url):
    clock = [T0]
    svc = KVService(KVManager(), CallLog(connect(redis_url)), wall_ms=lambda: clock[0])
    svc.register_worker(spec())
    step = svc.step
    run(svc.manager, "t", prompt(1, 4), pins=(PinPoint(2 * PS, 60),), step=step)
    clock[0] += 30 * S
    run(svc.manager, "t", prompt(1, 4), step=step)  # a hit at T0 + 30 s: expiry T0 + 90 s
    clock[0] += 70 * S
    run(svc.manager, "u", prompt(2, 2), pins=(PinPoint(0, 600),), step=step)  # t's pins lapsed before this call
    assert [p.tenant for p in svc.manager.pins.pins.values()] == ["u", "u"]
    loaded = KVService(KVManager(), CallLog(connect(redis_url)), wall_ms=lambda: clock[0])
    loaded.load()
    assert snapshot(loaded.manager) == snapshot(svc.manager)
    assert loaded.manager.pins.pins == svc.manager.pins.pins and loaded.manager.now_ms == T0 + 100 * S
    check_invariants(loaded.manager)


def test_a_snapshot_keeps_pins_tenants_activity_and_the_time():
    mgr = manager(store_capacity_bytes=4000)
    run(mgr, "t", prompt(1, 3), pins=(PinPoint(0, 300),))
    admin.pin(mgr, "t", prompt(1, 3))
    mgr.report_tier(TierReport("w0", 1, tuple(StoredBlock(h, "t", 1000) for h in hashes(mgr, "t", prompt(1, 3)))))
    loaded = KVManager(store_capacity_bytes=4000)
    snapshot_format.decode(snapshot_format.encode(mgr, []), loaded)
    assert (loaded.pins.pins, loaded.now_ms, loaded.fair.last_active) == (mgr.pins.pins, mgr.now_ms,
                                                                          mgr.fair.last_active)
    assert loaded.pools["w0"].usage == mgr.pools["w0"].usage and loaded.tier.pinned_bytes == 3000


def test_an_admin_soft_pin_makes_an_idle_tenant_active_so_it_has_a_budget():
    mgr = manager()
    run(mgr, "t", prompt(1, 3))
    mgr.set_time(T0 + 3600 * S)  # idle past the active window: share 0, no default budget
    assert mgr.pin_budget("t", mgr.pools["w0"]) == 0
    result = admin.pin(mgr, "t", prompt(1, 3), "", 60)
    assert (result.num_pinned_blocks, result.num_over_budget_blocks) == (3, 0)


def test_a_restart_with_another_policy_replays_under_the_old_one_then_switches(redis_url):
    """The calls since the last snapshot were made under the old policy: replayed under a new one they would evict
    other pages and hand a live request pages it was not given. The state keeps its policy; the new one applies
    from the restart on, logged, so that the next restart switches at the same point."""
    capped = CachePolicy(tenants={"a": TenantQuota(cap=Amount(pages=4))})
    svc = KVService(KVManager(policy=capped), CallLog(connect(redis_url)), wall_ms=lambda: T0)
    svc.load()  # as a kvmanager starts: an empty state, whose log now begins with the policy
    svc.register_worker(spec())
    run(svc.manager, "a", prompt(1, 4), step=svc.step)
    run(svc.manager, "b", prompt(2, 3), step=svc.step)
    live = svc.step(StepOps(next_step_id(svc.step), allocations=(PageAllocation("x", "a", prompt(3, 6), "w0"),)))
    table = live.allocations[0].page_table  # a at its cap: its own pages first
    restarted = KVService(KVManager(), CallLog(connect(redis_url)), wall_ms=lambda: T0)  # the default policy
    restarted.load()
    assert restarted.manager.requests["x"].page_table == table
    assert restarted.manager.fair.policy == CachePolicy()
    again = KVService(KVManager(), CallLog(connect(redis_url)), wall_ms=lambda: T0)
    again.load()  # replays under capped, then the logged switch: nothing to switch at its own start
    assert again.manager.requests["x"].page_table == table and again.manager.fair.policy == CachePolicy()
    check_invariants(again.manager)
