"""The KV manager: pools, live requests, the prefix index, and one batched call per scheduler step.

A step's ops are validated as a whole first (any error: nothing applied), then applied in the order
frees, commits, releases, extensions, allocations, so that freed and released pages and newly committed blocks
serve the same step. A request freed in a call may also commit its last full pages in it: that commit is applied
before the frees. A page committed in a call and released by its window in it is indexed first, so it joins the
LRU still cached. Out of pages is a result (OUT_OF_PAGES with num_pages_short), never an exception.

Pages that move between workers (transfers.py): past its pool's hit, an allocation takes a run of blocks another
compatible pool holds (peer hits: fresh pages its worker pulls, listed in peer_loads), holding the source pages
until the gateway reports the pull (StepOps.transfers), the request commits or is freed, or the lease passes. An
allocation with moved_from takes over a request whose prefill ran on another worker: its pages there are its peer
hits, and that incarnation is freed in the same op.

The shared KV tier (tier.py): an allocation takes, past its pool hits, the blocks the store holds (store
hits: fresh pages the worker fills before the first chunk, named in store_loads); a commit asks the committing
worker to write its new blocks the store lacks (StepResults.store_writes); a worker's ReportTier records what
landed (report_tier). Store hits enter the request's chain only with its first commit, which the gateway sends
once the loads succeeded: a page that failed to load is never indexed.

Eviction is tenant-aware (fair_share.py) in the pools and the tier. Pins (pins.py) are by block hash: a
request's pins are taken as its blocks enter its chain (hit at allocation, or committed), within its tenant's pin
budget; every hit refreshes a soft pin, and set_time() lapses the pins due. Time (``now_ms``) is an input of each
call, logged with it, so a replay takes and lapses the same pins.

A release turns page table entries into holes (HOLE): the page is released as a free releases it (ref_cnt - 1;
at 0 it joins the LRU if it holds a block, else the free list), and the request's later ops skip its holes.

Page groups (PoolSpec.grouped, issue 42: a model mixing full-attention and sliding-window layers): the pool holds
the full layers' pages and its ``group`` the sliding layers' (pool.py), each request a page table in each
(RequestPages.group). Both tables mean the same positions (index i: [i * page_size, (i + 1) * page_size)):

    full     page_table        [ 7 | 8 | 9 | 3 | 4 ]   dense: never released
    sliding  group_page_table  [ - | - | 2 | 0 | 5 ]   a windowed table: holes (-) out of the window

Allocation takes the joint prefix hit (placement.py: a token is cached only when every group holds what reading
it needs), the full group as a dense pool, the sliding group as a windowed one, atomically (short in either:
nothing taken). Extensions grow both tables, commits index the same token blocks in both (each group under its
own chain), releases name indices of the sliding group's table, frees release both. Pins keep the full group's
chain only; grouped pools have no peers, no shared tier and role "both".
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import repeat

from kvserve.common.errors import StaleEpoch
from kvserve.common.pages import HOLE, num_pages_for
from kvserve.common.wire.pages import (
    OpStatus,
    PageAllocation,
    PageAllocationResult,
    PageCommit,
    PageCommitResult,
    PageExtension,
    PageExtensionResult,
    PageFree,
    PageFreeResult,
    PageRelease,
    PageReleaseResult,
    PoolSpec,
    PoolSummary,
    RegisterResult,
    StepOps,
    StepResults,
    StoreWriteOrder,
)
from kvserve.common.wire.tier import PAGE_VALUE_HEADER_BYTES, StoreLoad, StoreWrite, TierReport
from kvserve.common.wire.transfer import DEFAULT_LEASE_MS, UNCOMMITTED_BLOCK, PeerLoad, TransferDone
from kvserve.kvmanager.errors import UnknownRequest, UnknownWorker
from kvserve.kvmanager.fair_share import FairShare
from kvserve.kvmanager.hashing import chain_hashes
from kvserve.kvmanager.pins import PinTable
from kvserve.kvmanager.placement import Fit, Placement, fit, place
from kvserve.kvmanager.pool import Block, PagePool, releasing, with_groups
from kvserve.kvmanager.spec_checks import check_roles, check_spec
from kvserve.kvmanager.state import Changes, GroupPages, RequestPages, TenantCounters
from kvserve.kvmanager.step_validate import validate_step
from kvserve.kvmanager.tenants import CachePolicy
from kvserve.kvmanager.tier import StoreIndex
from kvserve.kvmanager.transfers import TransferHold, TransferTotals

RECENT_RESULTS = 1 << 16


class KVManager:
    """In-memory owner of every page. Not thread-safe: the servicer serialises calls."""

    def __init__(self, load_penalty_pages: int = 4, store_capacity_bytes: int = 0, policy: CachePolicy | None = None,
                 lease_ms: int = DEFAULT_LEASE_MS):
        self.pools: dict[str, PagePool] = {}
        self.lease_ms = lease_ms  # how long a pull's source pages are held at most
        self.transfers = TransferTotals()
        self.fair = FairShare(policy)  # who gives up pages and tier entries (fair share, or the global LRU)
        self.tier = StoreIndex(store_capacity_bytes, self.fair)  # the shared KV tier's index (capacity 0: off)
        self.pins = PinTable()
        self.now_ms = 0  # wall-clock time of the current call (set_time), for pins' TTLs and tenants' activity
        self.policy_logged = False  # the state (snapshot or log) records the policy its calls ran under
        # Per-tenant evictions of pools since dropped (a new epoch, a forgotten worker): the counters stay monotonic
        self.retired_evicted_from: dict[str, int] = {}
        self.retired_evicted_by: dict[str, int] = {}
        self.store_writes: list[StoreWriteOrder] = []  # asked for by this call's commits
        self.num_holds = 0  # live requests holding a pull's source pages (TransferHold)
        self.requests: dict[str, RequestPages] = {}
        self.stale: dict[str, RequestPages] = {}  # requests whose pool epoch was replaced
        self.tenants: dict[str, TenantCounters] = {}
        self.load_penalty_pages = load_penalty_pages
        self.clock = 0  # logical time, one tick per event: block.last_used orders the LRU across restarts
        self.changes = Changes()  # whether calls changed state since the last durable write (service.py)
        # Answers that no live request record can hold (frees, OUT_OF_PAGES allocations), for retried calls:
        # (kind, req_id) -> (step_id, result). Bounded; not persisted (after a restart such ops re-evaluate).
        self.recent: OrderedDict[tuple[str, str], tuple[int, object]] = OrderedDict()

    # -- registration ---------------------------------------------------------------------------------
    def register_worker(self, spec: PoolSpec, release_requests: bool = False) -> RegisterResult:
        """Registers a pool; a higher epoch replaces the old pool and voids its requests and blocks. The same
        epoch again changes nothing, unless ``release_requests``: the worker's scheduler has just started and
        holds no request there, so each request the pool holds (left by a scheduler that died) is freed as a
        free would (its committed blocks stay cached) and listed in released_req_ids.

        Raises InvalidRequest (bad sizes), StaleEpoch (older epoch, or a changed pool under the same epoch).
        """
        check_spec(spec)
        check_roles(self.pools, spec)
        old = self.pools.get(spec.worker_id)
        if old is not None:
            if spec.epoch < old.spec.epoch:
                raise StaleEpoch(f"worker {spec.worker_id!r}: epoch {spec.epoch} is older than the registered "
                                 f"epoch {old.spec.epoch}")
            if spec.epoch == old.spec.epoch:
                if spec != old.spec:
                    raise StaleEpoch(f"worker {spec.worker_id!r} epoch {spec.epoch} is already registered with "
                                     f"a different pool")
                released = self._release_requests(spec.worker_id) if release_requests else ()
                return RegisterResult(previous_epoch=spec.epoch, dropped_req_ids=(), released_req_ids=released)
        pool = PagePool(spec)  # first: if building it fails, the old pool is still whole
        dropped = self._drop_pool(old) if old is not None else ()
        self.pools[spec.worker_id] = pool
        self.changes.changed = True
        return RegisterResult(previous_epoch=old.spec.epoch if old else 0, dropped_req_ids=dropped)

    def req_ids_on(self, worker_id: str) -> tuple[str, ...]:
        """The live requests on a worker's pool, sorted (the order they are dropped or released in)."""
        return tuple(sorted(r.req_id for r in self.requests.values() if r.worker_id == worker_id))

    def _release_requests(self, worker_id: str) -> tuple[str, ...]:
        released = self.req_ids_on(worker_id)
        for req_id in released:
            self._free(PageFree(req_id))
        return released

    def _drop_pool(self, pool: PagePool) -> tuple[str, ...]:
        for group in with_groups([pool]):  # its sliding group's evictions too
            for retired, counts in ((self.retired_evicted_from, group.num_evicted_from),
                                    (self.retired_evicted_by, group.num_evicted_by)):
                for tenant, n in counts.items():
                    retired[tenant] = retired.get(tenant, 0) + n
            group.num_evicted_from, group.num_evicted_by = {}, {}  # counted once, even if it is dropped again
        worker_id = pool.spec.worker_id
        for req in self.requests.values():  # pulls from it: its pages are gone, the pulls fail and recompute
            if req.transfer is not None and req.transfer.worker_id == worker_id:
                req.transfer = None
                self.num_holds -= 1
                self.transfers.num_expired += 1  # ended unreported: its report finds no hold
        dropped = self.req_ids_on(worker_id)
        for req_id in dropped:
            req = self.stale[req_id] = self.requests.pop(req_id)
            self._end_transfer(req)  # its pull's source pages go back to their pool
        self.changes.changed = True
        return dropped

    def forget_pool(self, worker_id: str) -> tuple[str, ...]:
        """Removes a registered pool with its blocks and every request on it, live or stale (the worker may
        register again under any epoch: no record of it may outlive the pool). Returns the live req_ids."""
        pool = self.pool(worker_id)
        dropped = self._drop_pool(pool)  # live requests become stale, then go with the stale ones below
        for req_id in [r for r, req in self.stale.items() if req.worker_id == worker_id]:
            del self.stale[req_id]
        del self.pools[worker_id]
        return dropped

    def pool(self, worker_id: str) -> PagePool:
        if worker_id not in self.pools:
            raise UnknownWorker(f"no pool is registered for worker {worker_id!r}")
        return self.pools[worker_id]

    def request(self, req_id: str) -> RequestPages:
        if req_id not in self.requests:
            raise UnknownRequest(f"request {req_id!r} is not live (never allocated, freed, or reset)")
        return self.requests[req_id]

    # -- the step call --------------------------------------------------------------------------------
    def step(self, ops: StepOps) -> StepResults:
        """Applies one scheduler step's page ops. Raises InvalidRequest, UnknownWorker, UnknownRequest or
        StaleStep with nothing applied."""
        self.check(ops)
        return self.apply_checked(ops)

    def check(self, ops: StepOps) -> None:
        """step()'s validation alone: raises as step() does, changes nothing."""
        validate_step(self, ops)

    def apply_checked(self, ops: StepOps) -> StepResults:
        """step() without its validation, for ops that check() just accepted on this same state."""
        out = StepResults()
        sid = ops.step_id
        for t in ops.transfers:
            self._transfer_done(t)
        freeing = {f.req_id for f in ops.frees} if ops.frees and ops.commits else ()
        final = {c.req_id: self._replay_or(sid, "commit", c.req_id, self._commit, c)
                 for c in ops.commits if c.req_id in freeing}
        out.frees = [self._replay_or(sid, "free", f.req_id, self._free, f) for f in ops.frees]
        for req_id, result in final.items():  # its request is gone now: a retry finds the answer here
            self._remember("commit", req_id, sid, result)
        out.commits = [final[c.req_id] if c.req_id in final else
                       self._replay_or(sid, "commit", c.req_id, self._commit, c) for c in ops.commits]
        out.releases = [self._replay_or(sid, "release", r.req_id, self._release, r) for r in ops.releases]
        out.extensions = [self._replay_or(sid, "extend", e.req_id, self._extend, e) for e in ops.extensions]
        out.allocations = [self._replay_or(sid, "allocate", a.req_id, self._allocate, a)
                           for a in ops.allocations]
        if self.store_writes:  # a retried call asks for none: a block not written is only a miss later
            out.store_writes, self.store_writes = self.store_writes, []
        out.pools = [PoolSummary(w, p.spec.epoch, p.num_free, p.num_evictable) for w, p in sorted(self.pools.items())]
        return out

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def set_time(self, now_ms: int) -> list[bytes]:
        """The current call's time (it never goes back): soft pins due by then lapse, their blocks join the LRUs.
        Returns the lapsed blocks' hashes."""
        if now_ms > self.now_ms:
            self.now_ms = self.fair.now_ms = now_ms
        lapsed = self.pins.expire(self.now_ms) if self.pins else []
        for h in lapsed:
            self.mark_pinned(h, False)
        if lapsed:
            self.changes.changed = True
        if self.num_holds:
            self._expire_holds()
        return lapsed

    def set_policy(self, policy: CachePolicy) -> bool:
        """Applies another eviction policy (a restart or take-over configured differently), logged as a call of
        its own: a replay must evict, and hand out, the same pages as the calls did. Returns whether it changed."""
        self.policy_logged = True
        if policy == self.fair.policy:
            return False
        self.fair.policy = policy
        self.changes.changed = True
        return True

    def mark_pinned(self, block_hash: bytes, pinned: bool) -> None:
        """Sets the pin flag of a block in every pool (sliding groups included) that holds it and in the tier.
        Unpinned, it counts as used now (a reload orders the LRUs by last_used)."""
        for pool in with_groups(self.pools.values()):
            block = pool.index.get(block_hash)
            if block is not None and block.pinned != pinned:
                if not pinned:
                    pool.touch(block, self.tick())
                pool.set_pinned(block, pinned)
        self.tier.set_pinned(block_hash, pinned)

    def _replay_or(self, step_id: int, kind: str, req_id: str, apply, op):
        """The answer remembered for this (kind, req_id) from the call with this step_id, else apply(op)."""
        req = self.requests.get(req_id) or self.stale.get(req_id)
        if kind == "allocate" and req is not None and req.worker_id == op.moved_from != op.worker_id:
            return self._move(step_id, op)
        if req is not None and req.is_replay(kind, step_id):
            return req.last_ops[kind][1]
        remembered = self.recent.get((kind, req_id))
        if remembered is not None and remembered[0] == step_id:
            return remembered[1]
        result = apply(op)
        req = self.requests.get(req_id) or self.stale.get(req_id)
        if req is not None:
            req.last_ops[kind] = (step_id, result)
        else:
            self._remember(kind, req_id, step_id, result)
        return result

    def _move(self, step_id: int, op: PageAllocation) -> PageAllocationResult:
        """An allocation taking over the incarnation its prefill left on op.moved_from (live or stale). That
        incarnation's answers are another caller's, under its step_ids: none is replayed nor overwritten here.
        An answer that leaves it in place (not OK) is remembered apart, for a retry of this call."""
        remembered = self.recent.get(("move", op.req_id))
        if remembered is not None and remembered[0] == step_id:
            return remembered[1]
        result = self._allocate(op)
        if result.status == OpStatus.OK:
            self.requests[op.req_id].last_ops["allocate"] = (step_id, result)
        else:
            self._remember("move", op.req_id, step_id, result)
        return result

    def _remember(self, kind: str, req_id: str, step_id: int, result) -> None:
        """Remembers an answer as the newest; one already remembered for this call (a retry found it) stays
        where it is: a retry changes nothing, so it is not logged, and a restart's replay must end with the
        same answers in the same order."""
        key = (kind, req_id)
        if self.recent.get(key, (None,))[0] == step_id:
            return
        self.recent[key] = (step_id, result)
        self.recent.move_to_end(key)
        if len(self.recent) > RECENT_RESULTS:
            self.recent.popitem(last=False)

    # -- ops ------------------------------------------------------------------------------------------
    def _allocate(self, op: PageAllocation) -> PageAllocationResult:
        pool = self.pools[op.worker_id]
        moving = self.requests.get(op.req_id) if op.moved_from else None
        moved = moving is not None  # its prompt was counted where it prefilled
        if moved and moving.worker_id == op.worker_id:  # it decodes where it prefilled: its pages are pool hits
            self._free(PageFree(op.req_id))
            moving = None
        chosen = fit(pool, op, self.tier, self.pools)
        if chosen.num_pages_short:
            return PageAllocationResult(op.req_id, OpStatus.OUT_OF_PAGES, num_pages_short=chosen.num_pages_short)
        hits, seed, spec = chosen.hits, pool.seed_for(op.tenant), pool.spec
        own, pulled, stored = hits.pool, hits.pulled, hits.stored
        self.stale.pop(op.req_id, None)  # a re-queued request may reuse the id of its dropped incarnation
        # a sliding window's pool: the hits its first chunk does not read stay holes
        table = [HOLE] * hits.num
        pool_held = [i for i in chosen.held if i < len(own)]
        for i in pool_held:
            table[i] = own[i].page_id
        pool.acquire([own[i].page_id for i in pool_held])
        self._touch(own)
        self.fair.touch(op.tenant)
        fresh = pool.allocate(chosen.num_fresh, op.tenant, self.fair)
        filled = [i for i in chosen.held if i >= len(own)]  # peer and store hits it reads: fresh pages, filled
        for i, page_id in zip(filled, fresh, strict=False):
            table[i] = page_id
        table += fresh[len(filled):]
        first_stored = len(own) + len(pulled)
        peer = [PeerLoad(table[i], pulled[i - len(own)].page_id, pulled[i - len(own)].block_hash, seed)
                for i in filled if i < first_stored]
        loads = [StoreLoad(table[i], stored[i - first_stored], seed) for i in filled if i >= first_stored]
        page_size = spec.page_size
        num_committed, num_cached = len(own) * page_size, hits.num * page_size
        partial = self._partial_page(op, moving, chosen, pool) if peer else None
        if partial is not None:  # its prompt's last page, computed on the prefill worker, moves too
            peer.append(PeerLoad(table[partial[0]], partial[1], UNCOMMITTED_BLOCK, seed))
            num_cached = moving.num_prompt_tokens
        req = RequestPages(op.req_id, op.tenant, spec.worker_id, spec.epoch, table, seed,
                           [b.block_hash for b in own], len(op.token_ids), num_committed, op.skip_prefix_cache,
                           pins=op.pins)
        if pool.group is not None:
            req.group = self._allocate_group(pool.group, op, chosen)
        if peer:
            req.transfer = self._hold(hits.source, [pulled[i - len(own)] for i in filled if i < first_stored],
                                      [partial[1]] if partial is not None else [])
        if moving is not None:  # its prefill's incarnation: its pages are held for the pull now
            self._free(PageFree(op.req_id))
        if moved:
            self.transfers.num_moved += 1
        self.requests[op.req_id] = req
        if self.pins:  # a hit refreshes the pins of what it hit
            group_hit = req.group.block_hashes if req.group is not None else []
            for h in [*req.block_hashes, *(b.block_hash for b in pulled), *stored, *group_hit]:
                self.pins.refresh(h, self.now_ms)
        pool.num_requests += 1
        counters = self.tenants.setdefault(op.tenant, TenantCounters())
        if not op.skip_prefix_cache and not moved:
            counters.prefix_cache_queries += len(op.token_ids)
            counters.prefix_cache_hits += num_cached
        if stored:
            self.tier.touch(stored)
            self.tier.count_hits(op.tenant, len(stored), page_size)
        self.changes.changed = True
        result = PageAllocationResult(op.req_id, OpStatus.OK, spec.worker_id, spec.epoch, list(table), num_cached,
                                      store_loads=loads, num_committed_tokens=num_committed,
                                      num_pinned_tokens=self._take_pins(req, pool))
        if req.transfer is not None:
            result.peer_loads, result.peer_worker_id = peer, req.transfer.worker_id
            result.peer_epoch, result.lease_expires_ms = req.transfer.epoch, req.transfer.expires_ms
        if req.group is not None:
            result.group_page_table = list(req.group.page_table)
        return result

    def _allocate_group(self, group: PagePool, op: PageAllocation, chosen: Fit) -> GroupPages:
        """A grouped allocation's sliding layers' pages, as fit planned them: of the hit, the pages its first
        chunk reads (the others are holes), then fresh pages. Its chain is the hit's, held or not."""
        hashes = chosen.hits.group_hashes
        table = [HOLE] * len(hashes)
        blocks = [group.index[hashes[i]] for i in chosen.group_held]
        for i, block in zip(chosen.group_held, blocks, strict=True):
            table[i] = block.page_id
        group.acquire([b.page_id for b in blocks])
        self._touch(blocks)
        table += group.allocate(chosen.group_num_fresh, op.tenant, self.fair)
        group.num_requests += 1
        return GroupPages(table, group.seed_for(op.tenant), list(hashes))

    # -- transfers ----------------------------------------------------------------------------------------
    def _partial_page(self, op: PageAllocation, moving, chosen, pool: PagePool) -> tuple[int, int] | None:
        """A request moving from the prefill worker whose pool holds it (``moving``), which computed its whole
        prompt and sampled its first token (op.token_ids is the prompt and that token): its prompt's last page,
        not full and so never committed, is pulled with the others when they are all peer or pool hits. Returns
        (its index in the page table, its page on the source), or None."""
        hits, page_size = chosen.hits, pool.spec.page_size
        if moving is None or moving.worker_id == op.worker_id or pool.window.slides or hits.stored:
            return None
        computed = moving.num_prompt_tokens
        k = computed // page_size
        if len(op.token_ids) != computed + 1 or computed % page_size == 0 or hits.num != k or \
                hits.source is None or hits.source.spec.worker_id != moving.worker_id or \
                k >= len(moving.page_table) or moving.page_table[k] == HOLE:
            return None
        return k, moving.page_table[k]

    def _hold(self, source: PagePool, blocks: list, uncommitted: list[int] = ()) -> TransferHold:
        """Holds a pull's source pages (one more ref_cnt each) until it ends or the lease passes: the blocks',
        and ``uncommitted`` pages (a prompt's last, partial page, held by the incarnation being moved)."""
        page_ids = [b.page_id for b in blocks] + list(uncommitted)
        source.acquire(page_ids)
        self._touch(blocks)
        self.num_holds += 1
        self.transfers.num_pulls += 1
        self.transfers.num_pages += len(page_ids)
        return TransferHold(source.spec.worker_id, source.spec.epoch, page_ids, self.now_ms + self.lease_ms)

    def _end_transfer(self, req: RequestPages) -> bool:
        """Releases the request's hold on its pull's source pages, if it has one. Returns whether it had."""
        hold, req.transfer = req.transfer, None
        if hold is None:
            return False
        self.num_holds -= 1
        source = self.pools.get(hold.worker_id)
        if source is not None and source.spec.epoch == hold.epoch:
            self._touch(source.release(hold.page_ids))
        self.changes.changed = True
        return True

    def _transfer_done(self, t: TransferDone) -> None:
        """The gateway's report of a pull: its hold ends; counted once (a retried call finds no hold)."""
        req = self.requests.get(t.req_id)
        if req is None or req.transfer is None:
            return
        self._end_transfer(req)
        totals = self.transfers
        if t.ok:
            totals.num_ok += 1
        else:
            totals.num_failed += 1
        totals.num_bytes += t.num_bytes
        totals.seconds += t.seconds

    def _expire_holds(self) -> None:
        for req in self.requests.values():
            if req.transfer is not None and req.transfer.expires_ms <= self.now_ms:
                self._end_transfer(req)
                self.transfers.num_expired += 1

    def _extend(self, op: PageExtension) -> PageExtensionResult:
        if op.req_id in self.stale:
            return PageExtensionResult(op.req_id, OpStatus.STALE_EPOCH)
        req = self.requests[op.req_id]
        pool = self.pools[req.worker_id]
        # The request's tables and their pools: with page groups, the sliding layers' too. Atomically: short in
        # either, nothing is taken.
        tables = [(pool, req.page_table)] + ([(pool.group, req.group.page_table)] if req.group is not None else [])
        num_pages = num_pages_for(op.num_tokens, pool.spec.page_size)
        needs = [max(0, num_pages - len(table)) for _, table in tables]
        if not any(needs):
            return PageExtensionResult(op.req_id, OpStatus.OK, [], len(req.page_table))
        short = max(need - p.available() for (p, _), need in zip(tables, needs, strict=True))
        if short > 0:
            return PageExtensionResult(op.req_id, OpStatus.OUT_OF_PAGES, [], len(req.page_table), short)
        fresh = []
        for (p, table), need in zip(tables, needs, strict=True):
            fresh.append(p.allocate(need, req.tenant, self.fair) if need else [])
            table.extend(fresh[-1])
        self.changes.changed = True
        return PageExtensionResult(op.req_id, OpStatus.OK, fresh[0], len(req.page_table),
                                   group_new_page_ids=fresh[1] if req.group is not None else [])

    def _commit(self, op: PageCommit) -> PageCommitResult:
        if op.req_id in self.stale:
            return PageCommitResult(op.req_id, OpStatus.STALE_EPOCH)
        req = self.requests[op.req_id]
        if req.transfer is not None:  # a commit follows a pull that succeeded
            self._end_transfer(req)
        pool = self.pools[req.worker_id]
        page_size = pool.spec.page_size
        if not req.skip_prefix_cache:
            hashes = req.block_hashes
            prev = hashes[-1] if hashes else req.seed
            new = chain_hashes(prev, op.token_ids, page_size)
            added = self._cache_chain(pool, req.tenant, req.page_table, prev, new, len(hashes))
            self._flag_pinned(pool, added)
            if pool.spec.kv_store and self.tier.enabled:
                self._order_writes(pool, req, added)
            hashes.extend(new)
            if req.group is not None:  # the same token blocks, in the sliding group under its own chain
                g = req.group
                prev = g.block_hashes[-1] if g.block_hashes else g.seed
                new = chain_hashes(prev, op.token_ids, page_size)
                self._flag_pinned(pool.group, self._cache_chain(pool.group, req.tenant, g.page_table, prev, new,
                                                                len(g.block_hashes)))
                g.block_hashes.extend(new)
        req.num_committed_tokens += len(op.token_ids)
        self.fair.touch(req.tenant)
        self.changes.changed = True
        return PageCommitResult(op.req_id, OpStatus.OK, req.num_committed_tokens, self._take_pins(req, pool))

    def _flag_pinned(self, pool: PagePool, added: list[Block]) -> None:
        """A block pinned while elsewhere (another pool, the tier, or evicted) is pinned here too."""
        if self.pins:
            for b in added:
                if b.block_hash in self.pins:
                    pool.set_pinned(b, True)

    def _cache_chain(self, pool: PagePool, tenant: str, table: list[int], prev: bytes, new: list[bytes],
                     first: int) -> list[Block]:
        """Indexes a chain's new blocks ``new`` (after ``prev``, from block ``first``) in the pages of ``table``
        at their positions, one clock tick each. Returns those indexed."""
        clock, k = self.clock, len(new)
        pages = table[first:first + k]
        blocks = list(map(Block, new, [prev, *new[:-1]], repeat(tenant, k), pages, range(first, first + k),
                          range(clock + 1, clock + k + 1)))
        self.clock += k
        if HOLE in pages:  # a late commit of pages its window released: the chain goes on, without their blocks
            blocks = [b for b in blocks if b.page_id != HOLE]
        return pool.cache_blocks(blocks)

    # -- pins -------------------------------------------------------------------------------------------
    # Pins follow the full layers' chain. On a grouped pool a pin that reaches its end also pins, in the sliding
    # group, the window its last block's successor reads (pin_window): what a hit on the whole pinned prefix
    # needs (placement.joint_hit), and no more, so a pinned prefix holds a window of sliding pages, not its length.
    def _take_pins(self, req: RequestPages, pool: PagePool) -> int:
        """Pins the request's chain as far as its pins reach and its chain goes, each block with the longest TTL
        of the pins covering it, until its tenant's pin budget is spent. Returns its pinned prompt tokens."""
        page_size = pool.spec.page_size
        if not req.pins:
            return 0
        reach = [((p.num_tokens or req.num_prompt_tokens) // page_size, p.ttl_s * 1000) for p in req.pins]
        target = max(n for n, _ in reach)
        end = min(target, len(req.block_hashes))
        if req.num_pinned_blocks >= end:  # most commits of a pinned request: nothing new, no budget to judge
            return req.num_pinned_blocks * page_size
        room = self.pin_budget(req.tenant, pool) - self.pins.num_soft.get(req.tenant, 0)
        while req.num_pinned_blocks < end:
            i = req.num_pinned_blocks
            left = self.take_pin(req.block_hashes[i], req.tenant, max(ttl for n, ttl in reach if n > i), room)
            if left is None:
                break  # over budget: the rest of its prefix stays unpinned (its answer says how far it got)
            room = left
            req.num_pinned_blocks += 1
        if req.group is not None and req.num_pinned_blocks == target:  # the whole reach pinned: its window too
            ttl_ms = max(ttl for n, ttl in reach if n == target)
            self.pin_window(pool.group, req.tenant, req.group.block_hashes, target, ttl_ms, room)
        return req.num_pinned_blocks * page_size

    def take_pin(self, block_hash: bytes, tenant: str, ttl_ms: int, room: int) -> int | None:
        """Pins one block (ttl_ms 0: an operator's pin, outside any budget), or refreshes its pin. A new soft pin
        takes one of ``room``, the tenant's pin budget left. Returns the room left, or None when a new soft pin
        found none (nothing pinned)."""
        is_new = block_hash not in self.pins
        if is_new and ttl_ms and room <= 0:
            return None
        self.pins.add(block_hash, tenant, ttl_ms, self.now_ms)
        if is_new:
            self.mark_pinned(block_hash, True)
        return room - is_new

    def pin_window(self, group: PagePool, tenant: str, hashes: list[bytes], n: int, ttl_ms: int, room: int) -> int:
        """Pins a sliding group's blocks (of the chain ``hashes``) that the query after ``n`` blocks reads, while
        ``room`` (the tenant's pin budget left) allows new soft pins. Returns the room left."""
        page_size = group.spec.page_size
        for h in hashes[group.window.first_page_read(n * page_size, page_size):n]:
            left = self.take_pin(h, tenant, ttl_ms, room)
            if left is None:
                break
            room = left
        return room

    def pin_budget(self, tenant: str, pool: PagePool) -> int:
        """Blocks the tenant's soft pins may hold, judged on ``pool``: its pages, and with the shared tier, the
        values that fit in its tier pin budget."""
        budget = self.fair.pin_budget(tenant, pool.spec.num_pages)
        if self.tier.enabled and pool.spec.kv_store:
            value_bytes = pool.spec.bytes_per_token * pool.spec.page_size + PAGE_VALUE_HEADER_BYTES
            budget = min(budget, self.fair.store_pin_budget(tenant, self.tier.capacity_bytes) // value_bytes)
        return budget

    def _order_writes(self, pool: PagePool, req: RequestPages, blocks: list[Block]) -> None:
        """Asks the committing worker to write the new blocks the store lacks (it copies them before its next
        step computes, and reports what landed)."""
        tier, worker_id = self.tier, pool.spec.worker_id
        self.store_writes += [StoreWriteOrder(worker_id, StoreWrite(b.page_id, b.block_hash, req.seed, req.tenant))
                              for b in blocks if b.block_hash not in tier]

    # -- the shared KV tier ---------------------------------------------------------------------------
    def report_tier(self, report: TierReport) -> tuple[int, int]:
        """A worker's ReportTier: records the values the store acknowledged (LRU within capacity), drops the
        entries whose values were found absent or damaged, sums its counters. Returns (added, evicted)."""
        tier = self.tier
        added, evicted = tier.add(list(report.written), self.pins)
        tier.drop_missing(report.missing)
        tier.totals.workers = tier.totals.workers + report.counters
        self.changes.changed = True
        return added, evicted

    def _free(self, op: PageFree) -> PageFreeResult:
        if op.req_id in self.stale:
            del self.stale[op.req_id]
            self.changes.changed = True
            return PageFreeResult(op.req_id, OpStatus.STALE_EPOCH)
        req = self.requests.pop(op.req_id, None)
        if req is None:
            return PageFreeResult(op.req_id, OpStatus.OK)  # freeing twice is harmless
        self._end_transfer(req)
        pool = self.pools[req.worker_id]
        self._release_table(pool, req.page_table)
        if req.group is not None:
            self._release_table(pool.group, req.group.page_table)
        self.changes.changed = True
        return PageFreeResult(op.req_id, OpStatus.OK)

    def _release_table(self, pool: PagePool, table: list[int]) -> None:
        """A freed request's pages in one pool. Tail first: the chain's end is evicted first. Blocks joining the
        LRU get their place in it stamped."""
        pages = reversed(table)
        if HOLE in table:  # what its window released is not held any more
            pages = [p for p in pages if p != HOLE]
        self._touch(pool.release(pages))
        pool.num_requests -= 1

    def _release(self, op: PageRelease) -> PageReleaseResult:
        if op.req_id in self.stale:
            return PageReleaseResult(op.req_id, OpStatus.STALE_EPOCH)
        req = self.requests[op.req_id]
        pool, table = releasing(self.pools[req.worker_id], req)
        pages = [table[i] for i in op.page_indices if table[i] != HOLE]  # in the order given; each index once
        if not pages:
            return PageReleaseResult(op.req_id, OpStatus.OK, 0)
        for i in op.page_indices:
            table[i] = HOLE
        self._touch(pool.release(pages))  # committed pages join the LRU still indexed: they can still be hit
        pool.num_window_released += len(pages)
        self.changes.changed = True
        return PageReleaseResult(op.req_id, OpStatus.OK, len(pages))

    def _touch(self, blocks: list[Block]) -> None:
        """Stamps blocks as used now, one clock tick each in order (recovery derives an LRU order from it)."""
        clock = self.clock
        for block in blocks:
            clock += 1
            block.last_used = clock
        self.clock = clock

    # -- placement ------------------------------------------------------------------------------------
    def place(self, tenant: str, token_ids: tuple[int, ...], num_queued: dict[str, int],
              exclude: frozenset[str] = frozenset(), only: tuple[str, ...] = (),
              pull_peers: bool = False) -> Placement:
        """Where a new request should be queued (placement.py's rule), with the caller's queued requests counted
        as load, over the pools of ``only`` (all when empty) but those of ``exclude`` (draining workers); every
        pool is a peer to pull from with ``pull_peers``. No side effect. Raises InvalidRequest, UnknownWorker."""
        pools = {w: p for w, p in self.pools.items() if w not in exclude and (not only or w in only)}
        if self.pools and not pools:
            what = "worker of those asked for" if only else "registered worker"
            raise UnknownWorker(f"every {what} is draining or gone: nowhere to place a new request")
        return place(pools, tenant, token_ids, num_queued, self.load_penalty_pages, self.tier,
                     self.pools if pull_peers else None)
