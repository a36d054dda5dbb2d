"""One engine loop per worker: a thread that runs scheduler steps while there is work, and sleeps on a condition
variable when there is none. One step reads top to bottom:

    out    = scheduler.schedule()              1. schedule (pure)
    result = kv.step_pages(out.ops)             2. page ops: one kvmanager round trip, or none
    batch  = scheduler.assign(out, result)
    output = worker.step(batch)                 3. compute
    scheduler.update(batch, output, stopped)    4. update: tokens, finish reasons; then text deltas to clients

A step whose call changes nothing the worker computes now (out.can_overlap: commits, headroom, frees, and
admissions reserved ahead for the next step) sends its call from a helper thread while the worker computes,
and applies the answer before the step's tokens: the kvmanager's latency hides behind the forward pass.

Front-end threads talk to it through ``submit`` and a handle's ``cancel`` only; everything else (the scheduler,
the requests' state, the text streams) is touched by the loop thread alone, so none of it needs a lock. The
helper thread only makes the kvmanager call. The backends are protocols (backends.py): the engine knows no
transport, and acts on the typed failures of errors.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvserve.common.errors import Internal
from kvserve.common.tokenizer import Tokenizer
from kvserve.common.wire.pages import PoolSpec, StepResults
from kvserve.common.wire.worker import StepOutput, WorkerInfo
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
from kvserve.services.gateway.handle import OutputDelta, RequestHandle
from kvserve.services.gateway.observe import Observer
from kvserve.services.gateway.request import FinishReason, Request, RequestStatus
from kvserve.services.gateway.scheduler import ScheduledBatch, Scheduler, SchedulerConfig, SchedulerOutput
from kvserve.services.gateway.textstream import TextStream

log = logging.getLogger("kvserve.gateway")
MAX_FAILED_STEPS = 2  # a request in this many failed steps in a row fails and never moves on (scheduler.py)


class StepUndone(Exception):
    """The kvmanager refused a step's page ops for one request: that request has failed, nothing of the step was
    applied, and the loop goes on with the others (they compute in the next step)."""


@dataclass(slots=True)
class Transfer:
    """A request handed from an engine whose worker is gone to another one: its handle (the client's stream),
    its text stream (what was streamed, and what it holds back for stop strings), its trace context. The
    request itself is reset for recompute: prompt plus the tokens already streamed, re-prefilled elsewhere."""

    handle: RequestHandle
    text: TextStream | None  # None: it never reached the loop (still in the inbox)
    traceparent: str = ""


@dataclass(slots=True)
class EngineStats:
    num_steps: int = 0
    num_kv_calls: int = 0  # steps that needed a kvmanager round trip
    num_kv_calls_overlapped: int = 0  # of which: made while the worker computed (out.can_overlap)
    num_admitted_ahead: int = 0  # admissions those calls reserved for the next step
    step_s: float = 0.0  # wall time of whole steps
    kv_wait_s: float = 0.0  # of which: blocked on the kvmanager's StepPages answer (not scheduling, not sending)
    compute_s: float = 0.0  # of which: the worker's forward pass and sampling (its compute_ms)

    @property
    def kv_wait_share(self) -> float:
        return self.kv_wait_s / self.step_s if self.step_s else 0.0

    @property
    def compute_share(self) -> float:
        return self.compute_s / self.step_s if self.step_s else 0.0


class EngineLoop:
    def __init__(self, worker: WorkerBackend, info: WorkerInfo, kv: KVManagerBackend, tokenizer: Tokenizer, *,
                 max_num_seqs: int, max_num_batched_tokens: int, prefix_caching: bool,
                 long_prefill_token_threshold: int = 0, overlap_page_ops: bool = True, reserve_ahead: bool = True,
                 observer: Observer | None = None):
        self.worker, self.info, self.kv, self.tokenizer = worker, info, kv, tokenizer
        self.overlap_page_ops = overlap_page_ops
        self._kv_thread = ThreadPoolExecutor(1, thread_name_prefix=f"kv-{info.worker_id}")  # overlapped calls
        self.observe = observer or Observer()
        self.scheduler = Scheduler(SchedulerConfig(
            info.worker_id, info.page_size, info.num_pages, info.max_model_len, info.eos_token_ids,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            prefix_caching=prefix_caching, long_prefill_token_threshold=long_prefill_token_threshold,
            window=info.sliding_window, sinks=info.attention_sinks, reserve_ahead=overlap_page_ops and reserve_ahead))
        self.stats = EngineStats()
        self.handles: dict[str, RequestHandle] = {}  # loop thread only, as the three below
        self.texts: dict[str, TextStream] = {}
        self.finishing: dict[str, tuple[RequestHandle, str]] = {}  # finished, last delta sent once freed
        self.traceparents: dict[str, str] = {}  # req_id -> its span's traceparent, for traced requests
        self._cv = threading.Condition()
        self._inbox: list[RequestHandle] = []
        self._cancels: list[str] = []
        self._stopping = False
        self._kv_failed = False  # the last kvmanager call failed (loop thread only)
        self.incompatible = ""  # why the restarted worker cannot be served through this engine, if it cannot
        # Set by the gateway: on_lost(engine, error) says whether a failed step means the worker is gone (the
        # engine then retires), hand_over(engine, transfers) takes its requests to live workers.
        self.on_lost: Callable[[EngineLoop, BackendFailure], bool] | None = None
        self.hand_over: Callable[[EngineLoop, list[Transfer]], None] | None = None
        self.retiring = False  # the worker is gone: hand everything over and end (set under _cv)
        self.draining = False  # the worker drains: no new request; its queued ones go elsewhere (under _cv)
        self._adopted: list[Transfer] = []
        self.idle = threading.Event()  # set while no request is in flight (for a graceful drain)
        self.idle.set()
        self.thread = threading.Thread(target=self._run, name=f"engine-{info.worker_id}", daemon=True)

    # -- front-end threads ------------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    @property
    def placeable(self) -> bool:
        """Whether new requests may be queued here: not retiring, not draining (an incompatible worker's engine
        is placeable: check_serving says why it refuses)."""
        return not (self.retiring or self.draining)

    def check_serving(self) -> None:
        """Raises WorkerIncompatible when the worker restarted as one this engine cannot serve (another model,
        page size or context length)."""
        if self.incompatible:
            raise WorkerIncompatible(self.incompatible)

    def submit(self, req: Request) -> RequestHandle:
        handle = RequestHandle(req, self.info.worker_id, self.cancel)
        with self._cv:
            self.idle.clear()
            self._inbox.append(handle)
            self._cv.notify()
        return handle

    def cancel(self, req_id: str) -> None:
        """Cancels a request (client cancel, deadline, shutdown); its pages are freed by the next step."""
        with self._cv:
            self._cancels.append(req_id)
            self._cv.notify()

    def adopt(self, transfers: list[Transfer]) -> None:
        """Takes over requests handed from an engine whose worker is gone; each is recomputed here first."""
        for t in transfers:
            t.handle.rebind(self.info.worker_id, self.cancel)
        with self._cv:
            self.idle.clear()
            self._adopted.extend(transfers)
            self._cv.notify()

    def retire(self) -> None:
        """The worker is gone for good (declared dead, or it left): the loop hands every request in flight over
        (``hand_over``) and ends, sending nothing more to the worker or for its pool. Any thread."""
        with self._cv:
            self.retiring = True
            self._cv.notify()
        self.worker.interrupt()

    def drain(self) -> None:
        """The worker drains: new requests go elsewhere, the queued ones are handed over, the running ones finish
        here. Any thread."""
        with self._cv:
            self.draining = True
            self._cv.notify()

    def stop(self) -> None:
        """Starts the stop: the loop cancels everything in flight, frees its pages (while the kvmanager answers)
        and ends; the step in flight is not waited for (its worker may be gone). ``join`` waits for the end."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self.worker.interrupt()

    def join(self) -> None:
        self.thread.join()
        self._kv_thread.shutdown()  # idle: every step waits for its own call

    @property
    def num_queued(self) -> int:
        """Requests waiting for pages on this worker (read from other threads: a snapshot). Counted as the
        scheduler's unfinished requests less the running ones: a waiting request the scheduler is trying to
        admit is out of its ``waiting`` deque for the length of a kvmanager call, and still queued."""
        return len(self._inbox) + len(self.scheduler.requests) - len(self.scheduler.running)

    @property
    def num_in_flight(self) -> int:
        return len(self.handles) + len(self._inbox)

    # -- the loop thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        while self._next_work():
            try:
                self._step()
            except StepUndone:
                pass
            except BackendFailure as e:
                with self._cv:
                    stopping = self._stopping
                if not stopping and self._gone(e):
                    break
                self._fail_all(e, stopping=stopping)
                if stopping and self._kv_failed:
                    self._abandon_frees()  # else (the worker failed) the next step frees them
            except Exception as e:  # a bug: fail what runs, rather than end the loop with every stream open
                log.exception("engine %s: a step raised", self.info.worker_id)
                self._fail_all(Internal(f"internal error in the gateway: {type(e).__name__}: {e}"))
            with self._cv:
                if not self.handles and not self._inbox and not self.finishing and not self._adopted:
                    self.idle.set()
        if self.retiring:
            self._hand_over_all()
        s = self.stats
        log.info("engine %s stopped after %d steps; kvmanager wait %.1f%% of step time (%.2f ms per step, "
                 "a call in %d steps, %d of them overlapped with compute), worker compute %.1f%%",
                 self.info.worker_id, s.num_steps, 100 * s.kv_wait_share, 1000 * s.kv_wait_s / max(s.num_steps, 1),
                 s.num_kv_calls, s.num_kv_calls_overlapped, 100 * s.compute_share)

    def _next_work(self) -> bool:
        """Waits for work; takes new requests, handed-over ones and cancels in. False once stopping and
        everything is freed, or once retiring."""
        with self._cv:
            while not (self._inbox or self._adopted or self._cancels or self._stopping or self.retiring
                       or self._should_hand_over_waiting() or self.scheduler.has_work()):
                self._cv.wait()
            if self.retiring:
                return False
            new, self._inbox = self._inbox, []
            adopted, self._adopted = self._adopted, []
            cancels, self._cancels = self._cancels, []
            stopping = self._stopping
        for handle in new:
            self._take(Transfer(handle, None, handle.req.traceparent))
        for t in reversed(adopted):  # each goes first: in the order they came
            self._take(t, first=True)
        cancels += [t.handle.req.req_id for t in adopted if t.handle.cancelled]  # cancelled on its way here
        for req_id in [*cancels, *(self.handles if stopping else ())]:
            self._end(req_id, self.scheduler.cancel)
        if not stopping and self._should_hand_over_waiting():
            self._hand_over_waiting()
        return self.scheduler.has_work() or not stopping

    def _should_hand_over_waiting(self) -> bool:
        return self.draining and bool(self.scheduler.waiting) and self.hand_over is not None

    def _take(self, t: Transfer, first: bool = False) -> None:
        req = t.handle.req
        self.handles[req.req_id] = t.handle
        self.texts[req.req_id] = t.text or TextStream(self.tokenizer, req.params.stop)
        self.scheduler.add(req, first=first)
        if t.traceparent:
            self.traceparents[req.req_id] = t.traceparent

    def _gone(self, error: BackendFailure) -> bool:
        """Whether a failed step means the worker is gone: retired by the gateway meanwhile, or (``on_lost``'s
        answer) steps that failed for the worker timeout, or a kvmanager that no longer has its pool."""
        if self.retiring:
            return True
        if self.on_lost is None or isinstance(error, (WorkerRestarted, WorkerIncompatible)):
            return False
        if self.on_lost(self, error):
            with self._cv:
                self.retiring = True
            return True
        return False

    def _transfer(self, req_id: str) -> Transfer:
        handle = self.handles.pop(req_id)
        req = handle.req
        if req.page_table or req.num_computed_tokens:
            req.reset_for_recompute()  # prompt + streamed tokens are its prompt now
        return Transfer(handle, self.texts.pop(req_id, None), self.traceparents.pop(req_id, ""))

    def _hand_over_all(self) -> None:
        """Retiring: every request in flight goes to ``hand_over`` (queued ones included); the finished ones
        whose free was pending end now (their pool is gone). Nothing more is sent for this worker."""
        with self._cv:
            new, self._inbox = self._inbox, []
            adopted, self._adopted = self._adopted, []
            self._cancels = []
        transfers = [self._transfer(req_id) for req_id in list(self.handles)]
        transfers += [Transfer(h, None, h.req.traceparent) for h in new] + adopted
        for handle, text in self.finishing.values():
            self._complete(handle, text)
        self.finishing = {}
        self.scheduler = Scheduler(self.scheduler.cfg)  # what it held lived on the dropped pool
        log.warning("engine %s: worker gone, handing %d requests over to live workers", self.info.worker_id,
                    len(transfers))
        if self.hand_over is not None:
            self.hand_over(self, transfers)
        self.idle.set()
        self.worker.close()
        self._kv_thread.shutdown(wait=False)

    def _hand_over_waiting(self) -> None:
        """Draining: the queued requests (they hold no pages) go to other workers; the running ones stay."""
        waiting = list(self.scheduler.waiting)
        for req in waiting:
            self.scheduler.requests.pop(req.req_id, None)
        self.scheduler.waiting.clear()
        transfers = [self._transfer(req.req_id) for req in waiting]
        log.info("engine %s: draining, %d queued requests go to other workers", self.info.worker_id,
                 len(transfers))
        self.hand_over(self, transfers)

    def _end(self, req_id: str, end, *args) -> None:
        """Ends a request that is still in flight with ``end(req, *args)`` (the scheduler's cancel or fail); its
        last delta goes out now, or once its pages are freed."""
        handle = self.handles.pop(req_id, None)
        if handle is None:
            return  # finished already
        if end(handle.req, *args):
            self.finishing[req_id] = (handle, "")  # its last delta waits for the free
        else:
            self._complete(handle)  # it holds no pages: nothing to wait for

    def _deliver_freed(self, freed_req_ids) -> None:
        """The last delta of a finished request goes out once the kvmanager has freed its pages, so a client
        that saw its request end never races the free (admin stats are back to baseline by then)."""
        for req_id in freed_req_ids:
            entry = self.finishing.pop(req_id, None)
            if entry is not None:
                self._complete(*entry)

    def _complete(self, handle: RequestHandle, text: str = "") -> None:
        """Sends the last delta and closes the request's span and metrics."""
        self.traceparents.pop(handle.req.req_id, None)
        self.texts.pop(handle.req.req_id, None)
        self.observe.finished(handle.req)
        handle.finish(text)

    def _step(self) -> None:
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        if self.overlap_page_ops and out.can_overlap:
            self._overlapped_step(out, t0)
            return
        ts = time.perf_counter()
        results = self._step_pages(out)
        t1 = time.perf_counter()
        if out.ops is not None:
            self._deliver_freed(f.req_id for f in out.ops.frees)
        batch = self.scheduler.assign(out, results)
        self._observe_assign(out)
        for req in batch.failed:
            self._complete(self.handles.pop(req.req_id))
        if batch.chunks:
            self._update(batch, self._compute(batch))
        self._account(t0, t1 - ts)

    def _overlapped_step(self, out: SchedulerOutput, t0: float) -> None:
        """The call (commits, headroom, frees, admissions for the next step) runs on the helper thread while
        the worker computes; its answer is applied before the step's tokens, and before a restarted worker's
        re-registration. Finished requests whose pages it freed get their last delta then."""
        call = self._kv_thread.submit(self.kv.step_pages, out.ops, dict(self.traceparents))
        batch = self.scheduler.assign(out, StepResults())  # every running chunk: none waits for a page
        computing, output = bool(batch.chunks), None
        try:
            output = self._compute(batch) if computing else None
        finally:
            t2 = time.perf_counter()
            results = self._answer(out, call.result)
            t3 = time.perf_counter()
            self.stats.num_kv_calls_overlapped += 1
            self.stats.num_admitted_ahead += len(out.admitted)
            self.scheduler.apply_late(out, results)
        self._deliver_freed(f.req_id for f in out.ops.frees)
        self._observe_assign(out)
        if computing:  # a restart (output None) re-registers, even when no chunk is left to update
            self._update(batch, output)
        self._account(t0, t3 - t2)

    def _account(self, t0: float, kv_wait_s: float) -> None:
        t = time.perf_counter()
        s = self.stats
        s.num_steps, s.step_s, s.kv_wait_s = s.num_steps + 1, s.step_s + t - t0, s.kv_wait_s + kv_wait_s
        self.observe.step(self.info.worker_id, t - t0, s.kv_wait_share, len(self.scheduler.running),
                          len(self.scheduler.waiting))

    def _step_pages(self, out: SchedulerOutput) -> StepResults:
        if out.ops is None:
            return StepResults()  # nothing to allocate, extend, commit or free: no round trip
        return self._answer(out, lambda: self.kv.step_pages(out.ops, self.traceparents))

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
            self._kv_failed = True
            raise
        self._kv_failed = False
        self.stats.num_kv_calls += 1
        return results

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
            return self.worker.step(batch.to_step(self.info.epoch), self.traceparents)
        except WorkerRestarted as e:
            self._failed_step(batch, e)
            return None
        except WorkerRejected as e:
            log.warning("engine %s: the worker refused a step of %d requests (%s); they compute again, one "
                        "under suspicion per step",
                        self.info.worker_id, len(batch.chunks), e)
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
            if req.num_failed_steps >= MAX_FAILED_STEPS and req.req_id in self.handles:
                struck_out = True
                batch.chunks.remove(chunk)
                log.error("engine %s: request %s failed in %d steps in a row; it fails (%s)", self.info.worker_id,
                          req.req_id, req.num_failed_steps, error)
                self._end(req.req_id, self.scheduler.fail, RequestFailed(
                    f"request {req.req_id} failed in {req.num_failed_steps} steps in a row, the last one as the "
                    f"only request under suspicion in its step: {error}"))
        return struck_out

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

    def _update(self, batch: ScheduledBatch, output: StepOutput | None) -> None:
        """The step's tokens: pushed through each request's text stream (which sees stop strings), then to the
        scheduler (which decides every finish), then out as deltas. A restarted worker: re-register, recompute."""
        if output is None:
            self._reregister()  # the worker restarted: its pages are gone, recompute what ran
            return
        self.stats.compute_s += output.compute_ms / 1000
        self._rejected(batch, output)
        texts = {s.req_id: self.texts[s.req_id].push(s.token_id) for s in output.sampled}
        stopped = frozenset(req_id for req_id, (_, stop) in texts.items() if stop)
        for req, sampled in self.scheduler.update(batch, output.sampled, stopped):
            self._emit(req, sampled, texts[req.req_id][0])

    def _emit(self, req: Request, sampled, text: str) -> None:
        handle = self.handles[req.req_id]
        req.last_token_s = time.monotonic()
        if req.first_token_s is None:
            req.first_token_s = req.last_token_s
            self.observe.first_token(req)
        logprobs = [sampled] if req.params.logprobs else []
        handle.put(OutputDelta(text=text, token_ids=[sampled.token_id], logprobs=logprobs))
        if req.status is RequestStatus.FINISHED:
            del self.handles[req.req_id]
            rest = "" if req.finish_reason is FinishReason.STOP else self.texts[req.req_id].flush()
            self.finishing[req.req_id] = (handle, rest)

    def _reregister(self) -> None:
        """After a worker restart: register its new pool (the kvmanager drops the old epoch's pages) and
        queue every running request for recompute. The engine takes the new epoch only once the kvmanager has
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
            self._kv_failed = True
            raise
        self.info = info
        log.warning("worker %s restarted (epoch %d -> %d): recomputing %d requests", self.info.worker_id,
                    result.previous_epoch, self.info.epoch, len(self.scheduler.running))
        self.scheduler.preempt_all()
        self.scheduler.resize(info.num_pages)  # it may come back with another pool size

    def _abandon_frees(self) -> None:
        """Stopping, and a kvmanager call failed: the frees would be retried forever, so the loop lets them go.
        Their pages stay allocated in the kvmanager until the next gateway registers the worker (it releases
        them), the worker registers a new epoch, or an admin resets."""
        num = self.scheduler.abandon_frees()
        if num:
            log.warning("engine %s: stopping with the kvmanager unreachable; the pages of %d requests stay "
                        "allocated there", self.info.worker_id, num)

    def _fail_all(self, error: Exception, stopping: bool = False) -> None:
        """Ends every request after a failed step: as failed, or, when the engine is stopping (its step may have
        been cancelled for it), as cancelled, which is what stopping does to the requests still in flight."""
        if stopping:
            log.info("engine %s: stopping mid-step (%s); cancelling its %d requests", self.info.worker_id, error,
                     len(self.handles))
        else:
            log.error("engine %s: step failed: %s; failing its %d requests", self.info.worker_id, error,
                      len(self.handles))
        for req_id in list(self.handles):
            if stopping:
                self._end(req_id, self.scheduler.cancel)
            else:
                self._end(req_id, self.scheduler.fail, error)
        # Their frees go out with the next call, but not the commits of what they filled last: a failed call
        # may have been applied without its answer arriving, and a commit computed before that answer would be
        # refused as out of order, failing the whole call and the requests it admits. Only cache entries lost.
        self.scheduler.drop_final_commits()
        self._deliver_freed(list(self.finishing))  # the kvmanager is unreachable: do not make clients wait


def incompatible_change(old: WorkerInfo, new: WorkerInfo) -> str:
    """What a restarted worker changed that an engine cannot follow ("" for nothing): its tokenizer, page
    tables and request limits were made for the worker it started with. A resized pool it can follow."""
    changes = [f"{name} {a} -> {b}" for name, a, b in (
        ("model", old.model_fingerprint, new.model_fingerprint), ("page size", old.page_size, new.page_size),
        ("max_model_len", old.max_model_len, new.max_model_len), ("sliding window", old.sliding_window,
                                                                   new.sliding_window),
        ("attention sinks", old.attention_sinks, new.attention_sinks)) if a != b]
    return ", ".join(changes)
