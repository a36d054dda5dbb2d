"""Properties of tenant-aware eviction and soft pins, over random histories: tenants of random weights, floors,
caps and pin budgets run prompts (some held while others come), ask for pins, let time pass, and report values
written to the shared tier. After every step:

    - the manager's invariants hold (pool.py's owners and usage, pins flagged everywhere, the tier's accounting);
    - each eviction took a page as fair_share.py orders them: from a tenant at its cap when one is, never from a
      tenant at or under its floor while another above its floor had a page to give, never from a tenant under
      its share while another above its floor was over its share;
    - no soft pin is past its expiry, and a tenant's soft pins never grew past its pin budget;
    - a snapshot decodes to the same state, pins, activity and time included (the replay of the call log is
      test_kvmanager_pins.py's).
"""

from __future__ import annotations

import math

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from kvmanager_soak import snapshot

from kvserve.common.wire.pages import OpStatus, PageAllocation, PageCommit, PageFree, PinPoint, PoolSpec, StepOps
from kvserve.common.wire.tier import StoredBlock, TierReport
from kvserve.kvmanager import admin
from kvserve.kvmanager import snapshot as snapshot_format
from kvserve.kvmanager.fair_share import FairShare
from kvserve.kvmanager.hashing import chain_hashes
from kvserve.kvmanager.invariants import check_invariants
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.tenants import Amount, CachePolicy, TenantQuota

PS = 4
NUM_PAGES = 24
STORE_BYTES = 12_000
VALUE_BYTES = 1000
TENANTS = ("A", "B", "C")
T0 = 1_800_000_000_000
WINDOW_MS = 60_000

quotas = st.builds(
    TenantQuota,
    weight=st.sampled_from([1.0, 2.0, 3.0]),
    floor=st.sampled_from([Amount(), Amount(pages=2), Amount(share=0.25)]),
    cap=st.sampled_from([Amount(), Amount(pages=10), Amount(share=0.5)]),
    pin_budget=st.sampled_from([None, Amount(pages=3), Amount(share=0.2)]),
    store_floor_bytes=st.sampled_from([0, 2 * VALUE_BYTES]),
    store_cap_bytes=st.sampled_from([0, 6 * VALUE_BYTES]),
)


class CheckedFairShare(FairShare):
    """FairShare whose every victim is checked against the rule, with the usage it was chosen on."""

    def victims(self, lru, usage, capacity, limits, requester=""):
        for victim in super().victims(lru, usage, capacity, limits, requester):
            self.check_victim(victim, lru, usage, capacity, limits)
            yield victim

    def check_victim(self, victim, lru, usage, capacity, limits) -> None:
        total = self.active_weight()

        def state(t):
            floor, cap = limits(self.policy.quota(t), capacity)
            held, share = usage.get(t, 0), self.share(t, capacity, total)
            return held, floor, cap, share

        held, floor, cap, share = state(victim)
        others = [state(t) for t in lru.by_tenant if t != victim]
        if any(c and h >= c for h, _, c, _ in others):
            assert cap and held >= cap, f"{victim} lost a page while another tenant was at its cap"
        if held <= floor:
            assert all(h <= f for h, f, _, _ in others), f"{victim} lost a page under its floor ({held} <= {floor})"
        elif not (cap and held >= cap) and held < share:
            assert not any(h > f and h > s and not (c and h >= c) for h, f, c, s in others), (
                f"{victim} lost a page under its share while another was over its own")


