"""Operator queries and actions over a KVManager, run through ``KVService.read`` / ``KVService.mutate``.

Plain Python like the rest of the domain. Reads (``stats``, ``list_tenants``, ``inspect_tenant``, ``probe``,
``page_table``) change nothing at all: no ref_cnt, LRU order, counter, logical clock or ``mgr.changes``.
Mutations (``evict_tenant``, ``pin``, ``unpin``, ``reset``, ``forget_worker``) mark ``mgr.changes`` when they
change something, so that the service logs the call (one that changed nothing is not logged).

A grouped pool (page groups, manager.py): its counts are its full layers', with the sliding layers' pool counted
alike in PoolStats.sliding_group; a probe counts the joint hit (placement.py), page_table shows the sliding
group's table and pages too, and evict_tenant evicts the tenant's blocks in both groups.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kvserve.common.errors import InvalidRequest, StaleEpoch
from kvserve.common.pages import HOLE
from kvserve.common.tokens import check_token_ids
from kvserve.common.wire.pages import MAX_PIN_TTL_S
from kvserve.kvmanager.errors import RequestsRunning, UnknownTenant
from kvserve.kvmanager.hashing import chain_hashes, hex_hash, iter_chain_hashes
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.placement import joint_hit
from kvserve.kvmanager.pool import Block, PagePool, with_groups
from kvserve.kvmanager.state import TenantCounters
from kvserve.kvmanager.step_validate import check_tenant
from kvserve.kvmanager.transfers import TransferTotals

DEFAULT_MAX_BLOCKS = 100
DEFAULT_MAX_PREFIXES = 10



@dataclass(slots=True)
class PoolStats:
    worker_id: str
    epoch: int
    model_fingerprint: str
    kv_dtype: str
    page_size: int
    num_pages: int
    num_used_pages: int
    num_cached_pages: int  # ref_cnt 0 with a block: evictable or pinned
    num_free_pages: int
    num_pinned_pages: int  # also counted as used or cached
    num_requests: int
    pool_bytes: int
    used_bytes: int
    cached_bytes: int
    kv_scales: str
    sliding_window: int  # 0 = none
    attention_sinks: int
    num_window_released_pages: int  # pages released by requests' windows since registration (cumulative)
    role: str = "both"  # what the gateway sends the worker: "both", "prefill" or "decode"
    sliding_group: PoolStats | None = None  # a grouped pool: its sliding layers' pool, counted alike


@dataclass(slots=True)
class TenantStats:
    tenant: str
    num_blocks: int
    num_pinned_blocks: int
    num_requests: int
    prefix_cache_queries: int
    prefix_cache_hits: int  # both tiers
    store_hits: int = 0  # of which: tokens loaded from the shared KV tier
    num_store_blocks: int = 0  # the tenant's blocks in the store
    weight: float = 1.0  # in the fair share (fair_share.py)
    active: bool = False  # used the cache within the active window
    num_pages: int = 0  # held over all pools (used, cached, pinned)
    share_pages: int = 0  # its fair share now, summed over the pools
    floor_pages: int = 0  # summed over the pools; 0: none
    cap_pages: int = 0
    store_bytes: int = 0
    store_floor_bytes: int = 0
    store_cap_bytes: int = 0
    num_pin_blocks: int = 0  # under its pins, soft and operator's
    num_soft_pin_blocks: int = 0
    pin_budget_blocks: int = 0  # on its largest pool
    num_evicted_pages: int = 0  # its pages evicted from the pools (suffered)
    num_evictions_caused: int = 0  # pages its allocations evicted (its own included)
    num_store_evicted: int = 0
    num_store_rejected: int = 0


@dataclass(slots=True)
class StoreStats:
    """The shared KV tier: its index (blocks, bytes, within capacity), its hits, and the workers' traffic."""

    capacity_bytes: int  # 0: the tier is off
    num_blocks: int
    num_bytes: int
    num_hit_pages: int  # pages allocations took from the store
    num_added_blocks: int
    num_evicted_blocks: int  # by the store's LRU, to stay within capacity
    num_dropped_missing: int  # entries dropped: a load found the value absent or damaged
    num_loaded_pages: int
    num_loaded_bytes: int
    load_s: float
    num_failed_loads: int  # requests recomputed because a load failed
    num_verify_failures: int
    num_written_pages: int
    num_written_bytes: int
    num_dropped_writes: int

    @property
    def load_mb_per_s(self) -> float:
        return self.num_loaded_bytes / self.load_s / 1e6 if self.load_s else 0.0


