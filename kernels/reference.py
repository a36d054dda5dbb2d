"""The reference paged-attention backend: gather pages, one padded SDPA call with a length mask.

Per step it turns the flat token run into a padded batch::

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

from kvserve.kernels.paged_attention import AttentionMetadata, write_kv


@dataclass(slots=True)
class ReferenceState:
    """Per-step gather/scatter indices and the attention mask, shared by all layers."""

    q_index: torch.Tensor  # [num_tokens] int64, flat token -> row in [num_seqs * max_q_len]
    page_ids: torch.Tensor  # [num_seqs * num_pages] int64, pages to gather, padded with page 0 (masked)
    num_keys: int  # num_pages * page_size: key length of the gathered batch
    mask: torch.Tensor  # [num_seqs, 1, max_q_len, num_keys] bool, True = may attend


class ReferenceBackend:
    """Runs on any device; fp32 on CPU. Exact, not fast: the yardstick for the other backends."""

    name = "reference"

    def prepare(self, meta: AttentionMetadata) -> ReferenceState:
        device = meta.positions.device
        max_q, max_k = meta.max_q_len, meta.max_seq_len
        row_in_seq = meta.positions - meta.start_pos[meta.token_seq]
        q_index = meta.token_seq * max_q + row_in_seq
        num_pages = -(-max_k // meta.page_size)
        page_ids = meta.block_tables[:, :num_pages].reshape(-1)
        num_keys = num_pages * meta.page_size
        key_pos = torch.arange(num_keys, device=device)
        query_pos = meta.start_pos[:, None] + torch.arange(max_q, device=device)[None, :]  # [num_seqs, max_q]
        visible = key_pos[None, None, :] <= query_pos[:, :, None]
        visible &= key_pos[None, None, :] < meta.seq_lens[:, None, None]
        return ReferenceState(q_index=q_index, page_ids=page_ids, num_keys=num_keys, mask=visible.unsqueeze(1))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        state: ReferenceState,
        scale: float,
    ) -> torch.Tensor:
        write_kv(k, v, kv_cache, meta.slot_mapping)
        num_tokens, num_heads, head_dim = q.shape
        num_seqs, max_q = meta.num_seqs, meta.max_q_len
        num_kv_heads = kv_cache.shape[3]
        kv = kv_cache.index_select(1, state.page_ids).to(q.dtype)  # K and V of every page in one gather
        kv = kv.view(2, num_seqs, state.num_keys, num_kv_heads, head_dim).transpose(2, 3)  # [2, seqs, kv_heads, k, d]
        padded = num_seqs * max_q != num_tokens
        if padded:
            q_pad = q.new_zeros((num_seqs * max_q, num_heads, head_dim))
            q_pad[state.q_index] = q
        else:  # every sequence has max_q tokens (e.g. a pure decode batch): no scatter needed
            q_pad = q
        q_pad = q_pad.view(num_seqs, max_q, num_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q_pad, kv[0], kv[1], attn_mask=state.mask, scale=scale, enable_gqa=True
        )  # [num_seqs, num_heads, max_q, head_dim]
        out = out.transpose(1, 2).reshape(num_seqs * max_q, num_heads, head_dim)
        return out[state.q_index] if padded else out
