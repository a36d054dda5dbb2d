"""The reference paged-attention backend: gather pages (dequantising a quantised cache's), padded SDPA calls
with a length mask.

A step's sequences are split into groups of like shape, so that padding never multiplies the work: all decode
sequences (one query each) form one group, and every prefill chunk is a group of its own (a 512-token chunk
padded next to 32 decodes would cost 32 chunks). Per group it turns the flat token run into a padded batch::

    flat q:   [a0 a1 a2 | b0 | c0 c1]           q_lens = [3, 1, 2]
    padded:   [[a0 a1 a2]
               [b0 -- --]                       (-- rows are computed and dropped)
               [c0 c1 --]]

and gathers each sequence's pages (whole pages: contiguous copies) into ``[num_seqs, num_pages * page_size]``
keys, the unused tail masked out. Query i of sequence b
(absolute position ``start_pos[b] + i``) may see key j when ``j <= start_pos[b] + i``. Padded query rows
still see key 0, so no row of the mask is empty (an empty row would give NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.common.pages import num_pages_for
from kvserve.kernels.kv_quant import FORMATS, dequantise
from kvserve.kernels.paged_attention import AttentionMetadata, write_kv
from kvserve.kernels.rotary import apply_rotary
from kvserve.kernels.window import scored_attention, window_keys


@dataclass(slots=True)
class GroupState:
    """Gather/scatter indices and the attention mask of one group of sequences, shared by all layers."""

    token_index: torch.Tensor | None  # [group_tokens] int64, the group's tokens in the flat run; None = all
    q_index: torch.Tensor  # [group_tokens] int64, group token -> row in [num_seqs * max_q_len]
    page_ids: torch.Tensor  # [num_seqs * num_pages] int64, pages to gather, padded with page 0 (masked)
    num_seqs: int
    max_q_len: int
    num_keys: int  # num_pages * page_size: key length of the gathered batch
    mask: torch.Tensor  # [num_seqs, 1, max_q_len, num_keys] bool, True = may attend; see additive_mask
    kv_rows: torch.Tensor | None = None  # rows of the layer cache viewed as [2 * num_pages, page]: K rows, V rows
    kv_buf: torch.Tensor | None = None  # the gathered pages, reused by every layer of the step
    sink_keys: torch.Tensor | None = None  # [num_seqs, 1, 1, num_keys] bool: attention sinks (window.py)
    logits_soft_cap: float = 0.0  # the metadata's soft cap on the scores (0: none)

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The mask as SDPA would convert it (0 = may attend, -inf = may not), once per step rather than in
        every layer's SDPA call."""
        if self.mask.dtype != dtype:
            self.mask = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device).masked_fill_(
                ~self.mask, float("-inf"))
        return self.mask

    @property
    def padded(self) -> bool:
        return self.num_seqs * self.max_q_len != self.q_index.shape[0]


@dataclass(slots=True)
class ReferenceState:
    groups: list[GroupState]


def group_state(meta: AttentionMetadata, seqs: list[int] | None) -> GroupState:
    """The state of the sequences ``seqs`` (None = all of them, in order)."""
    device = meta.positions.device
    if seqs is None:
        token_index, token_seq, q_lens = None, meta.token_seq, meta.q_lens
        start_pos, seq_lens, tables, positions = meta.start_pos, meta.seq_lens, meta.page_tables, meta.positions
    else:
        idx = torch.tensor(seqs, device=device)
        q_lens = meta.q_lens[idx]
        token_index = torch.cat([torch.arange(int(meta.cu_q_lens[i]), int(meta.cu_q_lens[i + 1]), device=device)
                                 for i in seqs])
        token_seq = torch.repeat_interleave(torch.arange(len(seqs), device=device), q_lens)
        start_pos, seq_lens, tables = meta.start_pos[idx], meta.seq_lens[idx], meta.page_tables[idx]
        positions = meta.positions[token_index]
    max_q, max_k = int(q_lens.max()), int(seq_lens.max())
    q_index = token_seq * max_q + (positions - start_pos[token_seq])
    num_pages = num_pages_for(max_k, meta.page_size)
    num_keys = num_pages * meta.page_size
    key_pos = torch.arange(num_keys, device=device)
    query_pos = start_pos[:, None] + torch.arange(max_q, device=device)[None, :]  # [num_seqs, max_q]
    if meta.window.slides:
        page_ids, key_pos, sink_keys = _window_keys(meta, tables, start_pos, seq_lens)
        query_pos = torch.minimum(query_pos, seq_lens[:, None] - 1)  # padded rows: as the last row (never empty)
        seen = meta.window.sees(query_pos[:, :, None], key_pos[:, None, :])
        return GroupState(token_index, q_index, page_ids, int(q_lens.shape[0]), max_q, key_pos.shape[1],
                          seen.unsqueeze(1), sink_keys=sink_keys, logits_soft_cap=meta.logits_soft_cap)
    seen = key_pos[None, None, :] <= query_pos[:, :, None]
    seen &= key_pos[None, None, :] < seq_lens[:, None, None]
    return GroupState(token_index, q_index, tables[:, :num_pages].reshape(-1), int(q_lens.shape[0]), max_q,
                      num_keys, seen.unsqueeze(1), logits_soft_cap=meta.logits_soft_cap)