@dataclass(slots=True)
class TransferStats:
    """Pulls of pages between workers' pools (transfers.py's TransferTotals), and the holds live now."""

    num_pulls: int = 0
    num_pages: int = 0
    num_ok: int = 0
    num_failed: int = 0
    num_expired: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    num_moved: int = 0
    num_holds: int = 0

    @property
    def mb_per_s(self) -> float:
        return self.num_bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0


@dataclass(slots=True)
class ClusterStats:
    pools: list[PoolStats]
    tenants: list[TenantStats]
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_evicted_blocks: int
    store: StoreStats | None = None
    transfers: TransferStats | None = None


@dataclass(slots=True)
class CachedBlock:
    block_hash: str
    parent_block_hash: str  # "" for a chain's first block
    worker_id: str
    epoch: int
    page_id: int
    ref_cnt: int
    pinned: bool
    block_index: int
    last_used: int  # the manager's logical clock


@dataclass(slots=True)
class CachedPrefix:
    worker_id: str
    last_block_hash: str
    num_blocks: int
    num_tokens: int


@dataclass(slots=True)
class TenantReport:
    stats: TenantStats
    blocks: list[CachedBlock]
    prefixes: list[CachedPrefix]


@dataclass(slots=True)
class ProbeHit:
    worker_id: str
    epoch: int
    num_cached_tokens: int


@dataclass(slots=True)
class ProbeResult:
    num_query_tokens: int
    num_cached_tokens: int
    worker_id: str  # best hit; "" when nothing hits
    hits: list[ProbeHit] = field(default_factory=list)


@dataclass(slots=True)
class EvictResult:
    num_evicted_blocks: int
    num_kept_blocks: int


@dataclass(slots=True)
class PinResult:
    num_pinned_blocks: int
    num_pinned_tokens: int  # on the best pool
    expires_ms: int = 0  # the first of the prefix's soft pins to lapse (Unix ms); 0: none is soft
    num_over_budget_blocks: int = 0  # a soft pin's blocks left unpinned: the tenant's pin budget was spent


PAGE_HELD, PAGE_SINK, PAGE_RELEASED = "held", "sink", "released"  # PageInfo.kind


@dataclass(slots=True)
class PageInfo:
    page_id: int  # HOLE (-1) for a released page
    ref_cnt: int
    block_hash: str
    pinned: bool
    kind: str  # PAGE_HELD, PAGE_SINK (held for good: it holds attention sinks) or PAGE_RELEASED (a hole)


@dataclass(slots=True)
class PageTable:
    req_id: str
    tenant: str
    worker_id: str
    epoch: int
    page_table: list[int]
    pages: list[PageInfo]
    num_committed_tokens: int
    num_prompt_tokens: int
    last_step_id: int
    page_size: int
    group_page_table: list[int] = field(default_factory=list)  # a grouped pool: the sliding layers' table
    group_pages: list[PageInfo] = field(default_factory=list)  # ... and its pages, as ``pages``


@dataclass(slots=True)
class DropResult:
    """What a reset or a forgotten worker dropped."""

    num_dropped_requests: int
    num_dropped_blocks: int


# -- reads --------------------------------------------------------------------------------------------------
def _pool_stats(pool: PagePool) -> PoolStats:
    s = pool.spec
    page_bytes = s.bytes_per_token * s.page_size
    num_cached = pool.num_cached
    return PoolStats(s.worker_id, s.epoch, s.model_fingerprint, s.kv_dtype, s.page_size, s.num_pages,
                     pool.num_used, num_cached, pool.num_free, sum(b.pinned for b in pool.index.values()),
                     pool.num_requests, page_bytes * s.num_pages, page_bytes * pool.num_used, page_bytes * num_cached,
                     s.kv_scales, s.sliding_window, s.attention_sinks, pool.num_window_released, s.role,
                     _pool_stats(pool.group) if pool.group is not None else None)


