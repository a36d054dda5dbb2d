"""In-process backends for the gateway core (kvserve/services/gateway/backends.py), for engine tests without gRPC:

- InProcessKVManager: the package's (kvserve/services/gateway/inprocess.py: the real KVManager called directly), with a
  switch that makes it unreachable (every call raises KVManagerUnavailable, as the gRPC client does once its
  retries run out).
- InlineExecutor: a core's overlapped calls made at once, in order (the engine loop makes them on a thread).
- PagedRuleWorker: a worker whose "model" is a rule over the KV cache it reads. Its cache holds the token id
  written at each slot; the token sampled after positions [0, n) is next_token() of the n token ids found
  in the request's page_table slots. A wrong page table, a stale prefix hit or a page written by another
  request changes what it answers, so the tokens are right only if the engine's pages are.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Executor, Future

from kvserve.common.telemetry import NO_TRACES
from kvserve.common.wire.pages import PinPoint, PoolSpec, RegisterResult, StepOps, StepResults
from kvserve.common.wire.tier import StoredBlock, TierReport
from kvserve.common.wire.worker import RejectedItem, SampledToken, StepBatch, StepOutput, WorkerInfo
from kvserve.kvmanager.admin import forget_worker
from kvserve.kvmanager.manager import KVManager
from kvserve.services.gateway import inprocess
from kvserve.services.gateway.errors import KVManagerUnavailable, WorkerRestarted
from kvserve.worker.validate import validate_batch

EOS = 250  # one of the ids the rule samples: a request ends there unless it ignores EOS


def next_token(context: list[int]) -> int:
    """The rule model: a token id in [200, 700) that depends on every token of the context and its length."""
    return 200 + (sum(t * (i + 1) for i, t in enumerate(context)) + len(context)) % 500


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    """What a request must generate: the rule applied to the true sequence, one token at a time."""
    seq, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(next_token(seq))
        seq.append(out[-1])
    return out


class InlineExecutor(Executor):
    """Runs what is submitted at once, in the caller's thread: a core's overlapped calls, answered in order."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:
            future.set_exception(e)
        return future


class InProcessKVManager(inprocess.InProcessKVManager):
    def __init__(self, store_capacity_bytes: int = 0):
        super().__init__(KVManager(store_capacity_bytes=store_capacity_bytes))
        self.reachable = True
        self.num_calls = 0

    def _check(self) -> None:
        if not self.reachable:
            raise KVManagerUnavailable("kvmanager call failed: UNAVAILABLE: unreachable (the test cut it off)")

    def register(self, spec: PoolSpec, release_requests: bool = False) -> RegisterResult:
        self._check()
        return super().register(spec, release_requests)

    def step_pages(self, ops: StepOps, traceparents=NO_TRACES) -> StepResults:
        self._check()
        self.num_calls += 1
        return super().step_pages(ops, traceparents)

    def place(self, tenant, token_ids, num_queued) -> str:
        self._check()
        return super().place(tenant, token_ids, num_queued)

    def place_among(self, tenant, token_ids, num_queued, worker_ids, pull_peers):
        self._check()
        return super().place_among(tenant, token_ids, num_queued, worker_ids, pull_peers)

    def leave_worker(self, worker_id: str, epoch: int) -> tuple[str, ...]:
        self._check()
        pool = self.mgr.pools.get(worker_id)
        if pool is None or pool.spec.epoch != epoch:
            return ()
        dropped = tuple(r for r, req in self.mgr.requests.items() if req.worker_id == worker_id)
        forget_worker(self.mgr, worker_id, force=True)
        return dropped



