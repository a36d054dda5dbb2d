"""The engine core: the steps of one worker, synchronous, with no threads and no locks. One step reads top to
bottom (``step``):

    out    = scheduler.schedule()              1. schedule (pure)
    result = kv.step_pages(out.ops)             2. page ops: one kvmanager round trip, or none
    batch  = scheduler.assign(out, result)
    output = worker.step(batch)                 3. compute
    scheduler.update(batch, output, stopped)    4. update: tokens and finishes, returned as the step's events

Transfers (disaggregated serving, cache-aware pulls): an admission whose answer lists peer_loads holds its pages
but does not compute until its worker has pulled them from the other worker (PullPages, run on ``pull_executor``
beside the steps); each step first collects the pulls that ended (on_pull_done wakes the engine loop). A request
on a prefill worker (prefill_until) computes its prompt and samples its first token, then leaves once its full
pages are committed (take_prefilled), for a decode worker.

The shared KV tier: the blocks an answer asks to be written (StepResults.store_writes) go with the worker's
next step, which copies them before it computes; with nothing to compute, a step carries them alone. Requests
whose pages the worker could not load from the store are recomputed (Scheduler.unloaded).

A step whose call changes nothing the worker computes now (out.can_overlap: commits, headroom, frees, and
admissions reserved ahead for the next step) sends its call through the injected executor while the worker
computes, and applies the answer before the step's tokens: the kvmanager's latency hides behind the forward pass.
Without an executor every call is answered before the worker computes.

Every driver steps this class: the gateway's engine loop (engine.py: its thread, inbox and hand-overs around
one core), ``kvserve generate --local`` (llm.py), the tests and the benchmarks with their fakes. The backends
are protocols (backends.py): the core knows no transport, and acts on the typed failures of errors.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

from kvserve.common.attention_window import FULL_ATTENTION, AttentionWindow
from kvserve.common.tokenizer import Tokenizer
from kvserve.common.wire.pages import PoolSpec, StepResults
from kvserve.common.wire.tier import StoreWrite
from kvserve.common.wire.transfer import PullOrder, PullResult, TransferDone
from kvserve.common.wire.worker import SampledToken, StepBatch, StepOutput, WorkerInfo
from kvserve.services.gateway.backends import KVManagerBackend, WorkerBackend
from kvserve.services.gateway.errors import (
    BackendFailure,
    KVManagerFailed,
    KVManagerUnavailable,
    RequestFailed,
    RequestRejected,
    WorkerIncompatible,
    WorkerRejected,
    WorkerRestarted,
)
from kvserve.services.gateway.observe import Observer
from kvserve.services.gateway.request import FinishReason, Request, RequestStatus
from kvserve.services.gateway.scheduler import ScheduledBatch, Scheduler, SchedulerConfig, SchedulerOutput
from kvserve.services.gateway.textstream import TextStream

log = logging.getLogger("kvserve.gateway")
MAX_FAILED_STEPS = 2  # a request in this many failed steps in a row fails and never moves on (scheduler.py)


class StepUndone(Exception):
    """The kvmanager refused a step's page ops for one request: that request has failed, nothing of the step was
    applied, and the core goes on with the others (they compute in the next step)."""


@dataclass(slots=True)
class TokenEvent:
    req: Request
    sampled: SampledToken
    text: str  # the text it adds (held back while it may start a stop string; "" without a tokenizer)


@dataclass(slots=True)
class StepEvents:
    """What a step (or an end between steps) has for the requests' clients, in order."""

    tokens: list[TokenEvent] = field(default_factory=list)
    # Finished requests whose last event may go out (its pages are freed, or it held none): (request, the rest
    # of its text). A request's end comes here once, after its last token.
    ended: list[tuple[Request, str]] = field(default_factory=list)
    scheduled: SchedulerOutput | None = None  # the step's schedule (None: no step ran)
    step_s: float = 0.0  # wall time of the step
    kv_wait_s: float = 0.0  # of which: blocked on the kvmanager's answer
    compute_s: float = 0.0  # the worker's forward pass and sampling (its compute_ms)
    kv_called: bool = False
    overlapped: bool = False  # its call ran while the worker computed


@dataclass(slots=True)
class Moved:
    """A request leaving this core (drained or its worker gone), reset for recompute elsewhere."""

    req: Request
    text: TextStream | None  # what was streamed, and what it holds back for stop strings
    traceparent: str