def _tenant_stats(mgr: KVManager) -> dict[str, TenantStats]:
    out: dict[str, TenantStats] = {}

    def entry(tenant: str) -> TenantStats:
        if tenant not in out:
            c = mgr.tenants.get(tenant, TenantCounters())
            out[tenant] = TenantStats(tenant, 0, 0, 0, c.prefix_cache_queries, c.prefix_cache_hits)
        return out[tenant]

    for tenant in mgr.tenants:
        entry(tenant)
    for pool in mgr.pools.values():
        for block in pool.index.values():
            t = entry(block.tenant)
            t.num_blocks += 1
            t.num_pinned_blocks += block.pinned
    for req in mgr.requests.values():
        entry(req.tenant).num_requests += 1
    for tenant, hits in mgr.tier.tenant_hits.items():
        entry(tenant).store_hits = hits
    for e in mgr.tier.entries.values():
        entry(e.tenant).num_store_blocks += 1
    for pin in mgr.pins.pins.values():
        t = entry(pin.tenant)
        t.num_pin_blocks += 1
        t.num_soft_pin_blocks += pin.ttl_ms > 0
    for tenant in [*mgr.fair.last_active, *mgr.tier.rejected, *mgr.tier.evicted_from, *mgr.retired_evicted_from]:
        entry(tenant)
    for tenant, t in out.items():
        _add_shares(mgr, tenant, t)
    return dict(sorted(out.items()))


def _add_shares(mgr: KVManager, tenant: str, t: TenantStats) -> None:
    """Its holdings against its share, floor and cap, its pin budget and evictions (fair_share.py)."""
    fair, tier = mgr.fair, mgr.tier
    q = fair.policy.quota(tenant)
    t.weight, t.active = q.weight, fair.is_active(tenant)
    for pool in with_groups(mgr.pools.values()):  # a sliding group's pages and evictions are the tenant's too
        n = pool.spec.num_pages
        t.num_pages += pool.usage.get(tenant, 0)
        t.share_pages += int(fair.share(tenant, n))
        t.floor_pages += q.floor.of(n)
        t.cap_pages += q.cap.of(n)
        t.num_evicted_pages += pool.num_evicted_from.get(tenant, 0)
        t.num_evictions_caused += pool.num_evicted_by.get(tenant, 0)
    t.num_evicted_pages += mgr.retired_evicted_from.get(tenant, 0)
    t.num_evictions_caused += mgr.retired_evicted_by.get(tenant, 0)
    largest = max(mgr.pools.values(), key=lambda p: p.spec.num_pages, default=None)
    t.pin_budget_blocks = mgr.pin_budget(tenant, largest) if largest is not None else 0
    t.store_bytes = tier.usage.get(tenant, 0)
    t.store_floor_bytes, t.store_cap_bytes = q.store_floor_bytes, q.store_cap_bytes
    t.num_store_evicted, t.num_store_rejected = tier.evicted_from.get(tenant, 0), tier.rejected.get(tenant, 0)


def store_stats(mgr: KVManager) -> StoreStats:
    tier = mgr.tier
    t, w = tier.totals, tier.totals.workers
    return StoreStats(tier.capacity_bytes, len(tier), tier.num_bytes, t.num_hit_pages, t.num_added, t.num_evicted,
                      t.num_dropped_missing, w.num_loaded_pages, w.num_loaded_bytes, w.load_s, w.num_failed_loads,
                      w.num_verify_failures, w.num_written_pages, w.num_written_bytes, w.num_dropped_writes)


def transfer_stats(mgr: KVManager) -> TransferStats:
    return TransferStats(**asdict(mgr.transfers), num_holds=mgr.num_holds)


