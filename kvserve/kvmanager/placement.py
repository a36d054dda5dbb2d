"""Where a new request goes (Place), and what of its prompt is cached on the pool it is allocated on.

One rule, in ``place``: over every registered pool, the highest

    score = hit_pages + (peer_hit_pages + store_hit_pages) / 2
            - load_penalty_pages * (requests on the pool + requests queued for it)

then the most available (free + evictable) pages, then the smallest worker_id. With the default penalty of 4
pages, a pool already running k more requests than another wins only with a hit at least 4k pages longer.
A peer hit (pages past the pool's hit that another compatible worker's pool holds, which this worker can pull)
and a store hit (pages of the shared KV tier past those, which any worker with a store can load) count half a
pool hit: cheap to move, but not free like a page the pool holds. So a busy worker's prefix goes to an idle
worker that pulls it, once the busy one's queue outweighs half the prefix.
The gateway asks Place when a request arrives and queues it on that worker; its allocation then names the
worker (``fit`` only looks at that pool), so the ranking runs in one place.

A grouped pool (page groups: full layers and sliding layers, pool.py) has no peer or store hits, and is no peer
of another pool. Its prefix hit is the joint one (grouped_hits): a token counts as cached only when every group
holds what reading it needs. The full group gives m, its longest run of chain blocks; the hit is the largest
n <= m such that every block the first query at n * page_size reads in the sliding group (its window's pages
below n) is in the sliding group's index under its own chain::

    page_size 4, window 8, m = 5:  full  [0][1][2][3][4]      sliding  [0][ ][2][3][4]   (block 1 evicted)
    n = 5: the query at 20 reads sliding pages 3, 4 -> held: n = 5 (block 1 is out of its window)
    had sliding block 3 gone instead: the queries at 20 and 16 read page 3, the one at 12 pages 1, 2: n = 3

A sliding block out of the window may be evicted without shortening the hit; a missing block in the window, or
in the full group anywhere before n, shortens it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvserve.common.errors import InvalidRequest
from kvserve.common.pages import num_pages_for
from kvserve.common.tokens import check_token_ids
from kvserve.common.wire.pages import PageAllocation
from kvserve.kvmanager.errors import UnknownWorker
from kvserve.kvmanager.hashing import chain_hashes, iter_chain_hashes
from kvserve.kvmanager.pool import Block, PagePool
from kvserve.kvmanager.step_validate import check_tenant
from kvserve.kvmanager.tier import StoreIndex


def cacheable_prefix(token_ids: tuple[int, ...], page_size: int) -> tuple[int, ...]:
    """The full pages a prompt may hit: at least its last token is always computed (its logits are needed)."""
    return token_ids[: (len(token_ids) - 1) // page_size * page_size]


@dataclass(slots=True)
class Hits:
    """What of a prompt's cacheable pages a pool can serve without computing them, in chain order: its own
    blocks (``pool``), then a run held by another compatible pool (``pulled``, from ``source``: peer hits), then
    a run the shared KV tier holds (``stored``)."""

    pool: list[Block] = field(default_factory=list)
    pulled: list[Block] = field(default_factory=list)
    source: PagePool | None = None
    stored: list[bytes] = field(default_factory=list)
    group_hashes: list[bytes] = field(default_factory=list)  # a grouped pool: the sliding group's chain of the hit

    @property
    def num(self) -> int:
        return len(self.pool) + len(self.pulled) + len(self.stored)


def tiered_hits(pool: PagePool, tier: StoreIndex | None, tenant: str, token_ids: tuple[int, ...],
                peers: Mapping[str, PagePool] | None = None, prefer: str = "") -> Hits:
    """The longest prefix of the prompt's cacheable pages found in the pool; past it, the longest run another
    pool of ``peers`` with the same hash chains holds (ties: ``prefer``, then the pool with fewer requests, then
    the smallest worker_id); past that, the longest run of blocks the shared KV tier holds (``tier`` None, or the
    pool without a store: none). A grouped pool: its joint hit alone (grouped_hits)."""
    if pool.group is not None:
        return grouped_hits(pool, tenant, token_ids)
    page_size = pool.spec.page_size
    seed = pool.seed_for(tenant)
    hashes = iter_chain_hashes(seed, cacheable_prefix(token_ids, page_size), page_size)
    out, index = Hits(), pool.index
    rest: list[bytes] = []
    for h in hashes:
        block = index.get(h)
        if block is None:
            rest = [h, *hashes]
            break
        out.pool.append(block)
    if not rest:
        return out
    if peers:
        out.source, out.pulled = _peer_run(pool, peers, tenant, seed, rest, prefer)
        rest = rest[len(out.pulled):]
    if tier is not None and tier.enabled and pool.spec.kv_store:
        for h in rest:
            if h not in tier:
                break
            out.stored.append(h)
    return out


def grouped_hits(pool: PagePool, tenant: str, token_ids: tuple[int, ...]) -> Hits:
    """A grouped pool's hit (the rule in the module's docstring): the full group's blocks of it, and the
    sliding group's chain over it (held or not: its later commits continue the chain)."""
    page_size = pool.spec.page_size
    prefix = cacheable_prefix(token_ids, page_size)
    full = pool.longest_prefix(iter_chain_hashes(pool.seed_for(tenant), prefix, page_size))
    hashes = chain_hashes(pool.group.seed_for(tenant), prefix[:len(full) * page_size], page_size)
    n = joint_hit(pool.group, hashes)
    return Hits(full[:n], group_hashes=hashes[:n])


