"""Where a new request goes, and which of its prompt's pages are already cached there.

Rule (cache-aware placement, balanced against load): among the pools where the request fits now,
choose the highest

    score = hit_pages - load_penalty_pages * num_requests_on_pool

then the most available (free + evictable) pages, then the smallest worker_id. With the default penalty of 4
pages, a pool already running k more requests than another wins only with a hit at least 4k pages longer.
A request that names its worker_id is not placed: only that pool is considered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.common.errors import InvalidRequest
from kvserve.common.pages import num_pages_for
from kvserve.common.tokens import check_token_ids
from kvserve.common.wire.pages import Allocate
from kvserve.kvmanager.errors import UnknownWorker
from kvserve.kvmanager.hashing import iter_chain_hashes
from kvserve.kvmanager.pool import Block, PagePool
from kvserve.kvmanager.step_validate import check_tenant

if TYPE_CHECKING:
    from kvserve.kvmanager.manager import KVManager


@dataclass(slots=True)
class Choice:
    pool: PagePool | None  # None: fits nowhere now
    hits: list[Block] = field(default_factory=list)
    seed: bytes = b""
    num_pages_short: int = 0  # when pool is None: the smallest shortfall over the candidate pools


def cacheable_prefix(token_ids: tuple[int, ...], page_size: int) -> tuple[int, ...]:
    """The full pages a prompt may hit: at least its last token is always computed (its logits are needed)."""
    return token_ids[: (len(token_ids) - 1) // page_size * page_size]


def prefix_hits(mgr: KVManager, pool: PagePool, tenant: str, token_ids: tuple[int, ...]) -> tuple[bytes, list[Block]]:
    seed = mgr.seed_for(pool, tenant)
    hashes = iter_chain_hashes(seed, cacheable_prefix(token_ids, pool.spec.page_size), pool.spec.page_size)
    return seed, pool.longest_prefix(hashes)


def choose_pool(mgr: KVManager, op: Allocate) -> Choice:
    candidates = [mgr.pools[op.worker_id]] if op.worker_id else [mgr.pools[w] for w in sorted(mgr.pools)]
    best, best_key, short = None, None, None
    for pool in candidates:
        if op.skip_prefix_cache:
            seed, hits = mgr.seed_for(pool, op.tenant), []
        else:
            seed, hits = prefix_hits(mgr, pool, op.tenant, op.token_ids)
        need = num_pages_for(len(op.token_ids), pool.spec.page_size) - len(hits)
        available = pool.available([b.page_id for b in hits])
        if available < need:
            short = need - available if short is None else min(short, need - available)
            continue
        key = (len(hits) - mgr.load_penalty_pages * pool.num_requests, available)
        if best_key is None or key > best_key:  # sorted worker_ids: the first of equals wins
            best, best_key = Choice(pool, hits, seed), key
    return best or Choice(None, num_pages_short=short or 0)


@dataclass(frozen=True, slots=True)
class Placement:
    worker_id: str
    num_hit_tokens: int


def place(mgr: KVManager, tenant: str, token_ids: tuple[int, ...], num_queued: dict[str, int]) -> Placement:
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
    if not mgr.pools:
        raise UnknownWorker("no worker is registered: nowhere to place a request")
    best, best_key = None, None
    for worker_id in sorted(mgr.pools):
        pool = mgr.pools[worker_id]
        hits = prefix_hits(mgr, pool, tenant, token_ids)[1]
        load = pool.num_requests + num_queued.get(worker_id, 0)
        key = (len(hits) - mgr.load_penalty_pages * load, pool.available([b.page_id for b in hits]))
        if best_key is None or key > best_key:
            best, best_key = Placement(worker_id, len(hits) * pool.spec.page_size), key
    return best