def stats(mgr: KVManager) -> ClusterStats:
    """Per pool (sorted by worker_id) and per tenant (sorted) counters, and their totals."""
    tenants = list(_tenant_stats(mgr).values())
    return ClusterStats(pools=[_pool_stats(mgr.pools[w]) for w in sorted(mgr.pools)], tenants=tenants,
                 prefix_cache_queries=sum(t.prefix_cache_queries for t in tenants),
                 prefix_cache_hits=sum(t.prefix_cache_hits for t in tenants),
                 num_evicted_blocks=sum(p.num_evicted for p in mgr.pools.values()), store=store_stats(mgr),
                 transfers=transfer_stats(mgr))


def list_tenants(mgr: KVManager) -> list[TenantStats]:
    """Every tenant with blocks, live requests or counters, sorted by name."""
    return list(_tenant_stats(mgr).values())


def _cached_block(pool: PagePool, b: Block) -> CachedBlock:
    parent = hex_hash(b.parent_hash) if b.block_index > 0 else ""
    return CachedBlock(hex_hash(b.block_hash), parent, pool.spec.worker_id, pool.spec.epoch, b.page_id,
                       pool.ref_cnt[b.page_id], b.pinned, b.block_index, b.last_used)


def _chain_ends(pool: PagePool, tenant: str) -> list[Block]:
    """Last blocks of the tenant's cached chains from block 0: reachable blocks with no reachable child.

    A block is reachable when its parent chain down to block 0 is cached; one whose ancestor was evicted
    can never be hit (lookups walk from block 0), so it starts no prefix.
    """
    children: dict[bytes, list[Block]] = {}
    for b in pool.index.values():
        if b.tenant == tenant:
            children.setdefault(b.parent_hash, []).append(b)
    frontier = [b for bs in children.values() for b in bs if b.block_index == 0]
    ends = []
    while frontier:
        b = frontier.pop()
        kids = children.get(b.block_hash, [])
        if not kids:
            ends.append(b)
        frontier.extend(kids)
    return ends


def inspect_tenant(mgr: KVManager, tenant: str, max_blocks: int = 0, max_prefixes: int = 0) -> TenantReport:
    """One tenant's counters, cached blocks (most recently used first) and longest cached prefixes.

    0 means the defaults (100 blocks, 10 prefixes). Raises InvalidRequest (empty tenant, negative limits),
    UnknownTenant (no blocks, no requests and no counters).
    """
    check_tenant(tenant)
    if max_blocks < 0 or max_prefixes < 0:
        raise InvalidRequest(f"max_blocks and max_prefixes must be >= 0, got {max_blocks} and {max_prefixes}")
    tenant_stats = _tenant_stats(mgr).get(tenant)
    if tenant_stats is None:
        raise UnknownTenant(f"tenant {tenant!r} has no cached blocks, no requests and no counters")
    blocks, prefixes = [], []
    for w in sorted(mgr.pools):
        pool = mgr.pools[w]
        blocks += [_cached_block(pool, b) for b in pool.index.values() if b.tenant == tenant]
        ps = pool.spec.page_size
        prefixes += [CachedPrefix(w, hex_hash(b.block_hash), b.block_index + 1, (b.block_index + 1) * ps)
                     for b in _chain_ends(pool, tenant)]
    blocks.sort(key=lambda b: (-b.last_used, b.worker_id, b.block_index, b.block_hash))
    prefixes.sort(key=lambda p: (-p.num_tokens, p.worker_id, p.last_block_hash))
    return TenantReport(tenant_stats, blocks[: max_blocks or DEFAULT_MAX_BLOCKS],
                        prefixes[: max_prefixes or DEFAULT_MAX_PREFIXES])


def _pools_in_scope(mgr: KVManager, worker_id: str) -> list[PagePool]:
    return [mgr.pool(worker_id)] if worker_id else [mgr.pools[w] for w in sorted(mgr.pools)]


def _prefix_blocks(mgr: KVManager, pool: PagePool, tenant: str, token_ids: tuple[int, ...]) -> list[Block]:
    """The cached blocks of the longest prefix of ``token_ids``' full pages (uncapped), read only."""
    ps = pool.spec.page_size
    return pool.longest_prefix(iter_chain_hashes(pool.seed_for(tenant), token_ids, ps))