def _window_keys(meta: AttentionMetadata, tables: torch.Tensor, start_pos: torch.Tensor, seq_lens: torch.Tensor):
    """Under a sliding window each sequence gathers only the pages its rows read (its tables may hold holes):
    the page ids, every gathered key's position, and which keys are attention sinks (kvserve/kernels/window.py)."""
    page_ids, key_pos = window_keys(start_pos.tolist(), seq_lens.tolist(), tables, meta.window, meta.page_size)
    sinks = meta.window.sinks
    return page_ids, key_pos, (key_pos < sinks)[:, None, None, :] if sinks else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, as HF does, then cast back; one fused op when x is already fp32."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope_split(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int):
    """The fused projection's output [tokens, (H + 2 Hkv) * D] as (q, k, v) [tokens, heads, D], RoPE applied to
    q and k (one call for both)."""
    head_dim = cos.shape[-1]
    qk, v = qkv.split([(num_heads + num_kv_heads) * head_dim, num_kv_heads * head_dim], dim=-1)
    qk = apply_rotary(qk.reshape(-1, num_heads + num_kv_heads, head_dim), cos, sin)
    q, k = qk.split([num_heads, num_kv_heads], dim=1)
    return q, k, v.view(-1, num_kv_heads, head_dim)


def argmax_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of [n, vocab] logits: the first index of the maximum, and logsumexp (the sampler's needs)."""
    return logits.argmax(-1), torch.logsumexp(logits, dim=-1)


MAX_DECODE_BUCKETS = 4


def _length_buckets(decodes: list[int], seq_lens: list[int], page_size: int) -> list[list[int]]:
    """Decode sequences in up to MAX_DECODE_BUCKETS groups of similar length, so that short contexts are not
    gathered and attended at the longest one's length. Splits (sorted by length, equal counts) only when that
    saves at least a quarter of the gathered pages; keeps the original order when it does not split."""
    if len(decodes) < 2 * MAX_DECODE_BUCKETS:
        return [decodes] if decodes else []
    pages = {i: num_pages_for(seq_lens[i], page_size) for i in decodes}
    ordered = sorted(decodes, key=pages.__getitem__)
    size = -(-len(ordered) // MAX_DECODE_BUCKETS)
    buckets = [ordered[k:k + size] for k in range(0, len(ordered), size)]
    padded = sum(len(b) * pages[b[-1]] for b in buckets)
    return buckets if padded <= 0.75 * len(decodes) * pages[ordered[-1]] else [decodes]


class ReferenceBackend:
    """Runs on any device; fp32 on CPU. Exact, not fast: the yardstick for the other backends."""

    name = "reference"
    kv_dtypes = tuple(FORMATS)

    def pack_weight(self, w: torch.Tensor) -> torch.Tensor:
        return w

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, w, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm_(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x.add_(delta), weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def argmax_logsumexp(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return argmax_logsumexp(logits)

    def qkv_attention(self, qkv, cos, sin, kv_cache, meta, state, scale: float, num_heads: int,
                      num_kv_heads: int, kv_scales: torch.Tensor | None = None, sink_rope=None) -> torch.Tensor:
        q, k, v = rope_split(qkv, cos, sin, num_heads, num_kv_heads)
        write_kv(k, v, kv_cache, meta.slot_mapping, kv_scales)
        return self.attend(q, kv_cache, state, scale, kv_scales, sink_query(qkv, sink_rope, num_heads))

    def prepare(self, meta: AttentionMetadata) -> ReferenceState:
        q_lens = meta.q_lens.tolist()
        decodes = [i for i, n in enumerate(q_lens) if n == 1]
        prefills = [i for i, n in enumerate(q_lens) if n > 1]
        buckets = _length_buckets(decodes, meta.seq_lens.tolist(), meta.page_size)
        if not prefills and len(buckets) == 1 and len(buckets[0]) == len(q_lens):
            return ReferenceState([group_state(meta, None)])
        if len(prefills) == 1 and not decodes:
            return ReferenceState([group_state(meta, None)])
        return ReferenceState([group_state(meta, b) for b in buckets] + [group_state(meta, [i]) for i in prefills])

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        state: ReferenceState,
        scale: float,
        kv_scales: torch.Tensor | None = None,
        q_sink: torch.Tensor | None = None,
    ) -> torch.Tensor:
        write_kv(k, v, kv_cache, meta.slot_mapping, kv_scales)
        return self.attend(q, kv_cache, state, scale, kv_scales, q_sink)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, state: ReferenceState, scale: float,
               kv_scales: torch.Tensor | None = None, q_sink: torch.Tensor | None = None) -> torch.Tensor:
        """forward() after its write: the new tokens' K/V are already in their slots. q_sink: the queries
        rotated at their in-cache positions, with attention sinks (kvserve/kernels/window.py)."""
        if len(state.groups) == 1 and state.groups[0].token_index is None:
            return _attend(q, kv_cache, state.groups[0], scale, kv_scales, q_sink)
        return attend_groups(q, kv_cache, state.groups, scale, torch.empty_like(q), kv_scales, q_sink)


def sink_query(qkv: torch.Tensor, sink_rope, num_heads: int) -> torch.Tensor | None:
    """The fused projection's queries rotated at their in-cache positions (sink_rope's cos and sin), or None
    without attention sinks."""
    if sink_rope is None:
        return None
    cos, sin = sink_rope
    head_dim = cos.shape[-1]
    return apply_rotary(qkv[:, :num_heads * head_dim].reshape(-1, num_heads, head_dim), cos, sin)


def attend_groups(q: torch.Tensor, kv_cache: torch.Tensor, groups: list[GroupState], scale: float,
                  out: torch.Tensor, kv_scales: torch.Tensor | None = None,
                  q_sink: torch.Tensor | None = None) -> torch.Tensor:
    """Writes each group's attention into its rows of ``out`` (flat tokens, like ``q``) and returns ``out``."""
    for group in groups:  # index_select / index_copy_, not []: a cheaper path on CPU
        qs = None if q_sink is None else q_sink.index_select(0, group.token_index)
        out.index_copy_(0, group.token_index,
                        _attend(q.index_select(0, group.token_index), kv_cache, group, scale, kv_scales, qs))
    return out


def _gather(kv_cache: torch.Tensor, g: GroupState) -> torch.Tensor:
    """K and V of the group's pages, ``[2, num_seqs * num_pages, page_size, kv_heads, d]``, in one gather.

    The layer's cache is viewed as rows of one page's K (or V), so the gather is one index_select over a
    contiguous 2-D tensor (about twice the bandwidth of selecting along dim 1 of the 5-D cache), into a buffer
    that every layer of the step reuses (no fresh multi-megabyte allocation per layer). fp8 pages are gathered
    as their bytes (torch selects no fp8 tensors)."""
    _, num_pages, *page_shape = kv_cache.shape
    if g.kv_rows is None:
        g.kv_rows = torch.cat([g.page_ids, g.page_ids + num_pages])
    stored = kv_cache.view(torch.uint8) if kv_cache.element_size() == 1 else kv_cache
    rows = stored.view(2 * num_pages, -1)
    if g.kv_buf is None or g.kv_buf.dtype != rows.dtype:
        g.kv_buf = rows.new_empty((g.kv_rows.shape[0], rows.shape[1]))
    torch.index_select(rows, 0, g.kv_rows, out=g.kv_buf)
    return g.kv_buf.view(kv_cache.dtype).view(2, -1, *page_shape)


def _gather_dequantised(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, g: GroupState,
                        dtype: torch.dtype) -> torch.Tensor:
    """_gather's K and V in ``dtype``: a quantised cache's elements times their scales (dequantise on gather)."""
    kv = _gather(kv_cache, g)
    if kv_scales is None:
        return kv.to(dtype)
    scales = kv_scales.view(kv_scales.shape[0] * kv_scales.shape[1], -1).index_select(0, g.kv_rows)
    return dequantise(kv, scales.view(kv.shape[:-1]), dtype)


def _padded(q: torch.Tensor, g: GroupState) -> torch.Tensor:
    """The group's flat queries as [num_seqs, heads, max_q_len, d]."""
    _, num_heads, head_dim = q.shape
    if g.padded:
        q_pad = q.new_zeros((g.num_seqs * g.max_q_len, num_heads, head_dim))
        q_pad.index_copy_(0, g.q_index, q)
    else:  # every sequence has max_q tokens (e.g. a pure decode batch): no scatter needed
        q_pad = q
    return q_pad.view(g.num_seqs, g.max_q_len, num_heads, head_dim).transpose(1, 2)


def _attend(q: torch.Tensor, kv_cache: torch.Tensor, g: GroupState, scale: float,
            kv_scales: torch.Tensor | None = None, q_sink: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one group's queries ``q`` [group_tokens, heads, d] over its sequences' pages."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    kv = _gather_dequantised(kv_cache, kv_scales, g, q.dtype)
    kv = kv.view(2, g.num_seqs, g.num_keys, num_kv_heads, head_dim).transpose(2, 3)  # [2, seqs, kv_heads, k, d]
    q_pad = _padded(q, g)
    if g.sink_keys is not None or g.logits_soft_cap:
        out = scored_attention(q_pad, kv[0], kv[1], g.additive_mask(q.dtype), scale, g.logits_soft_cap,
                               None if g.sink_keys is None else _padded(q_sink, g), g.sink_keys)
    else:
        out = F.scaled_dot_product_attention(q_pad, kv[0], kv[1], attn_mask=g.additive_mask(q.dtype), scale=scale,
                                             enable_gqa=True)
    out = out.transpose(1, 2).reshape(g.num_seqs * g.max_q_len, num_heads, head_dim)  # [seqs * max_q, heads, d]
    return out.index_select(0, g.q_index) if g.padded else out