class PagedRuleWorker:
    address = "in-process"

    def __init__(self, worker_id: str = "w0", num_pages: int = 32, page_size: int = 4, max_model_len: int = 256):
        self.worker_id, self.num_pages, self.page_size = worker_id, num_pages, page_size
        self.max_model_len = max_model_len
        self.epoch = 1
        self.slots: dict[int, int] = {}  # page_id * page_size + offset -> the token id written there
        self.restart_before_step: int | None = None  # restarts (new epoch, empty cache) before that step
        self.num_steps = 0

    @property
    def info_now(self) -> WorkerInfo:
        return WorkerInfo(self.worker_id, self.epoch, "rule", "fingerprint", self.page_size, self.num_pages,
                          "float32", 16, 16 * self.page_size * self.num_pages, 1, 1, 1, 8, 49152,
                          self.max_model_len, (EOS,), "cpu", "rule")

    def info(self, wait_s: float = 60.0) -> WorkerInfo:
        return self.info_now

    def restart(self) -> None:
        self.epoch += 1
        self.slots.clear()

    def step(self, batch: StepBatch, traceparents=NO_TRACES) -> StepOutput:
        self.num_steps += 1
        if self.restart_before_step == self.num_steps:
            self.restart()
        if batch.epoch and batch.epoch != self.epoch:
            raise WorkerRestarted(f"worker {self.worker_id} restarted: epoch {batch.epoch} is not {self.epoch}")
        rejected = validate_batch(batch, vocab_size=49152, num_pages=self.num_pages, page_size=self.page_size,
                                  max_model_len=self.max_model_len, max_step_tokens=4096)
        items = [i for i in batch.items if i.req_id not in rejected]
        sampled = []
        for item in items:
            for offset, token in enumerate(item.token_ids):
                self.slots[self._slot(item.page_table, item.start_pos + offset)] = token
            if item.sample:
                context = [self.slots.get(self._slot(item.page_table, p), -1) for p in range(item.end_pos)]
                sampled.append(SampledToken(item.req_id, next_token(context), -0.5))
        return StepOutput(sampled, sum(len(i.token_ids) for i in items), 0.1,
                          [RejectedItem(req_id, message) for req_id, message in rejected.items()])

    def _slot(self, page_table, position: int) -> int:
        return page_table[position // self.page_size] * self.page_size + position % self.page_size

    def interrupt(self) -> None:
        pass

    def close(self) -> None:
        pass


class StoreRuleWorker(PagedRuleWorker):
    """A PagedRuleWorker with a shared KV tier: ``store`` (block_hash -> the page's token ids, shared by the workers
    of a test) is its KV store. It writes what a step's store_writes name (and reports them to ``kv`` as
    ReportTier would, once "acknowledged"), and fills store_loads from it; an item with a value missing from the
    store is answered in ``unloaded`` and the value reported missing."""

    def __init__(self, kv: InProcessKVManager, store: dict, worker_id: str = "w0", **kw):
        super().__init__(worker_id, **kw)
        self.kv, self.store = kv, store
        self.num_loaded_pages = 0
        self.batches: list[StepBatch] = []

    @property
    def info_now(self) -> WorkerInfo:
        return dataclasses.replace(super().info_now, kv_store=True)

    def step(self, batch: StepBatch, traceparents=NO_TRACES) -> StepOutput:
        self.batches.append(batch)
        if batch.epoch and batch.epoch != self.epoch:
            return super().step(batch, traceparents)  # raises WorkerRestarted
        written = []
        for w in batch.store_writes:
            self.store[w.block_hash] = [self.slots.get(w.page_id * self.page_size + o, -1)
                                        for o in range(self.page_size)]
            written.append(StoredBlock(w.block_hash, w.tenant, 100))
        unloaded, missing, loaded = [], [], 0
        for item in batch.items:
            for load in item.store_loads:
                page = self.store.get(load.block_hash)
                if page is None:
                    missing.append(load.block_hash)
                    continue
                for o, token in enumerate(page):
                    self.slots[load.page_id * self.page_size + o] = token
                loaded += 1
            if any(load.block_hash in missing for load in item.store_loads):
                unloaded.append(item.req_id)
        if written or missing:
            self.kv.mgr.report_tier(TierReport(self.worker_id, self.epoch, tuple(written), tuple(missing)))
        self.num_loaded_pages += loaded
        items = tuple(i for i in batch.items if i.req_id not in unloaded)
        if not items:
            self.num_steps += 1
            return StepOutput([], 0, 0.0, unloaded=unloaded)
        out = super().step(dataclasses.replace(batch, items=items, store_writes=()), traceparents)
        out.unloaded, out.num_loaded_pages, out.load_ms = unloaded, loaded, 0.01 * loaded
        return out


class LockedKV(InProcessKVManager):
    """The in-process kvmanager, its calls serialised (several engine threads call it)."""

    def __init__(self):
        super().__init__()
        self.lock = threading.RLock()

    def register(self, spec, release_requests=False):
        with self.lock:
            return super().register(spec, release_requests)

    def step_pages(self, ops, traceparents=NO_TRACES):
        with self.lock:
            return super().step_pages(ops, traceparents)

    def place(self, tenant, token_ids, num_queued):
        with self.lock:
            return super().place(tenant, token_ids, num_queued)

    def place_among(self, tenant, token_ids, num_queued, worker_ids, pull_peers):
        with self.lock:
            return super().place_among(tenant, token_ids, num_queued, worker_ids, pull_peers)


class PinRecordingKV(LockedKV):
    """The in-process kvmanager, its calls serialised (two engine threads call it); ``pins``: req_id -> the
    pins its allocation carried."""

    def __init__(self):
        super().__init__()
        self.pins: dict[str, tuple[PinPoint, ...]] = {}

    def step_pages(self, ops, traceparents=NO_TRACES):
        with self.lock:
            self.pins.update((a.req_id, a.pins) for a in ops.allocations)
            return super().step_pages(ops, traceparents)
