"""One worker incarnation's page pool: ref_cnts, the free list, the evictable LRU, and its prefix index.

Every page is in exactly one of three states::

    used       ref_cnt > 0                      held by running requests (may also hold a cached block)
    cached     ref_cnt = 0, holds a block       in the evictable LRU, unless its block is pinned
    free       ref_cnt = 0, no block            on the free list

so ``num_used + num_cached + num_free == num_pages`` always. Allocation takes free pages first (FIFO), then
evicts the least recently used cached page. Both structures are O(1) per page: a deque and an OrderedDict
(a hash map over a doubly linked list, so a page can leave the middle of the LRU when a request hits it).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from kvserve.common.wire.pages import PoolSpec
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
    pinned: bool = False


class PagePool:
    def __init__(self, spec: PoolSpec):
        self.spec = spec
        self.window = spec.attention_window()  # which pages its requests keep and which they may release
        self.ref_cnt = [0] * spec.num_pages
        self.block_of: list[Block | None] = [None] * spec.num_pages
        self.index: dict[bytes, Block] = {}  # block_hash -> block
        self.free: deque[int] = deque(range(spec.num_pages))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # first = least recently used
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
        return self.num_free + self.num_evictable - sum(1 for p in hit_pages if p in self.evictable)

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
        ref_cnt, evictable = self.ref_cnt, self.evictable
        for page_id in page_ids:
            if not ref_cnt[page_id]:
                evictable.pop(page_id, None)
            ref_cnt[page_id] += 1

    def allocate(self, num: int) -> list[int]:
        """``num`` fresh pages with ref_cnt 1: free ones first, then the least recently used cached ones, whose
        blocks leave the index. Caller checked available()."""
        assert num <= self.num_free + self.num_evictable
        free, ref_cnt = self.free, self.ref_cnt
        pages = [free.popleft() for _ in range(min(num, len(free)))]
        num_evicted = num - len(pages)
        if num_evicted:
            popitem, block_of, index = self.evictable.popitem, self.block_of, self.index
            for _ in range(num_evicted):
                page_id = popitem(last=False)[0]
                del index[block_of[page_id].block_hash]  # _drop_block, inlined: this loop runs once per page
                block_of[page_id] = None
                pages.append(page_id)
            self.num_evicted += num_evicted
        for page_id in pages:
            ref_cnt[page_id] = 1
        return pages

    def release(self, page_ids) -> list[Block]:
        """One holder fewer for each page, in order; at ref_cnt 0 a page joins the LRU (cached, unpinned) or
        the free list. Returns the cached blocks whose pages reached ref_cnt 0, in that order."""
        ref_cnt, block_of, free, evictable = self.ref_cnt, self.block_of, self.free, self.evictable
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
                else:
                    if not block.pinned:
                        evictable[page_id] = None
                    settled.append(block)
        return settled

    def _drop_block(self, page_id: int) -> Block:
        block = self.block_of[page_id]
        del self.index[block.block_hash]
        self.block_of[page_id] = None
        return block

    def evict(self, page_id: int) -> Block:
        """Drops the cached block of an evictable page; the page becomes free."""
        del self.evictable[page_id]
        block = self._drop_block(page_id)
        self.free.append(page_id)
        self.num_evicted += 1
        return block

    def set_pinned(self, block: Block, pinned: bool) -> None:
        if block.pinned == pinned:
            return
        block.pinned = pinned
        if self.ref_cnt[block.page_id] == 0:
            if pinned:
                self.evictable.pop(block.page_id, None)
            else:
                self.evictable[block.page_id] = None

    def touch(self, block: Block, clock: int) -> None:
        block.last_used = clock
