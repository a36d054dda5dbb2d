"""The manager's invariants, checked in full (O(pages + page table entries)): for tests and after a reload.

Per pool, every page is in exactly one state (see pool.py), and::

    ref_cnt[p]   == number of live requests whose page_table holds p, plus the pulls that hold p as a source
    free list    == the ref-0 pages without a block        (no duplicates)
    evictable    == the ref-0 pages with an unpinned block  (no duplicates, disjoint from the free list)
    index[h]     is block_of[index[h].page_id]               (and every block_of entry is indexed)
    num_used + num_cached + num_free == num_pages

A page held by a request holds nothing or a block of that request's tenant at that request's position
(no cross-tenant hit), and a live request always sits on its pool's current epoch. Every page that is not free
has one owner (the tenant of its block and of its holders), usage counts them per tenant, and each evictable
page sits in its own tenant's LRU.

Pins: a block is flagged pinned exactly when its hash is in the pin table, in every pool and in the tier; each
tenant's soft-pin count is its soft pins'.

The shared KV tier's index counts exactly its entries' bytes (per tenant too, and the pinned ones'), within
its capacity (none with the tier off); its LRU holds exactly its unpinned entries.

A hole (HOLE, a page its sliding window released) holds nothing and counts for no page. Holes exist only on
pools with a window, never among the sink pages, and never at the end of a page table (the next token's page).

Page groups: a grouped pool's sliding group (pool.group) is checked as a pool of its own against the requests'
group tables (holes allowed there, never in their full layers' tables). A request on a grouped pool has a group
record and no other request has one; its group chain is as long as its full chain, under the group's seed.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from kvserve.common.pages import HOLE
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.pool import PagePool, group_spec, with_groups
from kvserve.kvmanager.state import RequestPages


class _Table(NamedTuple):
    """What the pool checks read of a request: a sliding group's checks see its group table as its table."""

    req_id: str
    tenant: str
    page_table: list[int]


def check_invariants(mgr: KVManager) -> None:
    """Raises AssertionError naming the first broken invariant."""
    both = set(mgr.requests) & set(mgr.stale)
    assert not both, f"req_ids both live and stale: {sorted(both)}"
    by_worker: dict[str, list[RequestPages]] = {w: [] for w in mgr.pools}
    for req_id, req in mgr.requests.items():
        assert req.req_id == req_id, f"request stored under {req_id!r} is {req.req_id!r}"
        pool = mgr.pools.get(req.worker_id)
        assert pool is not None, f"live request {req_id!r} is on unregistered worker {req.worker_id!r}"
        assert req.epoch == pool.spec.epoch, (f"live request {req_id!r} has epoch {req.epoch}, its pool "
                                              f"{req.worker_id!r} epoch {pool.spec.epoch}")
        by_worker[req.worker_id].append(req)
    for req_id, req in mgr.stale.items():
        pool = mgr.pools.get(req.worker_id)
        assert pool is None or pool.spec.epoch != req.epoch, f"stale request {req_id!r} is on a current epoch"
    for worker_id, pool in mgr.pools.items():
        assert pool.spec.worker_id == worker_id, f"pool under {worker_id!r} is {pool.spec.worker_id!r}"
        _check_pool(pool, by_worker[worker_id], _held_for_pulls(mgr, pool))
        _check_group(pool, by_worker[worker_id])
    for tenant, counters in mgr.tenants.items():
        assert 0 <= counters.prefix_cache_hits <= counters.prefix_cache_queries, f"tenant {tenant!r}: {counters}"
    _check_tier(mgr)
    _check_pins(mgr)


def _check_group(pool: PagePool, live: list[RequestPages]) -> None:
    w, group = pool.spec.worker_id, pool.group
    assert (group is not None) == pool.spec.grouped, f"{w}: a sliding group iff the spec has one"
    assert all((r.group is not None) == pool.spec.grouped for r in live), f"{w}: a request without its group"
    if group is None:
        return
    assert group.spec == group_spec(pool.spec) and group.group is None, f"{w}: a sliding group of another spec"
    for r in live:
        g = r.group
        assert len(g.block_hashes) == len(r.block_hashes), f"{w}: {r.req_id!r}'s group chain is not its chain"
        assert g.seed == group.seed_for(r.tenant), f"{w}: {r.req_id!r}'s group seed is not its group's"
        assert HOLE not in r.page_table, f"{w}: {r.req_id!r} has a hole in its full layers' table"
    _check_pool(group, [_Table(r.req_id, r.tenant, r.group.page_table) for r in live], {})


