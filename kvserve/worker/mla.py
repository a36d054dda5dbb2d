"""Multi-head latent attention (DeepSeek-V2/V3) over the paged pool, in plain torch, and the decoder around it.

The pool caches, per layer and token, one row and nothing per head (layout in kvserve/worker/mla_config.py)::

    kv_cache[layer]  [1, num_pages, page_size, 1, kv_lora_rank + qk_rope_head_dim]
    row              [ c_kv = kv_a_layernorm(latent) | k_rope = rope(shared key) ]

Each query head h attends over a sequence's rows in one of two ways, equal in exact arithmetic:

    decompress:  K_h = [c_kv @ W_UK_h^T | k_rope],  V_h = c_kv @ W_UV_h^T     (up-projects every cached row, every
                 step), then ordinary attention
    absorbed:    q'_h = [q_nope_h @ W_UK_h | q_rope_h] scores the cached rows as they are; the output
                 (probs @ c_kv) @ W_UV_h^T is up-projected once per query, not once per cached token

with W_UK / W_UV the key and value halves of kv_b_proj. Everything else (embedding, norms, the projections through
the backend's ``linear`` so packed weights work, the sampler's ops) is LlamaDecoder's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.kernels.kv_quant import FORMAT_OF_DTYPE, dequantise, quantise
from kvserve.kernels.paged_attention import AttentionMetadata, PagedAttentionBackend
from kvserve.kernels.rotary import apply_rotary, cos_sin_table, frequencies, scaling_kind
from kvserve.worker.config import ModelConfig
from kvserve.worker.mla_config import MLAParams
from kvserve.worker.mla_weights import MLALayerWeights, pack_mla_layers
from kvserve.worker.model import embedding, pack_lm_head
from kvserve.worker.moe import feed_forward
from kvserve.worker.weights import ModelWeights

MODES = ("absorbed", "decompress")
DEFAULT_MODE = "absorbed"  # it reads far less per step; make bench-models times both (bench/models_mla.py)
LATENT_NORM_EPS = 1e-6  # HF builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps, not rms_norm_eps


@dataclass(frozen=True, slots=True)
class SeqSpan:
    """One sequence of the step: its tokens [t0, t1) in the flat run, its cached length before them, and the
    pages holding its seq_len positions."""

    t0: int
    t1: int
    start_pos: int
    seq_len: int
    page_ids: torch.Tensor  # [num_pages_for(seq_len)] int64


def seq_spans(meta: AttentionMetadata) -> list[SeqSpan]:
    """The step's sequences, read once per step (every layer uses them)."""
    cu, start, lens = meta.cu_q_lens.tolist(), meta.start_pos.tolist(), meta.seq_lens.tolist()
    ps = meta.page_size
    return [SeqSpan(cu[b], cu[b + 1], start[b], lens[b], meta.page_tables[b, :(lens[b] + ps - 1) // ps])
            for b in range(meta.num_seqs)]


def rope_tables(cfg: ModelConfig, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, qk_rope_head_dim] as HF's DeepSeek rotary embedding makes them: default or yarn
    frequencies, times yarn's attention factor."""
    scaling = cfg.rope_scaling if scaling_kind(cfg.rope_scaling) == "yarn" else None
    inv_freq, factor = frequencies(cfg.mla.qk_rope_head_dim, cfg.rope_theta, scaling, cfg.max_position_embeddings)
    return cos_sin_table(inv_freq, positions, factor)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mla: MLAParams) -> torch.Tensor:
    """RoPE on x [tokens, heads, rope_dim] (cos, sin [tokens, rope_dim]) in the checkpoint's layout. Interleaved
    pairs (x0, x1), (x2, x3), ... rotate by one frequency each; V3 then writes the rotated evens before the odds,
    V2 keeps each pair in place (both as HF does: the layout of q and k only has to agree)."""
    if not mla.rope_interleave:
        return apply_rotary(x, cos, sin)
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    even, odd = x1 * c - x2 * s, x2 * c + x1 * s
    return torch.cat([even, odd], dim=-1) if mla.interleave_output else torch.stack([even, odd], -1).flatten(-2)


def write_latent(cache: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Stores rows [tokens, latent_dim] in their slots of a layer's cache [1, num_pages, page_size, 1, latent_dim];
    a 1-byte cache gets them quantised (kvserve/kernels/kv_quant.py), one scale per row in ``scales``
    [1, num_pages, page_size, 1] unless that is None (the tensor scheme)."""
    dim = cache.shape[-1]
    if cache.element_size() != 1:
        cache.view(-1, dim).index_copy_(0, slots, rows.to(cache.dtype))
        return
    stored, row_scales = quantise(rows, FORMAT_OF_DTYPE[cache.dtype], scales is not None)
    cache.view(torch.uint8).view(-1, dim).index_copy_(0, slots, stored.view(torch.uint8))  # fp8 has no index_copy_
    if row_scales is not None:
        scales.view(-1).index_copy_(0, slots, row_scales)


def read_latent(cache: torch.Tensor, scales: torch.Tensor | None, span: SeqSpan, dtype: torch.dtype) -> torch.Tensor:
    """The sequence's rows [seq_len, latent_dim] in ``dtype`` (dequantised from a 1-byte cache)."""
    dim = cache.shape[-1]
    if cache.element_size() != 1:
        return cache[0, span.page_ids].reshape(-1, dim)[:span.seq_len].to(dtype)
    stored = cache.view(torch.uint8)[0, span.page_ids].view(cache.dtype)
    rows = dequantise(stored, None if scales is None else scales[0, span.page_ids], dtype)
    return rows.reshape(-1, dim)[:span.seq_len]


def causal_mask(span: SeqSpan, device: torch.device) -> torch.Tensor | None:
    """[q_len, seq_len] bool, True = may attend: query i (position start_pos + i) sees keys <= its position.
    None for a single query, which sees every key."""
    if span.t1 - span.t0 == 1:
        return None
    keys = torch.arange(span.seq_len, device=device)
    return keys[None, :] <= (span.start_pos + torch.arange(span.t1 - span.t0, device=device))[:, None]


def attend_absorbed(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_b: torch.Tensor, cache: torch.Tensor,
                    scales: torch.Tensor | None, spans: list[SeqSpan], mla: MLAParams) -> torch.Tensor:
    """q_nope [T, H, nope], q_rope [T, H, rope] -> [T, H, v_head_dim]: the queries are moved into the latent
    space (q_nope @ W_UK), score the cached rows directly, and the latent output is up-projected by W_UV."""
    num_heads, r = q_nope.shape[1], mla.kv_lora_rank
    w = kv_b.view(num_heads, mla.qk_nope_head_dim + mla.v_head_dim, r)
    w_uk, w_uv = w[:, :mla.qk_nope_head_dim], w[:, mla.qk_nope_head_dim:]  # [H, nope, r], [H, v, r]
    q = torch.cat([torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1), q_rope], dim=-1)  # [T, H, r + rope]
    out = q.new_empty(q.shape[0], num_heads, r)
    for span in spans:
        rows = read_latent(cache, scales, span, q.dtype)  # [L, r + rope]
        n = span.t1 - span.t0
        scores = (q[span.t0:span.t1].reshape(n * num_heads, -1) @ rows.T).view(n, num_heads, -1)
        mask = causal_mask(span, q.device)
        if mask is not None:
            scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        probs = torch.softmax(scores * mla.softmax_scale, dim=-1, dtype=torch.float32).to(q.dtype)
        out[span.t0:span.t1] = (probs.view(n * num_heads, -1) @ rows[:, :r]).view(n, num_heads, r)
    return torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, v]


