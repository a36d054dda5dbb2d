"""Tiny random-weight models that mix full-attention and sliding-window layers, saved as HF folders: Gemma 2,
Gemma 3 text, Qwen2 with ``max_window_layers``, Ministral/Mistral and Llama with a ``layer_types`` list. They share
the default model's vocabulary (so its tokenizer serves them) and have weights large enough that attention decides
the tokens (a window changes them). HF's reference and the one-request loop are family_models'.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from family_models import save_model

VOCAB = 49152  # the default model's
WINDOW = 24  # tokens of the sliding layers' window: 1.5 pages of 16
MIXED = ["sliding_attention", "sliding_attention", "full_attention"] * 2  # six layers, two of them full
GEMMA2_ATTN_CAP, GEMMA2_FINAL_CAP = 2.0, 8.0  # Gemma 2's are 50 and 30, for scores of real checkpoints
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=1024, initializer_range=0.08, tie_word_embeddings=True, bos_token_id=1,
              eos_token_id=2)


def gemma3_config(**overrides):
    """A 6-layer Gemma 3 text config: sliding layers of window 24 with RoPE base 1e4, full layers with base 1e6
    and linear rope scaling (so the two ropes differ), a query scale other than head_dim's."""
    from transformers import Gemma3TextConfig

    kw = dict(COMMON, num_hidden_layers=6, head_dim=16, sliding_window=WINDOW, layer_types=MIXED,
              query_pre_attn_scalar=24, rms_norm_eps=1e-6, pad_token_id=0,
              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    return Gemma3TextConfig(**(kw | overrides))


def random_norms(model):
    """The model with every norm weight of its text layers drawn at random, in place (HF starts them at 0, where
    every Gemma norm scales by 1 and a wrong ``1 + w`` would go unseen); a vision tower's are left as they are."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "vision" not in name:
                p.normal_(0.0, 0.3)
    return model


def save_gemma3(folder: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """A tiny Gemma3ForCausalLM with random norm weights too (HF starts them at 0, where every norm scales by 1
    and a wrong ``1 + w`` would go unseen)."""
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(seed)
    return save_model(random_norms(Gemma3ForCausalLM(gemma3_config(**overrides))), folder, tokenizer_dir)


def gemma2_config(**overrides):
    """A 6-layer Gemma 2 config: layer_types left to HF (every other layer slides, window 24), one RoPE, a query
    scale other than head_dim's, and soft caps small enough to bend this model's attention scores and logits."""
    from transformers import Gemma2Config

    kw = dict(COMMON, num_hidden_layers=6, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
              rms_norm_eps=1e-6, pad_token_id=0, attn_logit_softcapping=GEMMA2_ATTN_CAP,
              final_logit_softcapping=GEMMA2_FINAL_CAP, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    return Gemma2Config(**(kw | overrides))


def save_gemma2(folder: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """A tiny Gemma2ForCausalLM with random norm weights (as save_gemma3) and larger projections, so that the
    attention scores reach the soft cap (a worker that left it out generates other tokens)."""
    from transformers import Gemma2ForCausalLM

    torch.manual_seed(seed)
    model = random_norms(Gemma2ForCausalLM(gemma2_config(**overrides)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(3.0)
    return save_model(model, folder, tokenizer_dir)


def save_gemma3_multimodal(folder: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A tiny Gemma3ForConditionalGeneration (what Gemma 3 4B to 27B are): gemma3_config's text model, random
    norms as in save_gemma3, and a one-layer vision tower the worker leaves out."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(seed)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    cfg = Gemma3Config(text_config=gemma3_config().to_dict(), vision_config=vision, mm_tokens_per_image=4)
    return save_model(random_norms(Gemma3ForConditionalGeneration(cfg)), folder, tokenizer_dir)


def save_mixed(folder: Path, tokenizer_dir: Path, model_type: str, seed: int = 0, drop: tuple[str, ...] = (),
               **overrides) -> Path:
    """A 4-layer tiny model of ``model_type`` ("qwen2", "ministral", "mistral", "llama") with ``overrides`` in its
    config; ``drop`` names config.json fields to leave out (e.g. layer_types, so HF derives it again)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    kw = dict(COMMON, num_hidden_layers=4, head_dim=16, rms_norm_eps=1e-5) | overrides
    cfg = AutoConfig.for_model(model_type, **kw)
    model = AutoModelForCausalLM.from_config(cfg)
    save_model(model, folder, tokenizer_dir)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if k not in drop}, indent=2))
    return folder