def _check_pins(mgr: KVManager) -> None:
    pins = mgr.pins
    for pool in with_groups(mgr.pools.values()):
        for h, block in pool.index.items():
            assert block.pinned == (h in pins), (f"{pool.spec.worker_id}: block {h.hex()} pinned={block.pinned} "
                                                 f"but {'in' if h in pins else 'not in'} the pin table")
    for h, e in mgr.tier.entries.items():
        assert e.pinned == (h in pins), f"store index: entry {h.hex()} pinned={e.pinned} disagrees with the pins"
    soft = Counter(p.tenant for p in pins.pins.values() if p.ttl_ms)
    assert soft == Counter(pins.num_soft), f"soft pins per tenant {dict(soft)} != counted {pins.num_soft}"
    for h, p in pins.pins.items():
        assert (p.ttl_ms > 0) == (p.expires_ms > 0), f"pin {h.hex()}: ttl {p.ttl_ms} but expires {p.expires_ms}"


def _check_tier(mgr: KVManager) -> None:
    tier = mgr.tier
    total = sum(e.num_bytes for e in tier.entries.values())
    assert tier.num_bytes == total, f"store index: num_bytes {tier.num_bytes} != {total} in its entries"
    usage: Counter[str] = Counter()
    for e in tier.entries.values():
        usage[e.tenant] += e.num_bytes
    assert usage == Counter(tier.usage), f"store index: usage {tier.usage} != {dict(usage)} in its entries"
    pinned = sum(e.num_bytes for e in tier.entries.values() if e.pinned)
    assert tier.pinned_bytes == pinned, f"store index: pinned_bytes {tier.pinned_bytes} != {pinned}"
    unpinned = {h for h, e in tier.entries.items() if not e.pinned}
    assert set(tier.lru) == unpinned and len(tier.lru) == len(unpinned), (
        "store index: its LRU is not its unpinned entries")
    assert not tier.entries or total <= tier.capacity_bytes, (
        f"store index: {total} bytes recorded over its capacity of {tier.capacity_bytes}")
    assert all(len(h) == 16 for h in tier.entries), "store index: a key that is not a 16-byte block hash"


def _held_for_pulls(mgr: KVManager, pool: PagePool) -> dict[int, tuple[int, str]]:
    """The pool's pages held as the source of live requests' pulls: page -> (holds, tenant). Each is a cached
    block (a committed page) but the last of a hold, which may be a prompt's last, partial page."""
    held: dict[int, tuple[int, str]] = {}
    for req in mgr.requests.values():
        hold = req.transfer
        if hold is not None and hold.worker_id == pool.spec.worker_id:
            assert hold.epoch == pool.spec.epoch, f"{req.req_id!r} holds pages of a dropped epoch of {hold.worker_id}"
            assert all(pool.block_of[p] is not None for p in hold.page_ids[:-1]), (
                f"{req.req_id!r} holds an uncached page that is not its prompt's last")
            for p in hold.page_ids:
                held[p] = (held.get(p, (0, ""))[0] + 1, req.tenant)
    assert mgr.num_holds == sum(1 for r in mgr.requests.values() if r.transfer is not None), "num_holds miscounted"
    return held


def _check_pool(pool: PagePool, live: list[RequestPages], held: dict[int, tuple[int, str]]) -> None:
    w, n = pool.spec.worker_id, pool.spec.num_pages
    assert len(pool.ref_cnt) == len(pool.block_of) == n, f"{w}: ref_cnt/block_of sized for {n} pages"
    holders: Counter[int] = Counter({p: k for p, (k, _) in held.items()})
    for req in live:
        pages = [p for p in req.page_table if p != HOLE]
        assert len(set(pages)) == len(pages), f"{w}: {req.req_id!r} holds a page twice"
        assert all(0 <= p < n for p in pages), f"{w}: {req.req_id!r} holds a page out of range"
        if len(pages) < len(req.page_table):
            _check_holes(pool, req)
        holders.update(pages)
        _check_blocks_of_holder(pool, req)
    for p in range(n):
        assert pool.ref_cnt[p] == holders[p], f"{w}: page {p} ref_cnt {pool.ref_cnt[p]} != {holders[p]} holders"
    assert pool.num_requests == len(live), f"{w}: num_requests {pool.num_requests} != {len(live)} live"
    _check_index(pool)
    _check_lists(pool)
    _check_owners(pool, live, held)


