"""The model runner: validates a step, runs one forward pass over the page pool, samples.

It keeps no scheduling state between steps: every step carries its page tables and positions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.common.attention_window import AttentionWindow
from kvserve.common.errors import InvalidRequest, StaleEpoch
from kvserve.common.wire.tier import TierCounters
from kvserve.common.wire.transfer import check_role
from kvserve.common.wire.worker import RejectedItem, SampledToken, StepBatch, StepItem, StepOutput, WorkerInfo
from kvserve.kernels.backends import get_backend
from kvserve.kernels.kv_quant import FORMAT_OF_DTYPE, KVFormat, kv_format
from kvserve.kernels.paged_attention import build_metadata
from kvserve.worker import page_groups
from kvserve.worker.config import ModelConfig, resolve_window
from kvserve.worker.gemma import GemmaDecoder
from kvserve.worker.kv_pool import PoolSize, allocate_pool, allocate_scales, size_pool
from kvserve.worker.layer_windows import SlidingGroup
from kvserve.worker.mla import MLADecoder
from kvserve.worker.model import LlamaDecoder
from kvserve.worker.sampler import non_finite_rows, sample
from kvserve.worker.tier import KVTier, store_client
from kvserve.worker.validate import SlidingGroupPages, validate_batch
from kvserve.worker.weights import load_weights, model_fingerprint

DEFAULT_KV_CACHE_BYTES = 512 * 1024 * 1024
# With attention sinks the positions a model sees stay below sinks + window however long a request runs, so a
# worker takes requests of any length: its max_model_len is this (an int32 field on the wire).
MAX_SINK_POSITIONS = (1 << 31) - 1
log = logging.getLogger("kvserve.worker")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    model_dir: Path
    worker_id: str = "worker-0"
    device: str = "auto"  # "auto" = cuda when present, else cpu
    dtype: str = "auto"  # "auto" = bfloat16 on cuda, float32 on cpu
    page_size: int = 16
    kv_cache_bytes: int | None = None  # default DEFAULT_KV_CACHE_BYTES when num_pages is None too
    num_pages: int | None = None
    attention_backend: str = "auto"
    max_step_tokens: int = 16384
    kv_cache_dtype: str = "auto"  # "auto" = the model dtype; or a name in kvserve/kernels/kv_quant.py's FORMATS
    kv_scales: str = "token_head"  # scales of a quantised cache: "token_head" (stored per token, kv head) or "tensor"
    sliding_window: int = 0  # attend to the last W positions (0: the model's own window, if it has one)
    attention_sinks: int = 0  # with sliding_window: the first S tokens stay visible (StreamingLLM)
    cuda_graphs: bool = True  # on CUDA with the triton backend: pure-decode steps replay CUDA graphs
    cuda_graph_max_seqs: int = 64  # the largest decode batch captured (larger ones run eagerly)
    kv_store_url: str = ""  # the shared KV tier's store (a Redis URL, as common/redis_client.py takes); "" = none
    role: str = "both"  # the work the gateway sends it: "prefill", "decode" or "both" (common/wire/transfer.py)
    # A model mixing sliding and full layers keeps the sliding layers' pages in a pool of their own, released out
    # of the window (worker/page_groups.py: when it falls back to one pool). Off here, so that drivers handing the
    # runner one page table per item keep working; `kvserve worker` turns it on unless --no-page-groups.
    page_groups: bool = False
    sliding_group_pages: int | None = None  # pages of the sliding layers' pool; None: page_groups.size_groups's


@dataclass(frozen=True, slots=True)
class TierPart:
    """One part of a step's store traffic (the write snapshot, or the loads): its wall-clock span and the tier's
    counters around it."""

    start_ns: int
    end_ns: int
    before: TierCounters
    after: TierCounters


@dataclass(slots=True)
class TierStep:
    """What a step's store traffic did, for its spans (kvserve/worker/spans.py): ModelRunner.step fills the parts the
    step had, and its caller takes it (take_tier_step). Only the compute thread snapshots and loads, so a part's load
    counters are its own; the writer thread may drop a write during a snapshot, and that drop is in the
    snapshot's counters too."""

    snapshot: TierPart | None = None
    load: TierPart | None = None

    @contextlib.contextmanager
    def part(self, name: str, tier: KVTier):
        before, start_ns = tier.stats(), time.time_ns()
        yield
        setattr(self, name, TierPart(start_ns, time.time_ns(), before, tier.stats()))