def _cached_tokens(mgr: KVManager, pool: PagePool, tenant: str, token_ids: tuple[int, ...]) -> int:
    """The prompt's leading tokens the pool holds; a grouped pool: its joint hit (placement.py)."""
    ps = pool.spec.page_size
    n = len(_prefix_blocks(mgr, pool, tenant, token_ids))
    if pool.group is not None:
        n = joint_hit(pool.group, chain_hashes(pool.group.seed_for(tenant), token_ids[:n * ps], ps))
    return n * ps


def probe(mgr: KVManager, tenant: str, token_ids: tuple[int, ...], worker_id: str = "") -> ProbeResult:
    """Leading tokens of a prompt in cached full pages, per pool. No side effect of any kind.

    Raises InvalidRequest (empty tenant or tokens, token id not a uint32), UnknownWorker.
    """
    check_tenant(tenant)
    check_token_ids("", token_ids)
    hits = [ProbeHit(p.spec.worker_id, p.spec.epoch, _cached_tokens(mgr, p, tenant, token_ids))
            for p in _pools_in_scope(mgr, worker_id)]
    best = max(hits, key=lambda h: h.num_cached_tokens, default=None)  # max keeps the first of equals
    if best is None or best.num_cached_tokens == 0:
        return ProbeResult(len(token_ids), 0, "", hits)
    return ProbeResult(len(token_ids), best.num_cached_tokens, best.worker_id, hits)


def page_table(mgr: KVManager, req_id: str) -> PageTable:
    """A live request's pages with their ref_cnts and block hashes; a page its window released is a hole
    (page_id HOLE, kind "released"), and on a pool with attention sinks the first pages are of kind "sink".

    Raises UnknownRequest (not live), StaleEpoch (its pages were dropped with their epoch).
    """
    if req_id in mgr.stale:
        req = mgr.stale[req_id]
        raise StaleEpoch(f"request {req_id!r}: its pages were dropped with epoch {req.epoch} of worker "
                         f"{req.worker_id!r}; free it and recompute")
    req = mgr.request(req_id)
    pool = mgr.pools[req.worker_id]
    group = req.group.page_table if req.group is not None else []
    return PageTable(req.req_id, req.tenant, req.worker_id, req.epoch, list(req.page_table),
                     _page_infos(pool, req.page_table), req.num_committed_tokens, req.num_prompt_tokens,
                     req.last_step_id, pool.spec.page_size, list(group),
                     _page_infos(pool.group, group) if group else [])


def _page_infos(pool: PagePool, table: list[int]) -> list[PageInfo]:
    pages, num_sinks = [], pool.num_sink_pages
    for i, page_id in enumerate(table):
        if page_id == HOLE:
            pages.append(PageInfo(HOLE, 0, "", False, PAGE_RELEASED))
            continue
        block = pool.block_of[page_id]
        pages.append(PageInfo(page_id, pool.ref_cnt[page_id], hex_hash(block.block_hash) if block else "",
                              bool(block and block.pinned), PAGE_SINK if i < num_sinks else PAGE_HELD))
    return pages


