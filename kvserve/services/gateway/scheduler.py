"""Iteration-level scheduling for one worker: which requests compute how many tokens in the next step, and the
page operations that step needs. Pure Python: no gRPC, no clocks, no threads.

One step, in three calls (the engine loop does the I/O between them):

    out   = scheduler.schedule()            running first (decode or the next prefill chunk), then waiting
                                            (FCFS) under max_num_seqs and max_num_batched_tokens; out.ops is
                                            the step's page operations for one kvmanager round trip
    batch = scheduler.assign(out, results)  applies the kvmanager's answer: admitted requests get page tables
                                            and num_cached_tokens; an extension out of pages preempts the
                                            newest running request (recompute later; its blocks stay cached)
    done  = scheduler.update(batch, sampled, stopped)
                                            appends sampled tokens and ends requests at EOS, a stop string
                                            (``stopped``: the engine's text streams saw one) or a length limit

Every finish reason is decided here: those three by update(), CANCELLED by cancel(), ERROR by fail(), and
finish() is the only writer of a request's finish_reason (through finish_unheld(), which also ends a request
no scheduler holds). Nothing outside this module writes the scheduler's fields: the engine core asks it
(add, take_waiting, reset, the counts), and a test checks it by reading the code.

Finished, cancelled and preempted requests are freed by the next step's page operations, together with the
commit of the pages they filled since their last one.

A step calls the kvmanager only when it must: to free, to admit, to extend a request that has no slot left for
this step, or to commit prompt pages (so that a request arriving next finds them). Pages filled by decoding ride
along with the next call, and every call tops up each running request that has less than a page of headroom
with one more page (while the pool has spare pages), so that decoding sequences cross page boundaries without
a round trip. A decode-only step mostly has nothing to ask: out.ops is None, and the engine skips the call.

A call that changes nothing this step computes (out.can_overlap) is sent while the worker computes: the engine
builds the batch with assign(out, StepResults()) and applies the answer with apply_late(out, results) before
update(). Such a call commits and tops up headroom. With reserve_ahead (the engine's default) it also frees and
admits: when the running requests can compute this step without a page they do not hold, the waiting requests
admitted by this call are reserved ahead, for the next step (out.ahead). They compute their first chunk one
step later than an in-series admission would, and in exchange no step waits on the kvmanager for them, which
matters when a step takes a few milliseconds (a GPU decode) and the call one or two::

    step N:     [ worker computes the running requests        ]
                [ StepPages: commit, headroom, free, allocate ]    (in parallel; answered before step N's tokens)
    step N+1:   [ worker computes the running + the admitted  ]

With nothing running there is nothing to hide behind: an admission is answered first and computes at once.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field, replace

from kvserve.common.attention_window import FULL_ATTENTION, AttentionWindow
from kvserve.common.pages import HOLE, num_pages_for
from kvserve.common.wire.pages import (
    OpStatus,
    PageAllocation,
    PageCommit,
    PageExtension,
    PageFree,
    PageRelease,
    StepOps,
    StepResults,
)
from kvserve.common.wire.transfer import TransferDone
from kvserve.common.wire.worker import SampledToken, StepBatch, StepItem
from kvserve.services.gateway.errors import OutOfCapacity
from kvserve.services.gateway.request import FinishReason, Request, RequestStatus
from kvserve.services.gateway.tier_rates import TierRates


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    worker_id: str
    page_size: int
    num_pages: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    max_num_seqs: int = 64  # running requests at once
    max_num_batched_tokens: int = 512  # tokens computed per step: decodes + prefill chunks
    prefix_caching: bool = True
    # In a step that also decodes, a prefill chunk computes at most this many tokens (0: no cap), so that a
    # long prompt's chunks do not stretch every running request's time per output token to a full budget's
    # prefill. vLLM's option of this name caps every chunk; here only chunks that share a step with decodes.
    long_prefill_token_threshold: int = 0
    # The worker's attention window (sliding window and sinks). A running request's pages that hold only
    # positions before its window are released as it advances (holes in its page table); an admission holds
    # only the pages its first chunk reads.
    window: AttentionWindow = FULL_ATTENTION
    # A worker with page groups (WorkerInfo.sliding_group_pages): the window of its sliding layers. window above
    # is then full attention (the full layers keep every page); the pages a request's sliding layers no longer
    # read are released from its group_page_table instead, and an admission holds only the pages of it that its
    # first chunk reads.
    group_window: AttentionWindow = FULL_ATTENTION
    # Admissions and frees ride with the call made while the worker computes, whenever this step's running
    # requests need no page they lack (the module docstring); off, only commits and headroom do. The engine
    # turns it on when it overlaps page ops with compute; a caller that answers every call before computing
    # (assign with the answer, no apply_late) leaves it off.
    reserve_ahead: bool = False
    # Pages of a prefix another worker's pool holds may be pulled instead of recomputed (the engine pulls them
    # before the request's first chunk; the kvmanager decides per request from the measured costs).
    pull_peers: bool = False

    @property
    def releasing(self) -> AttentionWindow:
        """The window whose pages running requests release: the sliding group's on a grouped worker."""
        return self.group_window if self.group_window.slides else self.window


