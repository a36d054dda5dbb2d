"""The engine core over a ModelRunner with a shared KV tier, in this process (as llm.py's LLM, whose kvmanager
has no tier): the kvmanager's store index is on, and the runner's KVTier reports to it, so that a prompt's
blocks are written to the store and a revisit loads them. For token comparisons without processes.

    llm = TierLLM(runner)                 # runner: a ModelRunner made with kv_store_url
    llm.generate(prompts, max_tokens)     # computes, writes the committed blocks
    llm.settle(); llm.evict_pool()        # every write recorded; the pool forgets the blocks, the store keeps them
    llm.generate(prompts, max_tokens)     # loads the prefixes from the store
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

from kvserve.common.telemetry import NO_TRACES
from kvserve.common.wire.pages import PoolSpec, RegisterResult, StepOps, StepResults
from kvserve.common.wire.tier import TierReport
from kvserve.kvmanager import admin
from kvserve.kvmanager.manager import KVManager
from kvserve.services.gateway.core import EngineCore, scheduler_config
from kvserve.services.gateway.inprocess import InProcessKVManager, InProcessWorker
from kvserve.services.gateway.llm import LLM
from kvserve.services.gateway.validate import Limits

TENANT = "local"  # LLM's requests' tenant
STORE_BYTES = 256 << 20
SETTLE_S = 30.0


class LockedKVManager(InProcessKVManager):
    """The in-process kvmanager, its calls serialised as the kvmanager's service serialises them: the engine
    core steps on the caller's thread, the tier reports on the runner's reporter thread."""

    def __init__(self, mgr: KVManager):
        super().__init__(mgr)
        self.lock = threading.Lock()

    def register(self, spec: PoolSpec, release_requests: bool = False) -> RegisterResult:
        with self.lock:
            return super().register(spec, release_requests)

    def step_pages(self, ops: StepOps, traceparents: Mapping[str, str] = NO_TRACES) -> StepResults:
        with self.lock:
            return super().step_pages(ops, traceparents)

    def place(self, tenant: str, token_ids: Sequence[int], num_queued: dict[str, int]) -> str:
        with self.lock:
            return super().place(tenant, token_ids, num_queued)

    def place_among(self, tenant, token_ids, num_queued, worker_ids, pull_peers):
        with self.lock:
            return super().place_among(tenant, token_ids, num_queued, worker_ids, pull_peers)

    def report_tier(self, report: TierReport) -> None:
        with self.lock:
            self.mgr.report_tier(report)


class TierLLM(LLM):
    def __init__(self, runner, *, max_num_batched_tokens: int = 64, store_bytes: int = STORE_BYTES):
        """``runner``: a ModelRunner with a KVTier (RunnerConfig.kv_store_url). Small prefill chunks by
        default, so that a prompt's computed tail is prefilled in several chunks after its loaded pages."""
        assert runner.tier is not None, "the runner has no KV store (RunnerConfig.kv_store_url)"
        info = runner.info
        self.runner = runner
        self.kv = LockedKVManager(KVManager(store_capacity_bytes=store_bytes))
        self.kv.register(PoolSpec.of(info))
        runner.tier.set_report(self.kv.report_tier)
        cfg = scheduler_config(info, max_num_seqs=64, max_num_batched_tokens=max_num_batched_tokens)
        self.core = EngineCore(InProcessWorker(runner), info, self.kv, cfg)
        pool_tokens = info.attention_window().max_request_tokens(info.max_model_len, info.num_pages * info.page_size)
        self.limits = Limits(info.max_model_len, pool_tokens, info.vocab_size, max_tokens_limit=info.max_model_len)

    @property
    def mgr(self) -> KVManager:
        return self.kv.mgr

    def settle(self) -> None:
        """Waits until every queued write is written and reported (so recorded in the index)."""
        assert self.runner.tier.flush(SETTLE_S), f"the tier's writes were not reported within {SETTLE_S:g} s"

    def evict_pool(self) -> int:
        """Evicts the tenant's cached blocks from the pool (not from the store); returns how many."""
        with self.kv.lock:
            return admin.evict_tenant(self.mgr, TENANT, worker_id=self.runner.info.worker_id).num_evicted_blocks
