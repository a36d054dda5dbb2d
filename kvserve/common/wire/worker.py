"""A worker's step and its answer, as plain data: one batch of items in, sampled tokens out; and the worker's
description (Info). The gateway builds them, the worker's servicer and runner read them."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.common.attention_window import AttentionWindow
from kvserve.common.wire.tier import StoreLoad, StoreWrite

GREEDY_BELOW_TEMPERATURE = 1e-5  # as vLLM's sampling epsilon: below it, sampling is greedy


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0  # 1 = disabled
    seed: int | None = None  # None = nondeterministic
    top_logprobs: int = 0  # alternatives returned per sampled token

    @property
    def greedy(self) -> bool:
        """0, or a temperature too small to divide logits by (they would overflow to inf, softmax to NaN)."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE


@dataclass(frozen=True, slots=True)
class StepItem:
    """Computes positions [start_pos, start_pos + len(token_ids)) of one request."""

    req_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    page_table: tuple[int, ...]
    sample: bool = True
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Pages of its cached prefix to fill from the shared KV tier's store before it computes (with its first
    # chunk). If any load fails, the item is not computed: StepOutput.unloaded.
    store_loads: tuple[StoreLoad, ...] = ()
    # A grouped pool: the sliding layers' page table (HOLE where released), beside page_table (the full layers')
    group_page_table: tuple[int, ...] = ()

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class StepBatch:
    items: tuple[StepItem, ...]  # empty only in a writes-only step (store_writes not empty)
    epoch: int = 0  # 0 = unchecked
    # Committed pages to copy (before the forward pass) and write to the shared KV tier's store in the background
    store_writes: tuple[StoreWrite, ...] = ()


@dataclass(slots=True)
class SampledToken:
    req_id: str
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass(frozen=True, slots=True)
class RejectedItem:
    """An item the worker rejected alone: its request fails, the step's other items are answered."""

    req_id: str
    message: str  # what was wrong, naming the field; or that its logits came out non-finite
    invalid: bool = True  # malformed input, nothing written (INVALID_ARGUMENT); False: non-finite logits (INTERNAL)


@dataclass(slots=True)
class StepOutput:
    sampled: list[SampledToken]  # one per item with sample=True and not rejected, in item order
    num_tokens: int
    compute_ms: float
    rejected: list[RejectedItem] = field(default_factory=list)  # items answered with no token: their requests fail
    unloaded: list[str] = field(default_factory=list)  # req_ids not computed: their store loads failed (recompute)
    num_loaded_pages: int = 0  # pages filled from the store, verified, for the items computed
    load_ms: float = 0.0  # wall time of the step's store loads (not part of compute_ms)


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    worker_id: str
    epoch: int
    model_name: str
    model_fingerprint: str
    page_size: int
    num_pages: int
    kv_dtype: str
    bytes_per_token: int
    pool_bytes: int
    num_layers: int
    num_kv_heads: int
    num_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    device: str
    attention_backend: str
    kv_scales: str = ""  # a quantised pool's scale scheme: "token_head" or "tensor"; "" for the others
    sliding_window: int = 0  # tokens of K/V attention reads back (the window); 0 = the whole sequence
    attention_sinks: int = 0  # leading tokens kept beside the window (StreamingLLM); 0 = none
    kv_store: bool = False  # it reads and writes the shared KV tier (--kv-store-url)
    role: str = "both"  # "prefill", "decode" or "both": the work the gateway sends it (--role)
    # Page groups (PoolSpec's fields of the same names): the sliding layers' pool, beside the full layers' above
    sliding_group_pages: int = 0
    sliding_group_window: int = 0
    sliding_group_bytes_per_token: int = 0

    def attention_window(self) -> AttentionWindow:
        """The policy of which positions this worker's requests keep. Raises InvalidRequest for bad settings."""
        return AttentionWindow.checked(self.sliding_window, self.attention_sinks, self.page_size)
