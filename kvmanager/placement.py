"""Where a new request goes (Place), and what of its prompt is cached on the pool it is allocated on.

One rule, in ``place``: over every registered pool, the highest

    score = hit_pages + store_hit_pages / 2 - load_penalty_pages * (requests on the pool + requests queued for it)

then the most available (free + evictable) pages, then the smallest worker_id. With the default penalty of 4
pages, a pool already running k more requests than another wins only with a hit at least 4k pages longer.
A store hit (pages of the shared KV tier past the pool's hit, which any worker with a store can load) counts
half a pool hit: cheap for any worker, but not free like a page the pool holds.
The gateway asks Place when a request arrives and queues it on that worker; its allocation then names the
worker (``fit`` only looks at that pool), so the ranking runs in one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvserve.common.errors import InvalidRequest
from kvserve.common.pages import num_pages_for
from kvserve.common.tokens import check_token_ids
from kvserve.common.wire.pages import PageAllocation
from kvserve.kvmanager.errors import UnknownWorker
from kvserve.kvmanager.hashing import iter_chain_hashes
from kvserve.kvmanager.pool import Block, PagePool
from kvserve.kvmanager.step_validate import check_tenant
from kvserve.kvmanager.tier import StoreIndex


def cacheable_prefix(token_ids: tuple[int, ...], page_size: int) -> tuple[int, ...]:
    """The full pages a prompt may hit: at least its last token is always computed (its logits are needed)."""
    return token_ids[: (len(token_ids) - 1) // page_size * page_size]


def tiered_hits(pool: PagePool, tier: StoreIndex | None, tenant: str,
                token_ids: tuple[int, ...]) -> tuple[list[Block], list[bytes]]:
    """The longest prefix of the prompt's cacheable pages found in the pool, then, past it, the longest run of
    blocks the shared KV tier holds (``tier`` None, or the pool without a store: none)."""
    page_size = pool.spec.page_size
    hashes = iter_chain_hashes(pool.seed_for(tenant), cacheable_prefix(token_ids, page_size), page_size)
    hits, index = [], pool.index
    stored: list[bytes] = []
    use_store = tier is not None and tier.enabled and pool.spec.kv_store
    for h in hashes:
        block = index.get(h)
        if block is not None and not stored:
            hits.append(block)
        elif use_store and h in tier:
            stored.append(h)
        else:
            break
    return hits, stored


def worth_loading(op: PageAllocation, page_size: int) -> bool:
    """Whether loading a page from the store beats recomputing its tokens, by the worker's measured costs in
    the op (unmeasured: load, and so measure it). Both costs are per page, so the answer holds for any number
    of pages: the break-even is load bandwidth = bytes per token x prefill tokens per second."""
    if op.skip_store:
        return False
    if op.load_s_per_page <= 0 or op.prefill_s_per_token <= 0:
        return True
    return op.load_s_per_page < page_size * op.prefill_s_per_token


@dataclass(slots=True)
class Fit:
    """An allocation on its pool: the blocks it hits in the pool, then the block hashes it takes from the
    store (``held``: the indices, over both, of the hits whose pages it holds: a pool hit's page, or a fresh
    page filled from the store), the fresh pages it needs (store fills included), or how many pages it is
    short (then it fits not now)."""

    hits: list[Block] = field(default_factory=list)
    held: list[int] = field(default_factory=list)
    num_fresh: int = 0
    num_pages_short: int = 0
    stored: list[bytes] = field(default_factory=list)


def allocation_plan(pool: PagePool, num_hits: int, op: PageAllocation) -> tuple[list[int], int]:
    """Which hit pages the request holds and how many fresh pages it takes. A dense pool: every hit, and pages
    for the whole prompt. A pool with a sliding window: pages up to the hit and op.chunk_tokens past it, and of
    the hits only those that chunk reads (its sinks and its window); the others are holes from the start."""
    page_size, total, window = pool.spec.page_size, len(op.token_ids), pool.window
    if not window.slides:
        return list(range(num_hits)), num_pages_for(total, page_size) - num_hits
    cached = num_hits * page_size
    cover = min(total, cached + op.chunk_tokens) if op.chunk_tokens else total
    read = set(window.pages_read(cached, cover, page_size))
    return [i for i in range(num_hits) if i in read], num_pages_for(cover, page_size) - num_hits


def fit(pool: PagePool, op: PageAllocation, tier: StoreIndex | None = None) -> Fit:
    if op.skip_prefix_cache:
        hits, stored = [], []
    else:
        tier = tier if tier is not None and worth_loading(op, pool.spec.page_size) else None
        hits, stored = tiered_hits(pool, tier, op.tenant, op.token_ids)
    held, need = allocation_plan(pool, len(hits) + len(stored), op)
    need += sum(1 for i in held if i >= len(hits))  # a store hit it reads takes a fresh page to fill
    available = pool.available([hits[i].page_id for i in held if i < len(hits)])
    return Fit(hits, held, need, stored=stored) if available >= need else Fit(num_pages_short=need - available)


@dataclass(frozen=True, slots=True)
class Placement:
    worker_id: str
    num_cached_tokens: int


def place(pools: Mapping[str, PagePool], tenant: str, token_ids: tuple[int, ...], num_queued: Mapping[str, int],
          load_penalty_pages: int, tier: StoreIndex | None = None) -> Placement:
    """Where a new request should be queued now: the rule above over every pool, with the caller's queued
    requests counted as load and no fit required (it is allocated later, when pages are free). No side effect.

    Raises InvalidRequest (empty tenant or tokens, a token id that is not a uint32, a negative queue length),
    UnknownWorker (no pool).
    """
    check_tenant(tenant)
    check_token_ids("", token_ids)
    negative = sorted(w for w, n in num_queued.items() if n < 0)
    if negative:
        raise InvalidRequest(f"num_queued[{negative[0]!r}] is {num_queued[negative[0]]}: a queue length is >= 0")
    if not pools:
        raise UnknownWorker("no worker is registered: nowhere to place a request")
    best, best_key = None, None
    for worker_id in sorted(pools):
        pool = pools[worker_id]
        hits, stored = tiered_hits(pool, tier, tenant, token_ids)
        load = pool.num_requests + num_queued.get(worker_id, 0)
        key = (len(hits) + len(stored) / 2 - load_penalty_pages * load, pool.available([b.page_id for b in hits]))
        if best_key is None or key > best_key:
            best, best_key = Placement(worker_id, (len(hits) + len(stored)) * pool.spec.page_size), key
    return best
