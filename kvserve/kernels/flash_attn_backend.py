"""The flash-attn backend: paged attention by flash-attn 4 (``flash_attn.cute``, CuTe DSL, Hopper and newer, any
page size) or flash-attn 2 (``flash_attn_with_kvcache``, pages of a multiple of 256 tokens), for CUDA workers with
bf16/fp16 models and pages.

UNTESTED ON HARDWARE: no machine with flash-attn installed has run ``bench/gpu_check.sh`` yet. It is written to
the libraries' documented signatures and its adapter (metadata conversion, checks, selection) is unit-tested on
CPU behind those signatures (tests/unit/kernels/test_flash_attn_backend.py), but ``--attention-backend auto``
never picks it (HARDWARE_TESTED) until such a run has compared it with the reference.

Both libraries read the layer cache in place: kvserve's ``[2, num_pages, page_size, kv_heads, d]`` gives
``k = kv_cache[0]`` and ``v = kv_cache[1]``, each ``[num_pages, page_size, kv_heads, d]``, the layout both take with
a page (block) table. Their causal mask is aligned to the bottom right: query row i of a sequence with q_len new
tokens and seq_len keys sees key j when ``j <= i + seq_len - q_len``, i.e. ``j <= start_pos + i``, kvserve's rule;
window_size = (left, right) keeps ``j >= i + seq_len - q_len - left``, so kvserve's window W (a query at p sees
``p - W < j <= p``) is ``(W - 1, 0)``. FA2 takes queries as ``[batch, max_q_len, heads, d]``; each sequence's
rows are put at the end of its block (front padding), so that bottom-right alignment holds for short chunks::

    q_lens [3, 1], max_q_len 3:   batch 0: [a0 a1 a2]    batch 1: [-- -- b0]   (-- rows: fully masked, dropped)

Not served: attention sinks (StreamingLLM keeps the first tokens visible beside the window; FA's
``learnable_sink`` is a different thing, a per-head logit) and quantised pages (FA4's fp8 path needs the queries
in fp8 too, with descales per batch and head, not kvserve's per-token scales).

flash-attn 4 on sm90 reads pages of any size (its non-TMA path when they are not a tile of 128) but does not
split the KV length (FlashDecoding) there: a long-context decode at a small batch keeps few SMs busy, one more
reason to measure before ``auto`` may pick it.

RoPE, the K/V write into their slots, norms and linear layers are not flash-attn's: they come from the ``ops``
backend (the triton backend's where the lead's selection passes it, else the reference's torch ops).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.kernels.paged_attention import AttentionMetadata, PagedAttentionBackend, write_kv
from kvserve.kernels.reference import ReferenceBackend, rope_split

HARDWARE_TESTED = False  # flip once bench/gpu_check.sh ran this backend against the reference on a GPU
FA2_PAGE_MULTIPLE = 256  # flash_attn_with_kvcache: "page_block_size must be a multiple of 256"
FA4_MIN_CAPABILITY = 9  # flash_attn.cute: sm90 (Hopper) and newer
DTYPES = (torch.bfloat16, torch.float16)


@dataclass(slots=True)
class FlashAttnArgs:
    """One step's flash-attn arguments, converted once from the metadata and shared by every layer."""

    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32, offsets of each sequence's queries in the flat run
    seqused_k: torch.Tensor  # [num_seqs] int32, keys per sequence (its seq_len: the new tokens are written first)
    page_table: torch.Tensor  # [num_seqs, max_pages] int32, HOLEs (released by a window) read as page 0, masked
    max_seqlen_q: int
    max_seqlen_k: int
    window_size: tuple[int, int] | None  # (window - 1, 0), or None without a window
    q_rows: torch.Tensor | None = None  # FA2: [num_tokens] int64, token -> row of [num_seqs * max_q_len]
    softcap: float = 0.0  # both kernels' soft cap on the scores (kvserve's logits_soft_cap; 0: none)


