"""Tiny random-weight DeepSeek-V3 (and one V2) models saved as HF folders, for the MLA tests
(tests/unit/worker/test_mla.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from family_models import save_model

VARIANTS = {
    # q through q_a_proj / q_a_layernorm / q_b_proj, interleaved rope, every layer dense
    "dense": dict(q_lora_rank=48, first_k_dense_replace=2),
    # q_proj, rotate-half rope with yarn (attention factor and softmax mscale both != 1), layer 1 routed MoE
    "moe_yarn": dict(q_lora_rank=None, first_k_dense_replace=1, rope_interleave=False,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 256, "mscale": 1.0,
                                      "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}),
    # DeepSeek-V2: pairs rotated in place, softmax routing limited to the best group, two shared experts
    "v2_moe": dict(q_lora_rank=None, first_k_dense_replace=1, topk_method="group_limited_greedy",
                   n_shared_experts=2, routed_scaling_factor=1.5),
}


def save_tiny_mla(folder: Path, tokenizer_dir: Path, variant: str = "dense", seed: int = 0) -> Path:
    """A 2-layer DeepseekV3ForCausalLM (DeepseekV2ForCausalLM for "v2_moe") of the default model's vocabulary (so
    its tokenizer serves it), with random weights large enough that attention decides the tokens."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    common = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, n_group=2, topk_group=1,
        num_experts_per_tok=2, routed_scaling_factor=2.5, max_position_embeddings=1024, rms_norm_eps=1e-5,
        initializer_range=0.08, bos_token_id=1, eos_token_id=2)
    common.update(VARIANTS[variant])
    torch.manual_seed(seed)
    if variant == "v2_moe":
        model = DeepseekV2ForCausalLM(DeepseekV2Config(**common))
    else:
        model = DeepseekV3ForCausalLM(DeepseekV3Config(num_mtp_layers=0, **common))
    if variant == "moe_yarn":  # a correction bias that changes the choice (HF initialises it to zeros)
        with torch.no_grad():
            model.model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.1)
    return save_model(model, folder, tokenizer_dir)
