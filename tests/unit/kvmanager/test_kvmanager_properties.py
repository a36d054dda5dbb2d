"""Property-based test of the kvmanager domain (hypothesis.stateful): random step calls across tenants and
workers, with the invariants checked after every step.

The model keeps each request's own tokens and page table, and what every page holds: a commit writes
``content[(worker, epoch, page_id)] = (tenant, tokens from position 0 to the end of that page)``; a page handed
out fresh holds nothing. A prefix hit is correct only if each hit page holds exactly the same tenant's same
tokens, so a hit across tenants, on a dead epoch's page or on a reused page fails whatever the hash does::

    prompt   | page 0 | page 1 | page 2 |..      num_cached_tokens = 8
    hit      |  p3    |  p0    |          <- content[p3] == (tenant, prompt[:4]), content[p0] == (tenant, prompt[:8])

Worker w1's pool has a sliding window (two pages) and attention sinks (its first page): its requests release
pages past the window at random, in calls of their own and inside batches, and the model's page tables get the
same holes. A hole holds nothing, so a commit over it writes no content; every check above still holds.

The shared KV tier (kvserve/kvmanager/tier.py): w0's pools have a store, w1's only under odd epochs, and the store holds
a few blocks (STORE_BYTES), so its LRU evicts. The model predicts the writes each commit orders (the new blocks a
pool with a store indexes that the store lacks), keeps the store's index as workers report writes landed (some of
those ordered, in any order, some twice) and values missing, and predicts every allocation's store hits exactly:
past the pool's hit, the run of blocks the store holds, each on a fresh page named in store_loads, counted in
num_cached_tokens but not in num_committed_tokens; the request's first commit then indexes the loaded pages::

    prompt   | page 0 | page 1 | page 2 |..      num_cached_tokens = 12, num_committed_tokens = 4
    hit      |  p3    |  p5    |  p6    |       <- p3 a pool hit; p5, p6 fresh, loaded (store_loads)

No entry names a value no worker reported written, none outlives a report of its value missing (until written
again), a dropped pool or epoch never removes one, and each removal queues its value's deletion once.
"""

from __future__ import annotations

import copy
from collections import OrderedDict, defaultdict
from dataclasses import astuple, dataclass, field, replace

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvserve.common.errors import DomainError, StaleEpoch
from kvserve.common.pages import HOLE
from kvserve.common.wire.pages import (
    OpStatus,
    PageAllocation,
    PageCommit,
    PageExtension,
    PageFree,
    PageRelease,
    PoolSpec,
    StepOps,
    StoreWriteOrder,
)
from kvserve.common.wire.tier import StoredBlock, StoreLoad, StoreWrite, TierCounters, TierReport
from kvserve.kvmanager.admin import evict_tenant, forget_worker
from kvserve.kvmanager.errors import UnknownTenant
from kvserve.kvmanager.hashing import chain_hashes, namespace_seed
from kvserve.kvmanager.invariants import check_invariants
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.placement import Placement
from kvserve.kvmanager.state import Changes
from kvserve.kvmanager.tenants import CachePolicy
from kvserve.kvmanager.tier import TierTotals

PS = 4  # page size
WORKERS = ("w0", "w1")
TENANTS = ("A", "B", "C")
PREFIXES = ((1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9, 9, 9), (20, 21, 22, 23))  # shared by all tenants
MAX_TOKENS = 24  # per request: fits the smallest pool (6 pages)
MAX_WINDOWED_TOKENS = 40  # a windowed request: 10 pages, more than a small pool has (it holds fewer)
WINDOWS = {"w1": (2 * PS, PS)}  # worker -> (sliding_window, attention_sinks): two pages, and one sink page
NUM_SINK_PAGES = 1
OK, SHORT, STALE = OpStatus.OK, OpStatus.OUT_OF_PAGES, OpStatus.STALE_EPOCH
PAGE_BYTES = PS * 64  # a page's K/V (bytes_per_token 64)
STORE_BYTES = 10 * PAGE_BYTES  # the shared tier's capacity: a few prompts' values, so its LRU evicts
# An allocation's load-or-recompute inputs: none measured (load), skip_store, a fast load, a load slower than
# recomputing its page, one exactly as slow (recompute), one cost measured alone (as none: load).
TIER_OPTIONS = ({},) * 2 + ({"skip_store": True}, {"load_s_per_page": 0.001, "prefill_s_per_token": 0.01},
                            {"load_s_per_page": 0.5, "prefill_s_per_token": 0.01},
                            {"load_s_per_page": 0.5, "prefill_s_per_token": 0.125}, {"load_s_per_page": 0.5})


def has_store(worker: str, epoch: int) -> bool:
    """w0's pools read and write the shared tier; w1's under odd epochs only (a pool with one, then without)."""
    return worker == "w0" or epoch % 2 == 1


def spec_for(worker: str, epoch: int, num_pages: int) -> PoolSpec:
    return PoolSpec(worker, epoch, num_pages, PS, "fp", "float32", 64, "", *WINDOWS.get(worker, (0, 0)),
                    kv_store=has_store(worker, epoch))


def value_bytes(block_hash: bytes) -> int:
    """What a worker reports a block's value takes: a page and a header of some size (so an add may evict several
    entries), now and then more than the whole store (deleted, never recorded)."""
    return STORE_BYTES + 1 if block_hash[0] < 8 else PAGE_BYTES + 64 * (block_hash[0] % 3)


def loads_pay(a: PageAllocation) -> bool:
    """Whether the allocation may take store hits: not skipped, and a load measured faster than recomputing its
    page (or either cost not measured yet)."""
    if a.skip_store:
        return False
    return a.load_s_per_page <= 0 or a.prefill_s_per_token <= 0 or a.load_s_per_page < PS * a.prefill_s_per_token


def first_chunk_pages(worker: str, num_cached: int, num_tokens: int) -> set[int]:
    """The page indices a prompt's first chunk (the whole prompt) reads: all of them, or on the windowed pool its
    sink pages and the window of its first computed position on (the hits before it are holes)."""
    if worker not in WINDOWS:
        return set(range(pages_for(num_tokens)))
    window, sinks = WINDOWS[worker]
    lo = max(0, num_cached - window + 1) // PS
    return set(range(min(pages_for(sinks), lo))) | set(range(lo, pages_for(num_tokens)))


def seed_of(tenant: str, worker: str = "w0") -> bytes:
    return namespace_seed(tenant, "fp", "float32", PS, "", *WINDOWS.get(worker, (0, 0)))


