"""DeepSeek-V2/V3 checkpoint tensors in the MLA decoder's layout (kvserve/worker/mla.py).

The two projections that read the layer input, q_a_proj (or q_proj) and kv_a_proj_with_mqa, are fused into one
matrix (one GEMM instead of two); kv_b_proj stays a plain tensor, since the absorbed attention reads it per head.
A MoE layer's routed experts keep HF's per-expert matrices, gate and up fused.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvserve.worker.config import ModelConfig
from kvserve.worker.moe import MoEWeights, gate_up, load_moe, pack_moe, random_moe


@dataclass(slots=True)
class MLALayerWeights:
    input_norm: torch.Tensor  # [hidden]
    a_proj: torch.Tensor  # [(q_lora_rank or H * qk_head_dim) + kv_lora_rank + qk_rope_head_dim, hidden]
    q_a_norm: torch.Tensor | None  # [q_lora_rank]; None: a_proj's first rows are q itself
    q_b: torch.Tensor | None  # [H * qk_head_dim, q_lora_rank]
    kv_a_norm: torch.Tensor  # [kv_lora_rank]
    kv_b: torch.Tensor  # [H * (qk_nope_head_dim + v_head_dim), kv_lora_rank], never packed
    o: torch.Tensor  # [hidden, H * v_head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor | None  # dense MLP [2 * intermediate, hidden]; None in a MoE layer
    down: torch.Tensor | None  # [hidden, intermediate]
    moe: MoEWeights | None = None


def mla_layers(t: dict[str, torch.Tensor], cfg: ModelConfig, cast) -> list[MLALayerWeights]:
    """Every layer's weights from HF-named tensors (``model.layers.{i}.self_attn.kv_b_proj.weight``, ...)."""
    return [_layer(t, f"model.layers.{i}.", cfg, i, cast) for i in range(cfg.num_layers)]


def _layer(t: dict[str, torch.Tensor], p: str, cfg: ModelConfig, i: int, cast) -> MLALayerWeights:
    attn, mlp = p + "self_attn.", p + "mlp."
    lora = cfg.mla.q_lora_rank is not None
    q_first = t[attn + ("q_a_proj.weight" if lora else "q_proj.weight")]
    moe = cfg.is_moe_layer(i)
    return MLALayerWeights(
        input_norm=cast(t[p + "input_layernorm.weight"]),
        a_proj=cast(torch.cat([q_first, t[attn + "kv_a_proj_with_mqa.weight"]])),
        q_a_norm=cast(t[attn + "q_a_layernorm.weight"]) if lora else None,
        q_b=cast(t[attn + "q_b_proj.weight"]) if lora else None,
        kv_a_norm=cast(t[attn + "kv_a_layernorm.weight"]),
        kv_b=cast(t[attn + "kv_b_proj.weight"]),
        o=cast(t[attn + "o_proj.weight"]),
        post_norm=cast(t[p + "post_attention_layernorm.weight"]),
        gate_up=None if moe else cast(gate_up(t, mlp)),
        down=None if moe else cast(t[mlp + "down_proj.weight"]),
        moe=load_moe(t, mlp, cfg.moe, cast) if moe else None,
    )


def pack_mla_layers(layers: list[MLALayerWeights], pack) -> list[MLALayerWeights]:
    """The layers with every matrix that goes through the backend's ``linear`` in its packed layout (kv_b and the
    router stay plain: they are read as tensors)."""

    def opt(w):
        return None if w is None else pack(w)

    out = []
    for layer in layers:
        moe = pack_moe(layer.moe, pack)
        out.append(replace(layer, a_proj=pack(layer.a_proj), q_b=opt(layer.q_b), o=pack(layer.o),
                           gate_up=opt(layer.gate_up), down=opt(layer.down), moe=moe))
    return out


def random_mla_layers(cfg: ModelConfig, d) -> list[MLALayerWeights]:
    """MLA layers of cfg's shapes drawn by ``d`` (random_draws.Draws; norms at 1), in mla_layers' layout: a dense MLP
    in the first ``first_k_dense_replace`` layers, routed experts (and shared ones) after, as cfg.moe says, their
    router in float32: benchmarks and GPU checks without a checkpoint."""
    m, h = cfg.mla, cfg.hidden_size

    def layer(i: int) -> MLALayerWeights:
        q_rows = m.q_lora_rank or cfg.num_heads * m.qk_head_dim
        routed = cfg.is_moe_layer(i)
        a_proj = d.mat(q_rows + m.latent_dim, h)
        q_b = None if m.q_lora_rank is None else d.mat(cfg.num_heads * m.qk_head_dim, m.q_lora_rank)
        kv_b = d.mat(cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
        o = d.mat(h, cfg.num_heads * m.v_head_dim)
        gate_up, down = (None, None) if routed else d.gated_mlp(h, cfg.intermediate_size)
        return MLALayerWeights(input_norm=d.ones(h), a_proj=a_proj, q_b=q_b, o=o, kv_b=kv_b, post_norm=d.ones(h),
                               q_a_norm=None if m.q_lora_rank is None else d.ones(m.q_lora_rank),
                               kv_a_norm=d.ones(m.kv_lora_rank), gate_up=gate_up, down=down,
                               moe=random_moe(cfg.moe, h, d, torch.float32) if routed else None)

    return [layer(i) for i in range(cfg.num_layers)]
