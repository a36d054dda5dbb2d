"""The gateway core, wired: one engine loop per worker, the tokenizer, the API keys, placement, admission and
drain. Front-ends (the gRPC servicer in rpc/, an HTTP one) convert their requests into GenerateInput and call
``submit``; the backends come in as the protocols of backends.py (rpc/connect.py makes gRPC ones)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvserve.common.metrics import GatewayMetrics
from kvserve.common.tokenizer import Tokenizer
from kvserve.common.wire.pages import PoolSpec
from kvserve.services.gateway.auth import ApiKeys
from kvserve.services.gateway.backends import KVManagerBackend, WorkerBackend
from kvserve.services.gateway.engine import EngineLoop
from kvserve.services.gateway.errors import GatewayBusy, KVManagerUnavailable, ShuttingDown
from kvserve.services.gateway.handle import RequestHandle
from kvserve.services.gateway.observe import Observer
from kvserve.services.gateway.request import Request
from kvserve.services.gateway.validate import GenerateInput, Limits, validate_request

log = logging.getLogger("kvserve.gateway")


def _pool_tokens(info) -> int:
    """The most tokens one request may hold on a worker's pool: all of it, or with a sliding window any number
    (it holds its window's pages, released as it advances)."""
    return info.max_model_len if info.sliding_window else info.num_pages * info.page_size


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    model_dir: Path  # for the tokenizer and chat template (the workers' model)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    prefix_caching: bool = True
    long_prefill_token_threshold: int = 0  # SchedulerConfig's: a prefill chunk's cap in steps that also decode
    overlap_page_ops: bool = True  # a call that only commits and tops up headroom runs while the worker computes
    default_max_tokens: int = 256
    max_tokens_limit: int = 4096
    max_queued_requests: int = 1024  # waiting for pages, over all workers; one more is refused (GatewayBusy)
    connect_timeout_s: float = 120.0


class Gateway:
    def __init__(self, cfg: GatewayConfig, keys: ApiKeys, kv: KVManagerBackend, workers: Sequence[WorkerBackend],
                 metrics: GatewayMetrics | None = None):
        """Asks each worker for its Info (waiting up to cfg.connect_timeout_s), registers its pool with the
        kvmanager, and starts its engine loop. Raises ValueError for no workers or workers of different models,
        and the backends' failures (errors.py)."""
        if not workers:
            raise ValueError("the gateway needs at least one worker")
        self.cfg, self.keys, self.kv = cfg, keys, kv
        self.observe = Observer(metrics)
        self.tokenizer = Tokenizer(cfg.model_dir)
        self.engines = [self._connect(worker) for worker in workers]
        fingerprints = {e.info.model_fingerprint for e in self.engines}
        if len(fingerprints) > 1:
            raise ValueError(f"the workers serve different models (fingerprints {sorted(fingerprints)})")
        info = self.engines[0].info
        self.limits = Limits(max_model_len=info.max_model_len, vocab_size=info.vocab_size,
                             max_pool_tokens=min(_pool_tokens(e.info) for e in self.engines),
                             default_max_tokens=cfg.default_max_tokens, max_tokens_limit=cfg.max_tokens_limit)
        self._lock = threading.Lock()
        self._placing_by_load = False  # the kvmanager did not answer the last placement (guarded by _lock)
        self.closing = False
        for engine in self.engines:
            engine.start()

    def _connect(self, worker: WorkerBackend) -> EngineLoop:
        """Asks the worker for its Info and registers its pool with the kvmanager."""
        info = worker.info(wait_s=self.cfg.connect_timeout_s)
        released = self.kv.register(PoolSpec.of(info), release_requests=True).released_req_ids
        if released:  # a gateway before this one died with requests running: their pages come back
            log.warning("worker %s: freed the pages of %d requests a previous gateway left running", info.worker_id,
                        len(released))
        log.info("worker %s at %s: %d pages x %d tokens, epoch %d", info.worker_id, worker.address, info.num_pages,
                 info.page_size, info.epoch)
        return EngineLoop(worker, info, self.kv, self.tokenizer, max_num_seqs=self.cfg.max_num_seqs,
                          max_num_batched_tokens=self.cfg.max_num_batched_tokens,
                          prefix_caching=self.cfg.prefix_caching,
                          long_prefill_token_threshold=self.cfg.long_prefill_token_threshold,
                          overlap_page_ops=self.cfg.overlap_page_ops,
                          observer=self.observe)

    def submit(self, inp: GenerateInput, tenant: str, trace_parent=None) -> RequestHandle:
        """Validates, tokenises and queues a request; ``trace_parent`` is the caller's trace context, if any.
        Raises InvalidRequest, ShuttingDown, GatewayBusy, or a backend failure (placement refused, the worker
        incompatible)."""
        req = validate_request(inp, tenant, self.tokenizer, self.limits)
        with self._lock:  # placement sees every earlier request queued somewhere
            if self.closing:
                raise ShuttingDown("the gateway is shutting down and admits no new requests")
            num_queued = {e.info.worker_id: e.num_queued for e in self.engines}
            if sum(num_queued.values()) >= self.cfg.max_queued_requests:
                raise GatewayBusy(f"{sum(num_queued.values())} requests are already waiting for pages (the "
                                  "gateway's limit, --max-queued-requests); retry later")
            engine = self.place(req, num_queued)
            engine.check_serving()
            self.observe.started(req, trace_parent)
            return engine.submit(req)

    def place(self, req: Request, num_queued: dict[str, int]) -> EngineLoop:
        """The worker the kvmanager's cache-aware placement chooses (longest prefix hit balanced against
        load, ``num_queued``: the requests this gateway has queued per worker); the only one when there is one.

        While the kvmanager is unreachable, the worker with the fewest queued requests: the request then waits
        for the kvmanager in its first page op, as running ones do, instead of holding up every submission
        behind a placement that waits out the outage."""
        if len(self.engines) == 1:
            return self.engines[0]
        try:
            worker_id = self.kv.place(req.tenant, req.prompt_token_ids, num_queued)
        except KVManagerUnavailable as e:
            worker_id = min(num_queued, key=num_queued.get)  # the first of the least queued
            self._placement_degraded(str(e))
        else:
            self._placement_degraded(None)
        return next((e for e in self.engines if e.info.worker_id == worker_id), self.engines[0])

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
        for engine in self.engines:
            if not engine.idle.wait(drain_s):
                log.info("engine %s: cancelling %d requests still in flight", engine.info.worker_id,
                         engine.num_in_flight)
        for engine in self.engines:  # each loop knows it stops before any backend call fails for it
            engine.stop()
        self.kv.interrupt()
        for engine in self.engines:
            engine.join()
            engine.worker.close()
        self.kv.close()