def resolve_kv_format(kv_cache_dtype: str, dtype: torch.dtype) -> KVFormat:
    """The pool's element type: ``auto`` is the model dtype's. ValueError on an unknown name."""
    return FORMAT_OF_DTYPE[dtype] if kv_cache_dtype == "auto" else kv_format(kv_cache_dtype)


def resolve_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    if dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    return dev, DTYPES[dtype]


class ModelRunner:
    """Owns the weights and the KV pool of one worker incarnation. Thread-safe: steps run one at a time, on
    one compute thread."""

    def __init__(self, cfg: RunnerConfig, compute: ThreadPoolExecutor | None = None, make_weights=None):
        """Loads the model and allocates the pool on the compute thread.

        make_weights: ``(model_cfg, dtype, device) -> ModelWeights`` instead of reading the folder's safetensors
        (e.g. weights.random_weights: GPU checks and benchmarks of a model shape, no download; the folder then
        needs only its config.json).

        compute: an executor with exactly one thread, to run all torch work on (default: one of its own).
        Share it with any other torch work in the process: libgomp gives every thread that runs a parallel
        region a team of its own, and once the teams together hold more threads than there are cores it stops
        spin-waiting, which costs decode throughput where cores are few.
        """
        self.cfg = cfg
        check_role(cfg.role)
        self._compute = compute or ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-compute")
        self.device, self.dtype = resolve_device_dtype(cfg.device, cfg.dtype)
        self.model_cfg = ModelConfig.from_folder(cfg.model_dir)
        self.window = resolve_window(self.model_cfg, cfg.sliding_window, cfg.attention_sinks, cfg.page_size)
        self.groups, why_not = page_groups.plan(self.model_cfg, enabled=cfg.page_groups,
                                                kv_store=bool(cfg.kv_store_url), role=cfg.role,
                                                sinks=self.window.sinks, page_size=cfg.page_size)
        self.pool_size, self.group_size = self._size_pools()
        self.page_groups_note = page_groups.describe(self.groups, why_not, self.group_size)
        self._group_pages = None if self.groups is None else \
            SlidingGroupPages(self.group_size.num_pages, AttentionWindow(self.groups.window))  # steps' validation
        self.epoch = time.time_ns()
        self._make_weights = make_weights or (lambda m, dtype, device: load_weights(cfg.model_dir, m, dtype, device))
        self.call(self._load)
        self.tier = self._make_tier() if cfg.kv_store_url else None
        self._seen = threading.local()  # each calling thread's last TierStep, until take_tier_step()
        self.info = self._describe(model_fingerprint(cfg.model_dir) if make_weights is None else "made-weights")

    def _size_pools(self) -> tuple[PoolSize, PoolSize | None]:
        """The pool (with page groups: the full layers' one) and the sliding layers' pool, or None."""
        cfg = self.cfg
        budget = cfg.kv_cache_bytes
        if budget is None and cfg.num_pages is None:
            budget = DEFAULT_KV_CACHE_BYTES
        fmt = resolve_kv_format(cfg.kv_cache_dtype, self.dtype)
        if self.groups is None:
            return size_pool(self.model_cfg, fmt, cfg.page_size, kv_scales=cfg.kv_scales, kv_cache_bytes=budget,
                             num_pages=cfg.num_pages), None
        return page_groups.size_groups(self.model_cfg, self.groups, fmt, cfg.page_size, kv_scales=cfg.kv_scales,
                                       kv_cache_bytes=budget, num_pages=cfg.num_pages,
                                       sliding_group_pages=cfg.sliding_group_pages,
                                       max_model_len=self.model_cfg.max_position_embeddings)

    def _load(self) -> None:
        self._compute_thread = threading.get_ident()
        # the backend first: one that cannot read this pool's element type fails before any pool is allocated
        backend = get_backend(self.cfg.attention_backend, self.device, self.dtype, self.pool_size.fmt.name,
                              self.pool_size.page_size)
        self.kv_cache = allocate_pool(self.model_cfg, self.pool_size, self.device)
        self.kv_scales = allocate_scales(self.model_cfg, self.pool_size, self.device)
        self.group_cache = self.group_scales = None
        if self.group_size is not None:  # page groups: the sliding layers' pool
            self.group_cache = allocate_pool(self.model_cfg, self.group_size, self.device)
            self.group_scales = allocate_scales(self.model_cfg, self.group_size, self.device)
        weights = self._make_weights(self.model_cfg, self.dtype, self.device)
        decoder = GemmaDecoder if self.model_cfg.gemma is not None else LlamaDecoder
        if self.model_cfg.mla is not None:  # DeepSeek-V2/V3: multi-head latent attention
            decoder = MLADecoder
        self.model = decoder(self.model_cfg, weights, backend)
        self.cuda = self._cuda_step() if self.device.type == "cuda" else None
        self._rng = torch.Generator(device=self.device).manual_seed(self.epoch & 0x7FFFFFFF)

    def _cuda_step(self):
        """The CUDA forward path (kvserve/worker/cuda_step.py): one stream, pinned staging, decode graphs."""
        from kvserve.worker.cuda_step import CudaStep

        return CudaStep(self.model, self.kv_cache, self.kv_scales, self.pool_size.page_size, self.window,
                        self.cfg.cuda_graphs, self.cfg.cuda_graph_max_seqs,
                        self.model_cfg.max_position_embeddings, self._sliding if self.groups else None)

    def _sliding(self, items, device: torch.device) -> SlidingGroup | None:
        """With page groups, the sliding layers' side of a step (its metadata built on ``device``); else None."""
        if self.groups is None:
            return None
        return page_groups.sliding_step(items, self.groups, self.pool_size.page_size, self.group_cache,
                                        self.group_scales, device)

    def _make_tier(self) -> KVTier:
        """The shared KV tier over this pool. It reports to no kvmanager (so writes nothing) until the worker
        joins one: tier.set_report(). Never with page groups (page_groups.plan: the store holds every layer)."""
        assert self.groups is None, "a worker with page groups has no shared KV tier"
        return KVTier(store_client(self.cfg.kv_store_url), self.kv_cache, self.kv_scales, None,
                      self.cfg.worker_id, lambda: self.epoch)

    @property
    def transfers_off(self) -> str:
        """Why no page moves to or from another worker ("" when pages may): with page groups a page's K/V is in
        two pools, and transfers move one (page_groups.plan keeps grouped workers to role both)."""
        return "it keeps page groups (its sliding layers' K/V in a pool apart)" if self.groups else ""

    def close_tier(self, timeout_s: float) -> None:
        """Writes and reports what the tier has queued (for up to ``timeout_s``), then stops it. Call once no
        step runs any more (a graceful stop)."""
        if self.tier is not None:
            if not self.tier.flush(timeout_s):
                log.warning("kv store: queued writes or reports not done within %.1fs; dropped", timeout_s)
            self.tier.close()

    def call(self, fn, *args, **kwargs):
        """Runs ``fn`` on the compute thread and returns its result (re-raising its exception). Re-entrant:
        called on the compute thread, it runs ``fn`` inline."""
        if threading.get_ident() == getattr(self, "_compute_thread", None):
            return fn(*args, **kwargs)
        return self._compute.submit(fn, *args, **kwargs).result()

    def _describe(self, fingerprint: str) -> WorkerInfo:
        m, s = self.model_cfg, self.pool_size
        return WorkerInfo(
            worker_id=self.cfg.worker_id, epoch=self.epoch, model_name=Path(self.cfg.model_dir).name,
            model_fingerprint=fingerprint, page_size=s.page_size, num_pages=s.num_pages,
            kv_dtype=s.fmt.name, kv_scales=s.kv_scales, bytes_per_token=s.bytes_per_token,
            pool_bytes=s.pool_bytes, num_layers=m.num_layers, num_kv_heads=m.num_kv_heads,
            num_heads=m.num_heads, head_dim=m.head_dim, vocab_size=m.vocab_size,
            max_model_len=MAX_SINK_POSITIONS if self.window.sinks else m.max_position_embeddings,
            eos_token_ids=m.eos_token_ids,
            device=str(self.device), attention_backend=self.model.backend.name,
            sliding_window=self.window.window, attention_sinks=self.window.sinks, kv_store=self.tier is not None,
            role=self.cfg.role,
            sliding_group_pages=self.group_size.num_pages if self.group_size else 0,
            sliding_group_window=self.groups.window if self.groups else 0,
            sliding_group_bytes_per_token=self.group_size.bytes_per_token if self.group_size else 0,
        )

    def renew_epoch(self) -> int:
        """Becomes a new incarnation (the kvmanager forgot this one: its lease lapsed, or it was declared dead):
        from now on steps addressed to the old epoch are refused with StaleEpoch, as after a restart, and Info
        reports the new one. The pool's bytes stay; the kvmanager hands its pages out afresh. Returns it."""
        self.epoch = max(time.time_ns(), self.epoch + 1)
        self.info = dataclasses.replace(self.info, epoch=self.epoch)
        return self.epoch

    def step(self, batch: StepBatch) -> StepOutput:
        """Runs one step. Raises InvalidRequest for a step malformed as a whole (nothing computed) or StaleEpoch.
        An item malformed alone, or whose logits come out non-finite, is answered in StepOutput.rejected and
        the others are computed. Before the forward pass the step's store writes are copied and its items'
        store loads filled; an item whose loads failed is not computed (StepOutput.unloaded). A step of store
        writes and no item copies them and computes nothing. The store traffic's timing and counters are this
        thread's take_tier_step() afterwards (for the step's spans)."""
        seen = self._seen.tier_step = TierStep()
        if batch.epoch and batch.epoch != self.epoch:
            raise StaleEpoch(f"step addressed epoch {batch.epoch}, but this worker is epoch {self.epoch}")
        info = self.info
        malformed = validate_batch(batch, vocab_size=info.vocab_size, num_pages=info.num_pages,
                                   page_size=info.page_size, max_model_len=info.max_model_len,
                                   max_step_tokens=self.cfg.max_step_tokens, window=self.window,
                                   sliding_group=self._group_pages)
        rejected = [RejectedItem(req_id, message) for req_id, message in malformed.items()]
        items = tuple(i for i in batch.items if i.req_id not in malformed)
        if not items and not batch.store_writes:
            return StepOutput(sampled=[], num_tokens=0, compute_ms=0.0, rejected=rejected)
        t0 = time.perf_counter()
        sampled, computed, load_s = self.call(self._run_with_tier, StepBatch(items, batch.epoch, batch.store_writes),
                                              rejected, seen)
        ms = (time.perf_counter() - t0 - load_s) * 1000
        kept = {i.req_id for i in computed}
        return StepOutput(sampled=sampled, num_tokens=sum(len(i.token_ids) for i in computed), compute_ms=ms,
                          rejected=rejected, unloaded=[i.req_id for i in items if i.req_id not in kept],
                          num_loaded_pages=sum(len(i.store_loads) for i in computed), load_ms=load_s * 1000)

    def take_tier_step(self) -> TierStep | None:
        """What the store traffic of the last step this thread ran did (None if it ran none since the last take):
        the servicer records its spans. A thread runs one step at a time, so it is that step's."""
        seen, self._seen.tier_step = getattr(self._seen, "tier_step", None), None
        return seen

    def _run_with_tier(self, batch: StepBatch, rejected: list[RejectedItem], seen: TierStep
                       ) -> tuple[list[SampledToken], tuple[StepItem, ...], float]:
        """The store's traffic, then the forward pass and sampling of the items whose loads succeeded. Returns
        the sampled tokens, the items computed and the loads' seconds."""
        items, load_s = self._store_traffic(batch, seen)
        return (self._run(StepBatch(items, batch.epoch), rejected) if items else []), items, load_s

    def _store_traffic(self, batch: StepBatch, seen: TierStep) -> tuple[tuple[StepItem, ...], float]:
        """Copies the pages of the step's store writes first (this step may overwrite them), then fills its
        items' store loads. Returns the items to compute (those whose loads all succeeded) and the loads'
        seconds. Without a store every item with loads fails them."""
        loads = {i.req_id: i.store_loads for i in batch.items if i.store_loads}
        if self.tier is None:
            return tuple(i for i in batch.items if i.req_id not in loads), 0.0
        if batch.store_writes:
            with seen.part("snapshot", self.tier):
                self.tier.snapshot_writes(batch.store_writes)
        if not loads:
            return batch.items, 0.0
        t0 = time.perf_counter()
        with seen.part("load", self.tier):
            failed = self.tier.load(loads)
        return tuple(i for i in batch.items if i.req_id not in failed), time.perf_counter() - t0

    def _run(self, batch: StepBatch, rejected: list[RejectedItem] | None = None):
        """The forward pass and sampling of a validated batch; an item whose logits are non-finite is not sampled
        and goes to ``rejected``."""
        items, rejected = batch.items, [] if rejected is None else rejected
        rows = [r for r, i in enumerate(items) if i.sample]
        hidden = self._forward(items, rows) if self.cuda is None else self.cuda.forward(items, rows)
        if not rows:
            return []
        with torch.inference_mode():
            logits = self.model.logits(hidden)
        bad = non_finite_rows(logits)
        if bad:
            rejected += [RejectedItem(items[rows[k]].req_id, f"item {items[rows[k]].req_id!r}: its logits hold a "
                                      f"NaN or an infinity at position {items[rows[k]].end_pos}", invalid=False)
                         for k in bad]
            keep = sorted(set(range(len(rows))) - set(bad))
            logits, rows = logits[keep], [rows[k] for k in keep]
            if not rows:
                return []
        chosen = [items[r] for r in rows]
        return sample([i.req_id for i in chosen], logits, [i.sampling for i in chosen],
                      [i.end_pos for i in chosen], self._rng, stats=self.model.backend.argmax_logsumexp)

    def _forward(self, items, rows: list[int]) -> torch.Tensor | None:
        """The forward pass on this device; hidden states of the last token of each item in ``rows``."""
        meta = build_metadata([i.start_pos for i in items], [len(i.token_ids) for i in items],
                              [list(i.page_table) for i in items], self.pool_size.page_size, self.device,
                              self.window)
        tokens = torch.tensor([t for i in items for t in i.token_ids], dtype=torch.int64, device=self.device)
        sliding = self._sliding(items, self.device)
        hidden = self.model.forward(tokens, meta, self.kv_cache, self.kv_scales, *([sliding] if sliding else []))
        if not rows:
            return None
        last = meta.cu_q_lens[1:][torch.tensor(rows, device=self.device)] - 1  # last token of each sampled item
        return hidden[last]


__all__ = ["InvalidRequest", "ModelRunner", "RunnerConfig", "StaleEpoch", "WorkerInfo"]