def attend_decompress(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_b: torch.Tensor, cache: torch.Tensor,
                      scales: torch.Tensor | None, spans: list[SeqSpan], mla: MLAParams) -> torch.Tensor:
    """q_nope [T, H, nope], q_rope [T, H, rope] -> [T, H, v_head_dim]: every cached row up-projected to each head's
    key and value (as HF does), then SDPA."""
    num_heads, r, nope = q_nope.shape[1], mla.kv_lora_rank, mla.qk_nope_head_dim
    q = torch.cat([q_nope, q_rope], dim=-1)
    out = q.new_empty(q.shape[0], num_heads, mla.v_head_dim)
    for span in spans:
        rows = read_latent(cache, scales, span, q.dtype)
        kv = F.linear(rows[:, :r], kv_b).view(span.seq_len, num_heads, -1)  # [L, H, nope + v]
        k = torch.cat([kv[..., :nope], rows[:, None, r:].expand(-1, num_heads, -1)], dim=-1)
        o = F.scaled_dot_product_attention(q[span.t0:span.t1].transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           kv[..., nope:].transpose(0, 1)[None], attn_mask=causal_mask(span, q.device),
                                           scale=mla.softmax_scale)
        out[span.t0:span.t1] = o[0].transpose(0, 1)
    return out