def convert_metadata(meta: AttentionMetadata, padded_rows: bool = False) -> FlashAttnArgs:
    """The call's arguments from kvserve's metadata; ``padded_rows`` adds FA2's front-padded query rows.
    ValueError for what flash-attn cannot serve (attention sinks)."""
    if meta.window.sinks:
        raise ValueError("the flash-attn backend does not serve attention sinks (--attention-sinks); use the "
                         "triton or reference backend")
    table = meta.page_tables.clamp(min=0).to(torch.int32)  # HOLE = -1 -> 0: any real page, never unmasked
    args = FlashAttnArgs(
        cu_seqlens_q=meta.cu_q_lens.to(torch.int32), seqused_k=meta.seq_lens.to(torch.int32),
        page_table=table.contiguous(), max_seqlen_q=meta.max_q_len, max_seqlen_k=meta.max_seq_len,
        window_size=(meta.window.window - 1, 0) if meta.window.slides else None, softcap=meta.logits_soft_cap)
    if padded_rows:  # row of token t: its sequence's block, counted back from the block's end
        seq = meta.token_seq
        from_end = meta.cu_q_lens[seq + 1] - 1 - torch.arange(meta.num_tokens, device=seq.device)
        args.q_rows = seq * meta.max_q_len + (meta.max_q_len - 1 - from_end)
    return args


class FlashAttnBackend:
    """Attention by one flash-attn kernel (``varlen``: FA4's flash_attn_varlen_func, or ``kvcache``: FA2's
    flash_attn_with_kvcache: exactly one of them); every other op by ``ops`` (default: the reference)."""

    name = "flash-attn"
    kv_dtypes = ("bfloat16", "float16")

    def __init__(self, varlen: Callable | None = None, kvcache: Callable | None = None,
                 ops: PagedAttentionBackend | None = None):
        if (varlen is None) == (kvcache is None):
            raise ValueError("give exactly one flash-attn kernel: varlen (flash-attn 4) or kvcache (flash-attn 2)")
        self.varlen, self.kvcache = varlen, kvcache
        self.kernel = "flash-attn 4" if varlen is not None else "flash-attn 2"
        self.ops = ops or ReferenceBackend()
        self.pack_weight, self.linear = self.ops.pack_weight, self.ops.linear
        self.rms_norm, self.add_rms_norm_ = self.ops.rms_norm, self.ops.add_rms_norm_
        self.silu_mul, self.argmax_logsumexp = self.ops.silu_mul, self.ops.argmax_logsumexp

    def prepare(self, meta: AttentionMetadata) -> FlashAttnArgs:
        if self.kvcache is not None and meta.page_size % FA2_PAGE_MULTIPLE:
            raise ValueError(f"flash-attn 2 reads pages of a multiple of {FA2_PAGE_MULTIPLE} tokens, not "
                             f"{meta.page_size}")
        return convert_metadata(meta, padded_rows=self.kvcache is not None)

    def qkv_attention(self, qkv, cos, sin, kv_cache, meta, state: FlashAttnArgs, scale: float, num_heads: int,
                      num_kv_heads: int, kv_scales: torch.Tensor | None = None, sink_rope=None) -> torch.Tensor:
        if sink_rope is not None:
            raise ValueError("the flash-attn backend does not serve attention sinks")
        q, k, v = rope_split(qkv, cos, sin, num_heads, num_kv_heads)
        return self.forward(q, k, v, kv_cache, meta, state, scale, kv_scales)

    def forward(self, q, k, v, kv_cache: torch.Tensor, meta: AttentionMetadata, state: FlashAttnArgs,
                scale: float, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        check_cache(q, kv_cache, kv_scales)
        write_kv(k, v, kv_cache, meta.slot_mapping)
        return self.attend(q, kv_cache, state, scale)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, a: FlashAttnArgs, scale: float) -> torch.Tensor:
        """forward() after its write: [num_tokens, heads, d] queries over the pages, in place."""
        if self.varlen is not None:
            out = self.varlen(q, kv_cache[0], kv_cache[1], cu_seqlens_q=a.cu_seqlens_q, seqused_k=a.seqused_k,
                              page_table=a.page_table, max_seqlen_q=a.max_seqlen_q, max_seqlen_k=a.max_seqlen_k,
                              softmax_scale=scale, causal=True, window_size=a.window_size or (None, None),
                              **_softcap(a))
            return out[0] if isinstance(out, tuple) else out  # flash-attn 4 returns (out, lse)
        num_seqs = a.seqused_k.shape[0]
        padded = q.new_zeros((num_seqs * a.max_seqlen_q, *q.shape[1:])).index_copy_(0, a.q_rows, q)
        out = self.kvcache(padded.view(num_seqs, a.max_seqlen_q, *q.shape[1:]), kv_cache[0], kv_cache[1],
                           cache_seqlens=a.seqused_k, block_table=a.page_table, softmax_scale=scale, causal=True,
                           window_size=a.window_size or (-1, -1), **_softcap(a))
        return out.reshape(num_seqs * a.max_seqlen_q, *q.shape[1:]).index_select(0, a.q_rows)