# -- mutations ----------------------------------------------------------------------------------------------
def evict_tenant(mgr: KVManager, tenant: str, worker_id: str = "", include_pinned: bool = False) -> EvictResult:
    """Evicts the tenant's cached blocks with ref_cnt 0 (pinned ones only with ``include_pinned``, which
    removes their pins); their pages become free. Blocks held by requests are kept (unpinned with
    include_pinned). Over every pool (no ``worker_id``), the tenant's blocks in the shared KV tier go too
    (counted as evicted; pinned ones only with include_pinned), and with include_pinned all its pins.

    Raises InvalidRequest (empty tenant), UnknownWorker.
    """
    check_tenant(tenant)
    pools = _pools_in_scope(mgr, worker_id)
    if include_pinned:
        doomed = mgr.pins.of_tenant(tenant) if not worker_id else [
            b.block_hash for p in with_groups(pools) for b in p.index.values() if b.tenant == tenant and b.pinned]
        for h in sorted(doomed):
            mgr.pins.remove(h)
            mgr.mark_pinned(h, False)
        mgr.changes.changed |= bool(doomed)
    evicted = kept = 0
    for pool in with_groups(pools):
        # In page order, not the index's: pages join the free list (and unpinned blocks the LRU) in this order,
        # which later allocations see, and the index's insertion order is not the same after a restart.
        for block in sorted((b for b in pool.index.values() if b.tenant == tenant), key=lambda b: b.page_id):
            if block.pinned or pool.ref_cnt[block.page_id] > 0:
                kept += 1
                continue
            pool.evict(block.page_id)
            mgr.changes.changed = True
            evicted += 1
    if not worker_id:
        dropped = mgr.tier.drop_tenant(tenant)
        evicted += dropped
        mgr.changes.changed |= bool(dropped)
    return EvictResult(evicted, kept)


def pin(mgr: KVManager, tenant: str, token_ids: tuple[int, ...], worker_id: str = "", ttl_s: int = 0) -> PinResult:
    """Pins the cached full-page blocks of a prefix found on the pools in scope, wherever they are (pins.py):
    never evicted from any pool or the tier while pinned. ``ttl_s`` 0: an operator's pin, until unpinned,
    outside any budget; > 0: a soft pin for the tenant, lapsing ttl_s after its last hit, within its pin
    budget (judged on the pool with the longest prefix): blocks past the budget stay unpinned, counted in
    num_over_budget_blocks.

    Raises InvalidRequest (empty tenant or tokens, token id not a uint32, negative ttl), UnknownWorker.
    """
    check_tenant(tenant)
    check_token_ids("", token_ids)
    if not 0 <= ttl_s <= MAX_PIN_TTL_S:
        raise InvalidRequest(f"ttl_s must be 0 (an operator's pin) to {MAX_PIN_TTL_S} seconds, got {ttl_s}")
    pools = _pools_in_scope(mgr, worker_id)
    if ttl_s:  # a soft pin is the tenant using the cache: it counts as active (its share, its default budget)
        mgr.fair.touch(tenant)
        mgr.changes.changed = True
    found = {p.spec.worker_id: _prefix_blocks(mgr, p, tenant, token_ids) for p in pools}
    best = max(pools, key=lambda p: len(found[p.spec.worker_id]), default=None)
    hashes = list(dict.fromkeys(b.block_hash for p in pools for b in found[p.spec.worker_id]))
    room = (mgr.pin_budget(tenant, best) - mgr.pins.num_soft.get(tenant, 0)) if ttl_s and best else 0
    windows = [(p, len(found[p.spec.worker_id])) for p in pools if p.group is not None and found[p.spec.worker_id]]
    over = 0
    for h in hashes:
        was = mgr.pins.get(h)
        before = (was.ttl_ms, was.expires_ms) if was else None
        left = mgr.take_pin(h, tenant, ttl_s * 1000, room)
        if left is None:
            over += 1
            continue
        room = left
        if before != (mgr.pins.get(h).ttl_ms, mgr.pins.get(h).expires_ms):
            mgr.changes.changed = True
    for pool, n in windows:  # a grouped pool: the sliding blocks a hit on the pinned prefix reads (manager.py)
        room = mgr.pin_window(pool.group, tenant, _group_chain(pool, tenant, token_ids, n), n, ttl_s * 1000, room)
        mgr.changes.changed = True
    reached = sum(b.pinned for bs in found.values() for b in bs)
    best_tokens = max((_leading_pinned(found[p.spec.worker_id]) * p.spec.page_size for p in pools), default=0)
    return PinResult(reached, best_tokens, _first_expiry(mgr, hashes), over)


def _group_chain(pool: PagePool, tenant: str, token_ids: tuple[int, ...], n: int) -> list[bytes]:
    """The chain of the first ``n`` full pages of ``token_ids`` in a grouped pool's sliding group."""
    ps = pool.spec.page_size
    return chain_hashes(pool.group.seed_for(tenant), token_ids[:n * ps], ps)


