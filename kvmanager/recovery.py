"""Rebuilds a manager from what a snapshot keeps (snapshot_layout.py): pools, cached blocks, requests, counters.

Ref_cnts, the free list and the LRU are not in the layout; they follow from the rest (a generation's snapshot
also holds the exact orders, which snapshots.restore_replay_state then puts back over the derived ones)::

    ref_cnt[p]  = number of live requests whose page_table holds p      (stale requests and holes hold nothing)
    free list   = ref-0 pages without a block, ascending
    evictable   = ref-0 pages with an unpinned block, least recently used first: by block.last_used, then
                  the chain's end first (a freed request's pages are released tail first), then page_id

A block of a dead epoch (its pool was re-registered) is never loaded: rebuild() returns it for deletion.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from kvserve.common.pages import HOLE
from kvserve.common.wire.pages import PoolSpec
from kvserve.kvmanager.invariants import check_invariants
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.pool import Block, PagePool
from kvserve.kvmanager.state import RequestPages, TenantCounters


@dataclass(slots=True)
class StoredBlock:
    worker_id: str
    epoch: int  # the pool epoch the block was computed under
    block: Block


@dataclass(slots=True)
class StoredState:
    """Everything a snapshot held, decoded, before it is placed into a manager."""

    clock: int = 0
    specs: list[PoolSpec] = field(default_factory=list)
    num_evicted: dict[str, int] = field(default_factory=dict)  # worker_id -> evictions so far
    num_window_released: dict[str, int] = field(default_factory=dict)  # worker_id -> pages released by windows
    tenants: dict[str, TenantCounters] = field(default_factory=dict)
    blocks: list[StoredBlock] = field(default_factory=list)
    requests: list[RequestPages] = field(default_factory=list)
    stale: list[RequestPages] = field(default_factory=list)


def rebuild(mgr: KVManager, state: StoredState) -> list[StoredBlock]:
    """Fills an empty manager; returns the stored blocks it dropped (dead epoch, unknown pool, or a page
    already taken). Raises AssertionError (check_invariants) if the result is inconsistent."""
    assert not (mgr.pools or mgr.requests or mgr.stale), "load into an empty manager"
    for spec in sorted(state.specs, key=lambda s: s.worker_id):
        pool = PagePool(spec)
        pool.num_evicted = state.num_evicted.get(spec.worker_id, 0)
        pool.num_window_released = state.num_window_released.get(spec.worker_id, 0)
        mgr.pools[spec.worker_id] = pool
    dropped = _place_blocks(mgr, state.blocks)
    _place_requests(mgr, state.requests, state.stale)
    for pool in mgr.pools.values():
        _derive_lists(pool)
    mgr.tenants = dict(state.tenants)
    last_used = max((b.last_used for p in mgr.pools.values() for b in p.index.values()), default=0)
    mgr.clock = max(state.clock, last_used)
    check_invariants(mgr)
    return dropped


def _place_blocks(mgr: KVManager, blocks: list[StoredBlock]) -> list[StoredBlock]:
    dropped = []
    for sb in sorted(blocks, key=lambda sb: (sb.worker_id, sb.block.page_id, sb.block.block_hash)):
        pool, b = mgr.pools.get(sb.worker_id), sb.block
        if (pool is None or sb.epoch != pool.spec.epoch or not 0 <= b.page_id < pool.spec.num_pages
                or pool.block_of[b.page_id] is not None or b.block_hash in pool.index):
            dropped.append(sb)
            continue
        pool.index[b.block_hash] = b
        pool.block_of[b.page_id] = b
    return dropped


def _place_requests(mgr: KVManager, live: list[RequestPages], stale: list[RequestPages]) -> None:
    for req in sorted(stale, key=lambda r: r.req_id):
        mgr.stale[req.req_id] = req
    for req in sorted(live, key=lambda r: r.req_id):
        pool = mgr.pools.get(req.worker_id)
        if pool is None or pool.spec.epoch != req.epoch:  # its pool was replaced: it can only be answered stale
            mgr.stale.setdefault(req.req_id, req)
            continue
        n = pool.spec.num_pages
        pages = [p for p in req.page_table if p != HOLE]  # a hole (released by its window) holds no page
        assert all(0 <= p < n for p in pages), f"request {req.req_id!r} holds a page outside its pool"
        mgr.requests[req.req_id] = req
        for page_id in pages:
            pool.ref_cnt[page_id] += 1
        pool.num_requests += 1


def _derive_lists(pool: PagePool) -> None:
    idle = [p for p in range(pool.spec.num_pages) if pool.ref_cnt[p] == 0]
    pool.free = deque(p for p in idle if pool.block_of[p] is None)
    cached = [pool.block_of[p] for p in idle if pool.block_of[p] is not None and not pool.block_of[p].pinned]
    cached.sort(key=lambda b: (b.last_used, -b.block_index, b.page_id))
    pool.evictable = OrderedDict.fromkeys(b.page_id for b in cached)