class TenantMachine(RuleBasedStateMachine):
    @initialize(policy=st.fixed_dictionaries({t: quotas for t in TENANTS}))
    def init(self, policy):
        self.mgr = KVManager(store_capacity_bytes=STORE_BYTES,
                             policy=CachePolicy(tenants=policy, active_window_ms=WINDOW_MS))
        self.mgr.fair = self.mgr.tier.fair = CheckedFairShare(self.mgr.fair.policy)
        self.mgr.register_worker(PoolSpec("w0", 1, NUM_PAGES, PS, "fp", "float32", 64, kv_store=True))
        self.mgr.set_time(T0)
        self.step_id = 0
        self.held: list[tuple[str, str, tuple[int, ...], int]] = []  # (req_id, tenant, tokens, committed)
        self.next_req = 0

    def step(self, **ops):
        self.step_id += 1
        before = dict(self.mgr.pins.num_soft)
        out = self.mgr.step(StepOps(self.step_id, **ops))
        for tenant, n in self.mgr.pins.num_soft.items():
            budget = self.mgr.pin_budget(tenant, self.mgr.pools["w0"])
            assert n <= max(before.get(tenant, 0), budget), f"{tenant}: {n} soft pins over a budget of {budget}"
        return out

    @rule(tenant=st.sampled_from(TENANTS), prefix=st.integers(0, 3), pages=st.integers(1, 8), hold=st.booleans(),
          pins=st.lists(st.tuples(st.integers(0, 36), st.sampled_from([5, 60, 3600])), max_size=2))
    def run(self, tenant, prefix, pages, hold, pins):
        tokens = tuple(range(prefix * 100, prefix * 100 + pages * PS + 1))
        pins = tuple(PinPoint(min(n, len(tokens)), ttl) for n, ttl in pins)
        self.next_req += 1
        req_id = f"r{self.next_req}"
        a = self.step(allocations=(PageAllocation(req_id, tenant, tokens, "w0", pins=pins),)).allocations[0]
        if a.status is not OpStatus.OK:
            return
        if hold:
            self.held.append((req_id, tenant, tokens, a.num_committed_tokens))
        else:
            self._finish(req_id, tokens, a.num_committed_tokens)

    def _finish(self, req_id, tokens, committed):
        full = len(tokens) // PS * PS
        self.step(commits=(PageCommit(req_id, committed, tokens[committed:full], len(tokens)),),
                  frees=(PageFree(req_id),))

    @rule(data=st.data())
    def finish_one(self, data):
        if self.held:
            req_id, _, tokens, committed = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
            self._finish(req_id, tokens, committed)

    @rule(seconds=st.sampled_from([1, 4, 30, 61, 600]))
    def time_passes(self, seconds):
        self.mgr.set_time(self.mgr.now_ms + seconds * 1000)

    @rule(tenant=st.sampled_from(TENANTS), prefix=st.integers(0, 3), pages=st.integers(1, 8))
    def values_written(self, tenant, prefix, pages):
        pool = self.mgr.pools["w0"]
        tokens = tuple(range(prefix * 100, prefix * 100 + pages * PS))
        hashes = chain_hashes(pool.seed_for(tenant), tokens, PS)
        self.mgr.report_tier(TierReport("w0", 1, tuple(StoredBlock(h, tenant, VALUE_BYTES) for h in hashes)))

    @rule(tenant=st.sampled_from(TENANTS), prefix=st.integers(0, 3), ttl=st.sampled_from([0, 30]))
    def admin_pin(self, tenant, prefix, ttl):
        admin.pin(self.mgr, tenant, tuple(range(prefix * 100, prefix * 100 + 8 * PS)), "", ttl)

    @invariant()
    def holds(self):
        mgr = self.mgr
        check_invariants(mgr)
        assert all(not p.ttl_ms or p.expires_ms > mgr.now_ms for p in mgr.pins.pins.values()), "a lapsed pin"
        for pool in mgr.pools.values():
            assert all(not math.isnan(mgr.fair.share(t, pool.spec.num_pages)) for t in TENANTS)

    @invariant()
    def a_snapshot_reloads_it(self):
        loaded = KVManager(store_capacity_bytes=STORE_BYTES, policy=self.mgr.fair.policy)
        snapshot_format.decode(snapshot_format.encode(self.mgr, []), loaded)
        assert snapshot(loaded) == snapshot(self.mgr)
        assert (loaded.pins.pins, loaded.now_ms, loaded.fair.last_active) == (
            self.mgr.pins.pins, self.mgr.now_ms, self.mgr.fair.last_active)
        assert loaded.pools["w0"].usage == {t: n for t, n in self.mgr.pools["w0"].usage.items() if n}
        assert (loaded.tier.usage, list(loaded.tier.lru)) == (self.mgr.tier.usage, list(self.mgr.tier.lru))


TestTenantProperties = TenantMachine.TestCase
TestTenantProperties.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
