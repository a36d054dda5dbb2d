"""Gemma 2 and Gemma 3 text models (``gemma2``, ``gemma3_text``) over the paged KV cache, computed as HF's
modeling_gemma2 and modeling_gemma3 compute them.

A layer differs from LlamaDecoder's in four places, everything else (the fused QKV and gate/up projections through
the backend's ``linear``, RoPE, the K/V write and the paged attention through ``backend.qkv_attention``) is shared:

- RMSNorm scales by ``1 + w`` and runs in float32 (Gemma3RMSNorm); ``1 + w`` is precomputed once, in float32.
- Four norms per layer, the attention's and the MLP's outputs normalised before they join the residual::

      h = input_norm(x);  x += post_norm(attention(h));  h = pre_mlp_norm(x);  x += post_mlp_norm(mlp(h))

- Gemma 3: q_norm / k_norm over each head before RoPE. Gemma 2: none, but every attention score is soft-capped
  (``cap * tanh(s / cap)``, in the backend's kernels: AttentionMetadata.logits_soft_cap). Queries are scaled by
  ``query_pre_attn_scalar ** -0.5``.
- Sliding layers attend within the window. Gemma 3's rotate with their own RoPE base (``rope_local_base_freq``),
  its full layers with ``rope_theta`` and the checkpoint's rope scaling; Gemma 2 has one rope.
- The embedding is scaled by ``sqrt(hidden_size)`` (cast to the weights' dtype, as HF casts it); the MLP is
  gelu(tanh)-gated; logits are soft-capped when ``final_logit_softcapping`` is set.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.kernels.paged_attention import AttentionMetadata, PagedAttentionBackend
from kvserve.kernels.rotary import cos_sin_table, inverse_frequencies
from kvserve.worker.config import ModelConfig
from kvserve.worker.layer_windows import SlidingGroup, layer_steps
from kvserve.worker.model import LlamaDecoder, embedding
from kvserve.worker.weights import LayerWeights, ModelWeights

NORMS = ("input_norm", "post_norm", "pre_mlp_norm", "post_mlp_norm", "q_norm", "k_norm")


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma3RMSNorm with ``weight`` = 1 + w in float32: normalised and scaled in float32, then cast back to x's
    dtype. F.rms_norm in float32 gives HF's ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` bit for bit (the cpu
    backend's fused kernel differs in the last bit, so it is not used here)."""
    return F.rms_norm(x.float(), weight.shape, weight, eps).to(x.dtype)


def one_plus_norms(weights: ModelWeights, qk_norm: bool) -> ModelWeights:
    """Replaces, in place, every norm weight w by ``1 + w`` in float32 (what Gemma3RMSNorm multiplies by)."""
    names = NORMS if qk_norm else NORMS[:4]
    for layer in weights.layers:
        for name in names:
            w = getattr(layer, name)
            assert w is not None, f"a Gemma layer needs its {name} weight"
            setattr(layer, name, 1.0 + w.float())
    weights.final_norm = 1.0 + weights.final_norm.float()
    return weights


class GemmaDecoder(LlamaDecoder):
    """LlamaDecoder's weights, packing and backend, with Gemma's norms, rope per layer type and MLP."""

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, backend: PagedAttentionBackend):
        assert cfg.gemma is not None, "GemmaDecoder runs gemma2 and gemma3_text configs"
        # the full layers' rope: rope_theta, scaling
        super().__init__(cfg, one_plus_norms(weights, cfg.gemma.qk_norm), backend)
        g = cfg.gemma
        self.scale = g.query_pre_attn_scalar ** -0.5
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5)  # float32, cast to the embedding's dtype (HF)
        cos, sin = cos_sin_table(inverse_frequencies(cfg.head_dim, g.sliding_rope_theta, g.sliding_rope_scaling),
                                 cfg.max_position_embeddings)
        self.local_cos, self.local_sin = cos.to(self.cos.device), sin.to(self.sin.device)

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,  # [num_tokens] int64
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,  # [num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]
        kv_scales: torch.Tensor | None = None,  # [num_layers, 2, num_pages, page_size, num_kv_heads] or None
        sliding: SlidingGroup | None = None,  # page groups: the sliding layers' pool and metadata (LlamaDecoder's)
    ) -> torch.Tensor:  # [num_tokens, hidden], after the final norm
        assert meta.sink_positions is None, "Gemma is served without attention sinks"
        x = embedding(token_ids, self.weights)
        x = x * self.embed_scale.to(device=x.device, dtype=x.dtype)  # the residual stream, updated in place
        pos = meta.positions
        ropes = {False: (self.cos[pos].to(x.dtype), self.sin[pos].to(x.dtype)),
                 True: (self.local_cos[pos].to(x.dtype), self.local_sin[pos].to(x.dtype))}
        # per layer (cache, scales, meta, state): windows and pools may differ
        steps = layer_steps(self.cfg, meta, self.backend.prepare, kv_cache, kv_scales, sliding)
        layers, eps, local = self.weights.layers, self.cfg.rms_norm_eps, self.cfg.gemma.sliding_layers
        h = gemma_rms_norm(x, layers[0].input_norm, eps)
        for i, layer in enumerate(layers):
            out = self._attention(h, layer, *ropes[local[i]], *steps[i])
            h = gemma_rms_norm(x.add_(gemma_rms_norm(out, layer.post_norm, eps)), layer.pre_mlp_norm, eps)
            following = layers[i + 1].input_norm if i + 1 < len(layers) else self.weights.final_norm
            h = gemma_rms_norm(x.add_(gemma_rms_norm(self._mlp(h, layer), layer.post_mlp_norm, eps)), following, eps)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] in fp32, soft-capped (``cap * tanh(logits / cap)``) when the config says so."""
        logits = self.linear(hidden, self.weights.lm_head)
        cap = self.cfg.gemma.final_logit_softcapping
        return (torch.tanh(logits / cap) * cap if cap else logits).float()

    def _attention(self, x, layer: LayerWeights, cos, sin, kv_cache, kv_scales, meta, state) -> torch.Tensor:
        """q_norm / k_norm per head on the fused projection's q and k (Gemma 3), then the backend's RoPE and paged
        attention (soft-capped through the metadata for Gemma 2)."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        qkv = self.linear(x, layer.qkv)
        if cfg.gemma.qk_norm:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            n, d = qkv.shape[0], cfg.head_dim
            q = gemma_rms_norm(q.reshape(-1, d), layer.q_norm, eps).reshape(n, self.q_size)
            k = gemma_rms_norm(k.reshape(-1, d), layer.k_norm, eps).reshape(n, self.kv_size)
            qkv = torch.cat([q, k, v], dim=-1)
        out = self.backend.qkv_attention(qkv, cos, sin, kv_cache, meta, state, self.scale,
                                         cfg.num_heads, cfg.num_kv_heads, kv_scales)
        return self.linear(out.reshape(-1, self.q_size), layer.o)

    def _mlp(self, x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        """down(gelu_pytorch_tanh(gate) * up), gate and up from the fused projection."""
        gate, up = self.linear(x, layer.gate_up).chunk(2, dim=-1)
        return self.linear(F.gelu(gate, approximate="tanh") * up, layer.down)
