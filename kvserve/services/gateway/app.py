"""The gateway core, wired: one engine loop per live worker, the tokenizer, the API keys, placement, admission
and drain. Front-ends (the gRPC servicer in rpc/, an HTTP one) convert their requests into GenerateInput and call
``submit``; the backends come in as the protocols of backends.py (rpc/connect.py makes gRPC ones).

Workers come and go (membership.py follows the kvmanager's list of live workers, or a static list is given).
A worker lost for good (its steps failed for ``worker_timeout_s``, or the kvmanager dropped its lease) is
declared dead, and each request in flight on it is handed to a live worker, where it is recomputed from its
prompt plus the tokens already streamed: its stream goes on with no token missing or repeated."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kvserve.common.metrics import GatewayMetrics
from kvserve.common.tokenizer import Tokenizer
from kvserve.common.wire.pages import PoolSpec
from kvserve.services.gateway.affinity import Affinity
from kvserve.services.gateway.auth import ApiKeys
from kvserve.services.gateway.backends import KVManagerBackend, WorkerBackend
from kvserve.services.gateway.core import incompatible_change
from kvserve.services.gateway.disagg import DEFAULT_MAX_LOCAL_PREFILL, Roles, choose, route
from kvserve.services.gateway.engine import EngineLoop, Transfer
from kvserve.services.gateway.errors import (
    BackendFailure,
    GatewayBusy,
    KVManagerUnavailable,
    ShuttingDown,
    WorkerUnavailable,
)
from kvserve.services.gateway.handle import RequestHandle
from kvserve.services.gateway.membership import Membership
from kvserve.services.gateway.observe import Observer
from kvserve.services.gateway.request import FinishReason, Request
from kvserve.services.gateway.scheduler import Scheduler
from kvserve.services.gateway.validate import GenerateInput, Limits, validate_request

log = logging.getLogger("kvserve.gateway")


def _pool_tokens(info) -> int:
    """The most tokens one request may hold on a worker's pool: all of it, or with a sliding window any number
    (it holds its window's pages, released as it advances)."""
    return info.attention_window().max_request_tokens(info.max_model_len, info.num_pages * info.page_size)


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    model_dir: Path  # for the tokenizer and chat template (the workers' model)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    prefix_caching: bool = True
    long_prefill_token_threshold: int = 0  # SchedulerConfig's: a prefill chunk's cap in steps that also decode
    overlap_page_ops: bool = True  # a call that only commits and tops up headroom runs while the worker computes
    reserve_ahead: bool = True  # with it: frees and admissions for the next step ride along too (scheduler.py)
    pull_peers: bool = True  # a prefix in another worker's pool is pulled instead of recomputed (when cheaper)
    # With prefill workers live: a prompt with more uncached tokens than this prefills on one (disagg.py)
    max_local_prefill: int = DEFAULT_MAX_LOCAL_PREFILL
    default_max_tokens: int = 256
    max_tokens_limit: int = 4096
    max_queued_requests: int = 1024  # waiting for pages, over all workers; one more is refused (GatewayBusy)
    connect_timeout_s: float = 120.0  # for the first worker; and how long a handed-over request waits for one
    worker_timeout_s: float = 5.0  # a worker whose steps fail this long is declared dead
    membership_poll_s: float = 0.25  # how often the kvmanager's list of live workers is read


class Gateway:
    def __init__(self, cfg: GatewayConfig, keys: ApiKeys, kv: KVManagerBackend,
                 workers: Sequence[WorkerBackend] | None, metrics: GatewayMetrics | None = None,
                 connect_worker: Callable[[str], WorkerBackend] | None = None):
        """``workers``: a static list, each asked for its Info (waiting up to cfg.connect_timeout_s), its pool
        registered with the kvmanager, its engine loop started. None: the workers are the kvmanager's live
        members, dialled with ``connect_worker(address)`` as they join (the first one waited for up to
        cfg.connect_timeout_s). Raises ValueError for no workers or workers of different models, and the
        backends' failures (errors.py)."""
        if workers is not None and not workers:
            raise ValueError("the gateway needs at least one worker")
        self.cfg, self.keys, self.kv = cfg, keys, kv
        self.observe = Observer(metrics)
        self.tokenizer = Tokenizer(cfg.model_dir)
        # guards _engines, _parked, _declared_dead, closing, _placing_by_load, affinity
        self._lock = threading.Lock()
        self._engines: dict[str, EngineLoop] = {}
        # engines given up on whose pool the kvmanager has not dropped yet: their hand-over drops it first
        self._declared_dead: set[EngineLoop] = set()
        self._parked: list[tuple[float, Transfer]] = []  # handed over while no worker was live: (since, request)
        self._placing_by_load = False  # the kvmanager did not answer the last placement
        self.affinity = Affinity()  # (tenant, cache_key) -> the worker its requests go to while it has room
        self.closing = False
        self.reference = None  # the WorkerInfo every worker must match (model, page size, context, window)
        self.limits: Limits | None = None
        self.membership = None
        if workers is not None:
            for engine in [self.connect_engine(worker) for worker in workers]:
                self.add_engine(engine)
        else:
            if connect_worker is None:
                raise ValueError("following the kvmanager's membership needs connect_worker")
            self.membership = Membership(self, connect_worker)
            self.membership.start()

    # -- engines as workers come and go -------------------------------------------------------------------
    @property
    def engines(self) -> list[EngineLoop]:
        """The engines of the live workers (a snapshot, in the order they joined)."""
        with self._lock:
            return list(self._engines.values())

    def connect_engine(self, worker: WorkerBackend, wait_s: float | None = None) -> EngineLoop:
        """Asks the worker for its Info, checks it against the workers served so far, registers its pool with
        the kvmanager (freeing what a gateway before this one left there) and makes its engine loop."""
        info = worker.info(wait_s=self.cfg.connect_timeout_s if wait_s is None else wait_s)
        if self.reference is not None:
            changed = incompatible_change(self.reference, info)
            if changed:
                raise ValueError(f"worker {info.worker_id} at {worker.address} differs from the workers this "
                                 f"gateway serves ({changed}); it is not served")
        released = self.kv.register(PoolSpec.of(info), release_requests=True).released_req_ids
        if released:  # a gateway before this one died with requests running: their pages come back
            log.warning("worker %s: freed the pages of %d requests a previous gateway left running", info.worker_id,
                        len(released))
        log.info("worker %s at %s: %d pages x %d tokens, epoch %d", info.worker_id, worker.address, info.num_pages,
                 info.page_size, info.epoch)
        engine = EngineLoop(worker, info, self.kv, self.tokenizer, max_num_seqs=self.cfg.max_num_seqs,
                            max_num_batched_tokens=self.cfg.max_num_batched_tokens,
                            prefix_caching=self.cfg.prefix_caching,
                            long_prefill_token_threshold=self.cfg.long_prefill_token_threshold,
                            overlap_page_ops=self.cfg.overlap_page_ops, reserve_ahead=self.cfg.reserve_ahead,
                            observer=self.observe, pull_peers=self.cfg.pull_peers, address_of=self._address_of)
        engine.on_lost, engine.hand_over, engine.hand_off = self._lost, self._hand_over, self._hand_off
        return engine

    def add_engine(self, engine: EngineLoop) -> None:
        """Starts serving a worker's engine; requests parked while no worker was live go to it."""
        info = engine.info
        if self.reference is None:
            self.reference = info
            self.limits = Limits(max_model_len=info.max_model_len, vocab_size=info.vocab_size,
                                 max_pool_tokens=_pool_tokens(info), default_max_tokens=self.cfg.default_max_tokens,
                                 max_tokens_limit=self.cfg.max_tokens_limit)
        with self._lock:
            self._engines[info.worker_id] = engine
            self._update_limits()
            parked, self._parked = [t for _, t in self._parked], []
        engine.start()
        if parked:
            log.info("worker %s joined: it takes the %d requests waiting for a live worker", info.worker_id,
                     len(parked))
            engine.adopt(parked)

    def _update_limits(self) -> None:
        """One request must fit the smallest live pool (under _lock)."""
        if self._engines:
            self.limits = replace(self.limits, max_pool_tokens=min(_pool_tokens(e.info)
                                                                   for e in self._engines.values()))

    def retire(self, engine: EngineLoop, why: str) -> None:
        """Stops serving a worker that is gone (it left, or the kvmanager dropped it): its engine hands every
        request over to the live workers and ends."""
        with self._lock:
            if self._engines.get(engine.info.worker_id) is engine:
                del self._engines[engine.info.worker_id]
                self._update_limits()
        if not engine.retiring:
            log.warning("worker %s (epoch %d) is gone (%s): its requests move to live workers", engine.info.worker_id,
                        engine.info.epoch, why)
        engine.retire()

    def _lost(self, engine: EngineLoop, error: BackendFailure) -> bool:
        """Called by an engine whose step failed: True when its worker is gone for good, after which it hands
        its requests over. Steps that failed for worker_timeout_s: the worker is declared dead (the kvmanager
        drops its pool, never served again). A kvmanager call refused: gone if the kvmanager no longer lists it."""
        if self.closing:
            return False
        if self.membership is None:
            with self._lock:
                others = any(e.placeable and e is not engine for e in self._engines.values())
            if not others:  # a static list names no worker to take them, and none will join: they fail
                return False
        if isinstance(error, WorkerUnavailable):
            with self._lock:
                self._declared_dead.add(engine)  # the kvmanager is told in _hand_over, before any is placed
            retire = self.membership.retire if self.membership is not None else self.retire
            retire(engine, f"no step answered for {self.cfg.worker_timeout_s:g} s: {error}")
            return True
        if self.membership is not None and not self.membership.is_member(engine.info):
            self.retire(engine, f"the kvmanager no longer lists it: {error}")
            return True
        return False

    def _declare_dead(self, worker_id: str, epoch: int) -> None:
        """Tells the kvmanager to drop the pool of a worker this gateway gave up on (never served again)."""
        try:
            self.kv.leave_worker(worker_id, epoch)
        except BackendFailure as e:  # its lease lapses there anyway; here it is not served again
            log.warning("could not declare worker %s dead at the kvmanager: %s", worker_id, e)

    def _hand_over(self, engine: EngineLoop, transfers: list[Transfer]) -> None:
        """Places requests handed over from a lost or draining worker on live ones, or parks them until one
        joins (for at most cfg.connect_timeout_s). A worker declared dead is dropped at the kvmanager first
        (on the lost engine's thread, waiting for a kvmanager that is away as any call does): until then its
        requests' allocations are live there, and a live worker's allocation of the same req_id is refused."""
        with self._lock:
            declared_dead = engine in self._declared_dead
            self._declared_dead.discard(engine)
        if declared_dead:
            self._declare_dead(engine.info.worker_id, engine.info.epoch)
        for t in transfers:
            with self._lock:
                target = self._placeable(exclude=engine)
                if target is None:
                    self._parked.append((time.monotonic(), t))
                    continue
            target.adopt([t])
        if self._parked:
            log.warning("no live worker: %d requests wait for one to join", len(self._parked))

    def _address_of(self, worker_id: str) -> str:
        """Where a live worker is dialled ("" when it is not served here): the source of a pull."""
        with self._lock:
            engine = self._engines.get(worker_id)
        return engine.worker.address if engine is not None else ""

    def _hand_off(self, engine: EngineLoop, transfers: list[Transfer]) -> None:
        """Requests whose prefill is done on ``engine`` (a prefill worker) go to the decode worker placement
        picks, counting the pages it would pull; with none live, back to ``engine``, which decodes them (its
        own pages are then pool hits)."""
        for t in transfers:
            with self._lock:
                live = [e for e in self._engines.values() if e.placeable]
                num_queued = {e.info.worker_id: e.num_queued for e in live}
            decoders = [e for e in live if e.info.role != "prefill"] or [engine]
            target = decoders[0] if len(decoders) == 1 else \
                choose(self.kv, t.handle.req, decoders, num_queued, self.cfg.pull_peers)[0]
            target.adopt([t])

    def _placeable(self, exclude: EngineLoop | None = None) -> EngineLoop | None:
        """The least queued engine that takes new requests (under _lock); None when there is none."""
        live = [e for e in self._engines.values() if e.placeable and e is not exclude]
        return min(live, key=lambda e: e.num_queued, default=None)

    def expire_parked(self) -> None:
        """Fails the requests that waited cfg.connect_timeout_s for a live worker (membership's poll calls it)."""
        deadline = time.monotonic() - self.cfg.connect_timeout_s
        with self._lock:
            expired = [t for since, t in self._parked if since < deadline]
            self._parked = [(since, t) for since, t in self._parked if since >= deadline]
        for t in expired:
            self._fail_parked(t, WorkerUnavailable(f"no live worker for {self.cfg.connect_timeout_s:g} s after "
                                                   "the one serving this request was lost"))

    def _fail_parked(self, t: Transfer, error: Exception) -> None:
        req = t.handle.req
        Scheduler.finish_unheld(req, FinishReason.CANCELLED if isinstance(error, ShuttingDown) else FinishReason.ERROR,
                                error)
        self.observe.finished(req)
        t.handle.finish()

    # -- requests -----------------------------------------------------------------------------------------
    def submit(self, inp: GenerateInput, tenant: str, trace_parent=None) -> RequestHandle:
        """Validates, tokenises and queues a request; ``trace_parent`` is the caller's trace context, if any.
        Raises InvalidRequest, ShuttingDown, GatewayBusy, WorkerUnavailable (no live worker), or a backend
        failure (placement refused, the worker incompatible)."""
        if self.limits is None:
            raise WorkerUnavailable("no worker has joined yet; retry once one has")
        req = validate_request(inp, tenant, self.tokenizer, self.limits)
        with self._lock:  # placement sees every earlier request queued somewhere
            if self.closing:
                raise ShuttingDown("the gateway is shutting down and admits no new requests")
            engines = [e for e in self._engines.values() if e.placeable]
            if not engines:
                raise WorkerUnavailable("no live worker is serving; retry once one has joined")
            num_queued = {e.info.worker_id: e.num_queued for e in engines}
            if sum(num_queued.values()) >= self.cfg.max_queued_requests:
                raise GatewayBusy(f"{sum(num_queued.values())} requests are already waiting for pages (the "
                                  "gateway's limit, --max-queued-requests); retry later")
            engine = self.place(req, num_queued, engines)
            engine.check_serving()
            self.observe.started(req, trace_parent)
            return engine.submit(req)

    def place(self, req: Request, num_queued: dict[str, int], engines: list[EngineLoop]) -> EngineLoop:
        """The engine a request goes to, among ``engines`` (the ones taking new requests; ``num_queued``: the
        requests this gateway has queued on each, by worker_id). A request with a cache_key goes to the worker
        its tenant's key was placed on while that one has room (affinity.py), without asking the kvmanager;
        otherwise it is placed by ``_place_by_cache`` and, with a key, the worker is remembered for it."""
        roles = Roles.of(engines)
        by_id = {e.info.worker_id: e for e in roles.decode}
        engine, num_cached = None, None
        if req.cache_key:
            worker_id = self.affinity.worker_for(req.tenant, req.cache_key, num_queued)
            engine = by_id.get(worker_id) if worker_id is not None else None
        if engine is None:
            engine, num_cached = self._place_by_cache(req, {w: num_queued[w] for w in by_id}, by_id)
            if req.cache_key:
                self.affinity.remember(req.tenant, req.cache_key, engine.info.worker_id)
        if roles.prefill and self.cfg.pull_peers:  # disaggregated: a long uncached prompt prefills there first
            engine = route(self.kv, req, roles, num_queued, engine, num_cached, self.cfg.max_local_prefill,
                           self.cfg.pull_peers)
        return engine

    def _place_by_cache(self, req: Request, num_queued: dict[str, int],
                        by_id: dict[str, EngineLoop]) -> tuple[EngineLoop, int | None]:
        """The worker the kvmanager's cache-aware placement chooses (longest prefix hit balanced against
        load, a prefix it would pull from another worker counted half) among ``by_id``'s; the only one when
        there is one. With it, the prompt tokens placement found cached for it there (None: not asked).

        While the kvmanager is unreachable, or when it names a worker that is not among them (gone, draining),
        the one with the fewest queued requests: the request then waits for the kvmanager in its first page op,
        as running ones do, instead of holding up every submission behind a placement that waits out the
        outage."""
        if len(by_id) == 1:
            return next(iter(by_id.values())), None
        least_queued = min(num_queued, key=num_queued.get)  # the first of the least queued
        try:
            worker_id, num_cached = self.kv.place_among(req.tenant, req.prompt_token_ids, num_queued, tuple(by_id),
                                                        self.cfg.pull_peers)
        except KVManagerUnavailable as e:
            self._placement_degraded(str(e))
            return by_id[least_queued], 0
        self._placement_degraded(None)
        return (by_id[worker_id], num_cached) if worker_id in by_id else (by_id[least_queued], None)

    def _placement_degraded(self, why: str | None) -> None:
        """Logs when placement starts (``why``) and stops (None) falling back to the least queued worker."""
        if why is not None and not self._placing_by_load:
            log.warning("kvmanager placement unavailable (%s); placing new requests on the least queued worker "
                        "until it answers again", why)
        elif why is None and self._placing_by_load:
            log.info("kvmanager placement answers again")
        self._placing_by_load = why is not None

    def close(self, drain_s: float = 5.0) -> None:
        """Graceful stop: admit nothing new, let in-flight requests finish for up to drain_s, cancel the rest,
        free their pages, stop the loops."""
        with self._lock:
            self.closing = True
            parked, self._parked = [t for _, t in self._parked], []
        if self.membership is not None:
            self.membership.stop()
        for t in parked:
            self._fail_parked(t, ShuttingDown("the gateway stopped before a live worker could take this request"))
        engines = self.engines
        for engine in engines:
            if not engine.idle.wait(drain_s):
                log.info("engine %s: cancelling %d requests still in flight", engine.info.worker_id,
                         engine.num_in_flight)
        for engine in engines:  # each loop knows it stops before any backend call fails for it
            engine.stop()
        self.kv.interrupt()
        for engine in engines:
            engine.join()
            engine.worker.close()
        self.kv.close()