@dataclass(slots=True)
class Chunk:
    """Tokens [start_pos, start_pos + num_tokens) of a request to compute in this step."""

    req: Request
    num_tokens: int
    start_pos: int = 0
    admitted: bool = False  # the first chunk of an admission: start_pos is the prefix cache's hit


@dataclass(slots=True)
class SchedulerOutput:
    ops: StepOps | None  # None: this step needs no kvmanager call
    running: list[Chunk]  # already running; those with an extension wait for its answer
    admitted: list[Chunk]  # waiting requests asking for an allocation; num_tokens is the budget reserved
    headroom_only: frozenset[str] = frozenset()  # extensions this step could do without (out of pages: no-op)
    ahead: bool = False  # the admitted compute next step: this call runs while the running requests compute

    @property
    def can_overlap(self) -> bool:
        """Whether the worker can compute this step before the kvmanager answers: the call extends nobody past
        their pages (headroom only), and either reserves ahead (its admissions compute next step; its frees
        are answered before this step's tokens, and a finished request's last delta waits for them) or admits
        and frees nobody."""
        ops = self.ops
        return (ops is not None and all(e.req_id in self.headroom_only for e in ops.extensions)
                and (self.ahead or not (ops.allocations or ops.frees)))


@dataclass(slots=True)
class ScheduledBatch:
    chunks: list[Chunk]
    failed: list[Request] = field(default_factory=list)  # finished with an error by assign()

    def to_step(self, epoch: int, store_writes: tuple = ()) -> StepBatch:
        items = tuple(StepItem(c.req.req_id, c.req.token_ids(c.start_pos, c.start_pos + c.num_tokens),
                               c.start_pos, tuple(c.req.page_table), sample=c.start_pos + c.num_tokens ==
                               c.req.num_tokens, sampling=c.req.params.sampling,
                               store_loads=c.req.store_loads if c.admitted else (),
                               group_page_table=tuple(c.req.group_page_table)) for c in self.chunks)
        return StepBatch(items=items, epoch=epoch, store_writes=store_writes)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last is preempted first
        self.pending_frees: list[str] = []
        self.final_commits: list[PageCommit] = []  # of requests in pending_frees: the pages they filled last
        self.finishing: dict[str, Request] = {}  # requests of final_commits, for the pins their answers report
        self.requests: dict[str, Request] = {}  # every request not finished, by req_id
        self.num_available_pages = cfg.num_pages  # free + evictable, as of the last answer
        self._step_ids = itertools.count(1)
        self.num_preemptions = 0
        self.preempted: list[Request] = []  # by the last assign(), for the engine's metrics and spans
        self.tier = TierRates()  # the worker's measured load and prefill costs (the engine core updates them)
        self.pulls: list[Request] = []  # allocated with peer_loads by the last assign: the core starts their pulls
        self.transfers: list[TransferDone] = []  # pulls that ended, for the next call (their sources' holds)

    # -- requests in and out ----------------------------------------------------------------------------
    def add(self, req: Request, first: bool = False) -> None:
        """Queues a request; ``first``: ahead of the others, as a preempted one is (a request handed over from
        a lost worker had its turn already)."""
        assert req.req_id not in self.requests, f"duplicate req_id {req.req_id}"
        self.requests[req.req_id] = req
        if first:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def cancel(self, req: Request) -> bool:
        """Ends a request the client cancelled (or whose deadline passed, or that the gateway's stop cut short).
        Returns as finish()."""
        return self.finish(req, FinishReason.CANCELLED)

    def fail(self, req: Request, error: Exception) -> bool:
        """Ends a request that cannot be served (``error`` says why). Returns as finish()."""
        return self.finish(req, FinishReason.ERROR, error)

    def finish(self, req: Request, reason: FinishReason, error: Exception | None = None) -> bool:
        """Ends a request wherever it is; a running one's pages are freed by the next step. Returns whether a
        free of its pages is queued: False for a request that holds none (queued, never admitted or preempted
        with its free already sent), whose end needs no page op to wait for. A request ends once: a later call
        changes nothing."""
        if req.status is RequestStatus.FINISHED:
            return req.req_id in self.pending_frees
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            if not req.pulling:  # a pull still writes into its pages: they are freed once it ends (pulled)
                self._queue_free(req, commit=reason is not FinishReason.ERROR)
        elif req in self.waiting:
            self.waiting.remove(req)
        else:  # between schedule() and assign(): its allocation may have been applied
            self.pending_frees.append(req.req_id)
        self.requests.pop(req.req_id, None)
        self.finish_unheld(req, reason, error)
        return req.req_id in self.pending_frees

    @staticmethod
    def finish_unheld(req: Request, reason: FinishReason, error: Exception | None = None) -> None:
        """Ends a request that no scheduler holds (handed over from a lost worker and parked, waiting for a live
        one): the write finish() ends with, and the only writer of a request's finish_reason."""
        req.status, req.finish_reason, req.error = RequestStatus.FINISHED, reason, error

    def _queue_free(self, req: Request, commit: bool = True) -> None:
        """Its pages go back with the next call, after the commit of those it filled since its last one (none for a
        request that failed: what it computed last is not trusted to the cache)."""
        self.pending_frees.append(req.req_id)
        commit = self._commit_for(req) if commit else None
        if commit is not None:
            self.final_commits.append(commit)
            self.finishing[req.req_id] = req

    def resend_frees(self, out: SchedulerOutput) -> None:
        """The page-ops call of ``out`` failed: its frees go out again with the next one (its commits do not:
        they only make a cache entry, and the kvmanager may have applied them)."""
        if out.ops is not None:
            self.pending_frees.extend(f.req_id for f in out.ops.frees)
            self.transfers.extend(out.ops.transfers)

    def drop_final_commits(self) -> None:
        """Forgets the commits queued with pending frees (after a page-ops call whose answer was lost: it may
        have been applied, and a commit computed before it would be refused as out of order). Only cache entries
        are lost."""
        self.final_commits, self.finishing = [], {}

    def abandon_frees(self) -> int:
        """Forgets the frees still to send (the engine stops, and the kvmanager cannot be reached); their pages
        stay allocated there until the worker's pool is registered again. Returns how many."""
        num = len(self.pending_frees)
        self.pending_frees, self.final_commits, self.finishing = [], [], {}
        return num

    def skip(self, batch: ScheduledBatch) -> None:
        """The worker computed none of ``batch`` (it refused the step): each request computes the same tokens
        in a later step, an admission's first chunk still as its first. ``batch`` is emptied."""
        for chunk in batch.chunks:
            chunk.req.admitted_ahead = chunk.req.admitted_ahead or chunk.admitted
        batch.chunks.clear()

    def undo(self, out: SchedulerOutput, refused_req_id: str) -> None:
        """The kvmanager refused ``out.ops`` for ``refused_req_id`` and applied none of it (its frees are already
        queued again by resend_frees): the admissions go back to the head of the queue, and the refused request's
        own free is not sent again (it was what the kvmanager refused, or the request fails and frees anew)."""
        for chunk in reversed(out.admitted):
            if chunk.req.status is RequestStatus.WAITING and chunk.req.req_id in self.requests:
                self.waiting.appendleft(chunk.req)
        self.pending_frees = [r for r in self.pending_frees if r != refused_req_id]

    def resize(self, num_pages: int) -> None:
        """The worker came back with a pool of ``num_pages`` pages (its requests were preempted first)."""
        self.cfg = replace(self.cfg, num_pages=num_pages)

    def preempt_all(self) -> None:
        """Every running request back to the queue for recompute (the worker restarted: its pages are gone)."""
        for req in list(self.running):
            self.preempt(req)

    def has_work(self) -> bool:
        """Anything to schedule: a request pulling its pages is not, until its pull ends."""
        return bool(self.waiting or self.pending_frees or self.transfers
                    or any(not r.pulling and not r.prefilled for r in self.running))

    # -- pulls and hand-offs (disaggregated serving) ----------------------------------------------------
    def pulled(self, req: Request, pull_seq: int, done: TransferDone) -> None:
        """Its pull number ``pull_seq`` ended (``done``): on success it computes from the next step; on failure it
        frees its pages and queues first, to be admitted again without peer hits. Reported with the next call.
        A pull of an earlier incarnation (its worker restarted meanwhile: its pages went with the old pool, and
        their hold with their free) changes nothing and is not reported: it could end a newer pull's hold."""
        if not req.pulling or req.pull_seq != pull_seq:
            return
        self.transfers.append(done)
        req.pulling = False
        if req.status is RequestStatus.FINISHED:  # cancelled while it pulled: its pages can go back now
            self.pending_frees.append(req.req_id)
            return
        if not done.ok:
            req.skip_peers = True
            self.preempt(req)
            self.num_preemptions -= 1  # a recompute, not a preemption for pages

    def take_pulls(self) -> list[Request]:
        """The requests allocated with peer_loads since the last call: their pulls start now."""
        pulls, self.pulls = self.pulls, []
        return pulls

    def take_prefilled(self) -> list[Request]:
        """The requests whose prefill is done and committed here (a prefill worker): they leave this scheduler
        holding their pages, which their decode worker's allocation takes over (moved_from) and frees."""
        done = [r for r in self.running if r.prefilled]
        for req in done:
            self.running.remove(req)
            del self.requests[req.req_id]
        return done

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_queued(self) -> int:
        """Unfinished requests that hold no pages (read from other threads: a snapshot). A waiting request being
        admitted is out of ``waiting`` for the length of a kvmanager call, and still queued."""
        return len(self.requests) - len(self.running)

    def take_waiting(self) -> list[Request]:
        """Takes the queued requests out (they hold no pages), in their order: they leave this worker."""
        waiting = list(self.waiting)
        for req in waiting:
            del self.requests[req.req_id]
        self.waiting.clear()
        return waiting

    def reset(self) -> None:
        """Forgets every request and page op (the worker's pool is gone: what they held lived on it); the step_id
        sequence goes on."""
        self.waiting.clear()
        self.running, self.pending_frees, self.final_commits, self.preempted = [], [], [], []
        self.finishing = {}
        self.requests = {}
        self.num_available_pages = self.cfg.num_pages

    # -- 1. schedule ------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """At most one request under suspicion (num_failed_steps: its last step failed without an answer for it)
        computes per step, beside the requests that are not; the other suspects wait their turn (a running one
        sits the step out, a queued one at the head holds the queue for a step). So a request that breaks its
        steps is the only suspect in its second failed step, and fails there, while the requests it shared the
        first one with are cleared one by one, and the rest runs on."""
        suspect = next((r for r in self.running if r.num_failed_steps), None)
        computing = [r for r in self.running if (not r.num_failed_steps or r is suspect) and not r.pulling
                     and r.num_uncomputed_tokens > 0]
        return self._schedule(computing, suspect is not None)

    def _schedule(self, computing: list[Request], suspect_computing: bool) -> SchedulerOutput:
        page_size = self.cfg.page_size
        budget = self.cfg.max_num_batched_tokens
        frees = tuple(PageFree(r) for r in self.pending_frees)
        freeing = set(self.pending_frees)
        final_commits, self.pending_frees, self.final_commits = self.final_commits, [], []
        commits = [c for c in map(self._commit_for, self.running) if c is not None]
        running, extensions, pages_needed = [], [], 0
        cap = self._prefill_cap()
        for req in computing:
            if budget == 0:
                break
            n = min(req.num_uncomputed_tokens, budget, cap)
            budget -= n
            running.append(Chunk(req, n, req.num_computed_tokens, admitted=req.admitted_ahead))
            end = req.num_computed_tokens + n
            if end > req.num_covered_pages * page_size:
                extensions.append(PageExtension(req.req_id, end))
                pages_needed += max(0, num_pages_for(end, page_size) - len(req.page_table))
        releases = self._releases(running)
        spare = self.num_available_pages - pages_needed + sum(len(r.page_indices) for r in releases)
        admitted = self._admit(budget, spare, freeing, cap, suspect_computing)
        prompt_commits = any(c.start_pos < len(self.requests[c.req_id].prompt_token_ids) for c in commits)
        transfers, self.transfers = tuple(self.transfers), []
        if not (frees or admitted or extensions or prompt_commits or releases or transfers):
            return SchedulerOutput(None, running, admitted)
        spare -= sum(self._pages_needed(c.req, c.num_tokens) for c in admitted)
        extensions, headroom_only = self._with_headroom(running, extensions, spare)
        chunk = (lambda c: c.num_tokens) if self.cfg.releasing.slides else (lambda c: 0)  # dense: the whole prompt
        tier, skip_store = self.tier, self.tier.skip_store
        allocations = tuple(PageAllocation(c.req.req_id, c.req.tenant, tuple(c.req.all_token_ids), self.cfg.worker_id,
                                           skip_prefix_cache=not self.cfg.prefix_caching, chunk_tokens=chunk(c),
                                           skip_store=skip_store or c.req.skip_store,
                                           load_s_per_page=tier.load_s_per_page,
                                           prefill_s_per_token=tier.prefill_s_per_token, pins=c.req.pins,
                                           pull_peers=self.cfg.pull_peers and not c.req.skip_peers,
                                           pull_s_per_page=tier.pull_s_per_page, moved_from=c.req.moved_from)
                            for c in admitted)
        ops = StepOps(next(self._step_ids), allocations, tuple(extensions), tuple(final_commits + commits), frees,
                      releases, transfers)
        ahead = self.cfg.reserve_ahead and bool(running) and all(e.req_id in headroom_only for e in extensions)
        return SchedulerOutput(ops, running, admitted, headroom_only, ahead)

    def _releases(self, running: list[Chunk]) -> tuple[PageRelease, ...]:
        """With a sliding window: each running request's pages before the window of this step's first position
        (its sink pages and its last page stay); on a grouped worker, those of its sliding layers' table."""
        window, page_size, out = self.cfg.releasing, self.cfg.page_size, []
        for chunk in running:
            table = chunk.req.sliding_table
            gone = [k for k in window.releasable_pages(chunk.start_pos, page_size)
                    if window.may_release(k, len(table), page_size) and table[k] != HOLE]
            if gone:
                out.append(PageRelease(chunk.req.req_id, tuple(gone)))
        return tuple(out)

    def _pages_needed(self, req: Request, chunk_tokens: int) -> int:
        """Pages an admission takes at most (as if nothing hit the cache): the whole request, or with a window
        its sinks and the first chunk's window."""
        return self.cfg.window.max_pages_held(req.num_tokens, self.cfg.page_size, chunk_tokens)

    def _with_headroom(self, running: list[Chunk], extensions: list[PageExtension],
                       spare: int) -> tuple[list[PageExtension], frozenset[str]]:
        """This step's extensions, each running request topped up to a page of headroom past this step (never
        past the last position it can compute), while that takes at most half the spare pages."""
        page_size = self.cfg.page_size
        needed = {e.req_id: e.num_tokens for e in extensions}
        out, headroom_only, budget = [], set(), max(spare, 0) // 2
        for chunk in running:
            req = chunk.req
            end = chunk.start_pos + chunk.num_tokens
            last = min(req.prefill_until or len(req.prompt_token_ids) + req.params.max_tokens - 1,
                       self.cfg.max_model_len,
                       # the kvmanager refuses a call extending past its pool (a window's holes hold no page)
                       self.cfg.window.max_request_tokens(self.cfg.max_model_len, self.cfg.num_pages * page_size))
            target = max(end, min(end + page_size, last))
            have = max(req.num_covered_pages, num_pages_for(needed.get(req.req_id, 0), page_size))
            extra = num_pages_for(target, page_size) - have
            if 0 < extra <= budget:
                budget -= extra
                out.append(PageExtension(req.req_id, target))
                if req.req_id not in needed:
                    headroom_only.add(req.req_id)
            elif req.req_id in needed:
                out.append(PageExtension(req.req_id, needed[req.req_id]))
        return out, frozenset(headroom_only)

    def _prefill_cap(self) -> int:
        """The most tokens one prefill chunk computes this step: long_prefill_token_threshold when a running
        request decodes in it (and the threshold is set), else the whole budget. A decode's one token is never
        capped."""
        threshold = self.cfg.long_prefill_token_threshold
        decoding = any(r.num_computed_tokens >= len(r.prompt_token_ids) for r in self.running)
        return threshold if threshold > 0 and decoding else self.cfg.max_num_batched_tokens

    def _commit_for(self, req: Request) -> PageCommit | None:
        """The request's pages that became full since its last commit, if prefix caching is on (none while its
        pages from the store are not loaded yet: they are committed once its first chunk computed)."""
        if not self.cfg.prefix_caching or req.store_loads or req.peer_loads:
            return None
        full = req.num_computed_tokens // self.cfg.page_size * self.cfg.page_size
        if full <= req.num_committed_tokens:
            return None
        tokens = req.token_ids(req.num_committed_tokens, full)
        return PageCommit(req.req_id, req.num_committed_tokens, tokens, req.num_computed_tokens)

    def _admit(self, budget: int, available: int, freeing: set[str], cap: int, suspect_taken: bool) -> list[Chunk]:
        """Waiting requests, first come first served, while sequences, tokens and (pessimistically, as if
        nothing hit the cache) pages last, and at most one suspect in the step (``suspect_taken``: a running one
        computes in it). With nothing running, the first one is always tried."""
        admitted: list[Chunk] = []
        while self.waiting and budget > 0 and len(self.running) + len(admitted) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            if req.req_id in freeing:  # a free and an allocation of one req_id cannot share a call
                break
            if req.num_failed_steps:
                if suspect_taken:
                    break
                suspect_taken = True
            n = min(req.num_tokens, budget, cap)
            need = self._pages_needed(req, n)
            if need > available and (self.running or admitted):
                break
            self.waiting.popleft()
            budget -= n
            available -= need
            admitted.append(Chunk(req, n))
        return admitted

    # -- 2. assign --------------------------------------------------------------------------------------
    def assign(self, out: SchedulerOutput, results: StepResults) -> ScheduledBatch:
        """Applies the kvmanager's answer to ``out.ops`` and returns what the worker computes this step."""
        self.preempted = []
        self._apply_pools_and_commits(out, results)
        skipped = self._apply_extensions(results, out.headroom_only)
        chunks = [c for c in out.running if c.req.status is RequestStatus.RUNNING and c.req.req_id not in skipped]
        batch = ScheduledBatch(chunks)
        if not out.ahead:
            self._apply_allocations(out.admitted, results, batch)
        return batch

    def apply_late(self, out: SchedulerOutput, results: StepResults) -> None:
        """The answer to a call that ran while the worker computed (out.can_overlap; the batch came from
        assign(out, StepResults())), applied before update(): commits, headroom pages and, reserved ahead,
        admissions, which start running and compute their first chunk next step. A headroom page the pool could
        not give is no loss; an admission that did not fit waits at the head of the queue; a stale epoch fails
        the worker's step as well, and the engine then re-registers and recomputes."""
        assert out.can_overlap, "apply_late is for calls made while the worker computes (out.can_overlap)"
        self._apply_pools_and_commits(out, results)
        for e in results.extensions:
            req = self.requests.get(e.req_id)
            if e.status is OpStatus.OK and req is not None and req.status is RequestStatus.RUNNING:
                req.extend_pages(e)
        if out.admitted:
            self._apply_allocations(out.admitted, results, None)

    def _apply_pools_and_commits(self, out: SchedulerOutput, results: StepResults) -> None:
        for pool in results.pools:
            if pool.worker_id == self.cfg.worker_id:
                self.num_available_pages = pool.num_free_pages + pool.num_evictable_pages
        freed = {f.req_id for f in out.ops.frees} if out.ops is not None else ()
        for c in results.commits:
            req = self.requests.get(c.req_id) or self.finishing.pop(c.req_id, None)
            if c.status is not OpStatus.OK or req is None:
                continue
            req.num_pinned_tokens = max(req.num_pinned_tokens, c.num_pinned_tokens)  # usage reports it once freed
            if c.req_id not in freed:
                req.num_committed_tokens = c.num_committed_tokens
        released = {r.req_id: r for r in out.ops.releases} if out.ops is not None else {}
        for r in results.releases:  # the window's pages are gone: holes in the request's copy of its table
            req = self.requests.get(r.req_id)
            if r.status is OpStatus.OK and req is not None and req.status is RequestStatus.RUNNING:
                table = req.sliding_table
                for k in released[r.req_id].page_indices:
                    table[k] = HOLE

    def _apply_extensions(self, results: StepResults, headroom_only: frozenset[str]) -> set[str]:
        """Appends new pages; on out of pages preempts the newest running request (unless the request only
        asked for headroom). Returns the req_ids that sit this step out (they wait for a victim's pages)."""
        skipped: set[str] = set()
        for e in results.extensions:
            req = self.requests[e.req_id]
            if req.status is not RequestStatus.RUNNING:  # preempted by an earlier extension of this step
                continue
            if e.status is OpStatus.OK:
                req.extend_pages(e)
            elif e.status is OpStatus.STALE_EPOCH:
                self.preempt(req)
            elif e.req_id in headroom_only:
                continue
            else:  # the newest that computes: a pull writes into its pages, a prefilled one leaves this step
                victim = next(r for r in reversed(self.running) if not (r.pulling or r.prefilled))
                self.preempt(victim)
                if victim is not req:
                    skipped.add(req.req_id)
        return skipped

    def _apply_allocations(self, admitted: list[Chunk], results: StepResults, batch: ScheduledBatch | None) -> None:
        """Admitted requests start running; each computes its first chunk in ``batch``, or with None (reserved
        ahead) in the next step's schedule. Those that did not fit go back to the head of the queue."""
        short: list[Request] = []
        for chunk, a in zip(admitted, results.allocations, strict=True):
            req = chunk.req
            if a.status is not OpStatus.OK:
                short.append(req)
                continue
            req.status, req.page_table, req.epoch = RequestStatus.RUNNING, list(a.page_table), a.epoch
            req.group_page_table = list(a.group_page_table)
            req.num_computed_tokens, req.num_committed_tokens = a.num_cached_tokens, a.num_committed_tokens
            req.store_loads = tuple(a.store_loads)
            req.num_pinned_tokens = max(req.num_pinned_tokens, a.num_pinned_tokens)
            req.moved_from = ""  # its pages on the prefill worker are this allocation's peer hits now
            self.running.append(req)
            if a.peer_loads:  # its worker pulls them first; its first chunk computes once they are in
                req.peer_loads, req.pulling, req.admitted_ahead = tuple(a.peer_loads), True, True
                req.pull_seq += 1
                req.peer_source = (a.peer_worker_id, a.peer_epoch, a.lease_expires_ms)
                self.pulls.append(req)
            elif batch is None:
                req.admitted_ahead = True
            else:
                batch.chunks.append(Chunk(req, min(chunk.num_tokens, req.num_uncomputed_tokens),
                                          a.num_cached_tokens, admitted=True))
        for req in reversed(short):  # back to the head of the queue, in their order
            self.waiting.appendleft(req)
        if short and batch is not None and not self.running and not self.pending_frees:
            self._fail_unplaceable(short[0], batch)

    def _fail_unplaceable(self, req: Request, batch: ScheduledBatch) -> None:
        """Nothing runs and nothing is being freed, yet it does not fit: it never will (pinned or foreign
        pages hold the pool). Fail it rather than wait forever."""
        self.finish(req, FinishReason.ERROR, OutOfCapacity(
            f"the request needs {num_pages_for(req.num_tokens, self.cfg.page_size)} pages but worker "
            f"{self.cfg.worker_id} cannot free that many (pinned or cached blocks of running requests hold them)"))
        batch.failed.append(req)

    def unloaded(self, batch: ScheduledBatch, req_ids) -> None:
        """The worker could not load these requests' pages from the store (and computed none of them): out of
        the batch, each frees its pages (nothing of them committed) and is queued first, to take pool hits only
        on its next admission."""
        gone = set(req_ids)
        for chunk in [c for c in batch.chunks if c.req.req_id in gone]:
            batch.chunks.remove(chunk)
            chunk.req.skip_store = True
            if chunk.req.status is RequestStatus.RUNNING:
                self.preempt(chunk.req)

    def preempt(self, req: Request) -> None:
        """Frees the request's pages (next step) and queues it first for recompute."""
        self.running.remove(req)
        self._queue_free(req)
        req.reset_for_recompute()
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        self.preempted.append(req)

    # -- 3. update --------------------------------------------------------------------------------------
    def update(self, batch: ScheduledBatch, sampled: list[SampledToken],
               stopped: frozenset[str] = frozenset()) -> list[tuple[Request, SampledToken]]:
        """Advances computed positions, appends sampled tokens, and ends requests at EOS, at a stop string (the
        req_ids in ``stopped``: their text now holds one) or at a length limit. Returns (request, token) per
        sampled token, finished or not, for the output side.

        A request's num_cached_tokens (what usage reports) is the prefix hit of its first admission that was
        computed: an admission undone before its prefill ran (the worker restarted) does not count."""
        for c in batch.chunks:
            c.req.num_computed_tokens = c.start_pos + c.num_tokens
            c.req.admitted_ahead = False
            c.req.store_loads = c.req.peer_loads = ()  # loaded: its pages are committed from the next step on
            c.req.num_failed_steps = 0
            if c.admitted and c.req.num_cached_tokens is None:
                c.req.num_cached_tokens = c.start_pos
        by_id = {c.req.req_id: c.req for c in batch.chunks}
        new_tokens = []
        for s in sampled:
            req = by_id[s.req_id]
            req.output_token_ids.append(s.token_id)
            new_tokens.append((req, s))
            reason = self._finish_reason(req, s.token_id, s.req_id in stopped)
            if reason is not None:
                self.finish(req, reason)
        return new_tokens

    def _finish_reason(self, req: Request, token_id: int, stop_string: bool) -> FinishReason | None:
        """EOS first (it ends the text), then a stop string (also when the last allowed token completed it), then
        the length limits."""
        if token_id in self.cfg.eos_token_ids and not req.params.ignore_eos:
            return FinishReason.EOS
        if stop_string:
            return FinishReason.STOP
        if len(req.output_token_ids) >= req.params.max_tokens or req.num_tokens >= self.cfg.max_model_len:
            return FinishReason.LENGTH
        return None
