"""Tenant-aware eviction: which tenant gives up a page (or a tier entry) when one is needed.

Each pool keeps its evictable pages, and the shared tier its unpinned entries, in a TenantLRU: one LRU per
tenant, all stamped from one sequence (so their union is still the global LRU). When something must go,
FairShare picks the tenant, then its least recently used entry goes:

    1. a tenant at or over its cap, furthest over it first;
    2. else the tenant furthest over its fair share (usage / share, largest first), where its share is
       capacity * its weight / the weights of the tenants active in the window; an inactive tenant's share
       is 0, so the cache it holds goes first;
    3. tenants at or under their floor last of all (2's order among them).

Ties go to the older LRU head. Usage counts everything a tenant holds there: pages its requests hold, its
cached pages, its pinned ones (pool), its entries' bytes (tier). So a tenant using less than its share keeps
its recently used prefixes however hard another one floods, and a tenant over its cap makes room from its own
pages first (pool.py). With the ``lru`` policy the victim is the tenant with the oldest LRU head: exactly the
global LRU kvserve used before fair share.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator

from kvserve.kvmanager.tenants import DEFAULT_PIN_SHARE, CachePolicy, TenantQuota

Limits = Callable[[TenantQuota, int], tuple[int, int]]  # (quota, capacity) -> (floor, cap) in usage units


def pool_limits(q: TenantQuota, num_pages: int) -> tuple[int, int]:
    return q.floor.of(num_pages), q.cap.of(num_pages)


def store_limits(q: TenantQuota, capacity_bytes: int) -> tuple[int, int]:
    return q.store_floor_bytes, q.store_cap_bytes


class TenantLRU:
    """Keys (a pool's page ids, the tier's block hashes) in LRU order per tenant, stamped from one sequence."""

    __slots__ = ("by_tenant", "seq", "size")

    def __init__(self):
        self.by_tenant: dict[str, OrderedDict[Hashable, int]] = {}  # tenant -> key -> stamp, oldest first
        self.seq = 0
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def __contains__(self, key) -> bool:  # O(tenants): for checks and tests; the hot paths use has()
        return any(key in od for od in self.by_tenant.values())

    def __iter__(self) -> Iterator:
        """Every key, least recently used first over all tenants."""
        merged = heapq.merge(*(((s, k) for k, s in od.items()) for od in self.by_tenant.values()))
        return (k for _, k in merged)

    def has(self, key, tenant: str) -> bool:
        od = self.by_tenant.get(tenant)
        return od is not None and key in od

    def add(self, key, tenant: str) -> None:
        """Adds the key (or moves it) as the most recently used."""
        od = self.by_tenant.get(tenant)
        if od is None:
            od = self.by_tenant[tenant] = OrderedDict()
        if key in od:
            od.move_to_end(key)
        else:
            self.size += 1
        self.seq += 1
        od[key] = self.seq

    def discard(self, key, tenant: str) -> bool:
        od = self.by_tenant.get(tenant)
        if od is None or od.pop(key, None) is None:
            return False
        self.size -= 1
        if not od:
            del self.by_tenant[tenant]
        return True

    def head_seq(self, tenant: str) -> int:
        return next(iter(self.by_tenant[tenant].values()))

    def pop_oldest(self, tenant: str):
        od = self.by_tenant[tenant]
        key = od.popitem(last=False)[0]
        self.size -= 1
        if not od:
            del self.by_tenant[tenant]
        return key

    def count(self, tenant: str) -> int:
        od = self.by_tenant.get(tenant)
        return len(od) if od else 0


class FairShare:
    """The policy (tenants.py) plus who is active: the victim rule above, shares and pin budgets."""

    def __init__(self, policy: CachePolicy | None = None):
        self.policy = policy or CachePolicy()
        self.last_active: dict[str, int] = {}  # tenant -> manager time (ms) it last allocated or committed
        self.now_ms = 0

    @classmethod
    def global_lru(cls) -> FairShare:
        """One LRU over every tenant (the ``lru`` policy)."""
        return cls(CachePolicy("lru"))

    def touch(self, tenant: str) -> None:
        self.last_active[tenant] = self.now_ms

    def active_weight(self) -> float:
        """The weights of the tenants active in the window, summed."""
        since, quota = self.now_ms - self.policy.active_window_ms, self.policy.quota
        return sum(quota(t).weight for t, at in self.last_active.items() if at >= since)

    def is_active(self, tenant: str) -> bool:
        at = self.last_active.get(tenant)
        return at is not None and at >= self.now_ms - self.policy.active_window_ms

    def share(self, tenant: str, capacity: int, total_weight: float | None = None) -> float:
        """The tenant's fair share of ``capacity`` now (0 while inactive)."""
        if not self.is_active(tenant):
            return 0.0
        w = self.active_weight() if total_weight is None else total_weight
        return capacity * self.policy.quota(tenant).weight / w if w else float(capacity)

    def over_cap(self, tenant: str, usage: int, capacity: int, limits: Limits) -> bool:
        if not self.policy.fair:
            return False
        cap = limits(self.policy.quota(tenant), capacity)[1]
        return bool(cap) and usage >= cap

    def victims(self, lru: TenantLRU, usage: dict[str, int], capacity: int, limits: Limits,
                requester: str = "") -> Iterator[str]:
        """Tenants to evict from, one entry each, in order, for ``requester`` (whose usage grows by one with each
        entry taken from another tenant; the caller updates ``usage``). Stops when ``lru`` is empty."""
        if not self.policy.fair:
            while lru.size:
                yield min(lru.by_tenant, key=lru.head_seq)
            return
        total_weight, terms = self.active_weight(), {}
        while lru.size:
            by_tenant = lru.by_tenant
            if len(by_tenant) == 1:
                yield next(iter(by_tenant))
                continue
            ranked = []
            for tenant, od in by_tenant.items():
                t = terms.get(tenant)
                if t is None:  # (floor, cap, share) of a tenant: fixed for the call, only usage moves
                    floor, cap = limits(self.policy.quota(tenant), capacity)
                    t = terms[tenant] = (floor, cap, self.share(tenant, capacity, total_weight))
                ranked.append((_rank(usage.get(tenant, 0), *t, next(iter(od.values()))), tenant))
            key, victim = max(ranked)
            run = min(lru.count(victim), self._run(victim, key, ranked, usage, terms, requester))
            for _ in range(run):
                yield victim

    @staticmethod
    def _run(victim: str, key: tuple, ranked: list, usage: dict[str, int], terms: dict, requester: str) -> int:
        """Entries the victim can give, one after the other, before another tenant could rank first (at least 1):
        its usage falls by one each, the requester's rises by one each, the others' stay."""
        if victim == requester:  # its pages go to itself: nobody's usage moves
            return 1 << 62
        held, (floor, cap, share) = usage.get(victim, 0), terms[victim]
        cls = key[0]
        if cls == 2:
            run, unit = held - cap + 1, cap  # while still at its cap
        else:
            run, unit = (held - floor if cls == 1 else 1 << 62), share  # while still above its floor
        for other_key, other in ranked:
            if other == victim:
                continue
            if other == requester:
                run = min(run, _requester_bound(usage.get(other, 0), terms[other], cls, held, unit))
            elif other_key[0] == cls and unit:
                # strictly ahead on the ratio while (held - i) / unit > theirs: ties go back to a full ranking
                run = min(run, math.ceil(held - other_key[1] * unit)) if other_key[1] < math.inf else 1
            elif other_key[0] == cls:  # both inactive (share 0): the LRU heads decide, one at a time
                run = 1
        return max(1, run)

    def pin_budget(self, tenant: str, num_pages: int) -> int:
        """Pages the tenant's soft pins may hold on a pool of ``num_pages``: its pin_budget, else half its floor,
        else half its fair share now."""
        q = self.policy.quota(tenant)
        if q.pin_budget is not None:
            return q.pin_budget.of(num_pages)
        if q.floor:
            return int(DEFAULT_PIN_SHARE * q.floor.of(num_pages))
        return int(DEFAULT_PIN_SHARE * self.share(tenant, num_pages))

    def store_pin_budget(self, tenant: str, capacity_bytes: int) -> int:
        """Bytes of the tier its soft pins may hold: half its store floor, else half its fair share."""
        q = self.policy.quota(tenant)
        if q.store_floor_bytes:
            return int(DEFAULT_PIN_SHARE * q.store_floor_bytes)
        return int(DEFAULT_PIN_SHARE * self.share(tenant, capacity_bytes))


def _rank(held: int, floor: int, cap: int, share: float, head_seq: int) -> tuple:
    """A tenant's place in the eviction order (largest first): at or over its cap (by how far), then above its
    floor, by usage over its share (inactive: infinite), then at or under its floor; the older LRU head on ties."""
    if cap and held >= cap:
        return 2, held / cap, -head_seq
    return (1 if held > floor else 0), (held / share if share else math.inf), -head_seq


def _requester_bound(held: int, terms: tuple, cls: int, victim_held: int, victim_unit: float) -> int:
    """Entries taken before the requester (usage rising from ``held``) could outrank the victim."""
    floor, cap, share = terms
    run = cap - held if cap else 1 << 62  # it reaches its cap: class 2
    if cls < 2 and held + run > floor and cls == 0:
        run = min(run, max(1, floor - held + 1))  # it rises above its floor over a victim at or under its own
    if victim_unit and share:  # (victim_held - i) / victim_unit > (held + i) / share
        run = min(run, math.ceil((victim_held * share - held * victim_unit) / (share + victim_unit)))
    elif not share and cls < 2 and held + 1 > floor:  # the requester inactive (share 0): its ratio is infinite
        run = 1
    return max(1, run)
