"""The shapes of multi-head latent attention (MLA, DeepSeek-V2/V3) and of DeepSeek's routed mixture of experts, read
from an HF ``config.json``. ModelConfig holds them as its ``mla`` and ``moe`` fields; everything else about the
model (vocabulary, hidden size, norms, layer count) stays in ModelConfig's own fields.

For the pool an MLA model is one "KV head" of width ``latent_dim`` with no separate V plane::

    per layer and token:  [ c_kv (kv_lora_rank, after kv_a_layernorm) | k_rope (qk_rope_head_dim, rotated) ]
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.kernels.rotary import yarn_mscale
from kvserve.worker.moe import MoEParams

MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
ROPE_TYPES = ("default", "yarn")  # the rope_type values an MLA model may use here


@dataclass(frozen=True, slots=True)
class MLAParams:
    """MLA's projection ranks and head widths, its RoPE flavour and softmax scale."""

    q_lora_rank: int | None  # None: one q_proj; else q_a_proj -> q_a_layernorm -> q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the rope part's pairs are (x0, x1), (x2, x3), ... (DeepSeek's checkpoints)
    interleave_output: bool  # V3's rotation writes the rotated evens then the odds; V2's keeps the pairs in place
    softmax_scale: float  # qk_head_dim ** -0.5, times yarn's mscale(factor, mscale_all_dim) ** 2

    @property
    def latent_dim(self) -> int:
        """Elements cached per token and layer: the compressed latent and the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def mla_params(raw: dict, rope_scaling: dict | None, unsupported: type[ValueError]) -> MLAParams:
    """MLAParams of a deepseek_v2 / deepseek_v3 HF config dict; ``unsupported`` (the config module's
    UnsupportedModel) for what kvserve cannot serve exactly."""
    model_type = raw["model_type"]
    kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if kind not in ROPE_TYPES:
        raise unsupported(f"{model_type}: rope type {kind!r} is not supported with MLA; supported: {ROPE_TYPES}")
    nope, rope = int(raw["qk_nope_head_dim"]), int(raw["qk_rope_head_dim"])
    if rope % 2:
        raise unsupported(f"{model_type}: qk_rope_head_dim must be even, got {rope}")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise unsupported(f"{model_type}: {flag} is not supported with MLA")
    q_lora = raw.get("q_lora_rank")
    v3 = model_type == "deepseek_v3"
    return MLAParams(
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(raw["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=int(raw["v_head_dim"]),
        rope_interleave=bool(raw.get("rope_interleave", True)) if v3 else True,  # V2 always rotates pairs
        interleave_output=v3,
        softmax_scale=_softmax_scale(nope + rope, rope_scaling if kind != "default" else None),
    )


def _softmax_scale(qk_head_dim: int, yarn: dict | None) -> float:
    """HF's yarn_apply_mscale: with yarn and ``mscale_all_dim``, every dim's scores scale by mscale squared."""
    scale = qk_head_dim ** -0.5
    if yarn and yarn.get("mscale_all_dim"):
        m = yarn_mscale(float(yarn["factor"]), float(yarn["mscale_all_dim"]))
        scale = scale * m * m
    return scale


def mla_moe_params(raw: dict, unsupported: type[ValueError]) -> MoEParams | None:
    """DeepSeek's routed experts (ModelConfig.moe), or None when every layer is dense (first_k_dense_replace >=
    num_hidden_layers, or no routed experts)."""
    v3 = raw["model_type"] == "deepseek_v3"
    num_layers = int(raw["num_hidden_layers"])
    first_dense = int(raw.get("first_k_dense_replace") or 0)
    num_experts = int(raw.get("n_routed_experts") or 0)
    if first_dense >= num_layers or num_experts == 0:
        return None
    if int(raw.get("moe_layer_freq", 1)) != 1:
        raise unsupported(f"{raw['model_type']}: moe_layer_freq {raw['moe_layer_freq']} is not supported; only 1")
    scoring = raw.get("scoring_func", "sigmoid" if v3 else "softmax")
    method = raw.get("topk_method", "noaux_tc" if v3 else "greedy")
    known = {("sigmoid", "noaux_tc")} if v3 else {("softmax", "greedy"), ("softmax", "group_limited_greedy")}
    if (scoring, method) not in known:
        raise unsupported(f"{raw['model_type']}: MoE routing scoring_func={scoring!r}, topk_method={method!r} is "
                          f"not supported; supported: {sorted(known)}")
    n_group = int(raw.get("n_group") or 1)
    if num_experts % n_group:
        raise unsupported(f"n_routed_experts {num_experts} is not a multiple of n_group {n_group}")
    return MoEParams(
        first_k_dense_replace=first_dense,
        n_routed_experts=num_experts,
        num_experts_per_tok=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(raw["moe_intermediate_size"]),
        n_shared_experts=int(raw.get("n_shared_experts") or 0),
        n_group=n_group,
        topk_group=int(raw.get("topk_group") or 1),
        norm_topk_prob=v3 and bool(raw.get("norm_topk_prob", True)),  # HF's V2 router never renormalises
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        scoring_func=scoring,
        topk_method=method,
    )
