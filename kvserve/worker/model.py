"""A Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged KV cache.

The forward pass takes a flat run of tokens from many sequences (see kvserve/kernels/paged_attention.py) and
returns hidden states for all of them; the runner picks the rows it needs logits for.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F

from kvserve.kernels.paged_attention import AttentionMetadata, PagedAttentionBackend
from kvserve.kernels.rotary import cos_sin_table, frequencies
from kvserve.worker.config import ModelConfig
from kvserve.worker.layer_windows import SlidingGroup, layer_steps
from kvserve.worker.moe import feed_forward, pack_moe
from kvserve.worker.weights import LayerWeights, ModelWeights


def pack_weights(weights: ModelWeights, pack) -> ModelWeights:
    """Puts the projection weights and the LM head, in place, in the layout the attention backend's ``linear``
    reads, one matrix at a time (the unpacked copy of a layer is freed before the next is packed)."""
    for i, layer in enumerate(weights.layers):
        weights.layers[i] = replace(layer, qkv=pack(layer.qkv), o=pack(layer.o), gate_up=_pack(pack, layer.gate_up),
                                    down=_pack(pack, layer.down), moe=pack_moe(layer.moe, pack))
    return pack_lm_head(weights, pack)


def pack_lm_head(weights: ModelWeights, pack) -> ModelWeights:
    """The LM head packed, in place; a tied embedding is then read from it (``embed`` becomes None), so the
    matrix is held once."""
    tied = weights.lm_head is weights.embed
    weights.lm_head = pack(weights.lm_head)
    if tied and weights.lm_head is not weights.embed:
        weights.embed = None
    return weights


def _pack(pack, w: torch.Tensor | None):
    return None if w is None else pack(w)


def describe_weights(weights: ModelWeights) -> str:
    """How the packed matrices are held, for the worker's ready line: "120 as 4-bit blocks, 1 as 8-bit blocks
    (111 MB)" for the default model; a plain or panel tensor counts as its dtype (float32)."""
    matrices = [m for layer in weights.layers for m in _matrices(layer)]
    counts: dict[str, int] = {}
    num_bytes = 0
    for m in [*matrices, weights.lm_head]:
        parts = [m] if isinstance(m, torch.Tensor) else [m.q, m.d, m.m]
        kind = str(m.dtype).removeprefix("torch.") if isinstance(m, torch.Tensor) else \
            ("4-bit blocks" if m.q.dtype == torch.uint8 else "8-bit blocks")
        counts[kind] = counts.get(kind, 0) + 1
        num_bytes += sum(t.numel() * t.element_size() for t in parts)
    return ", ".join(f"{n} as {kind}" for kind, n in counts.items()) + f" ({num_bytes / 1e6:.0f} MB)"


def _matrices(layer) -> list:
    """A layer's weight matrices, whatever its family's dataclass (LlamaDecoder's, Gemma's, MLA's with its experts):
    every packed matrix and 2-D tensor among its fields, nested dataclasses and (gate_up, down) pairs included."""
    found = []
    for name in layer.__slots__:
        value = getattr(layer, name)
        values = value if isinstance(value, list | tuple) else [value]
        for v in values:
            if isinstance(v, tuple):
                found.extend(v)
            elif hasattr(v, "__slots__") and not hasattr(v, "q"):  # a nested dataclass (MoE weights)
                found.extend(_matrices(v))
            elif (isinstance(v, torch.Tensor) and v.dim() >= 2) or hasattr(v, "q"):
                found.append(v)
    return found


