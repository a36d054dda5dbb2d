"""Tiny random-weight models of the families kvserve serves beyond Llama, saved as HF folders by transformers'
own classes (no downloads): the default model's vocabulary, so its tokenizer serves them, and weights large
enough that attention decides the tokens."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.08,
              tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def save_model(model, folder: Path, tokenizer_dir: Path) -> Path:
    """``model`` saved as safetensors with the default model's tokenizer files beside it."""
    model.save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def save_tiny_qwen3(folder: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """A 2-layer Qwen3: per-head q/k RMSNorm, and a head_dim (32) other than hidden / heads (16), as Qwen3's
    checkpoints have (128 against 5120 / 64 = 80 for the 32B)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**{**COMMON, "head_dim": 32, **overrides}))
    with torch.no_grad():  # HF initialises the norms at 1: random ones show a worker that skipped them
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return save_model(model, folder, tokenizer_dir)


def save_tiny_qwen3_moe(folder: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """A 3-layer Qwen3-MoE (Qwen3-30B-A3B's family): layer 0 dense (mlp_only_layers), layers 1 and 2 routing 2 of
    4 experts per token, renormalised (norm_topk_prob, as Qwen3-30B-A3B's config sets it)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": 3, "head_dim": 32, "num_experts": 4,
                            "num_experts_per_tok": 2, "moe_intermediate_size": 48, "norm_topk_prob": True,
                            "mlp_only_layers": [0], "decoder_sparse_step": 1, **overrides})
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return save_model(model, folder, tokenizer_dir)