def joint_hit(group: PagePool, hashes: list[bytes]) -> int:
    """The largest n <= len(hashes) such that the sliding group's index holds every block the query at
    n * page_size reads below n (its window: the group has no sinks). A missing block j in that window rules out
    every n' in (j, n] too (their windows start no later), so the next candidate is j: one pass from the end."""
    page_size, window, index = group.spec.page_size, group.window, group.index
    n = len(hashes)
    while n:
        lo = window.first_page_read(n * page_size, page_size)
        missing = next((i for i in range(n - 1, lo - 1, -1) if hashes[i] not in index), None)
        if missing is None:
            return n
        n = missing
    return 0


def _peer_run(pool: PagePool, peers: Mapping[str, PagePool], tenant: str, seed: bytes, hashes: list[bytes],
              prefer: str) -> tuple[PagePool | None, list[Block]]:
    best, best_key, best_run = None, None, []
    for worker_id in sorted(peers):
        q = peers[worker_id]
        if q is pool or q.group is not None or q.seed_for(tenant) != seed:  # a grouped pool's pages hold only
            continue  # its full layers
        run, index = [], q.index
        for h in hashes:
            block = index.get(h)
            if block is None:
                break
            run.append(block)
        key = (len(run), worker_id == prefer, -q.num_requests)
        if run and (best_key is None or key > best_key):
            best, best_key, best_run = q, key, run
    return best, best_run


def worth_loading(op: PageAllocation, page_size: int) -> bool:
    """Whether loading a page from the store beats recomputing its tokens, by the worker's measured costs in
    the op (unmeasured: load, and so measure it). Both costs are per page, so the answer holds for any number
    of pages: the break-even is load bandwidth = bytes per token x prefill tokens per second."""
    if op.skip_store:
        return False
    if op.load_s_per_page <= 0 or op.prefill_s_per_token <= 0:
        return True
    return op.load_s_per_page < page_size * op.prefill_s_per_token


def worth_pulling(op: PageAllocation, page_size: int) -> bool:
    """Whether pulling a page from another worker beats recomputing its tokens, by the worker's measured costs
    in the op (unmeasured: pull, and so measure it). A request whose prefill ran elsewhere (moved_from) always
    pulls: its pages exist only to be pulled."""
    if not op.pull_peers:
        return False
    if op.moved_from or op.pull_s_per_page <= 0 or op.prefill_s_per_token <= 0:
        return True
    return op.pull_s_per_page < page_size * op.prefill_s_per_token


@dataclass(slots=True)
class Fit:
    """An allocation on its pool: its hits (``held``: the indices, over all of them in chain order, of the hits
    whose pages it holds: a pool hit's page, or a fresh page filled from a peer or the store), the fresh pages
    it needs (fills included), or how many pages it is short (then it fits not now)."""

    hits: Hits = field(default_factory=Hits)
    held: list[int] = field(default_factory=list)
    num_fresh: int = 0
    num_pages_short: int = 0
    group_held: list[int] = field(default_factory=list)  # a grouped pool: held and num_fresh in its sliding group
    group_num_fresh: int = 0


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


def fit(pool: PagePool, op: PageAllocation, tier: StoreIndex | None = None,
        peers: Mapping[str, PagePool] | None = None) -> Fit:
    if pool.group is not None:
        return _fit_grouped(pool, op)
    if op.skip_prefix_cache:
        hits = Hits()
    else:
        page_size = pool.spec.page_size
        tier = tier if tier is not None and worth_loading(op, page_size) else None
        peers = peers if peers is not None and worth_pulling(op, page_size) else None
        hits = tiered_hits(pool, tier, op.tenant, op.token_ids, peers, op.moved_from)
    own = len(hits.pool)
    held, need = allocation_plan(pool, hits.num, op)
    need += sum(1 for i in held if i >= own)  # a peer or store hit it reads takes a fresh page to fill
    available = pool.available([hits.pool[i].page_id for i in held if i < own])
    return Fit(hits, held, need) if available >= need else Fit(num_pages_short=need - available)


def _fit_grouped(pool: PagePool, op: PageAllocation) -> Fit:
    """A grouped pool's allocation: the full group as a dense pool, the sliding group as a windowed one
    (allocation_plan), both over the joint hit. Short in either: the larger shortage, and it fits not now."""
    hits = Hits() if op.skip_prefix_cache else grouped_hits(pool, op.tenant, op.token_ids)
    group = pool.group
    held, need = allocation_plan(pool, hits.num, op)
    group_held, group_need = allocation_plan(group, hits.num, op)
    short = max(need - pool.available([b.page_id for b in hits.pool]),
                group_need - group.available([group.index[hits.group_hashes[i]].page_id for i in group_held]))
    if short > 0:
        return Fit(num_pages_short=short)
    return Fit(hits, held, need, group_held=group_held, group_num_fresh=group_need)


@dataclass(frozen=True, slots=True)
class Placement:
    worker_id: str
    num_cached_tokens: int


def place(pools: Mapping[str, PagePool], tenant: str, token_ids: tuple[int, ...], num_queued: Mapping[str, int],
          load_penalty_pages: int, tier: StoreIndex | None = None,
          peers: Mapping[str, PagePool] | None = None) -> Placement:
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
        hits = tiered_hits(pool, tier, tenant, token_ids, peers)
        load = pool.num_requests + num_queued.get(worker_id, 0)
        elsewhere = len(hits.pulled) + len(hits.stored)
        key = (len(hits.pool) + elsewhere / 2 - load_penalty_pages * load,
               pool.available([b.page_id for b in hits.pool]))
        if best_key is None or key > best_key:
            best, best_key = Placement(worker_id, hits.num * pool.spec.page_size), key
    return best
