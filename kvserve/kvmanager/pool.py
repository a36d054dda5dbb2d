"""One worker incarnation's page pool: ref_cnts, the free list, the evictable LRU, and its prefix index.

Every page is in exactly one of three states::

    used       ref_cnt > 0                      held by running requests (may also hold a cached block)
    cached     ref_cnt = 0, holds a block       in the evictable LRU, unless its block is pinned
    free       ref_cnt = 0, no block            on the free list

so ``num_used + num_cached + num_free == num_pages`` always. Every page that is not free has one owner, the
tenant whose request took it (hits stay within a tenant's namespace), counted in ``usage``. Allocation takes
free pages first (FIFO), then evicts cached pages: the tenant fair_share.py picks gives up its least recently
used one (a tenant at its cap gives up its own first, before any free page). Both structures are O(1) per
page: a deque and a TenantLRU (an OrderedDict per tenant, so a page can leave the middle of its LRU when a
request hits it).

Page groups (PoolSpec.grouped: a model mixing full-attention and sliding-window layers): the pool holds the full
layers' pages, and ``group`` is a second PagePool of its own page ids for the sliding layers' pages, with the
group's window (group_spec). Each group has its own ref_cnts, free list, LRU and index; the sliding group's seed
includes its window, so its hash chains are its own.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

from kvserve.common.wire.pages import PoolSpec
from kvserve.kvmanager.fair_share import FairShare, TenantLRU, pool_limits
from kvserve.kvmanager.hashing import namespace_seed


@dataclass(slots=True)
class Block:
    """A full page in the prefix index. Write-once except for pinned and last_used."""

    block_hash: bytes
    parent_hash: bytes  # the chain's previous hash (the namespace seed for block 0)
    tenant: str
    page_id: int
    block_index: int  # covers tokens [block_index * page_size, (block_index + 1) * page_size)
    last_used: int  # the manager's logical clock; orders the LRU after a restart
    pinned: bool = False  # under a pin of the manager's PinTable (pins.py): not evictable


def group_spec(spec: PoolSpec) -> PoolSpec:
    """The sliding layers' pool of a grouped spec: the same worker, epoch, model, dtype, scales and page size,
    its own pages, bytes per token and window."""
    return replace(spec, num_pages=spec.sliding_group_pages, bytes_per_token=spec.sliding_group_bytes_per_token,
                   sliding_window=spec.sliding_group_window, attention_sinks=0, sliding_group_pages=0,
                   sliding_group_window=0, sliding_group_bytes_per_token=0)


def with_groups(pools) -> list[PagePool]:
    """The pools, then the sliding groups of those that have page groups: every PagePool holding blocks."""
    pools = list(pools)
    return [*pools, *(p.group for p in pools if p.group is not None)]


def releasing(pool: PagePool, req) -> tuple[PagePool, list[int]]:
    """The pool and the page table a request's releases name (``req``: a RequestPages on ``pool``): on a grouped
    pool, its sliding layers' (only their pages fall out of a window)."""
    if req.group is not None:
        return pool.group, req.group.page_table
    return pool, req.page_table