def _check_owners(pool: PagePool, live: list[RequestPages], held: dict[int, tuple[int, str]]) -> None:
    w = pool.spec.worker_id
    want: list[str | None] = [b.tenant if b is not None else None for b in pool.block_of]
    for p, (_, tenant) in held.items():
        want[p] = tenant
    for req in live:
        for p in req.page_table:
            if p != HOLE:
                want[p] = req.tenant
    assert pool.owner == want, f"{w}: page owners {pool.owner} != {want}"
    usage = Counter(t for t in want if t is not None)
    assert usage == Counter({t: n for t, n in pool.usage.items() if n}), f"{w}: usage {pool.usage} != {dict(usage)}"
    for tenant, od in pool.evictable.by_tenant.items():
        assert od, f"{w}: tenant {tenant!r} has an empty LRU left behind"
        assert all(pool.block_of[p].tenant == tenant for p in od), f"{w}: a page in {tenant!r}'s LRU is not its"


def _check_holes(pool: PagePool, req: RequestPages) -> None:
    w, table = pool.spec.worker_id, req.page_table
    assert all(pool.window.may_release(i, len(table), pool.spec.page_size) for i, p in enumerate(table)
               if p == HOLE), f"{w}: {req.req_id!r} has a hole its window may not release ({pool.window}): {table}"


def _check_blocks_of_holder(pool: PagePool, req: RequestPages) -> None:
    for i, p in enumerate(req.page_table):
        if p == HOLE:
            continue
        block = pool.block_of[p]
        if block is not None:
            assert block.tenant == req.tenant, (f"{pool.spec.worker_id}: page {p} of {req.req_id!r} (tenant "
                                                f"{req.tenant!r}) holds a block of tenant {block.tenant!r}")
            assert block.block_index == i, (f"{pool.spec.worker_id}: page {p} is position {i} of {req.req_id!r} "
                                            f"but holds block {block.block_index}")


def _check_index(pool: PagePool) -> None:
    w = pool.spec.worker_id
    for h, block in pool.index.items():
        assert block.block_hash == h, f"{w}: index entry {h.hex()} holds block {block.block_hash.hex()}"
        assert 0 <= block.page_id < pool.spec.num_pages, f"{w}: block {h.hex()} page {block.page_id} out of range"
        assert pool.block_of[block.page_id] is block, f"{w}: block {h.hex()} is not block_of[{block.page_id}]"
    num_blocks = sum(1 for b in pool.block_of if b is not None)
    assert num_blocks == len(pool.index), f"{w}: {num_blocks} pages hold blocks, {len(pool.index)} indexed"


def _check_lists(pool: PagePool) -> None:
    w = pool.spec.worker_id
    free, evictable = list(pool.free), list(pool.evictable)
    assert len(set(free)) == len(free), f"{w}: duplicate pages on the free list"
    assert not set(free) & set(evictable), f"{w}: pages both free and evictable: {sorted(set(free) & set(evictable))}"
    for p in free:
        assert pool.ref_cnt[p] == 0 and pool.block_of[p] is None, f"{w}: free page {p} is held or cached"
    for p in evictable:
        block = pool.block_of[p]
        assert pool.ref_cnt[p] == 0 and block is not None and not block.pinned, (
            f"{w}: evictable page {p} is held, holds no block, or is pinned")
    idle = [p for p in range(pool.spec.num_pages) if pool.ref_cnt[p] == 0]
    want_free = {p for p in idle if pool.block_of[p] is None}
    want_lru = {p for p in idle if pool.block_of[p] is not None and not pool.block_of[p].pinned}
    assert set(free) == want_free, f"{w}: free pages missing from the free list: {sorted(want_free - set(free))}"
    assert set(evictable) == want_lru, f"{w}: cached pages missing from the LRU: {sorted(want_lru - set(evictable))}"
    num_used = sum(1 for c in pool.ref_cnt if c > 0)
    num_cached = len(idle) - len(want_free)
    assert num_used + num_cached + len(free) == pool.spec.num_pages, (
        f"{w}: used {num_used} + cached {num_cached} + free {len(free)} != {pool.spec.num_pages} pages")