def pages_for(num_tokens: int) -> int:
    return -(-num_tokens // PS)


def _block(b):
    return None if b is None else (b.block_hash, b.parent_hash, b.tenant, b.page_id, b.block_index, b.last_used,
                                   b.pinned)


def snapshot(mgr: KVManager, volatile: bool = True):
    """Everything the manager holds, as plain data. ``volatile`` adds the clock and the changes not yet made
    durable (whether the service would log a call)."""
    pools = {w: (p.spec, tuple(p.ref_cnt), tuple(map(_block, p.block_of)),
                 sorted((h, _block(b)) for h, b in p.index.items()), tuple(p.free), tuple(p.evictable),
                 p.num_requests, p.num_evicted, p.num_window_released) for w, p in mgr.pools.items()}

    def reqs(d):  # the remembered answers by value: their repr (a fifth of a deepcopy's cost, on every call)
        return {k: (r.tenant, r.worker_id, r.epoch, tuple(r.page_table), r.seed, tuple(r.block_hashes),
                    r.num_prompt_tokens, r.num_committed_tokens, r.skip_prefix_cache, repr(r.last_ops))
                for k, r in d.items()}

    tenants = {t: (c.prefix_cache_queries, c.prefix_cache_hits) for t, c in mgr.tenants.items()}
    tier = mgr.tier  # its entries in LRU order; the deletions it queued are handed over once a call is durable
    store = (tuple((h, e.tenant, e.num_bytes) for h, e in tier.entries.items()), tier.num_bytes, astuple(tier.totals),
             sorted(tier.tenant_hits.items()))
    out = (pools, reqs(mgr.requests), reqs(mgr.stale), tenants, mgr.load_penalty_pages, store)
    if volatile:
        out += (mgr.clock, mgr.changes.changed, mgr.changes.reset, tuple(tier.deleted))
    return out


@dataclass
class ModelReq:
    tenant: str
    worker: str
    epoch: int
    tokens: list[int]  # everything computed so far: prompt, then generated tokens
    page_table: list[int]
    num_committed: int
    skip: bool


@dataclass
class ModelTier:
    """The shared tier's index as the model keeps it: what workers reported written (LRU first, within
    STORE_BYTES, minus what was reported missing or evicted), and what the invariants need."""

    entries: OrderedDict[bytes, tuple[str, int]] = field(default_factory=OrderedDict)  # hash -> (tenant, bytes)
    totals: TierTotals = field(default_factory=TierTotals)
    tenant_hits: dict[str, int] = field(default_factory=dict)
    deleted: list[bytes] = field(default_factory=list)  # removals whose deletion the manager must queue
    orders: list[StoreWriteOrder] = field(default_factory=list)  # every write ordered, oldest first
    prompts: dict[bytes, tuple[str, str, tuple[int, ...]]] = field(default_factory=dict)  # ordered block hash ->
    # (tenant, worker, the tokens it ends): a prompt to come back with
    written: set[bytes] = field(default_factory=set)  # ever reported written
    missing: set[bytes] = field(default_factory=set)  # reported missing, and not reported written since

    def report(self, r: TierReport) -> tuple[int, int]:
        """Written values first (an LRU within capacity), then missing ones; returns (added, evicted)."""
        added = evicted = rejected = 0
        for b in r.written:
            self.written.add(b.block_hash)
            self.missing.discard(b.block_hash)
            if b.block_hash in self.entries:
                self.entries.move_to_end(b.block_hash)
            elif b.num_bytes > STORE_BYTES:  # cannot be kept: deleted, and counted
                self.deleted.append(b.block_hash)
                rejected += 1
            else:
                while sum(n for _, n in self.entries.values()) + b.num_bytes > STORE_BYTES:
                    self.remove(next(iter(self.entries)))
                    evicted += 1
                self.entries[b.block_hash] = (b.tenant, b.num_bytes)
                added += 1
        self.missing.update(r.missing)
        dropped = [h for h in dict.fromkeys(r.missing) if h in self.entries]
        for h in dropped:
            self.remove(h)
        t = self.totals
        self.totals = TierTotals(t.num_hit_pages, t.num_added + added, t.num_evicted + evicted,
                                 t.num_dropped_missing + len(dropped), t.workers + r.counters,
                                 t.num_rejected + rejected)
        return added, evicted

    def hit(self, tenant: str, hashes: list[bytes]) -> None:
        for h in hashes:
            self.entries.move_to_end(h)
        self.totals.num_hit_pages += len(hashes)
        self.tenant_hits[tenant] = self.tenant_hits.get(tenant, 0) + len(hashes) * PS

    def drop_tenant(self, tenant: str) -> int:
        doomed = [h for h, (t, _) in self.entries.items() if t == tenant]
        for h in doomed:
            self.remove(h)
        return len(doomed)

    def remove(self, block_hash: bytes) -> None:
        del self.entries[block_hash]
        self.deleted.append(block_hash)


@dataclass
class Pre:
    """A pool before a single-op call: the oracle for placement, hits, out-of-pages and eviction order."""

    free: list[int]
    evictable: list[int]
    blocks: dict[tuple[str, tuple[int, ...]], int]  # (tenant, prefix) of every indexed block -> page_id
    num_requests: int
    hits: list[int] = field(default_factory=list)


class KVManagerMachine(RuleBasedStateMachine):
    # Sub-cases that once hit bugs (fixed); their minimal reproductions stay at the end of this file.
    reuse_stale_ids = True
    retry_stale_frees = True
    retry_short_before_ok = True

    def __init__(self):
        super().__init__()
        # one global LRU over the tenants: the oracle's eviction order (fair share has its own properties)
        self.mgr = KVManager(store_capacity_bytes=STORE_BYTES, policy=CachePolicy("lru"))
        self.tier = ModelTier()
        self.indexed: dict[str, set[bytes]] = {}  # during a call: each pool's indexed block hashes
        self.writes: list[StoreWriteOrder] = []  # during a call: the writes its commits must order
        self.epoch: dict[str, int] = {}
        self.num_pages: dict[str, int] = {}
        self.live: dict[str, ModelReq] = {}
        self.stale: dict[str, ModelReq] = {}
        self.gone: set[str] = set()
        self.committed: dict[tuple[str, int, str], set[tuple[int, ...]]] = defaultdict(set)
        self.content: dict[tuple[str, int, int], tuple[str, tuple[int, ...]]] = {}
        self.counters: dict[str, list[int]] = {}
        self.histories: list[tuple[int, ...]] = []
        self.pending: dict[str, list[int]] = {}  # req_id -> its tokens once the extension in flight succeeds
        self.num_ids = self.num_steps = 0
        self.last = None  # (ops, results, snapshot after) of the latest call
        self.last_step: dict[str, int] = {}  # req_id with a record (live or stale) -> the newest step_id applied

    # -- plain actions (the fixed-bug repros call these directly) -----------------------------------------------
    def setup(self, sizes):
        for w, n in zip(WORKERS, sizes, strict=True):
            self.register(w, 1, n)

    def register(self, w: str, epoch: int, num_pages: int, address: str = "") -> None:
        res = self.register_pool(spec_for(w, epoch, num_pages), address)
        dropped = sorted(rid for rid, m in self.live.items() if m.worker == w)
        assert res.dropped_req_ids == tuple(dropped) and res.previous_epoch == self.epoch.get(w, 0)
        for rid in dropped:
            self.stale[rid] = self.live.pop(rid)
        self.epoch[w], self.num_pages[w], self.last = epoch, num_pages, None

    def register_pool(self, spec: PoolSpec, address: str):
        """The registration; the replay machine has a worker with an ``address`` join instead."""
        return self.mgr.register_worker(spec)

    def call(self, ops: StepOps):
        single = len(ops.allocations) + len(ops.extensions) + len(ops.commits) + len(ops.frees) + len(
            ops.releases) == 1
        pre = self.pre_state() if single else None
        self.indexed, self.writes = {w: set(p.index) for w, p in self.mgr.pools.items()}, []
        res = self.mgr.step(ops)
        assert [len(res.allocations), len(res.extensions), len(res.commits), len(res.frees), len(res.releases)] == [
            len(ops.allocations), len(ops.extensions), len(ops.commits), len(ops.frees), len(ops.releases)]
        freeing = {f.req_id for f in ops.frees}
        commits = list(zip(ops.commits, res.commits, strict=True))
        for c, r in commits:  # a request's last commit, in the call that frees it, goes first
            if c.req_id in freeing:
                self.absorb_commit(c, r)
        for f, r in zip(ops.frees, res.frees, strict=True):
            self.absorb_free(f, r)
        for c, r in commits:
            if c.req_id not in freeing:
                self.absorb_commit(c, r)
        for x, r in zip(ops.releases, res.releases, strict=True):
            self.absorb_release(x, r, pre)
        for e, r in zip(ops.extensions, res.extensions, strict=True):
            self.absorb_extend(e, r, pre)
        for a, r in zip(ops.allocations, res.allocations, strict=True):
            self.absorb_allocate(a, r, pre)
        assert res.store_writes == self.writes, "the writes ordered: each new block a pool with a store indexes"
        self.tier.orders += res.store_writes
        self.pending.clear()
        for op in (*ops.allocations, *ops.extensions, *ops.commits, *ops.frees, *ops.releases):
            if op.req_id in self.live or op.req_id in self.stale:
                self.last_step[op.req_id] = max(self.last_step.get(op.req_id, 0), ops.step_id)
            else:  # freed, or an allocation short of pages: no record keeps its step_id
                self.last_step.pop(op.req_id, None)
        self.last = (ops, copy.deepcopy(res), snapshot(self.mgr, volatile=False))
        self.check_all()  # after every call, also inside rules that make several
        return res

    def log_mark(self):
        return None

    def logged_since(self, mark) -> bool:
        """Whether a call since log_mark() would be logged: here, whether it marked the manager's changes (the
        replay machine, whose calls are logged, counts the log's records instead)."""
        return self.mgr.changes.changed

    def baseline(self):
        """snapshot() of the manager as KVService leaves it once a call is durable (its changes cleared), for a
        call that must change nothing: one that marked changes would be logged."""
        self.mgr.changes = Changes()
        return snapshot(self.mgr)

    def retry(self) -> None:
        """The same call again: the same answers, and nothing applied twice."""
        ops, res, after = self.last
        self.mgr.changes = Changes()
        again = self.mgr.step(ops)
        # pool summaries describe the pools now, not the ops: not compared
        assert (again.allocations, again.extensions, again.commits, again.frees, again.releases) == (
            res.allocations, res.extensions, res.commits, res.frees, res.releases)
        assert snapshot(self.mgr, volatile=False) == after and self.mgr.changes.empty()
        assert again.store_writes == [] and not self.mgr.tier.deleted  # nothing ordered or removed again

    def report(self, report: TierReport) -> None:
        """A worker's ReportTier, and the model's; the last call's retry must still change nothing."""
        assert self.send_report(report) == self.tier.report(report)
        if self.last is not None:
            ops, res, _ = self.last
            self.last = (ops, res, snapshot(self.mgr, volatile=False))
        self.check_all()

    def send_report(self, report: TierReport) -> tuple[int, int]:
        """The call; the replay machine sends it through the logged service."""
        return self.mgr.report_tier(report)

    def take_deletions(self) -> list[bytes]:
        """The store values whose deletion calls queued since the last check (the replay machine's service hands
        them to its janitor once each call is durable)."""
        return self.mgr.tier.take_deleted()

    def extend_to(self, rid: str, new_tokens: list[int]) -> PageExtension:
        self.pending[rid] = self.live[rid].tokens + list(new_tokens)
        return PageExtension(rid, len(self.pending[rid]))

    # -- absorbing results into the model, with per-op checks ---------------------------------------------
    def absorb_free(self, f: PageFree, r) -> None:
        if f.req_id in self.live:
            assert r.status is OK
            del self.live[f.req_id]
            self.gone.add(f.req_id)
        elif f.req_id in self.stale:
            assert r.status is STALE, r
            del self.stale[f.req_id]
            self.gone.add(f.req_id)
        else:
            assert r.status is OK  # freeing twice is harmless

    def absorb_commit(self, c: PageCommit, r) -> None:
        if c.req_id in self.stale:
            assert r.status is STALE
            return
        m = self.live[c.req_id]
        end = c.start_pos + len(c.token_ids)
        assert r.status is OK and r.num_committed_tokens == end
        for i in range(c.start_pos // PS, end // PS):
            prefix = tuple(m.tokens[: (i + 1) * PS])
            if m.page_table[i] != HOLE:  # a page its window released may hold anything by now
                self.content[(m.worker, m.epoch, m.page_table[i])] = (m.tenant, prefix)
            if not m.skip:
                self.committed[(m.worker, m.epoch, m.tenant)].add(prefix)
                self.expect_write(m, m.page_table[i], prefix)
        m.num_committed = end
        self.histories.append(tuple(m.tokens))

    def expect_write(self, m: ModelReq, page_id: int, prefix: tuple[int, ...]) -> None:
        """A committed page joins its pool's index unless it is a hole or its block is indexed already (computed
        twice); then, on a pool with a store, a write is ordered if the store lacks the block."""
        block_hash = chain_hashes(seed_of(m.tenant, m.worker), prefix, PS)[-1]
        if page_id == HOLE or block_hash in self.indexed[m.worker]:
            return
        self.indexed[m.worker].add(block_hash)
        if has_store(m.worker, m.epoch) and block_hash not in self.tier.entries:
            self.tier.prompts[block_hash] = (m.tenant, m.worker, prefix)
            self.writes.append(StoreWriteOrder(m.worker, StoreWrite(page_id, block_hash, seed_of(m.tenant, m.worker),
                                                                    m.tenant)))

    def absorb_release(self, x: PageRelease, r, pre) -> None:
        if x.req_id in self.stale:
            assert r.status is STALE and r.num_released == 0
            return
        m = self.live[x.req_id]
        released = [m.page_table[i] for i in x.page_indices if m.page_table[i] != HOLE]
        assert r.status is OK and r.num_released == len(released), (r, released)
        for i in x.page_indices:
            m.page_table[i] = HOLE
        if pre is not None:  # single op: pages that nobody holds now join the LRU (cached) or the free list, in order
            pool, p = self.mgr.pools[m.worker], pre[m.worker]
            idle = [page_id for page_id in released if not pool.ref_cnt[page_id]]
            assert list(pool.evictable) == p.evictable + [q for q in idle if pool.block_of[q] is not None]
            assert list(pool.free) == p.free + [q for q in idle if pool.block_of[q] is None]

    def absorb_extend(self, e: PageExtension, r, pre) -> None:
        if e.req_id in self.stale:
            assert r.status is STALE and not r.new_page_ids
            return
        m = self.live[e.req_id]
        need = pages_for(e.num_tokens) - len(m.page_table)
        if pre is not None:  # single op: exact pages, FIFO free list first, then the LRU head
            p = pre[m.worker]
            avail = len(p.free) + len(p.evictable)
            assert (r.status is OK) == (need <= avail), (r, need, avail)
            assert r.status is OK or r.num_pages_short == need - avail
            assert r.status is not OK or r.new_page_ids == (p.free + p.evictable)[: max(need, 0)]
        if r.status is SHORT:
            assert need > 0 and r.num_pages_short > 0 and not r.new_page_ids and r.num_pages == len(m.page_table)
            return
        assert r.status is OK and len(r.new_page_ids) == max(need, 0)
        for page_id in r.new_page_ids:
            assert self.mgr.pools[m.worker].ref_cnt[page_id] == 1  # a fresh page has exactly one holder
            self.content.pop((m.worker, m.epoch, page_id), None)
        m.page_table += r.new_page_ids
        m.tokens = self.pending[e.req_id]
        assert r.num_pages == len(m.page_table)

    def absorb_allocate(self, a: PageAllocation, r, pre) -> None:
        if pre is not None:
            self.check_placement(a, r, pre)
        if r.status is SHORT:
            assert r.num_pages_short > 0 and not r.page_table and a.req_id not in self.mgr.requests
            return
        assert r.status is OK and r.worker_id == a.worker_id
        w, e, pt = r.worker_id, self.epoch[r.worker_id], r.page_table
        assert r.epoch == e, "an allocation named a dead epoch"
        held = [page_id for page_id in pt if page_id != HOLE]
        assert len(pt) == pages_for(len(a.token_ids)) and len(set(held)) == len(held)
        assert all(0 <= p < self.num_pages[w] for p in held)
        k = self.check_hits(a, r)
        for page_id in pt[r.num_committed_tokens // PS:]:  # store hits and the rest: fresh pages
            if page_id != HOLE:
                assert self.mgr.pools[w].ref_cnt[page_id] == 1  # a fresh page has exactly one holder
                self.content.pop((w, e, page_id), None)
        self.stale.pop(a.req_id, None)
        self.gone.discard(a.req_id)
        self.live[a.req_id] = ModelReq(a.tenant, w, e, list(a.token_ids), list(pt), r.num_committed_tokens,
                                       a.skip_prefix_cache)
        counters = self.counters.setdefault(a.tenant, [0, 0])
        if not a.skip_prefix_cache:
            counters[0] += len(a.token_ids)
            counters[1] += k * PS
        self.histories.append(a.token_ids)

    def check_hits(self, a: PageAllocation, r) -> int:
        """An allocation's hits: pool hits explained by this tenant's own commits on this pool incarnation, page
        by page; past them exactly the run of blocks the store holds, each read page of them a fresh page to
        load. The store's entries become the most recently used. Returns the number of hit pages."""
        w, e, pt = r.worker_id, self.epoch[r.worker_id], r.page_table
        k, rem = divmod(r.num_cached_tokens, PS)
        kp, rem_pool = divmod(r.num_committed_tokens, PS)
        assert rem == rem_pool == 0 and kp <= k and r.num_cached_tokens <= (len(a.token_ids) - 1) // PS * PS
        assert not (a.skip_prefix_cache and k)
        read = first_chunk_pages(w, k * PS, len(a.token_ids))
        assert [i for i in range(k) if pt[i] != HOLE] == [i for i in range(k) if i in read], "holes: pages not read"
        if kp:
            assert a.token_ids[: kp * PS] in self.committed[(w, e, a.tenant)], "hit not explained by own commits"
            for i in range(kp):
                assert i not in read or self.content.get((w, e, pt[i])) == (a.tenant, a.token_ids[: (i + 1) * PS])
        stored = self.store_hits(a, w, kp)
        assert k - kp == len(stored), "store hits: not the run of blocks the store holds past the pool's hit"
        seed = seed_of(a.tenant, w)
        assert r.store_loads == [StoreLoad(pt[i], stored[i - kp], seed) for i in range(kp, k) if i in read]
        if stored:
            self.tier.hit(a.tenant, stored)
        return k

    def store_hits(self, a: PageAllocation, w: str, num_pool_hits: int) -> list[bytes]:
        """The blocks an allocation takes from the store past its pool hits (none with skip_prefix_cache, or a
        load that does not pay)."""
        if a.skip_prefix_cache or not loads_pay(a):
            return []
        return self.store_run(w, a.tenant, a.token_ids, num_pool_hits)

    def store_run(self, w: str, tenant: str, token_ids: tuple[int, ...], num_pool_hits: int) -> list[bytes]:
        """The hashes of the longest run of the prompt's cacheable pages past its pool hits that the model's store
        holds; none on a pool without a store."""
        if not has_store(w, self.epoch[w]):
            return []
        cacheable = token_ids[: (len(token_ids) - 1) // PS * PS]
        run = []
        for h in chain_hashes(seed_of(tenant, w), cacheable, PS)[num_pool_hits:]:
            if h not in self.tier.entries:
                break
            run.append(h)
        return run

    def pre_state(self) -> dict[str, Pre]:
        out = {}
        for w, pool in self.mgr.pools.items():
            blocks = {self.content.get((w, pool.spec.epoch, b.page_id)): b.page_id for b in pool.index.values()}
            out[w] = Pre(list(pool.free), list(pool.evictable), blocks, pool.num_requests)
        return out

    @staticmethod
    def model_hits(p: Pre, tenant: str, token_ids: tuple[int, ...], skip: bool = False) -> list[int]:
        """The pages of the longest indexed prefix of the prompt's cacheable pages, from the model's index."""
        hits = []
        for i in range(0 if skip else (len(token_ids) - 1) // PS):
            page_id = p.blocks.get((tenant, token_ids[: (i + 1) * PS]))
            if page_id is None:
                break
            hits.append(page_id)
        return hits

    @staticmethod
    def model_available(p: Pre, hits: list[int]) -> int:
        return len(p.free) + len(p.evictable) - sum(1 for h in hits if h in p.evictable)

    def check_placement(self, a: PageAllocation, r, pre: dict[str, Pre]) -> None:
        """Single allocation, on the pool it names: the longest indexed prefix, then the store's run past it, exact
        fresh pages (first for the store hits it reads, in order), or exactly how many pages it is short."""
        p, w = pre[a.worker_id], a.worker_id
        p.hits = self.model_hits(p, a.tenant, a.token_ids, a.skip_prefix_cache)
        kp = len(p.hits)
        k = kp + len(self.store_hits(a, w, kp))
        read = first_chunk_pages(w, k * PS, len(a.token_ids))
        held = [p.hits[i] for i in range(kp) if i in read]
        need = pages_for(len(a.token_ids)) - k + sum(1 for i in range(kp, k) if i in read)
        short = need - self.model_available(p, held)
        if short > 0:
            assert r.status is SHORT and r.num_pages_short == short, (r, short)
            return
        fresh = iter((p.free + [e for e in p.evictable if e not in held])[:need])
        table = [(p.hits[i] if i < kp else next(fresh)) if i in read else HOLE for i in range(k)] + list(fresh)
        assert (r.page_table, r.num_cached_tokens, r.num_committed_tokens) == (table, k * PS, kp * PS), (r, p)

    # -- invariants -------------------------------------------------------------------------------------
    def check_all(self) -> None:
        mgr = self.mgr
        assert {w: (p.spec.epoch, p.spec.num_pages) for w, p in mgr.pools.items()} == {
            w: (self.epoch[w], self.num_pages[w]) for w in self.epoch}
        for w, pool in mgr.pools.items():
            self.check_pool(w, pool)
        assert set(mgr.requests) == set(self.live) and set(mgr.stale) == set(self.stale)
        for rid, m in self.live.items():
            r = mgr.requests[rid]
            assert (r.tenant, r.worker_id, r.epoch, r.page_table, r.num_committed_tokens, r.skip_prefix_cache) == (
                m.tenant, m.worker, m.epoch, m.page_table, m.num_committed, m.skip), rid
            assert r.epoch == mgr.pools[r.worker_id].spec.epoch, "a live request holds pages of a dead epoch"
            assert len(m.page_table) == pages_for(len(m.tokens))
            if not m.skip:
                assert r.block_hashes == chain_hashes(seed_of(m.tenant, m.worker), m.tokens[: m.num_committed], PS)
            if HOLE in m.page_table:  # only a windowed pool's, between its sink page and its last page
                assert m.worker in WINDOWS and HOLE not in m.page_table[:NUM_SINK_PAGES] + m.page_table[-1:]
        assert {t: [c.prefix_cache_queries, c.prefix_cache_hits] for t, c in mgr.tenants.items()} == self.counters
        self.check_tier()
        check_invariants(mgr)

    def check_tier(self) -> None:
        """The store's index is the model's, LRU order, tenants and bytes included (so a dropped pool or epoch
        removed nothing from it); no entry names a value no worker reported written, or one reported missing
        and not written since; every removal queued its value's deletion, once, in order."""
        tier, model = self.mgr.tier, self.tier
        assert [(h, e.tenant, e.num_bytes) for h, e in tier.entries.items()] == [
            (h, *entry) for h, entry in model.entries.items()], "the store's index, in LRU order"
        assert set(tier.entries) <= model.written, "an entry for a value no worker reported written"
        assert not set(tier.entries) & model.missing, "an entry kept after its value was reported missing"
        assert (tier.totals, tier.tenant_hits) == (model.totals, model.tenant_hits)
        assert self.take_deletions() == model.deleted, "the values to delete: those whose entries were removed"
        model.deleted = []

    def check_pool(self, w: str, pool) -> None:
        n, e = pool.spec.num_pages, pool.spec.epoch
        holders: list[list[int]] = [[] for _ in range(n)]  # positions in the holders' page tables
        for r in self.mgr.requests.values():
            if r.worker_id == w:
                held = [page_id for page_id in r.page_table if page_id != HOLE]
                assert len(set(held)) == len(held), f"{r.req_id} holds a page twice"
                for i, page_id in enumerate(r.page_table):
                    if page_id == HOLE:
                        continue
                    assert 0 <= page_id < n
                    holders[page_id].append(i)
        free, evictable = list(pool.free), list(pool.evictable)
        assert len(set(free)) == len(free) and not set(free) & set(evictable)
        num_used = num_cached = 0
        for page_id in range(n):
            ref, block = pool.ref_cnt[page_id], pool.block_of[page_id]
            assert ref == len(holders[page_id]), f"{w} page {page_id}: ref_cnt {ref} != {len(holders[page_id])}"
            if ref > 1:  # only an indexed block is shared, and always at its own position
                assert block is not None and pool.index.get(block.block_hash) is block, f"page {page_id} shared"
                assert set(holders[page_id]) == {block.block_index}
            if ref:
                num_used += 1
                assert page_id not in free and page_id not in pool.evictable
            elif block is None:
                assert page_id in free
            else:
                num_cached += 1
                assert (page_id in pool.evictable) != block.pinned
        assert (pool.num_used, pool.num_cached, pool.num_free) == (num_used, num_cached, n - num_used - num_cached)
        assert pool.num_requests == sum(1 for m in self.live.values() if m.worker == w)
        assert sum(1 for b in pool.block_of if b is not None) == len(pool.index)
        for h, b in pool.index.items():
            assert b.block_hash == h and 0 <= b.page_id < n and pool.block_of[b.page_id] is b
            tenant, prefix = self.content.get((w, e, b.page_id), ("", ()))  # the page holds what the block says
            assert tenant == b.tenant and len(prefix) == (b.block_index + 1) * PS, f"{w} page {b.page_id} holds {b}"
            chain = chain_hashes(seed_of(tenant, w), prefix, PS)
            assert chain[-1] == h and b.parent_hash == ([seed_of(tenant, w)] + chain)[-2]
            assert prefix in self.committed[(w, e, tenant)]

    @invariant()
    def invariants_hold(self):
        self.check_all()

    # -- drawing ops ------------------------------------------------------------------------------------
    def new_id(self) -> str:
        self.num_ids += 1
        return f"r{self.num_ids}"

    def next_step(self) -> int:
        self.num_steps += 1
        return self.num_steps

    def draw_prompt(self, data) -> tuple[int, ...]:
        base = data.draw(st.sampled_from(PREFIXES + tuple(self.histories[-6:])))
        k = max(0, min(len(base), 12) // PS - data.draw(st.sampled_from((0, 0, 0, 1, 2))))  # mostly all of it
        suffix = data.draw(st.lists(st.integers(0, 3), min_size=0 if k else 1, max_size=5))
        return tuple(base[: k * PS]) + tuple(suffix)  # no suffix: page-aligned, the last page is recomputed

    def alloc_op(self, data, req_id: str | None = None, prompt: tuple[int, ...] = ()) -> PageAllocation:
        if req_id is None:
            reuse = sorted(self.gone - set(self.live))
            req_id = data.draw(st.sampled_from(reuse)) if reuse and data.draw(st.integers(0, 4)) == 0 else None
        tenant = data.draw(st.sampled_from(TENANTS[:1] * 3 + TENANTS))  # mostly one tenant: more hits
        worker = data.draw(st.sampled_from(WORKERS[:1] * 3 + WORKERS))
        return PageAllocation(req_id or self.new_id(), tenant, prompt or self.draw_prompt(data), worker,
                              data.draw(st.integers(0, 4)) == 0, **data.draw(st.sampled_from(TIER_OPTIONS)))

    def extend_op(self, rid: str, data) -> PageExtension | None:
        m = self.live[rid]
        room = (MAX_WINDOWED_TOKENS if m.worker in WINDOWS else MAX_TOKENS) - len(m.tokens)
        if room <= 0:
            return None
        new = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=min(6, room)))
        if pages_for(len(m.tokens) + len(new)) - m.page_table.count(HOLE) > self.num_pages[m.worker]:
            return None  # it would hold more pages than its pool has: refused, as bad_call checks
        return self.extend_to(rid, new)

    def release_op(self, rid: str, data) -> PageRelease | None:
        """Some of a windowed request's pages between its sink page and its last one, now and then a hole again."""
        m = self.live[rid]
        between = range(NUM_SINK_PAGES, len(m.page_table) - 1)
        held = [i for i in between if m.page_table[i] != HOLE]
        if m.worker not in WINDOWS or not between:
            return None
        choices = held * 4 + [i for i in between if i not in held]
        return PageRelease(rid, tuple(data.draw(st.lists(st.sampled_from(choices), unique=True, min_size=1,
                                                         max_size=3))))

    def window_op(self, rid: str) -> PageRelease | None:
        """What the gateway releases in the step that computes a request's next tokens: the pages past the sinks
        whose positions all lie before the window of the first of them (position p attends [p + 1 - window, p])."""
        m, window = self.live[rid], WINDOWS[self.live[rid].worker][0]
        first = len(m.tokens)
        old = [i for i in range(NUM_SINK_PAGES, len(m.page_table) - 1)
               if (i + 1) * PS <= first + 1 - window and m.page_table[i] != HOLE]
        return PageRelease(rid, tuple(old)) if old else None

    def commit_op(self, rid: str, data) -> PageCommit | None:
        m = self.live[rid]
        num_new = (len(m.tokens) // PS * PS - m.num_committed) // PS
        end = m.num_committed + PS * data.draw(st.integers(min(1, num_new), num_new))
        return PageCommit(rid, m.num_committed, tuple(m.tokens[m.num_committed : end]), len(m.tokens))

    # -- rules ------------------------------------------------------------------------------------------
    @initialize(sizes=st.tuples(st.integers(6, 12), st.integers(6, 12)), load_penalty_pages=st.sampled_from((4, 1)))
    def init_pools(self, sizes, load_penalty_pages=4):
        # 1 as well as the default 4: a request of load then weighs a page of hit, so that placement's weighing of
        # hits (two store hits for one pool hit) decides more often
        self.mgr.load_penalty_pages = load_penalty_pages
        self.setup(sizes)

    @rule(data=st.data())
    def allocate(self, data):
        """A new request; usually its prompt is then computed and committed (and the writes that orders may be
        reported landed), and sometimes it finishes."""
        r = self.call(StepOps(self.next_step(), allocations=(self.alloc_op(data),))).allocations[0]
        if r.status is not OK or data.draw(st.integers(0, 3)) == 0:
            return
        ordered = self.call(StepOps(self.next_step(), commits=(self.commit_op(r.req_id, data),))).store_writes
        if ordered and data.draw(st.booleans()):
            self.report_written(data, ordered)
        if data.draw(st.integers(0, 2)):
            self.call(StepOps(self.next_step(), frees=(PageFree(r.req_id),)))

    @precondition(lambda self: self.reuse_stale_ids and self.stale)
    @rule(data=st.data())
    def allocate_stale_id(self, data):
        """A request whose pages were dropped with their epoch is recomputed under its req_id, as the gateway
        re-queues it: the allocation is accepted (a newer call than any that touched it), and once it gets
        pages the stale record is gone; an allocation short of pages leaves it stale."""
        op = self.alloc_op(data, data.draw(st.sampled_from(sorted(self.stale))))
        r = self.call(StepOps(self.next_step(), allocations=(op,))).allocations[0]
        assert r.status in (OK, SHORT) and (op.req_id in self.mgr.stale) is (r.status is SHORT)

    @precondition(lambda self: any(p.num_evictable for p in self.mgr.pools.values()))
    @rule(data=st.data())
    def allocate_under_pressure(self, data):
        """Fresh tokens that need more pages than are free: the LRU head is evicted (checked exactly)."""
        w = data.draw(st.sampled_from([w for w, p in self.mgr.pools.items() if p.num_evictable]))
        pool = self.mgr.pools[w]
        num = min(MAX_TOKENS // PS, pool.num_free + data.draw(st.integers(1, pool.num_evictable)))
        tokens = tuple(range(1000 + 100 * self.num_ids, 1000 + 100 * self.num_ids + num * PS))
        op = PageAllocation(self.new_id(), data.draw(st.sampled_from(TENANTS)), tokens, w, data.draw(st.booleans()))
        self.call(StepOps(self.next_step(), allocations=(op,)))

    def call_on_live_or_stale(self, data, kind: str, on_live, on_stale) -> None:
        """One op (``kind``: "extensions" or "commits") on a live or a stale request, in a call of its own; a
        stale one's op answers STALE_EPOCH. ``on_live(rid, data)`` may make no op (None)."""
        rid = data.draw(st.sampled_from(sorted(self.live) + sorted(self.stale)))
        op = on_stale(self.stale[rid], rid) if rid in self.stale else on_live(rid, data)
        if op is not None:
            self.call(StepOps(self.next_step(), **{kind: (op,)}))

    @precondition(lambda self: self.live or self.stale)
    @rule(data=st.data())
    def extend(self, data):
        self.call_on_live_or_stale(data, "extensions", self.extend_op,
                                   lambda m, rid: PageExtension(rid, len(m.tokens) + 1))

    @precondition(lambda self: self.live or self.stale)
    @rule(data=st.data())
    def commit(self, data):
        def stale_commit(m, rid):
            return PageCommit(rid, m.num_committed, tuple(m.tokens[m.num_committed : m.num_committed + PS]), 0)

        self.call_on_live_or_stale(data, "commits", self.commit_op, stale_commit)

    @precondition(lambda self: any(m.worker in WINDOWS for m in self.live.values()) or self.stale)
    @rule(data=st.data())
    def release(self, data):
        """A windowed request's window moves past some of its pages (a stale request's release: STALE_EPOCH)."""
        ids = sorted(r for r, m in self.live.items() if m.worker in WINDOWS) + sorted(self.stale)
        rid = data.draw(st.sampled_from(ids))
        op = PageRelease(rid, (NUM_SINK_PAGES,)) if rid in self.stale else self.release_op(rid, data)
        if op is not None:
            self.call(StepOps(self.next_step(), releases=(op,)))

    @rule(data=st.data())
    def stream(self, data):
        """A windowed request (a new one, or one running) decodes for a few steps, each one call as the gateway
        sends it: its newly full pages committed, the pages that fell out of its window released, the page table
        extended. It may run longer than its pool has pages."""
        running = sorted(r for r, m in self.live.items() if m.worker in WINDOWS)
        if running and data.draw(st.booleans()):
            rid = data.draw(st.sampled_from(running))
        else:
            a = replace(self.alloc_op(data, self.new_id()), worker_id="w1")
            if self.call(StepOps(self.next_step(), allocations=(a,))).allocations[0].status is not OK:
                return
            rid = a.req_id
        for _ in range(data.draw(st.integers(1, 8))):
            if rid not in self.live or (ext := self.extend_op(rid, data)) is None:
                return
            release = self.window_op(rid)
            r = self.call(StepOps(self.next_step(), extensions=(ext,), commits=(self.commit_op(rid, data),),
                                  releases=(release,) if release else ()))
            if r.extensions[0].status is not OK:
                return

    @rule(data=st.data())
    def free(self, data):
        kinds = [k for k, ids in (("live", self.live), ("stale", self.stale), ("gone", self.gone)) if ids]
        kind = data.draw(st.sampled_from(kinds + ["unknown"]))
        ids = {"live": self.live, "stale": self.stale, "gone": self.gone}.get(kind, {"ghost"})
        self.call(StepOps(self.next_step(), frees=(PageFree(data.draw(st.sampled_from(sorted(ids)))),)))

    @rule(data=st.data())
    def batch(self, data):
        """One scheduler step for several requests: frees, commits, extensions and new allocations."""
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.live)), unique=True, max_size=3)) if self.live else []
        frees, commits, extensions, releases = [], [], [], []
        for rid in chosen:
            kind = data.draw(st.sampled_from(("free", "commit", "extend", "both", "last", "window")))
            if kind in ("free", "last"):  # last: its final commit and its free in one call
                frees.append(PageFree(rid))
            if kind in ("commit", "both", "last", "window"):
                commits.append(self.commit_op(rid, data))
            if kind == "window" and (op := self.release_op(rid, data)) is not None:  # commit, release, extend
                releases.append(op)
            if kind in ("extend", "both", "window") and (op := self.extend_op(rid, data)) is not None:
                extensions.append(op)
        shared = self.draw_prompt(data) if data.draw(st.booleans()) else ()  # computed twice: a duplicate block
        allocations = [self.alloc_op(data, self.new_id(), shared) for _ in range(data.draw(st.integers(0, 3)))]
        self.call(StepOps(self.next_step(), tuple(allocations), tuple(extensions), tuple(commits), tuple(frees),
                          tuple(releases)))

    @rule(data=st.data())
    def reregister(self, data):
        w = data.draw(st.sampled_from(WORKERS))
        kind = data.draw(st.sampled_from(("newer", "same", "older", "same", "release")))
        if kind == "newer":
            self.register(w, self.epoch[w] + data.draw(st.integers(1, 2)), data.draw(st.integers(6, 12)))
            return
        if kind == "release":  # its scheduler restarted: every request the dead one left is freed, as a free
            res = self.mgr.register_worker(spec_for(w, self.epoch[w], self.num_pages[w]), release_requests=True)
            released = sorted(rid for rid, m in self.live.items() if m.worker == w)
            assert res.released_req_ids == tuple(released) and res.dropped_req_ids == ()
            for rid in released:
                del self.live[rid]
                self.last_step.pop(rid, None)
                self.gone.add(rid)
            self.last = None
            self.check_all()
            return
        before = self.baseline()
        if kind == "same":  # idempotent: nothing dropped, nothing changed
            assert self.mgr.register_worker(spec_for(w, self.epoch[w], self.num_pages[w])).dropped_req_ids == ()
        elif self.epoch[w] > 1:
            with pytest.raises(StaleEpoch):
                self.mgr.register_worker(spec_for(w, self.epoch[w] - 1, self.num_pages[w]))
        assert snapshot(self.mgr) == before

    def retry_is_tested(self) -> bool:
        if self.last is None:
            return False
        ops, res, _ = self.last
        stale_free = any(r.status is STALE for r in res.frees)
        pairs = list(zip(ops.allocations, res.allocations, strict=True))
        short_before_ok = any(r.status is SHORT and any(r2.status is OK and a.worker_id == r2.worker_id
                                                        for _, r2 in pairs[i + 1 :])
                              for i, (a, r) in enumerate(pairs))
        return (self.retry_stale_frees or not stale_free) and (self.retry_short_before_ok or not short_before_ok)

    @precondition(retry_is_tested)
    @rule()
    def retry_last_call(self):
        self.retry()

    @precondition(lambda self: self.mgr.pools)
    @rule(data=st.data())
    def place(self, data):
        self.check_place(data, data.draw(st.sampled_from(TENANTS)), self.draw_prompt(data))

    def check_place(self, data, tenant: str, prompt: tuple[int, ...]) -> None:
        """Place: the documented rule over every pool (longest hit, a store hit counting half a pool hit, minus
        the load penalty per request running or queued there, then the most available pages, then the smallest
        worker_id), and no side effect."""
        queued = {w: data.draw(st.integers(0, 2)) for w in self.mgr.pools if data.draw(st.booleans())}
        pre, before = self.pre_state(), self.baseline()
        keys, hits = {}, {}
        for w, p in pre.items():
            pool_hits = self.model_hits(p, tenant, prompt)
            num_stored = len(self.store_run(w, tenant, prompt, len(pool_hits)))  # a store hit: half a pool hit
            hits[w] = len(pool_hits) + num_stored
            load = p.num_requests + queued.get(w, 0)
            keys[w] = (len(pool_hits) + num_stored / 2 - self.mgr.load_penalty_pages * load,
                       self.model_available(p, pool_hits))
        best = max(keys.values())
        chosen = min(w for w, key in keys.items() if key == best)
        assert self.mgr.place(tenant, prompt, queued) == Placement(chosen, hits[chosen] * PS), keys
        assert snapshot(self.mgr) == before

    @precondition(lambda self: self.tier.orders)
    @rule(data=st.data())
    def report_written(self, data, recent: list[StoreWriteOrder] | None = None):
        """A worker reports values the store acknowledged: the writes it was ordered lately from some point on
        (the earlier ones reported before, or lost), maybe one of them lost, in any order, maybe one twice (or
        already recorded)."""
        recent = recent or self.tier.orders[-12:]
        w = data.draw(st.sampled_from(sorted({o.worker_id for o in recent})))
        mine = [o for o in recent if o.worker_id == w]
        landed = mine[data.draw(st.integers(0, len(mine) - 1)):]
        lost = data.draw(st.sampled_from([None] * 3 + landed[1:]))
        landed = data.draw(st.permutations([o for o in landed if o is not lost]))
        orders = landed + data.draw(st.lists(st.sampled_from(landed), max_size=2))
        blocks = tuple(StoredBlock(o.write.block_hash, o.write.tenant, value_bytes(o.write.block_hash))
                       for o in orders)
        counters = TierCounters(num_written_pages=len(blocks), num_written_bytes=sum(b.num_bytes for b in blocks))
        self.report(TierReport(w, self.epoch[w], written=blocks, counters=counters))

    @precondition(lambda self: self.tier.orders)
    @rule(data=st.data())
    def report_missing(self, data):
        """A worker's loads found values absent or damaged: mostly recorded ones, maybe one not recorded (evicted,
        reported before, or never written)."""
        known = list(self.tier.entries) * 3 + [o.write.block_hash for o in self.tier.orders[-4:]]
        missing = tuple(data.draw(st.lists(st.sampled_from(known), min_size=1, max_size=3)))
        w = data.draw(st.sampled_from(WORKERS))
        counters = TierCounters(num_loaded_pages=1, load_s=0.1, num_failed_loads=1, num_verify_failures=1)
        self.report(TierReport(w, self.epoch[w], missing=missing, counters=counters))

    # One rule per way a pool loses blocks the store keeps: more store hits in each run (each run enables a random
    # subset of the rules).
    @precondition(lambda self: self.tier.prompts)
    @rule(data=st.data())
    def reload_from_the_store_after_an_evict(self, data):
        self.reload_from_the_store(data, "evict")

    @precondition(lambda self: self.tier.prompts)
    @rule(data=st.data())
    def reload_from_the_store_after_a_restart(self, data):
        self.reload_from_the_store(data, "restart")

    def reload_from_the_store(self, data, how: str) -> None:
        """A prompt that an ordered block ends comes back (its chain's writes mostly reported landed first) after
        the tenant was evicted from that pool, or after the worker restarted (a new epoch; a pool with no store
        then gets no store hits). The store serves what the pool lost; the first commit indexes the loaded pages
        and orders writes of what the store lacks, which may be reported."""
        tenant, w, prefix = self.tier.prompts[data.draw(st.sampled_from(list(self.tier.prompts)[-12:]))]
        if data.draw(st.integers(0, 3)):
            chain = set(chain_hashes(seed_of(tenant, w), prefix, PS))
            landed = data.draw(st.permutations([o for o in self.tier.orders if o.write.block_hash in chain]))
            self.report(TierReport(w, self.epoch[w], tuple(
                StoredBlock(o.write.block_hash, tenant, value_bytes(o.write.block_hash)) for o in landed)))
        if how == "evict":
            self.evict_a_tenant(tenant, w)
        else:
            self.register(w, self.epoch[w] + data.draw(st.integers(1, 2)), data.draw(st.integers(6, 12)))
        suffix = tuple(data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=3)))  # the block is a full page
        prompt = prefix[: (self.num_pages[w] - 1) * PS] + suffix
        self.check_place(data, tenant, prompt)  # as the gateway asks, before it queues the request
        op = replace(self.alloc_op(data, self.new_id(), prompt), tenant=tenant, worker_id=w, skip_prefix_cache=False)
        if self.call(StepOps(self.next_step(), allocations=(op,))).allocations[0].status is not OK:
            return
        ordered = self.call(StepOps(self.next_step(), commits=(self.commit_op(op.req_id, data),))).store_writes
        if ordered and data.draw(st.booleans()):
            self.report_written(data, ordered)
        if data.draw(st.booleans()):
            self.call(StepOps(self.next_step(), frees=(PageFree(op.req_id),)))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def bad_call(self, data):
        """One bad op among good ones: the call raises and changes nothing."""
        rid = data.draw(st.sampled_from(sorted(self.live)))
        m, slots = self.live[rid], len(self.live[rid].page_table) * PS
        nc = m.num_committed
        new = self.num_steps + 1  # a new call's id: what is refused is the bad op, not a stale id
        bad = data.draw(st.sampled_from((
            StepOps(new, allocations=(PageAllocation("x", "", (1,), "w0"),)),
            StepOps(new, allocations=(PageAllocation("x", "A", (1,), "nope"),)),
            StepOps(new, allocations=(PageAllocation("x", "A", (1,)),)),
            StepOps(new, allocations=(PageAllocation("x", "A", (1 << 32,), "w0"),)),
            StepOps(new, allocations=(PageAllocation("x", "A", tuple(range(60)), "w0"),)),
            StepOps(new, allocations=(PageAllocation(rid, "A", (1, 2), "w0"),)),
            StepOps(new, extensions=(PageExtension("ghost", 4),)),
            StepOps(new, extensions=(PageExtension(rid, 0),)),
            StepOps(new, extensions=(PageExtension(rid, 1000),)),
            StepOps(new, commits=(PageCommit(rid, nc, (1, 2, 3), slots),)),
            StepOps(new, commits=(PageCommit(rid, nc + PS, (1, 2, 3, 4), slots),)),
            StepOps(new, commits=(PageCommit(rid, nc, (), slots + 1),)),
            StepOps(new, frees=(PageFree(rid), PageFree(rid))),
            StepOps(0),
            StepOps(-1),
            # bad on any pool: a dense pool has nothing to release, a windowed one refuses these indices
            StepOps(new, releases=(PageRelease(rid, (len(m.page_table),)),)),
            StepOps(new, releases=(PageRelease(rid, (len(m.page_table) - 1,)),)),
            StepOps(new, releases=(PageRelease(rid, (0,)),)),
            StepOps(new, releases=(PageRelease(rid, ()),), frees=(PageFree(rid),)),
            StepOps(new, releases=(PageRelease(rid, ()), PageRelease(rid, ()))),
            StepOps(new, extensions=(
                PageExtension(rid, (self.num_pages[m.worker] + 1 + m.page_table.count(HOLE)) * PS),)),
        )))
        others = sorted(set(self.live) - {rid})
        good_free = (PageFree(data.draw(st.sampled_from(others))),) if others and data.draw(st.booleans()) else ()
        good_alloc = (self.alloc_op(data, self.new_id()),) if data.draw(st.booleans()) else ()
        ops = StepOps(bad.step_id, bad.allocations + good_alloc, bad.extensions, bad.commits, bad.frees + good_free,
                      bad.releases)
        before = self.baseline()
        with pytest.raises(DomainError):
            self.mgr.step(ops)
        assert snapshot(self.mgr) == before

    @rule(tenant=st.sampled_from(TENANTS), worker=st.sampled_from(("", "", *WORKERS)))
    def evict_a_tenant(self, tenant, worker=""):
        """An operator evicts a tenant's cached blocks from one pool, or from every pool and the store."""
        before = self.baseline()
        mark = self.log_mark()
        pools = [p for w, p in self.mgr.pools.items() if worker in ("", w)]
        cached = [sum(1 for b in p.index.values() if b.tenant == tenant and not p.ref_cnt[b.page_id]) for p in pools]
        try:
            res = evict_tenant(self.mgr, tenant, worker)
        except UnknownTenant:
            assert snapshot(self.mgr) == before
            return
        num_stored = 0 if worker else self.tier.drop_tenant(tenant)
        assert res.num_evicted_blocks == sum(cached) + num_stored  # nothing is pinned here
        assert self.logged_since(mark) == bool(res.num_evicted_blocks)  # logged only if it evicted something
        self.last = None
        self.counters = {t: [c.prefix_cache_queries, c.prefix_cache_hits] for t, c in self.mgr.tenants.items()}
        for pool in pools:
            for page_id, b in enumerate(pool.block_of):
                assert b is None or b.tenant != tenant or pool.ref_cnt[page_id] or b.pinned, "cached block kept"


    def forget(self, w: str):
        """The admin RPC's domain call; the replay machine sends it through the logged service instead."""
        return forget_worker(self.mgr, w, True)

    @rule(data=st.data())
    def forget_a_worker_and_register_it_again(self, data):
        """An operator forgets a worker with force, whatever runs on it; the worker registers again, under the
        same epoch or a newer one: a fresh pool, and no request or block of the old one left anywhere."""
        w = data.draw(st.sampled_from(WORKERS))
        num_blocks = len(self.mgr.pools[w].index)
        on_w = sorted(rid for rid, m in self.live.items() if m.worker == w)
        res = self.forget(w)
        assert (res.num_dropped_requests, res.num_dropped_blocks) == (len(on_w), num_blocks)
        epoch = self.forgotten(w, on_w) + data.draw(st.integers(0, 1))
        self.register(w, epoch, data.draw(st.integers(6, 12)))
        assert not [r for r in (*self.mgr.requests.values(), *self.mgr.stale.values()) if r.worker_id == w]

    def forgotten(self, w: str, on_w: list[str]) -> int:
        """The model after worker ``w``'s pool was forgotten with its requests (``on_w`` the live ones); the
        epoch it had."""
        assert w not in self.mgr.pools
        for rid in on_w + [rid for rid, m in self.stale.items() if m.worker == w]:
            (self.live if rid in self.live else self.stale).pop(rid)
            self.last_step.pop(rid, None)
            self.gone.add(rid)  # forgotten: a free of it is OK, as for any unknown id
        for model in (self.committed, self.content):
            for key in [k for k in model if k[0] == w]:
                del model[key]
        return self.epoch.pop(w)


KVManagerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestKVManagerProperties = KVManagerMachine.TestCase


# -- fixed bugs: minimal reproductions, replayed through the same model and invariant checks ---------------
def _machine(sizes=(8, 8)) -> KVManagerMachine:
    m = KVManagerMachine()
    m.setup(sizes)
    return m


def test_allocating_a_stale_req_id_again():
    m = _machine()
    m.call(StepOps(1, allocations=(PageAllocation("a", "A", (1, 2, 3, 4, 5), "w0"),)))
    m.register("w0", 2, 8)
    before = m.baseline()
    try:
        m.call(StepOps(2, allocations=(PageAllocation("a", "A", (1, 2, 3, 4, 5), "w0"),)))
    except DomainError:
        assert snapshot(m.mgr) == before
        return
    m.check_all()


def test_retried_free_of_a_stale_request():
    m = _machine()
    m.call(StepOps(1, allocations=(PageAllocation("a", "A", (1, 2, 3, 4, 5), "w0"),)))
    m.register("w0", 2, 8)
    m.call(StepOps(2, frees=(PageFree("a"),)))
    m.retry()


def test_retried_out_of_pages_before_an_allocation_that_fits():
    m = _machine((6, 6))
    m.call(StepOps(1, allocations=(PageAllocation("z", "A", tuple(range(8)), "w0"),)))  # 2 of 6 pages
    m.call(StepOps(2, allocations=(PageAllocation("x", "A", tuple(range(24)), "w0"),  # 6 pages: short by 2
                                   PageAllocation("y", "A", (1, 2, 3, 4, 5), "w0"))))  # 2 pages: fits
    m.retry()