class PagePool:
    def __init__(self, spec: PoolSpec):
        self.spec = spec
        # A grouped pool: the sliding layers' pages, a pool of their own (this one holds the full layers')
        self.group: PagePool | None = PagePool(group_spec(spec)) if spec.grouped else None
        self.window = spec.attention_window()  # which pages its requests keep and which they may release
        self.ref_cnt = [0] * spec.num_pages
        self.block_of: list[Block | None] = [None] * spec.num_pages
        self.index: dict[bytes, Block] = {}  # block_hash -> block
        self.free: deque[int] = deque(range(spec.num_pages))
        self.evictable = TenantLRU()  # cached unpinned pages, least recently used first per tenant
        self.owner: list[str | None] = [None] * spec.num_pages  # the tenant holding each page; None: free
        self.usage: dict[str, int] = {}  # tenant -> pages it owns here (used, cached or pinned)
        self.num_evicted_from: dict[str, int] = {}  # tenant -> its blocks evicted here, since registration
        self.num_evicted_by: dict[str, int] = {}  # tenant -> blocks its allocations evicted (its own included)
        self.num_requests = 0
        self.num_evicted = 0
        self.num_window_released = 0  # pages requests released past their sliding window, since registration

    # -- counts ---------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_evictable(self) -> int:
        return len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.spec.num_pages - self.num_free - self.num_cached

    @property
    def num_cached(self) -> int:
        """Pages with ref_cnt 0 that hold a block (evictable, or pinned)."""
        return sum(1 for p, b in enumerate(self.block_of) if b is not None and self.ref_cnt[p] == 0)

    @property
    def num_sink_pages(self) -> int:
        """Leading pages of a request's page table that hold attention sinks: never released by a window."""
        return self.window.num_sink_pages(self.spec.page_size)

    def seed_for(self, tenant: str) -> bytes:
        """h_0 of the tenant's prefix chains on this pool (hashing.py)."""
        s = self.spec
        return namespace_seed(tenant, s.model_fingerprint, s.kv_dtype, s.page_size, s.kv_scales, self.window.window,
                              self.window.sinks)

    def available(self, hit_pages: list[int] = ()) -> int:
        """Pages an allocation could take, not counting cached pages it is about to reuse."""
        has, block_of = self.evictable.has, self.block_of
        return self.num_free + self.num_evictable - sum(1 for p in hit_pages if has(p, block_of[p].tenant))

    # -- prefix index ---------------------------------------------------------------------------------
    def longest_prefix(self, hashes) -> list[Block]:
        """The cached blocks of the longest prefix of ``hashes`` (any iterable: a lazy one stops being consumed
        at the first miss)."""
        out = []
        for h in hashes:
            block = self.index.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def cache_blocks(self, blocks: list[Block]) -> list[Block]:
        """Indexes blocks computed in their pages; returns those indexed. A block already indexed in another
        page (the same tokens computed twice) is left out: its duplicate stays a plain page."""
        index, block_of = self.index, self.block_of
        if index.keys().isdisjoint([b.block_hash for b in blocks]):  # the usual case: all new, no test per block
            index.update([(b.block_hash, b) for b in blocks])
            for block in blocks:
                block_of[block.page_id] = block
            return blocks
        added = []
        for block in blocks:
            if block.block_hash in index:
                continue
            index[block.block_hash] = block_of[block.page_id] = block
            added.append(block)
        return added

    # -- pages ---------------------------------------------------------------------------------------
    # The loops below run once per page of every request a step admits, commits or frees (tens of thousands
    # per call at 64 prompts of 2000 tokens), so they bind attributes to locals and avoid per-page calls.
    def acquire(self, page_ids) -> None:
        """One more holder of each page (prefix hits); a cached page leaves the LRU."""
        ref_cnt, discard, block_of = self.ref_cnt, self.evictable.discard, self.block_of
        for page_id in page_ids:
            if not ref_cnt[page_id]:
                discard(page_id, block_of[page_id].tenant)
            ref_cnt[page_id] += 1

    def allocate(self, num: int, tenant: str = "", fair: FairShare | None = None) -> list[int]:
        """``num`` fresh pages with ref_cnt 1 for ``tenant``: its own least recently used cached pages first while
        it is at its cap, then free ones, then cached ones of the tenants ``fair`` picks (None: the global LRU),
        whose blocks leave the index. Caller checked available()."""
        assert num <= self.num_free + self.num_evictable
        fair = fair or GLOBAL_LRU
        lru, usage, num_pages = self.evictable, self.usage, self.spec.num_pages
        pages: list[int] = []
        if tenant in lru.by_tenant and fair.over_cap(tenant, usage.get(tenant, 0), num_pages, pool_limits):
            pages += [self._take_cached(tenant, tenant) for _ in range(min(num, lru.count(tenant)))]
        free, owner = self.free, self.owner
        taken = [free.popleft() for _ in range(min(num - len(pages), len(free)))]
        for page_id in taken:
            owner[page_id] = tenant
        usage[tenant] = usage.get(tenant, 0) + len(taken)  # counted before any eviction ranks the tenants
        pages += taken
        if len(pages) < num:
            for victim in fair.victims(lru, usage, num_pages, pool_limits, tenant):
                pages.append(self._take_cached(victim, tenant))
                if len(pages) == num:
                    break
        ref_cnt = self.ref_cnt
        for page_id in pages:
            ref_cnt[page_id] = 1
        return pages

    def _take_cached(self, victim: str, tenant: str) -> int:
        """Evicts the victim's least recently used cached page and hands it to ``tenant``."""
        page_id = self.evictable.pop_oldest(victim)
        del self.index[self.block_of[page_id].block_hash]
        self.block_of[page_id] = None
        self.num_evicted += 1
        self.num_evicted_from[victim] = self.num_evicted_from.get(victim, 0) + 1
        self.num_evicted_by[tenant] = self.num_evicted_by.get(tenant, 0) + 1
        if victim != tenant:
            self.usage[victim] -= 1
            self.usage[tenant] = self.usage.get(tenant, 0) + 1
            self.owner[page_id] = tenant
        return page_id

    def release(self, page_ids) -> list[Block]:
        """One holder fewer for each page, in order; at ref_cnt 0 a page joins the LRU (cached, unpinned) or
        the free list. Returns the cached blocks whose pages reached ref_cnt 0, in that order."""
        ref_cnt, block_of, free, add = self.ref_cnt, self.block_of, self.free, self.evictable.add
        settled = []
        for page_id in page_ids:
            n = ref_cnt[page_id] - 1
            if n < 0:
                raise AssertionError(f"page {page_id} released more often than acquired")
            ref_cnt[page_id] = n
            if not n:
                block = block_of[page_id]
                if block is None:
                    free.append(page_id)
                    self._disown(page_id)
                else:
                    if not block.pinned:
                        add(page_id, block.tenant)
                    settled.append(block)
        return settled

    def _drop_block(self, page_id: int) -> Block:
        block = self.block_of[page_id]
        del self.index[block.block_hash]
        self.block_of[page_id] = None
        return block

    def evict(self, page_id: int) -> Block:
        """Drops the cached block of an evictable page; the page becomes free."""
        block = self._drop_block(page_id)
        self.evictable.discard(page_id, block.tenant)
        self.free.append(page_id)
        self._disown(page_id)
        self.num_evicted += 1
        self.num_evicted_from[block.tenant] = self.num_evicted_from.get(block.tenant, 0) + 1
        return block

    def _disown(self, page_id: int) -> None:
        tenant = self.owner[page_id]
        self.owner[page_id] = None
        self.usage[tenant] -= 1

    def recount_owners(self, requests) -> None:
        """Owners and usage from the blocks and the live requests' page tables (after a snapshot's load), in the
        group's pool too."""
        mine = [r for r in requests if r.worker_id == self.spec.worker_id and r.epoch == self.spec.epoch]
        self._recount([(r.tenant, r.page_table) for r in mine])
        if self.group is not None:
            self.group._recount([(r.tenant, r.group.page_table) for r in mine])

    def _recount(self, tables: list[tuple[str, list[int]]]) -> None:
        owner = [None] * self.spec.num_pages
        for p, block in enumerate(self.block_of):
            if block is not None:
                owner[p] = block.tenant
        for tenant, table in tables:
            for p in table:
                if p >= 0:
                    owner[p] = tenant
        self.owner, self.usage = owner, {}
        for tenant in owner:
            if tenant is not None:
                self.usage[tenant] = self.usage.get(tenant, 0) + 1

    def set_pinned(self, block: Block, pinned: bool) -> None:
        if block.pinned == pinned:
            return
        block.pinned = pinned
        if self.ref_cnt[block.page_id] == 0:
            if pinned:
                self.evictable.discard(block.page_id, block.tenant)
            else:
                self.evictable.add(block.page_id, block.tenant)

    def touch(self, block: Block, clock: int) -> None:
        block.last_used = clock


GLOBAL_LRU = FairShare.global_lru()
