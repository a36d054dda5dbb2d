"""The paged-attention interface: per-step metadata and the backend protocol.

A step computes a flat run of tokens from several sequences (prefill chunks and single decode tokens). Each
sequence b contributes ``q_lens[b]`` new tokens at positions ``[start_pos[b], start_pos[b] + q_lens[b])`` and
attends to every position ``< seq_lens[b] = start_pos[b] + q_lens[b]`` of its own page table, causally.

Slot arithmetic (page_size = 4)::

    page_tables[b] = [7, 2, 9]
    position p  ->  slot = page_tables[b][p // 4] * 4 + p % 4
    p = 0..3    ->  slots 28..31 (page 7)
    p = 4..7    ->  slots  8..11 (page 2)

The metadata is built once per step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvserve.common.attention_window import FULL_ATTENTION, AttentionWindow
from kvserve.kernels.kv_quant import write_kv_quantised
from kvserve.kernels.window import sink_positions


@dataclass(slots=True)
class AttentionMetadata:
    """Everything a backend needs for one step, shared by all layers."""

    page_size: int
    q_lens: torch.Tensor  # [num_seqs] int64, new tokens per sequence
    start_pos: torch.Tensor  # [num_seqs] int64, tokens already in the cache per sequence
    seq_lens: torch.Tensor  # [num_seqs] int64, start_pos + q_lens
    cu_q_lens: torch.Tensor  # [num_seqs + 1] int64, offsets of each sequence in the flat token run
    positions: torch.Tensor  # [num_tokens] int64, absolute position of each new token
    token_seq: torch.Tensor  # [num_tokens] int64, the sequence each new token belongs to
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot each new token's K/V is written to
    page_tables: torch.Tensor  # [num_seqs, max_pages] int64, page ids, padded with 0
    max_q_len: int
    max_seq_len: int
    window: AttentionWindow = FULL_ATTENTION  # the keys each query reads; with a sliding one, page tables may
    # hold HOLEs (kvserve/kernels/window.py)
    sink_positions: torch.Tensor | None = None  # [num_tokens] int64, each query's in-cache position (sinks only)
    logits_soft_cap: float = 0.0  # > 0: every score s (after the scale) becomes cap * tanh(s / cap) before the
    # softmax (Gemma 2's attn_logit_softcapping); 0: none

    @property
    def num_seqs(self) -> int:
        return int(self.q_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


def build_metadata(
    start_pos: list[int], q_lens: list[int], page_tables: list[list[int]], page_size: int, device: torch.device,
    window: AttentionWindow = FULL_ATTENTION,
) -> AttentionMetadata:
    """Builds the step metadata from plain lists (one entry per sequence).

    Callers validate first: every page table must cover ``start_pos + q_len`` positions (with a window: the
    pages those positions are written to and the ones they read are not holes).
    """
    num_seqs = len(q_lens)
    max_pages = max(len(t) for t in page_tables)
    tables = torch.zeros((num_seqs, max_pages), dtype=torch.int64)
    for b, table in enumerate(page_tables):
        tables[b, : len(table)] = torch.tensor(table, dtype=torch.int64)
    q = torch.tensor(q_lens, dtype=torch.int64)
    start = torch.tensor(start_pos, dtype=torch.int64)
    seq_index = torch.repeat_interleave(torch.arange(num_seqs), q)  # [num_tokens]
    cu = torch.zeros(num_seqs + 1, dtype=torch.int64)
    torch.cumsum(q, 0, out=cu[1:])
    offset_in_seq = torch.arange(int(cu[-1])) - cu[seq_index]
    positions = start[seq_index] + offset_in_seq
    pages = tables[seq_index, positions // page_size]
    slot_mapping = pages * page_size + positions % page_size
    seq_lens = start + q
    return AttentionMetadata(
        page_size=page_size,
        q_lens=q.to(device),
        start_pos=start.to(device),
        seq_lens=seq_lens.to(device),
        cu_q_lens=cu.to(device),
        positions=positions.to(device),
        token_seq=seq_index.to(device),
        slot_mapping=slot_mapping.to(device),
        page_tables=tables.to(device),
        max_q_len=max(q_lens),
        max_seq_len=int(seq_lens.max()),
        window=window,
        sink_positions=sink_positions(positions, window).to(device) if window.sinks else None,
    )


class PagedAttentionBackend(Protocol):
    """A paged-attention implementation. ``prepare`` runs once per step, ``forward`` (or ``qkv_attention``, which
    applies RoPE and splits the heads first) once per layer. A backend also owns the layout of the linear layers'
    weights (``pack_weight`` runs once per weight at load, and the model calls ``linear`` with what it returned)
    and the small ops around them (``rms_norm``, ``add_rms_norm_``, ``silu_mul``, and the sampler's
    ``argmax_logsumexp``), which a CPU backend runs as one pass each.

    The layer cache's dtype is the pool's element type (kvserve/kernels/kv_quant.py): float32, bfloat16 or float16
    values, or 1-byte int8 / fp8 elements, quantised on write, with ``kv_scales`` (one float32 per token and kv
    head, for K and for V) or without (a per-tensor scale of 1.0). ``kv_dtypes`` names the ones it serves."""

    name: str
    kv_dtypes: tuple[str, ...]

    def pack_weight(self, w: torch.Tensor) -> torch.Tensor:
        """w [out_features, in_features] in the layout ``linear`` reads (w itself for F.linear)."""
        ...

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ w.T + bias, for a w that ``pack_weight`` returned."""
        ...

    def prepare(self, meta: AttentionMetadata) -> object:
        """Precomputes backend-specific per-step state (gather indices, masks) from the metadata."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of each row, as HF computes it."""
        ...

    def add_rms_norm_(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x += delta in place (the residual stream), then rms_norm(x)."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[tokens, 2 I] (the fused gate and up projections) -> silu(gate) * up [tokens, I]."""
        ...

    def argmax_logsumexp(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row of [n, vocab] logits: the first index of the maximum, and logsumexp (the sampler's needs)."""
        ...

    def qkv_attention(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                      meta: AttentionMetadata, state: object, scale: float, num_heads: int,
                      num_kv_heads: int, kv_scales: torch.Tensor | None = None,
                      sink_rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The fused projection's output [tokens, (H + 2 Hkv) * D]: RoPE (cos, sin [tokens, D]) on q and k, k and
        v into their slots, then forward's attention; returns [tokens, H, D]. With attention sinks, sink_rope
        is (cos, sin) at ``meta.sink_positions``: q rotated there scores the sink keys (kvserve/kernels/window.py)."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], RoPE applied
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], RoPE applied
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_pages, page_size, num_kv_heads, head_dim] of one layer
        meta: AttentionMetadata,
        state: object,
        scale: float,
        kv_scales: torch.Tensor | None = None,  # [2, num_pages, page_size, num_kv_heads] float32, or None
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Writes k and v into their slots, then attends each new token to its sequence's cached prefix."""
        ...


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scales: torch.Tensor | None = None) -> None:
    """Stores the new tokens' K/V in their cache slots (in place); a 1-byte cache gets them quantised
    (kvserve/kernels/kv_quant.py), with their scales in ``kv_scales`` unless that is None (the tensor scheme)."""
    if kv_cache.element_size() == 1:
        write_kv_quantised(k, v, kv_cache, kv_scales, slot_mapping)
        return
    _, num_pages, page_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_pages * page_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))