def _first_expiry(mgr: KVManager, hashes: list[bytes]) -> int:
    """When the first of these blocks' soft pins lapses unless hit (0: none of them is under a soft pin)."""
    due = [p.expires_ms for h in hashes if (p := mgr.pins.get(h)) is not None and p.ttl_ms]
    return min(due, default=0)


def _leading_pinned(blocks: list[Block]) -> int:
    n = 0
    while n < len(blocks) and blocks[n].pinned:
        n += 1
    return n


def unpin(mgr: KVManager, tenant: str, token_ids: tuple[int, ...], worker_id: str = "") -> int:
    """Removes the pins of a prefix's blocks found on the pools in scope, tail first: each counts as used now
    (last_used = the clock) and joins its LRUs' most recent end once no request holds it. Returns how many
    blocks of those pools were pinned and are not any more. Raises as ``pin``."""
    check_tenant(tenant)
    check_token_ids("", token_ids)
    pools = _pools_in_scope(mgr, worker_id)
    found = [_prefix_blocks(mgr, p, tenant, token_ids) for p in pools]
    changed = sum(b.pinned for bs in found for b in bs)
    sliding = [h for p in pools if p.group is not None  # every sliding block of the prefix a pin's window took
               for h in _group_chain(p, tenant, token_ids, len(token_ids) // p.spec.page_size)]
    for h in reversed(list(dict.fromkeys([*(b.block_hash for bs in found for b in bs), *sliding]))):
        if mgr.pins.remove(h) is not None:
            mgr.mark_pinned(h, False)
            mgr.changes.changed = True
    return changed


def reset(mgr: KVManager, force: bool = False) -> DropResult:
    """Drops every request (live and stale), block (in the pools and the shared KV tier, whose values are
    deleted) and counter. Pools stay registered with every page free.

    Refused (RequestsRunning) while requests are live, unless ``force``: a gateway may still be computing them
    on their pages, which the reset would hand to new requests (their K/V overwritten mid-decode). ``force``
    is for requests no gateway serves any more."""
    if mgr.requests and not force:
        workers = sorted({r.worker_id for r in mgr.requests.values()})
        raise RequestsRunning(
            f"{len(mgr.requests)} requests are running (on {', '.join(workers)}): a reset would hand their pages "
            "to new requests while a worker may still write them. Stop the gateway first (it frees them), drop "
            "cached blocks with evict, or, if no gateway serves them any more, reset with force "
            "(kvserve admin reset --yes --force)")
    result = DropResult(len(mgr.requests), sum(len(p.index) for p in mgr.pools.values()))
    mgr.requests.clear()
    mgr.stale.clear()
    mgr.tenants.clear()
    mgr.tier.clear()
    mgr.pins.clear()
    mgr.fair.last_active.clear()
    mgr.retired_evicted_from, mgr.retired_evicted_by = {}, {}
    mgr.transfers, mgr.num_holds = TransferTotals(), 0  # the holds went with their requests
    for worker_id, pool in mgr.pools.items():
        mgr.pools[worker_id] = PagePool(pool.spec)
    mgr.changes.reset = True  # persisted as a snapshot of what is left, not as a log record
    return result


def forget_worker(mgr: KVManager, worker_id: str, force: bool = False) -> DropResult:
    """Removes a worker's pool and its blocks, for a worker gone for good. Refused (RequestsRunning) while
    requests are live on it, unless ``force``: they are forgotten with it (KVManager.forget_pool).

    Raises UnknownWorker, RequestsRunning.
    """
    pool = mgr.pool(worker_id)
    live = len(mgr.req_ids_on(worker_id))
    if live and not force:
        raise RequestsRunning(f"{live} requests are running on worker {worker_id!r}: is it still serving? Stop "
                              "its gateway first, or forget it with force if it is gone for good")
    num_blocks = len(pool.index)
    return DropResult(len(mgr.forget_pool(worker_id)), num_blocks)
