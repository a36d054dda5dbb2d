"""The exact KV-cache memory calculator behind ``kvserve kv-mem``: pure arithmetic over a model's shape
(kvserve/common/kvmem_models.py reads it from a built-in table or a config.json).

Per token, grouped-query (or multi-head) attention caches one K and one V vector per KV head per layer::

    bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * bytes_per_element

Multi-head latent attention (DeepSeek-V2/V3) caches one compressed latent per token per layer instead::

    bytes_per_token = num_layers * (kv_lora_rank + qk_rope_head_dim) * bytes_per_element

A quantised cache (int8, fp8 e4m3 / e5m2: 1-byte elements) with the default ``token_head`` scales also stores one
fp32 scale per token per KV head per layer, for K and for V::

    bytes_per_token = 2 * num_layers * num_kv_heads * (head_dim * 1 + 4)

(``tensor`` scales: one per-tensor scale of 1.0, nothing stored per token). A sequence holds
``tokens * bytes_per_token``; a batch ``batch`` of them. On top of that: page padding (``ceil(tokens / page_size)``
whole pages), a sliding window with attention sinks (only
``min(seq_len, window + sinks)`` tokens kept), and the reverse question: given GPU memory and weights, how many
tokens, or requests of a given length, fit.

The worker sizes its page pool with :func:`kv_bytes_per_token` (``kvserve/worker/kv_pool.py``), so the two agree by
construction. Every entry point raises :class:`KvMemError` (a ``ValueError``) with a one-line message on bad input.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

from kvserve.common.attention_window import AttentionWindow
from kvserve.common.pages import num_pages_for
from kvserve.common.wire.tier import PAGE_VALUE_HEADER_BYTES

if TYPE_CHECKING:
    from kvserve.common.kvmem_models import ModelSpec

GIB = 1 << 30


class KvMemError(ValueError):
    """Bad calculator input: an unknown model or dtype, a non-positive size, weights that do not fit."""


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int,
                       scale_bytes: int = 0) -> int:
    """Exact KV-cache bytes of one token: K and V, every layer, every KV head, each head's elements and its scale
    (``scale_bytes``: 4 for a quantised cache's per-token-head fp32 scale, else 0). The worker's pool uses this."""
    return 2 * num_layers * num_kv_heads * (head_dim * dtype_bytes + scale_bytes)


def mla_bytes_per_token(num_layers: int, latent_dim: int, dtype_bytes: int) -> int:
    """Exact MLA cache bytes of one token: one compressed latent (kv_lora_rank + qk_rope_head_dim) per layer."""
    return num_layers * latent_dim * dtype_bytes


# --- element types ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KvDtype:
    name: str
    bytes: int
    note: str = ""
    scale_bytes: int = 0  # bytes of one per-(token, KV head) scale of a quantised cache (fp32), for K and for V


SCALE_SCHEMES = ("token_head", "tensor")
_QUANTISED = ("with token_head scales (the default), one fp32 scale per token per KV head per layer for K and one "
              "for V (MLA: one per token per layer), counted as scale overhead; with tensor scales one per-tensor "
              "scale, nothing per token")
DTYPES: dict[str, KvDtype] = {
    "fp32": KvDtype("fp32", 4),
    "bf16": KvDtype("bf16", 2),
    "fp16": KvDtype("fp16", 2),
    "fp8_e4m3": KvDtype("fp8_e4m3", 1, scale_bytes=4, note=f"fp8_e4m3 stores 1-byte elements {_QUANTISED}"),
    "fp8_e5m2": KvDtype("fp8_e5m2", 1, scale_bytes=4, note=f"fp8_e5m2 stores 1-byte elements {_QUANTISED}"),
    "int8": KvDtype("int8", 1, scale_bytes=4, note=f"int8 stores 1-byte elements {_QUANTISED}"),
}
DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
                 "fp8": "fp8_e4m3", "fp8-e4m3": "fp8_e4m3", "e4m3": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3",
                 "fp8-e5m2": "fp8_e5m2", "e5m2": "fp8_e5m2", "float8_e5m2": "fp8_e5m2"}


def check_scales(scales: str) -> str:
    if scales not in SCALE_SCHEMES:
        raise KvMemError(f"unknown --kv-scales {scales!r}; known: {', '.join(SCALE_SCHEMES)}")
    return scales


def get_dtype(name: str, what: str = "--kv-dtype") -> KvDtype:
    key = str(name).strip().lower()
    key = DTYPE_ALIASES.get(key, key)
    if key not in DTYPES:
        raise KvMemError(f"unknown {what} {name!r}; known: {', '.join(DTYPES)}")
    return DTYPES[key]


# --- models -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PerToken:
    kv_bytes: int  # the cached elements
    scale_bytes: int  # a quantised dtype's per-token scales, else 0
    bytes: int  # kv_bytes + scale_bytes
    formula: str
    scale_formula: str = ""


@dataclass(frozen=True, slots=True)
class Paging:
    page_size: int
    pages_per_sequence: int
    allocated_tokens_per_sequence: int
    allocated_bytes_per_sequence: int
    padding_tokens_per_sequence: int
    padding_bytes_per_sequence: int
    padding_percent: float  # padding / allocated
    total_pages: int
    total_allocated_bytes: int
    total_padding_bytes: int


DEFAULT_PAGE_SIZE = 16  # the workers' default


@dataclass(frozen=True, slots=True)
class StoreSizing:
    """The shared KV tier (--kv-store-bytes): one value per page, its header included."""

    store_bytes: int
    page_size: int
    value_bytes: int  # PAGE_VALUE_HEADER_BYTES + page_size x bytes per token
    max_pages: int
    max_tokens: int
    max_sequences: int  # of --seq-len (their kept tokens' full pages: only full pages are stored)


@dataclass(frozen=True, slots=True)
class Capacity:
    gpu_memory_bytes: int
    memory_utilization: float
    usable_bytes: int  # floor(gpu_memory * memory_utilization)
    weights_bytes: int
    weights_source: str
    reserve_bytes: int
    kv_budget_bytes: int  # usable - weights - reserve
    max_tokens: int  # page-rounded down when paged
    max_pages: int | None
    request_tokens: int  # tokens one request of --seq-len keeps (window cap applied)
    request_pages: int | None
    request_bytes: int  # bytes one request takes (whole pages when paged)
    max_concurrent_requests: int
    batch_fits: bool  # the requested batch x seq_len fits in the KV budget


@dataclass(frozen=True, slots=True)
class PageGroups:
    """A model of sliding and full layers mixed (Gemma 3), per sequence: what its page table per layer group holds
    (the worker's page groups, as vLLM's hybrid KV cache manager: sliding layers release what their window left
    behind), against every layer's pages (a worker without page groups; docs/features/models.md#page-groups)."""

    full_layers: int
    sliding_layers: int
    window: int
    full_tokens: int  # every token (whole pages when paged)
    sliding_tokens: int  # the window's (its pages while a decode step runs, when paged)
    bytes_per_sequence: int  # full layers x full tokens + sliding layers x sliding tokens
    every_page_bytes: int  # every layer x full tokens: what one pool for every layer holds
    saving: float  # every_page_bytes / bytes_per_sequence


@dataclass(frozen=True, slots=True)
class KvMemReport:
    model: ModelSpec
    kv_dtype: KvDtype
    kv_scales: str  # the scale scheme of a quantised dtype, "" for the others
    per_token: PerToken
    batch: int
    seq_len: int
    sliding_window: int | None  # the effective window (None: full attention)
    sinks: int
    tokens_per_sequence: int  # min(seq_len, window + sinks), or seq_len
    bytes_per_sequence: int
    total_tokens: int
    total_bytes: int
    paging: Paging | None = None
    capacity: Capacity | None = None
    notes: tuple[str, ...] = ()
    store: StoreSizing | None = None
    page_groups: PageGroups | None = None

    def to_dict(self) -> dict:
        """JSON-ready: every figure in bytes, tokens or pages (ints)."""
        return {
            "model": self.model.to_dict(),
            "kv_dtype": self.kv_dtype.name,
            "kv_scales": self.kv_scales,
            "dtype_bytes": self.kv_dtype.bytes,
            "per_token": asdict(self.per_token),
            "bytes_per_token": self.per_token.bytes,
            "batch": self.batch,
            "seq_len": self.seq_len,
            "sliding_window": self.sliding_window,
            "sinks": self.sinks,
            "tokens_per_sequence": self.tokens_per_sequence,
            "bytes_per_sequence": self.bytes_per_sequence,
            "total_tokens": self.total_tokens,
            "total_bytes": self.total_bytes,
            "total_gib": self.total_bytes / GIB,
            "paging": asdict(self.paging) if self.paging else None,
            "capacity": asdict(self.capacity) if self.capacity else None,
            "store": asdict(self.store) if self.store else None,
            "page_groups": asdict(self.page_groups) if self.page_groups else None,
            "notes": list(self.notes),
        }


def _check_positive(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise KvMemError(f"{what} must be a positive integer, got {value!r}")
    return value


def _check_non_negative(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise KvMemError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def per_token(model: ModelSpec, dtype: KvDtype, scales: str = "token_head") -> PerToken:
    """Bytes of one cached token, with the formula filled in; ``scales`` is the scheme of a quantised dtype."""
    b, L = dtype.bytes, model.num_layers
    scale_bytes = dtype.scale_bytes if check_scales(scales) == "token_head" else 0
    elem = f"{b} B ({dtype.name})"
    if model.attention == "mla":
        kv = mla_bytes_per_token(L, model.latent_dim, b)
        formula = f"{L} layers x {model.latent_dim} latent x {elem} = {kv:,} B"
        scale_total = L * scale_bytes
        scale_formula = f"{L} layers x {scale_bytes} B (fp32 scale) = {scale_total:,} B" if scale_total else ""
        total = kv + scale_total
    else:
        kv = kv_bytes_per_token(L, model.num_kv_heads, model.head_dim, b)
        formula = f"2 x {L} layers x {model.num_kv_heads} kv heads x {model.head_dim} head_dim x {elem} = {kv:,} B"
        total = kv_bytes_per_token(L, model.num_kv_heads, model.head_dim, b, scale_bytes)
        scale_total = total - kv
        scale_formula = (f"2 x {L} layers x {model.num_kv_heads} kv heads x {scale_bytes} B (fp32 scale) "
                         f"= {scale_total:,} B" if scale_total else "")
    return PerToken(kv_bytes=kv, scale_bytes=scale_total, bytes=total, formula=formula, scale_formula=scale_formula)


def weights_bytes_from_params(params: float, dtype: KvDtype) -> int:
    return int(round(params)) * dtype.bytes


def calculate(
    model: ModelSpec,
    *,
    batch: int = 1,
    seq_len: int | None = None,
    kv_dtype: str | None = None,
    kv_scales: str = "token_head",
    page_size: int | None = None,
    sliding_window: int | None = None,
    sinks: int = 0,
    gpu_memory: int | None = None,
    weights_bytes: int | None = None,
    weights_dtype: str = "bf16",
    memory_utilization: float = 0.9,
    reserve: int = 0,
    store_bytes: int | None = None,
) -> KvMemReport:
    """The full answer. ``seq_len`` None: the model's max context. ``kv_dtype`` None: the model's own dtype.
    ``kv_scales``: the scale scheme of a quantised dtype (token_head or tensor).
    ``sliding_window`` None: the model's own window; 0: none. ``gpu_memory`` set: also the reverse question.
    ``store_bytes`` set: what a shared KV tier of that size holds (pages of ``page_size``, default 16).

    Raises KvMemError on bad input, or when weights + reserve exceed the usable GPU memory.
    """
    _check_positive(batch, "--batch")
    if seq_len is None:
        if model.max_context is None:
            raise KvMemError(f"{model.name} has no max context in its config; give --seq-len")
        seq_len = model.max_context
    _check_positive(seq_len, "--seq-len")
    dtype = get_dtype(kv_dtype or model.default_kv_dtype)
    if page_size is not None:
        _check_positive(page_size, "--page-size")
    _check_non_negative(sinks, "--sinks")
    if sliding_window is not None:
        _check_non_negative(sliding_window, "--sliding-window")
    window = model.sliding_window if sliding_window is None else (sliding_window or None)
    if sinks and not window:
        raise KvMemError(f"--sinks needs a sliding window ({model.name} has none; give --sliding-window W)")

    notes = [n for n in (dtype.note,) if n]
    if model.attention == "mla":
        notes.append("MLA caches one compressed latent per token per layer (kv_lora_rank + qk_rope_head_dim): "
                     "no K/V factor 2, no heads")
    if model.max_context is not None and seq_len > model.max_context:
        notes.append(f"--seq-len {seq_len:,} exceeds {model.name}'s max context of {model.max_context:,}")
    if window:
        notes.append(f"sliding window {window:,} + {sinks} sinks: a sequence keeps its first {sinks} tokens and "
                     f"its last {window:,} (StreamingLLM)")

    pt = per_token(model, dtype, kv_scales)
    policy = AttentionWindow(window or 0, sinks)  # StreamingLLM keeps the first sinks plus the last window
    tokens = policy.tokens_kept(seq_len)
    paging = None
    if page_size is not None:  # a windowed sequence: its sink pages and its window's, not page-aligned
        pages = policy.pages_held(seq_len, page_size)
        alloc_tokens = pages * page_size
        pad = alloc_tokens - tokens
        paging = Paging(
            page_size=page_size, pages_per_sequence=pages, allocated_tokens_per_sequence=alloc_tokens,
            allocated_bytes_per_sequence=alloc_tokens * pt.bytes, padding_tokens_per_sequence=pad,
            padding_bytes_per_sequence=pad * pt.bytes, padding_percent=100.0 * pad / alloc_tokens,
            total_pages=batch * pages, total_allocated_bytes=batch * alloc_tokens * pt.bytes,
            total_padding_bytes=batch * pad * pt.bytes,
        )
    capacity = None
    if gpu_memory is not None:
        capacity = _capacity(model, pt, batch, tokens, paging, page_size, gpu_memory=gpu_memory,
                             weights_bytes=weights_bytes, weights_dtype=weights_dtype,
                             memory_utilization=memory_utilization, reserve=reserve)
    store = None
    if store_bytes is not None:
        store = store_sizing(pt.bytes, page_size or DEFAULT_PAGE_SIZE,
                             _check_positive(store_bytes, "--kv-store-bytes"), tokens)
    return KvMemReport(
        model=model, kv_dtype=dtype, kv_scales=kv_scales if dtype.scale_bytes else "", per_token=pt, batch=batch,
        seq_len=seq_len, sliding_window=window, sinks=sinks,
        tokens_per_sequence=tokens, bytes_per_sequence=tokens * pt.bytes, total_tokens=batch * tokens,
        total_bytes=batch * tokens * pt.bytes, paging=paging, capacity=capacity, notes=tuple(notes), store=store,
        page_groups=page_groups(model, pt, seq_len, page_size) if window is None else None,
    )


def page_groups(model: ModelSpec, pt: PerToken, seq_len: int, page_size: int | None) -> PageGroups | None:
    """For a model whose sliding and full layers mix: per sequence of ``seq_len`` tokens, a page table per layer
    group against every layer's pages (None for other models). Paged: the full layers' whole pages, and the most
    pages a sliding layer's window holds while a decode step runs (AttentionWindow.max_pages_held)."""
    if not model.sliding_layers or model.attention != "gqa":
        return None
    window = AttentionWindow(model.layer_window)
    if page_size is None:
        full, sliding = seq_len, window.tokens_kept(seq_len)
    else:
        full = num_pages_for(seq_len, page_size) * page_size
        sliding = window.max_pages_held(seq_len, page_size) * page_size
    per_layer = pt.bytes // model.num_layers
    num_full = model.num_layers - model.sliding_layers
    grouped = per_layer * (num_full * full + model.sliding_layers * sliding)
    every = per_layer * model.num_layers * full
    return PageGroups(num_full, model.sliding_layers, model.layer_window, full, sliding, grouped, every,
                      every / grouped)


def store_sizing(bytes_per_token: int, page_size: int, store_bytes: int, tokens_per_sequence: int) -> StoreSizing:
    """Pages, tokens and sequences a shared KV tier of ``store_bytes`` holds: the kvmanager counts each value's
    bytes (its header included) against --kv-store-bytes."""
    value = PAGE_VALUE_HEADER_BYTES + page_size * bytes_per_token
    pages = store_bytes // value
    full_pages = tokens_per_sequence // page_size
    sequences = pages // full_pages if full_pages else 0
    return StoreSizing(store_bytes, page_size, value, pages, pages * page_size, sequences)


def _capacity(model, pt, batch, tokens, paging, page_size, *, gpu_memory, weights_bytes, weights_dtype,
              memory_utilization, reserve) -> Capacity:
    _check_positive(gpu_memory, "--gpu-memory")
    _check_non_negative(reserve, "--reserve")
    if not isinstance(memory_utilization, (int, float)) or not 0 < memory_utilization <= 1:
        raise KvMemError(f"--memory-utilization must be in (0, 1], got {memory_utilization!r}")
    if weights_bytes is None:
        wdtype = get_dtype(weights_dtype, "--weights-dtype")
        if model.params is None:
            raise KvMemError(f"the parameter count of {model.name} is unknown; give --weights-bytes")
        weights_bytes = weights_bytes_from_params(model.params, wdtype)
        source = f"{params_text(model.params)} params x {wdtype.bytes} B ({wdtype.name})"
    else:
        _check_non_negative(weights_bytes, "--weights-bytes")
        source = "--weights-bytes"
    usable = math.floor(gpu_memory * Fraction(str(memory_utilization)))
    budget = usable - weights_bytes - reserve
    if budget <= 0:
        raise KvMemError(
            f"the weights ({weights_bytes:,} B = {weights_bytes / GIB:.2f} GiB) plus reserve ({reserve:,} B) do not "
            f"fit in the usable GPU memory ({gpu_memory:,} B x {memory_utilization} = {usable:,} B = "
            f"{usable / GIB:.2f} GiB)")
    if paging is None:
        max_pages, max_tokens = None, budget // pt.bytes
        request_pages, request_bytes = None, tokens * pt.bytes
        requests = budget // request_bytes
        need = batch * request_bytes
    else:
        max_pages = budget // (page_size * pt.bytes)
        max_tokens = max_pages * page_size
        request_pages, request_bytes = paging.pages_per_sequence, paging.allocated_bytes_per_sequence
        requests = max_pages // request_pages
        need = paging.total_allocated_bytes
    return Capacity(
        gpu_memory_bytes=gpu_memory, memory_utilization=memory_utilization, usable_bytes=usable,
        weights_bytes=weights_bytes, weights_source=source, reserve_bytes=reserve, kv_budget_bytes=budget,
        max_tokens=max_tokens, max_pages=max_pages, request_tokens=tokens, request_pages=request_pages,
        request_bytes=request_bytes, max_concurrent_requests=requests, batch_fits=need <= budget,
    )


def params_text(params: float) -> str:
    """8.03e9 -> '8.03 billion', 135e6 -> '135 million'."""
    for word, scale in (("trillion", 1e12), ("billion", 1e9), ("million", 1e6)):
        if params >= scale:
            return f"{params / scale:.3g} {word}"
    return f"{params:,.0f}"
