"""Tiny random-weight models of the families kvserve serves beyond Llama, saved as HF folders by transformers'
own classes (no downloads): the default model's vocabulary, so its tokenizer serves them, and weights large
enough that attention decides the tokens. Also what every family's tests compare with: HF's model of a folder
and its greedy tokens, and one request's greedy generation through the runner, from a prefix hit or not."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from kvserve.common.pages import num_pages_for

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


def hf_model(folder: Path, model_class=None, **overrides):
    """The folder's HF model in float32, never stopping early (as the paged loops never do); ``model_class``:
    another than AutoModelForCausalLM's choice."""
    from transformers import AutoModelForCausalLM

    cls = model_class or AutoModelForCausalLM
    model = cls.from_pretrained(folder, dtype=torch.float32, local_files_only=True, **overrides)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def hf_generate(model, prompt: list[int], new_tokens: int, use_cache: bool = True) -> list[int]:
    """HF's greedy tokens; ``use_cache=False`` runs the whole sequence through the model for every token."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, use_cache=use_cache)
    return out[0, len(prompt):].tolist()


def generate_one(runner, req_id: str, prompt: list[int], new_tokens: int, chunk: int, free: list[int],
                 page_table: list[int] | None = None, num_cached_tokens: int = 0) -> tuple[list[int], list[int]]:
    """Greedy generation of one request through runner.step: its prompt from ``num_cached_tokens`` on in chunks of
    ``chunk`` tokens, then one token a step. ``page_table`` starts with the pages that hold the cached tokens;
    pages are taken from ``free`` as it grows. Returns the new tokens and the final page table."""
    from kvserve.common.wire.worker import SamplingParams, StepBatch, StepItem

    page_size, table, tokens, out = runner.info.page_size, list(page_table or []), list(prompt), []
    computed = num_cached_tokens
    while len(out) < new_tokens:
        n = min(chunk, len(tokens) - computed) if computed < len(prompt) else 1
        while len(table) < num_pages_for(computed + n, page_size):
            table.append(free.pop(0))
        item = StepItem(req_id, tuple(tokens[computed:computed + n]), computed, tuple(table),
                        sample=computed + n >= len(prompt), sampling=SamplingParams(temperature=0.0))
        step = runner.step(StepBatch((item,)))
        assert not step.rejected, step.rejected
        sampled = step.sampled
        computed += n
        if sampled:
            out.append(sampled[0].token_id)
            tokens.append(sampled[0].token_id)
    return out, table