def scheduler_config(info: WorkerInfo, *, max_num_seqs: int, max_num_batched_tokens: int, prefix_caching: bool = True,
                     long_prefill_token_threshold: int = 0, reserve_ahead: bool = False,
                     pull_peers: bool = False) -> SchedulerConfig:
    """The scheduler of a worker as it describes itself; ``reserve_ahead`` only with an executor to overlap,
    ``pull_peers`` only with a pull executor."""
    return SchedulerConfig(info.worker_id, info.page_size, info.num_pages, info.max_model_len, info.eos_token_ids,
                           max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                           prefix_caching=prefix_caching, long_prefill_token_threshold=long_prefill_token_threshold,
                           window=info.attention_window(), group_window=group_window(info),
                           reserve_ahead=reserve_ahead, pull_peers=pull_peers)


def group_window(info: WorkerInfo) -> AttentionWindow:
    """The window of a grouped worker's sliding layers (full attention for a worker without page groups)."""
    if not info.sliding_group_pages:
        return FULL_ATTENTION
    return AttentionWindow.checked(info.sliding_group_window, 0, info.page_size)


class EngineCore:
    def __init__(self, worker: WorkerBackend, info: WorkerInfo, kv: KVManagerBackend, cfg: SchedulerConfig, *,
                 tokenizer: Tokenizer | None = None, executor: Executor | None = None,
                 observer: Observer | None = None, pull_executor: Executor | None = None,
                 address_of: Callable[[str], str] | None = None, on_pull_done: Callable[[], None] | None = None):
        """``info``: the worker's, its pool registered with ``kv``. ``tokenizer``: text events and stop strings
        (None: token ids only). ``executor``: runs the calls that overlap compute (None: none overlaps).
        ``pull_executor``: runs the worker's pulls (with cfg.pull_peers); ``address_of(worker_id)``: where a
        source worker is dialled ("" when unknown: the pull fails, the request recomputes); ``on_pull_done``:
        called from the pull's thread when one ends (the engine loop wakes)."""
        self.worker, self.info, self.kv, self.tokenizer = worker, info, kv, tokenizer
        self.executor = executor
        self.pull_executor, self.address_of = pull_executor, address_of or (lambda worker_id: "")
        self.on_pull_done = on_pull_done
        self.pulls: dict[str, tuple[Request, int, Future]] = {}  # req_id -> (request, its pull_seq, the pull)
        self.scheduler = Scheduler(cfg)
        self.observe = observer or Observer()
        self.live: dict[str, Request] = {}  # added and not ended, in the order they came
        self.texts: dict[str, TextStream] = {}
        self.traceparents: dict[str, str] = {}  # req_id -> its span's traceparent, for traced requests
        self.finishing: dict[str, tuple[Request, str]] = {}  # finished; ends once freed, with the rest of its text
        self.kv_failed = False  # the last kvmanager call failed
        self.incompatible = ""  # why the restarted worker cannot be served through this core, if it cannot
        self.pending_writes: tuple[StoreWrite, ...] = ()  # for the worker's next step
        self._events = StepEvents()

    # -- one step ---------------------------------------------------------------------------------------
    def step(self) -> StepEvents:
        """Schedule, page ops, compute, update; returns the step's events (with those of ends since the last).
        Raises BackendFailure when the step failed for the worker or the kvmanager (the caller decides: fail
        what runs, or hand it over)."""
        t0 = time.perf_counter()
        self._collect_pulls()
        out = self.scheduler.schedule()
        overlap = self.executor is not None and out.can_overlap
        try:
            batch, computing, output, kv_wait_s = self._overlapped(out) if overlap else self._in_series(out)
        except StepUndone:
            return self.flush()
        if computing:  # a restart (output None) re-registers, even when no chunk is left to update
            self._update(batch, output)
        events = self.flush()
        events.scheduled, events.kv_wait_s = out, kv_wait_s
        events.step_s = time.perf_counter() - t0
        events.compute_s = output.compute_ms / 1000 if output is not None else 0.0
        events.kv_called, events.overlapped = out.ops is not None, overlap
        return events

    def _in_series(self, out: SchedulerOutput) -> tuple[ScheduledBatch, bool, StepOutput | None, float]:
        t0 = time.perf_counter()
        results = self._answer(out, lambda: self.kv.step_pages(out.ops, self.traceparents)) if out.ops else \
            StepResults()  # nothing to allocate, extend, commit or free: no round trip
        kv_wait_s = time.perf_counter() - t0
        if out.ops is not None:
            self._deliver_freed(f.req_id for f in out.ops.frees)
        batch = self.scheduler.assign(out, results)
        self._observe_assign(out)
        self._start_pulls()
        for req in batch.failed:
            self._ended(self.live.pop(req.req_id))
        computing = bool(batch.chunks)
        if not computing and self.pending_writes:
            self._write_only()
        return batch, computing, self._compute(batch) if computing else None, kv_wait_s

    def _overlapped(self, out: SchedulerOutput) -> tuple[ScheduledBatch, bool, StepOutput | None, float]:
        """The call (commits, headroom, frees, admissions for the next step) runs through the executor while
        the worker computes; its answer is applied before the step's tokens, and before a restarted worker's
        re-registration. Finished requests whose pages it freed end then."""
        call = self.executor.submit(self.kv.step_pages, out.ops, dict(self.traceparents))
        batch = self.scheduler.assign(out, StepResults())  # every running chunk: none waits for a page
        computing, output = bool(batch.chunks), None
        try:
            output = self._compute(batch) if computing else None
        finally:
            t0 = time.perf_counter()
            results = self._answer(out, call.result)
            kv_wait_s = time.perf_counter() - t0
            self.scheduler.apply_late(out, results)  # its writes go with the next step: this one computed
        self._deliver_freed(f.req_id for f in out.ops.frees)
        self._observe_assign(out)
        self._start_pulls()
        return batch, computing, output, kv_wait_s

    def _answer(self, out: SchedulerOutput, get) -> StepResults:
        """The answer to out.ops (``get`` makes or awaits the call); when the call fails, its frees go out again
        with the next one, and the error is raised."""
        try:
            results = get()
        except Exception as e:
            self.scheduler.resend_frees(out)
            if isinstance(e, KVManagerFailed) and not isinstance(e, KVManagerUnavailable) and e.req_id:
                self._refused(out, e)
                raise StepUndone(str(e)) from e
            self.kv_failed = True
            raise
        self.kv_failed = False
        worker_id = self.info.worker_id
        self.pending_writes += tuple(o.write for o in results.store_writes if o.worker_id == worker_id)
        return results

    def _take_writes(self) -> tuple[StoreWrite, ...]:
        """The writes for the step about to be sent: they go once, whatever becomes of that step (a block not
        written is only a miss later)."""
        writes, self.pending_writes = self.pending_writes, ()
        return writes

    def _write_only(self) -> None:
        """A step that computes nothing, to hand the worker its pending writes (before any later step can
        overwrite their pages). Its failure loses only the writes."""
        try:
            self.worker.step(StepBatch((), self.info.epoch, self._take_writes()), self.traceparents)
        except BackendFailure as e:
            log.info("engine %s: a writes-only step failed (%s); those blocks are not written to the store",
                     self.info.worker_id, e)

    def _refused(self, out: SchedulerOutput, error: KVManagerFailed) -> None:
        """The kvmanager refused the call for one request (error.req_id) and applied none of it: that request
        fails, the step is undone (its admissions queue again), and the others go on."""
        req_id = error.req_id
        log.warning("engine %s: the kvmanager refused request %s's page op (%s); that request fails alone",
                    self.info.worker_id, req_id, error)
        self.scheduler.undo(out, req_id)
        self._end(req_id, self.scheduler.fail, RequestFailed(f"request {req_id}: the kvmanager refused its page "
                                                              f"op: {error}"))
        self._deliver_freed([req_id])  # when what was refused was its free: nothing more to wait for

    def _observe_assign(self, out: SchedulerOutput) -> None:
        for chunk in out.admitted:
            if chunk.req.status is RequestStatus.RUNNING:
                self.observe.admitted(chunk.req, self.info.worker_id)
        if self.scheduler.preempted:
            log.info("engine %s: out of pages, preempted %d requests (recompute later)", self.info.worker_id,
                     len(self.scheduler.preempted))
            for req in self.scheduler.preempted:
                self.observe.preempted(req)

    def _compute(self, batch: ScheduledBatch) -> StepOutput | None:
        """The worker's Step; None when the worker restarted. A step that failed without an answer for its
        requests counts against each of them (_failed_step); one the worker refused as a whole is skipped (its
        requests compute again, one under suspicion per step), and the worker is not suspected of being gone."""
        try:
            return self.worker.step(batch.to_step(self.info.epoch, self._take_writes()), self.traceparents)
        except WorkerRestarted as e:
            self._failed_step(batch, e)
            return None
        except WorkerRejected as e:
            log.warning("engine %s: the worker refused a step of %d requests (%s); they compute again, one "
                        "under suspicion per step", self.info.worker_id, len(batch.chunks), e)
            self._failed_step(batch, e)
            return self._not_computed(batch)
        except BackendFailure as e:
            if not self._failed_step(batch, e):
                raise
            # the step held a request in its second failed step in a row, the only one under suspicion in it: that
            # request, not the worker, is what failed (a worker that is really gone fails the next step too)
            return self._not_computed(batch)

    def _not_computed(self, batch: ScheduledBatch) -> StepOutput:
        """The answer for a step the worker computed none of: its requests compute the same tokens later."""
        self.scheduler.skip(batch)
        return StepOutput(sampled=[], num_tokens=0, compute_ms=0.0)

    def _failed_step(self, batch: ScheduledBatch, error: BackendFailure) -> bool:
        """Counts the failed step against each of its requests; one at MAX_FAILED_STEPS (the last time as the
        only suspect in its step, by the scheduler's rule, here or on another worker) fails now, and is never
        handed around again. Returns whether one did."""
        struck_out = False
        for chunk in list(batch.chunks):
            req = chunk.req
            req.num_failed_steps += 1
            if req.num_failed_steps >= MAX_FAILED_STEPS and req.req_id in self.live:
                struck_out = True
                batch.chunks.remove(chunk)
                log.error("engine %s: request %s failed in %d steps in a row; it fails (%s)", self.info.worker_id,
                          req.req_id, req.num_failed_steps, error)
                self._end(req.req_id, self.scheduler.fail, RequestFailed(
                    f"request {req.req_id} failed in {req.num_failed_steps} steps in a row, the last one as the "
                    f"only request under suspicion in its step: {error}"))
        return struck_out

    def _update(self, batch: ScheduledBatch, output: StepOutput | None) -> None:
        """The step's tokens: pushed through each request's text stream (which sees stop strings), then to the
        scheduler (which decides every finish), then out as events. A restarted worker: re-register, recompute."""
        if output is None:
            self._reregister()  # the worker restarted: its pages are gone, recompute what ran
            return
        self._measure(batch, output)
        if output.unloaded:
            log.warning("engine %s: %d requests' pages could not be loaded from the KV store; they recompute",
                        self.info.worker_id, len(output.unloaded))
            self.scheduler.unloaded(batch, output.unloaded)
            self.scheduler.tier.load_failed()
        self._rejected(batch, output)
        texts = {s.req_id: self._push(s) for s in output.sampled}
        stopped = frozenset(req_id for req_id, (_, stop) in texts.items() if stop)
        for req, sampled in self.scheduler.update(batch, output.sampled, stopped):
            self._token(req, sampled, texts[req.req_id][0])

    def _measure(self, batch: ScheduledBatch, output: StepOutput) -> None:
        """The worker's load and prefill costs, for the kvmanager's load-or-recompute choice (tier_rates.py)."""
        tier = self.scheduler.tier
        tier.loaded(output.num_loaded_pages, output.load_ms)
        prefill = sum(c.num_tokens for c in batch.chunks if c.num_tokens > 1)
        tier.computed(prefill, output.num_tokens, output.compute_ms)

    def _push(self, sampled: SampledToken) -> tuple[str, bool]:
        text = self.texts.get(sampled.req_id)
        return text.push(sampled.token_id) if text is not None else ("", False)

    def _rejected(self, batch: ScheduledBatch, output: StepOutput) -> None:
        """Items the worker rejected alone: their requests fail, out of the batch; the others are answered."""
        if not output.rejected:
            return
        rejected = {r.req_id: r for r in output.rejected}
        batch.chunks = [c for c in batch.chunks if c.req.req_id not in rejected]
        for req_id, r in rejected.items():
            log.warning("engine %s: the worker rejected request %s: %s", self.info.worker_id, req_id, r.message)
            error = RequestRejected(r.message) if r.invalid else RequestFailed(r.message)
            self._end(req_id, self.scheduler.fail, error)

    def _token(self, req: Request, sampled: SampledToken, text: str) -> None:
        req.last_token_s = time.monotonic()
        if req.first_token_s is None:
            req.first_token_s = req.last_token_s
            self.observe.first_token(req)
        self._events.tokens.append(TokenEvent(req, sampled, text))
        if req.status is RequestStatus.FINISHED and self.live.pop(req.req_id, None) is not None:
            stream = self.texts.get(req.req_id)
            rest = stream.flush() if stream is not None and req.finish_reason is not FinishReason.STOP else ""
            self.finishing[req.req_id] = (req, rest)

    def _reregister(self) -> None:
        """After a worker restart: register its new pool (the kvmanager drops the old epoch's pages) and
        queue every running request for recompute. The core takes the new epoch only once the kvmanager has
        it: if registering fails, the worker refuses the next step (old epoch) and this runs again, whereas a
        new epoch over the kvmanager's old pool would be served prefix hits on pages the worker never wrote."""
        info = self.worker.info()
        changed = incompatible_change(self.info, info)
        if changed:
            self.incompatible = (f"worker {info.worker_id} restarted with {changed}; this gateway serves what it "
                                 "started with: restart the gateway")
            raise WorkerIncompatible(self.incompatible)
        try:
            result = self.kv.register(PoolSpec.of(info))
        except BackendFailure:
            self.kv_failed = True
            raise
        self.info = info
        log.warning("worker %s restarted (epoch %d -> %d): recomputing %d requests", self.info.worker_id,
                    result.previous_epoch, self.info.epoch, self.scheduler.num_running)
        self.scheduler.preempt_all()
        self.scheduler.resize(info.num_pages)  # it may come back with another pool size
        self.pending_writes = ()  # of pages the old incarnation held

    # -- requests in and out ----------------------------------------------------------------------------
    def add(self, req: Request, text: TextStream | None = None, traceparent: str = "", first: bool = False) -> None:
        """Queues a request; ``text``: its text stream so far (handed over), ``first``: ahead of the others."""
        self.live[req.req_id] = req
        if text is None and self.tokenizer is not None:
            text = TextStream(self.tokenizer, req.params.stop)
        if text is not None:
            self.texts[req.req_id] = text
        if traceparent:
            self.traceparents[req.req_id] = traceparent
        self.scheduler.add(req, first=first)

    def cancel(self, req_id: str) -> None:
        """Cancels a request (client cancel, deadline, stop); its pages are freed by the next step. A request
        that ended already is left alone."""
        self._end(req_id, self.scheduler.cancel)

    def has_work(self) -> bool:
        """Something to step: a pull in flight is not, until it ends (then on_pull_done wakes the loop)."""
        return (self.scheduler.has_work() or bool(self.pending_writes)
                or any(f.done() for _, _, f in self.pulls.values()))

    # -- pulls ------------------------------------------------------------------------------------------
    def _start_pulls(self) -> None:
        """Starts the pulls of the requests just allocated with peer_loads (their pages are theirs alone)."""
        for req in self.scheduler.take_pulls():
            worker_id, epoch, lease_ms = req.peer_source
            order = PullOrder(req.req_id, self.info.epoch, worker_id, epoch, self.address_of(worker_id), lease_ms,
                              tuple(req.peer_loads), self.traceparents.get(req.req_id, ""))
            future = self.pull_executor.submit(self._pull, order) if self.pull_executor is not None else None
            if future is None:  # no executor: pulled in line (kvserve generate --local, tests)
                future = Future()
                future.set_result(self._pull(order))
            self.pulls[req.req_id] = (req, req.pull_seq, future)
            if self.on_pull_done is not None:
                future.add_done_callback(lambda _f: self.on_pull_done())

    def _pull(self, order: PullOrder) -> PullResult:
        if not order.source_address:
            return PullResult(error=f"no address is known for worker {order.source_worker_id}")
        try:
            return self.worker.pull(order)
        except Exception as e:  # a failed pull is a recompute, whatever failed
            return PullResult(error=f"{type(e).__name__}: {e}")

    def _collect_pulls(self) -> None:
        """The pulls that ended: their requests compute from this step on, or recompute (scheduler.pulled)."""
        for req_id in [r for r, (_, _, f) in self.pulls.items() if f.done()]:
            req, seq, future = self.pulls.pop(req_id)
            result: PullResult = future.result()
            if result.ok:
                self.scheduler.tier.pulled(result.num_pages, result.seconds)
            else:
                log.warning("engine %s: request %s could not pull its pages (%s); it recomputes them",
                            self.info.worker_id, req_id, result.error)
            self.observe.pulled(req, self.info.worker_id, result)
            self.scheduler.pulled(req, seq, TransferDone(req_id, result.ok, result.num_bytes, result.seconds))

    def take_prefilled(self) -> list[Moved]:
        """The requests whose prefill is done here (a prefill worker): they leave for a decode worker, still
        holding their pages here until its allocation takes them over."""
        moved = []
        for req in self.scheduler.take_prefilled():
            self.live.pop(req.req_id)
            req.reset_for_decode(self.info.worker_id)
            moved.append(Moved(req, self.texts.pop(req.req_id, None), self.traceparents.pop(req.req_id, "")))
        return moved

    def flush(self) -> StepEvents:
        """The events since the last step or flush (ends between steps: cancels, failures, hand-overs)."""
        events, self._events = self._events, StepEvents()
        return events

    def fail_all(self, error: Exception, stopping: bool = False) -> None:
        """Ends every request after a failed step: as failed, or, when stopping (its step may have been cancelled
        for it), as cancelled, which is what stopping does to the requests still in flight."""
        if stopping:
            log.info("engine %s: stopping mid-step (%s); cancelling its %d requests", self.info.worker_id, error,
                     len(self.live))
        else:
            log.error("engine %s: step failed: %s; failing its %d requests", self.info.worker_id, error,
                      len(self.live))
        for req_id in list(self.live):
            if stopping:
                self._end(req_id, self.scheduler.cancel)
            else:
                self._end(req_id, self.scheduler.fail, error)
        # Their frees go out with the next call, but not the commits of what they filled last: a failed call
        # may have been applied without its answer arriving, and a commit computed before that answer would be
        # refused as out of order, failing the whole call and the requests it admits. Only cache entries lost.
        self.scheduler.drop_final_commits()
        self._deliver_freed(list(self.finishing))  # the kvmanager is unreachable: do not make clients wait

    def abandon_frees(self) -> int:
        """Stopping, and a kvmanager call failed: the frees would be retried forever, so they are let go. Their
        pages stay allocated in the kvmanager until the worker's pool is registered again. Returns how many."""
        return self.scheduler.abandon_frees()

    def take_waiting(self) -> list[Moved]:
        """The queued requests (they hold no pages) leave: the worker drains."""
        return [self._move(req.req_id) for req in self.scheduler.take_waiting()]

    def take_all(self) -> list[Moved]:
        """Every request in flight leaves (queued ones included), the finished ones whose free was pending end
        now: the worker is gone, and nothing more is sent for its pool."""
        moved = [self._move(req_id) for req_id in list(self.live)]
        self._deliver_freed(list(self.finishing))
        self.scheduler.reset()  # what it held lived on the dropped pool
        self.pending_writes = ()
        self.pulls = {}  # into the dropped pool: what they pulled is gone with it
        return moved

    def _move(self, req_id: str) -> Moved:
        req = self.live.pop(req_id)
        if req.page_table or req.num_computed_tokens:
            req.reset_for_recompute()  # prompt + streamed tokens are its prompt now
        return Moved(req, self.texts.pop(req_id, None), self.traceparents.pop(req_id, ""))

    def _end(self, req_id: str, end, *args) -> None:
        """Ends a request still in flight with ``end(req, *args)`` (the scheduler's cancel or fail); its end
        event goes out now, or once its pages are freed."""
        req = self.live.pop(req_id, None)
        if req is None:
            return  # ended already
        if end(req, *args):
            self.finishing[req_id] = (req, "")  # its end waits for the free
        else:
            self._ended(req)  # it holds no pages: nothing to wait for

    def _deliver_freed(self, freed_req_ids) -> None:
        """A finished request ends once the kvmanager has freed its pages, so a client that saw its request end
        never races the free (admin stats are back to baseline by then)."""
        for req_id in freed_req_ids:
            entry = self.finishing.pop(req_id, None)
            if entry is not None:
                self._ended(*entry)

    def _ended(self, req: Request, rest: str = "") -> None:
        self.traceparents.pop(req.req_id, None)
        self.texts.pop(req.req_id, None)
        self.observe.finished(req)
        self._events.ended.append((req, rest))


def incompatible_change(old: WorkerInfo, new: WorkerInfo) -> str:
    """What a restarted worker changed that a core cannot follow ("" for nothing): its tokenizer, page tables
    and request limits were made for the worker it started with. A resized pool it can follow."""
    changes = [f"{name} {a} -> {b}" for name, a, b in (
        ("model", old.model_fingerprint, new.model_fingerprint), ("page size", old.page_size, new.page_size),
        ("max_model_len", old.max_model_len, new.max_model_len), ("sliding window", old.sliding_window,
                                                                   new.sliding_window),
        ("attention sinks", old.attention_sinks, new.attention_sinks),
        ("sliding layers' window", old.sliding_group_window, new.sliding_group_window)) if a != b]
    return ", ".join(changes)
