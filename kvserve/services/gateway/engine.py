"""One engine loop per worker: a thread around one engine core (core.py). It runs the core's steps while there is
work, and sleeps on a condition variable when there is none; it delivers each step's events to the requests'
handles, and does what concerns threads and the worker's life: the inbox, cancels, hand-over of requests to
other workers (the worker drains, or is gone), the stop, and the step statistics.

Front-end threads talk to it through ``submit`` and a handle's ``cancel`` only; everything else (the core, the
handles) is touched by the loop thread alone, so none of it needs a lock. The helper thread the core is given
only makes the kvmanager calls that overlap compute.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvserve.common.errors import Internal
from kvserve.common.tokenizer import Tokenizer
from kvserve.common.wire.worker import WorkerInfo
from kvserve.services.gateway.backends import KVManagerBackend, WorkerBackend
from kvserve.services.gateway.core import EngineCore, StepEvents, scheduler_config
from kvserve.services.gateway.errors import BackendFailure, WorkerIncompatible, WorkerRestarted
from kvserve.services.gateway.handle import OutputDelta, RequestHandle
from kvserve.services.gateway.observe import Observer
from kvserve.services.gateway.request import Request
from kvserve.services.gateway.textstream import TextStream

log = logging.getLogger("kvserve.gateway")


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

    def add(self, e: StepEvents) -> None:
        self.num_steps += 1
        self.num_kv_calls += e.kv_called
        self.num_kv_calls_overlapped += e.overlapped
        self.num_admitted_ahead += len(e.scheduled.admitted) if e.overlapped else 0
        self.step_s, self.kv_wait_s, self.compute_s = (self.step_s + e.step_s, self.kv_wait_s + e.kv_wait_s,
                                                        self.compute_s + e.compute_s)

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
                 observer: Observer | None = None, pull_peers: bool = False,
                 address_of: Callable[[str], str] | None = None):
        self.worker, self.kv = worker, kv
        overlap = ThreadPoolExecutor(1, thread_name_prefix=f"kv-{info.worker_id}") if overlap_page_ops else None
        self._kv_thread = overlap  # the calls that overlap compute run on this thread
        # pulls wait on the worker (it moves the bytes): a few at once, beside the steps
        self._pull_threads = ThreadPoolExecutor(4, thread_name_prefix=f"pull-{info.worker_id}") if pull_peers else None
        self.observe = observer or Observer()
        cfg = scheduler_config(info, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                               prefix_caching=prefix_caching, long_prefill_token_threshold=long_prefill_token_threshold,
                               reserve_ahead=overlap_page_ops and reserve_ahead, pull_peers=pull_peers)
        self.core = EngineCore(worker, info, kv, cfg, tokenizer=tokenizer, executor=self._kv_thread,
                               observer=self.observe, pull_executor=self._pull_threads, address_of=address_of,
                               on_pull_done=self._wake)
        self.stats = EngineStats()
        self.handles: dict[str, RequestHandle] = {}  # loop thread only: every request whose end is not delivered
        self._cv = threading.Condition()
        self._inbox: list[RequestHandle] = []
        self._cancels: list[str] = []
        self._stopping = False
        # Set by the gateway: on_lost(engine, error) says whether a failed step means the worker is gone (the
        # engine then retires), hand_over(engine, transfers) takes its requests to live workers.
        self.on_lost: Callable[[EngineLoop, BackendFailure], bool] | None = None
        self.hand_over: Callable[[EngineLoop, list[Transfer]], None] | None = None
        # Set by the gateway when prefill workers serve: hand_off(engine, transfers) takes requests whose prefill
        # is done here (a prefill worker) to decode workers.
        self.hand_off: Callable[[EngineLoop, list[Transfer]], None] | None = None
        self.retiring = False  # the worker is gone: hand everything over and end (set under _cv)
        self.draining = False  # the worker drains: no new request; its queued ones go elsewhere (under _cv)
        self._adopted: list[Transfer] = []
        self.idle = threading.Event()  # set while no request is in flight (for a graceful drain)
        self.idle.set()
        self.thread = threading.Thread(target=self._run, name=f"engine-{info.worker_id}", daemon=True)

    @property
    def info(self) -> WorkerInfo:  # as the core serves it (a restart re-registers a new epoch)
        return self.core.info

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
        if self.core.incompatible:
            raise WorkerIncompatible(self.core.incompatible)

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

    def _wake(self) -> None:
        """A pull ended (any thread): the loop collects it."""
        with self._cv:
            self._cv.notify()

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
        if self._kv_thread is not None:
            self._kv_thread.shutdown()  # idle: every step waits for its own call
        if self._pull_threads is not None:
            self._pull_threads.shutdown(wait=False, cancel_futures=True)

    @property
    def num_queued(self) -> int:
        """Requests waiting for pages on this worker (read from other threads: a snapshot)."""
        return len(self._inbox) + self.core.scheduler.num_queued

    @property
    def num_in_flight(self) -> int:
        return len(self.handles) + len(self._inbox)

    # -- the loop thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        while self._next_work():
            try:
                self._deliver(self.core.step())
            except BackendFailure as e:
                with self._cv:
                    stopping = self._stopping
                if not stopping and self._gone(e):
                    break
                self.core.fail_all(e, stopping=stopping)
                if stopping and self.core.kv_failed:
                    self._abandon_frees()  # else (the worker failed) the next step frees them
            except Exception as e:  # a bug: fail what runs, rather than end the loop with every stream open
                log.exception("engine %s: a step raised", self.info.worker_id)
                self.core.fail_all(Internal(f"internal error in the gateway: {type(e).__name__}: {e}"))
            self._deliver(self.core.flush())
            self._hand_off_prefilled()
            with self._cv:
                if not self.handles and not self._inbox and not self._adopted:
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
                       or self._should_hand_over_waiting() or self.core.has_work()):
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
            self.core.cancel(req_id)
        if not stopping and self._should_hand_over_waiting():
            transfers = self._transfers(self.core.take_waiting())
            log.info("engine %s: draining, %d queued requests go to other workers", self.info.worker_id,
                     len(transfers))
            self.hand_over(self, transfers)
        self._deliver(self.core.flush())
        return self.core.has_work() or not stopping

    def _should_hand_over_waiting(self) -> bool:
        return self.draining and self.core.scheduler.num_waiting > 0 and self.hand_over is not None

    def _take(self, t: Transfer, first: bool = False) -> None:
        self.handles[t.handle.req.req_id] = t.handle
        self.core.add(t.handle.req, t.text, t.traceparent, first=first)

    def _deliver(self, events: StepEvents) -> None:
        """A step's events to the requests' handles: a delta per token, then the last delta of each that ended."""
        for e in events.tokens:
            logprobs = [e.sampled] if e.req.params.logprobs else []
            self.handles[e.req.req_id].put(OutputDelta(e.text, [e.sampled.token_id], logprobs))
        for req, rest in events.ended:
            self.handles.pop(req.req_id).finish(rest)
        if events.scheduled is not None:
            self.stats.add(events)
            self.observe.step(self.info.worker_id, events.step_s, self.stats.kv_wait_share,
                              self.core.scheduler.num_running, self.core.scheduler.num_waiting)

    def _hand_off_prefilled(self) -> None:
        """Requests whose prefill is done here go to a decode worker (the gateway's hand_off)."""
        moved = self.core.take_prefilled()
        if not moved:
            return
        transfers = self._transfers(moved)
        for t in transfers:
            self.observe.handed_off(t.handle.req, self.info.worker_id)
        self.hand_off(self, transfers)

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

    def _transfers(self, moved) -> list[Transfer]:  # the core's leaving requests, with their handles
        return [Transfer(self.handles.pop(m.req.req_id), m.text, m.traceparent) for m in moved]

    def _hand_over_all(self) -> None:
        """Retiring: every request in flight goes to ``hand_over`` (queued ones included); the finished ones
        whose free was pending end now (their pool is gone). Nothing more is sent for this worker."""
        with self._cv:
            new, self._inbox = self._inbox, []
            adopted, self._adopted = self._adopted, []
            self._cancels = []
        transfers = self._transfers(self.core.take_all())
        transfers += [Transfer(h, None, h.req.traceparent) for h in new] + adopted
        self._deliver(self.core.flush())
        log.warning("engine %s: worker gone, handing %d requests over to live workers", self.info.worker_id,
                    len(transfers))
        if self.hand_over is not None:
            self.hand_over(self, transfers)
        self.idle.set()
        self.worker.close()
        if self._kv_thread is not None:
            self._kv_thread.shutdown(wait=False)
        if self._pull_threads is not None:
            self._pull_threads.shutdown(wait=False, cancel_futures=True)

    def _abandon_frees(self) -> None:
        """Stopping, and a kvmanager call failed: the frees would be retried forever, so the loop lets them go.
        Their pages stay allocated in the kvmanager until the next gateway registers the worker (it releases
        them), the worker registers a new epoch, or an admin resets."""
        num = self.core.abandon_frees()
        if num:
            log.warning("engine %s: stopping with the kvmanager unreachable; the pages of %d requests stay "
                        "allocated there", self.info.worker_id, num)