ATTEND = {"absorbed": attend_absorbed, "decompress": attend_decompress}


class MLADecoder:
    """LlamaDecoder's interface (forward, logits, backend, weights) for an MLA model; stateless apart from its
    weights. ``mode`` picks the attention (MODES); both give HF's tokens."""

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, backend: PagedAttentionBackend,
                 mode: str = DEFAULT_MODE):
        if mode not in MODES:
            raise ValueError(f"unknown MLA attention mode {mode!r}; known: {', '.join(MODES)}")
        self.cfg, self.mla, self.mode = cfg, cfg.mla, mode
        weights.layers = pack_mla_layers(weights.layers, backend.pack_weight)
        self.weights = pack_lm_head(weights, backend.pack_weight)
        self.backend, self.linear = backend, backend.linear
        cos, sin = rope_tables(cfg, cfg.max_position_embeddings)
        device = weights.final_norm.device
        self.cos, self.sin = cos.to(device), sin.to(device)

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,  # [num_tokens] int64
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,  # [num_layers, 1, num_pages, page_size, 1, latent_dim]
        kv_scales: torch.Tensor | None = None,  # [num_layers, 1, num_pages, page_size, 1] or None
    ) -> torch.Tensor:  # [num_tokens, hidden]
        x = embedding(token_ids, self.weights)  # the residual stream: updated in place by add_rms_norm_
        cos, sin = self.cos[meta.positions].to(x.dtype), self.sin[meta.positions].to(x.dtype)
        spans = seq_spans(meta)
        b, eps, layers = self.backend, self.cfg.rms_norm_eps, self.weights.layers
        h = b.rms_norm(x, layers[0].input_norm, eps)
        for i, layer in enumerate(layers):
            scales = None if kv_scales is None else kv_scales[i]
            attn = self._attention(h, layer, cos, sin, kv_cache[i], scales, meta.slot_mapping, spans)
            h = b.add_rms_norm_(x, attn, layer.post_norm, eps)
            following = layers[i + 1].input_norm if i + 1 < len(layers) else self.weights.final_norm
            h = b.add_rms_norm_(x, feed_forward(h, layer, self.cfg.moe, b), following, eps)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] in fp32."""
        return self.linear(hidden, self.weights.lm_head).float()

    def _attention(self, h, layer: MLALayerWeights, cos, sin, cache, scales, slots, spans) -> torch.Tensor:
        m, num_heads, num_tokens = self.mla, self.cfg.num_heads, h.shape[0]
        a = self.linear(h, layer.a_proj)
        q_rows = a.shape[1] - m.latent_dim
        q = a[:, :q_rows]
        if layer.q_b is not None:
            q = self.linear(self.backend.rms_norm(q.contiguous(), layer.q_a_norm, LATENT_NORM_EPS), layer.q_b)
        q = q.view(num_tokens, num_heads, m.qk_head_dim)
        c_kv = self.backend.rms_norm(a[:, q_rows:q_rows + m.kv_lora_rank].contiguous(), layer.kv_a_norm,
                                     LATENT_NORM_EPS)
        k_rope = rotate(a[:, None, q_rows + m.kv_lora_rank:], cos, sin, m)[:, 0]
        write_latent(cache, scales, slots, torch.cat([c_kv, k_rope], dim=-1))
        q_rope = rotate(q[..., m.qk_nope_head_dim:], cos, sin, m)
        out = ATTEND[self.mode](q[..., :m.qk_nope_head_dim], q_rope, layer.kv_b, cache, scales, spans, m)
        return self.linear(out.reshape(num_tokens, -1), layer.o)