def _softcap(a: FlashAttnArgs) -> dict:
    """flash-attn's softcap argument where the model soft-caps its scores (Gemma 2); left out otherwise, so that
    the call is the one without it."""
    return {"softcap": a.softcap} if a.softcap else {}


def check_cache(q: torch.Tensor, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> None:
    """ValueError unless queries and pages are one of flash-attn's dtypes, alike, and unquantised."""
    if kv_scales is not None or kv_cache.element_size() == 1:
        raise ValueError(f"the flash-attn backend reads bfloat16 or float16 pages, not quantised "
                         f"{str(kv_cache.dtype).removeprefix('torch.')} ones; use the triton or reference backend")
    if q.dtype not in DTYPES or kv_cache.dtype != q.dtype:
        raise ValueError(f"flash-attn attends bfloat16 or float16 queries over pages of the same dtype, not "
                         f"{q.dtype} over {kv_cache.dtype}")


def load_kernels() -> tuple[Callable | None, Callable | None, str]:
    """(flash-attn 4's flash_attn_varlen_func or None, flash-attn 2's flash_attn_with_kvcache or None, why
    neither imports). Imports nothing at kvserve's import time: only when a worker asks for this backend."""
    varlen = kvcache = None
    errors = []
    try:
        from flash_attn.cute import flash_attn_varlen_func as varlen
    except Exception as e:  # ImportError, or the CUTLASS DSL failing to load its libraries
        errors.append(f"flash_attn.cute: {type(e).__name__}: {e}")
    try:
        from flash_attn import flash_attn_with_kvcache as kvcache
    except Exception as e:
        errors.append(f"flash_attn (2): {type(e).__name__}: {e}")
    return varlen, kvcache, "; ".join(errors)


def pick_kernel(varlen: Callable | None, kvcache: Callable | None, capability: tuple[int, int],
                page_size: int, why_not: str = "") -> dict[str, Callable]:
    """The kernel a worker of this GPU capability and page size uses: flash-attn 4 on sm90+, else flash-attn 2
    where the pages are a multiple of 256 tokens (FlashAttnBackend's keyword). ValueError saying why none."""
    if varlen is not None and capability[0] >= FA4_MIN_CAPABILITY:
        return {"varlen": varlen}
    if kvcache is not None and page_size % FA2_PAGE_MULTIPLE == 0:
        return {"kvcache": kvcache}
    reasons = [why_not] if why_not else []
    if varlen is not None:
        reasons.append(f"flash-attn 4 needs sm{FA4_MIN_CAPABILITY}0 or newer, this GPU is sm{capability[0]}"
                       f"{capability[1]}")
    if kvcache is not None:
        reasons.append(f"flash-attn 2 needs pages of a multiple of {FA2_PAGE_MULTIPLE} tokens, not {page_size}")
    raise ValueError("the flash-attn attention backend is not available: " + "; ".join(reasons))