def embedding(token_ids: torch.Tensor, weights: ModelWeights) -> torch.Tensor:
    """Rows of the embedding; of a tied one, read from the packed LM head (the same floats): from panels
    [vocab / 32, hidden, 32], column id % 32 of panel id // 32; from a packing with ``rows``, its rows."""
    if weights.embed is not None:
        return F.embedding(token_ids, weights.embed)
    if hasattr(weights.lm_head, "rows"):
        return weights.lm_head.rows(token_ids)
    panel = weights.lm_head.shape[2]
    return weights.lm_head[token_ids // panel, :, token_ids % panel]


class LlamaDecoder:
    """Stateless apart from its weights: all KV lives in the pool passed to ``forward``."""

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, backend: PagedAttentionBackend):
        self.cfg = cfg
        self.weights = pack_weights(weights, backend.pack_weight)
        self.backend = backend
        self.linear = backend.linear
        device = weights.lm_head.device
        self.inv_freq, self.rope_factor = frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                                      cfg.max_position_embeddings)
        cos, sin = cos_sin_table(self.inv_freq, cfg.max_position_embeddings, self.rope_factor)
        self.cos, self.sin = cos.to(device), sin.to(device)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,  # [num_tokens] int64
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,  # [num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]
        kv_scales: torch.Tensor | None = None,  # [num_layers, 2, num_pages, page_size, num_kv_heads] or None
        sliding: SlidingGroup | None = None,  # page groups: the sliding layers' pool and metadata (kv_cache and
        # kv_scales then hold the full layers only; kvserve/worker/layer_windows.py)
    ) -> torch.Tensor:  # [num_tokens, hidden]
        x = embedding(token_ids, self.weights)  # the residual stream: updated in place by add_rms_norm_
        dtype = x.dtype
        if meta.max_seq_len > self.cos.shape[0]:  # attention sinks: positions past the model's context
            self._grow_rope(meta.max_seq_len)
        cos = self.cos[meta.positions].to(dtype)
        sin = self.sin[meta.positions].to(dtype)
        sink_rope = None if meta.sink_positions is None else \
            (self.cos[meta.sink_positions].to(dtype), self.sin[meta.sink_positions].to(dtype))
        # per layer (cache, scales, meta, state): windows and pools may differ
        steps = layer_steps(self.cfg, meta, self.backend.prepare, kv_cache, kv_scales, sliding)
        b, eps, layers = self.backend, self.cfg.rms_norm_eps, self.weights.layers
        h = b.rms_norm(x, layers[0].input_norm, eps)
        for i, layer in enumerate(layers):
            h = b.add_rms_norm_(x, self._attention(h, layer, cos, sin, *steps[i], sink_rope), layer.post_norm, eps)
            following = layers[i + 1].input_norm if i + 1 < len(layers) else self.weights.final_norm
            h = b.add_rms_norm_(x, self._mlp(h, layer), following, eps)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] in fp32."""
        return self.linear(hidden, self.weights.lm_head).float()

    def _grow_rope(self, positions: int) -> None:
        """Extends the cos/sin tables to cover ``positions`` (doubling; the first rows stay the same floats)."""
        size = self.cos.shape[0]
        while size < positions:
            size *= 2
        cos, sin = cos_sin_table(self.inv_freq, size, self.rope_factor)
        self.cos, self.sin = cos.to(self.cos.device), sin.to(self.sin.device)

    def _attention(self, x, layer: LayerWeights, cos, sin, kv_cache, kv_scales, meta, state,
                   sink_rope) -> torch.Tensor:
        cfg = self.cfg
        qkv = self.linear(x, layer.qkv, layer.qkv_bias)
        if layer.q_norm is not None:
            qkv = self._qk_norm(qkv, layer)
        if sink_rope is None:  # the backends' signature without attention sinks
            out = self.backend.qkv_attention(qkv, cos, sin, kv_cache, meta, state, self.scale, cfg.num_heads,
                                             cfg.num_kv_heads, kv_scales)
        else:
            out = self.backend.qkv_attention(qkv, cos, sin, kv_cache, meta, state, self.scale, cfg.num_heads,
                                             cfg.num_kv_heads, kv_scales, sink_rope=sink_rope)
        return self.linear(out.reshape(-1, self.q_size), layer.o)

    def _qk_norm(self, qkv: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        """Qwen3's RMSNorm over each query and key head (head_dim wide), before the backend applies RoPE."""
        n, d, eps = qkv.shape[0], self.cfg.head_dim, self.cfg.rms_norm_eps
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.backend.rms_norm(q.reshape(-1, d), layer.q_norm, eps).reshape(n, self.q_size)
        k = self.backend.rms_norm(k.reshape(-1, d), layer.k_norm, eps).reshape(n, self.kv_size)
        return torch.cat([q, k, v], dim=-1)

    def _mlp(self, x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        return feed_forward(x, layer, self.cfg.moe, self.backend)  # Qwen3-MoE's routed layers run their experts
