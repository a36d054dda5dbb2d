"""Tiny random-weight models that mix full-attention and sliding-window layers, saved as HF folders: Gemma 3 text,
Qwen2 with ``max_window_layers``, Ministral/Mistral and Llama with a ``layer_types`` list. They share the default
model's vocabulary (so its tokenizer serves them) and have weights large enough that attention decides the tokens
(a window changes them). Also: greedy HF generation, and a paged loop that runs a second request on the first
one's cached pages (a prefix hit).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from family_models import save_model

from kvserve.common.pages import num_pages_for

VOCAB = 49152  # the default model's
WINDOW = 24  # tokens of the sliding layers' window: 1.5 pages of 16
MIXED = ["sliding_attention", "sliding_attention", "full_attention"] * 2  # six layers, two of them full
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


def save_gemma3(folder: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """A tiny Gemma3ForCausalLM with random norm weights too (HF starts them at 0, where every norm scales by 1
    and a wrong ``1 + w`` would go unseen)."""
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(gemma3_config(**overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    return save_model(model, folder, tokenizer_dir)


def save_gemma3_multimodal(folder: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A tiny Gemma3ForConditionalGeneration (what Gemma 3 4B to 27B are): gemma3_config's text model, random
    norms as in save_gemma3, and a one-layer vision tower the worker leaves out."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(seed)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    cfg = Gemma3Config(text_config=gemma3_config().to_dict(), vision_config=vision, mm_tokens_per_image=4)
    model = Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "vision" not in name:
                p.normal_(0.0, 0.3)
    return save_model(model, folder, tokenizer_dir)


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


def hf_model(folder: Path, model_class=None, **overrides):
    """The folder's HF model in float32 (``model_class``: other than AutoModelForCausalLM's choice)."""
    from transformers import AutoModelForCausalLM

    cls = model_class or AutoModelForCausalLM
    model = cls.from_pretrained(folder, dtype=torch.float32, local_files_only=True, **overrides)
    model.generation_config.eos_token_id = None  # the paged loops never stop early either
    model.generation_config.pad_token_id = 0
    return model.eval()


def hf_generate(model, prompt: list[int], new_tokens: int, use_cache: bool = True) -> list[int]:
    """HF's greedy tokens; ``use_cache=False`` runs the whole sequence through the model for every token."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, use_cache=use_cache)
    return out[0, len(prompt):].tolist()


def run_on_cached_prefix(runner, prompt: list[int], new_tokens: int, chunk: int,
                         cached: tuple[list[int], int] = ([], 0), first_page: int = 0) -> tuple[list[int], list[int]]:
    """Greedy generation of one request through runner.step, its prompt fed in chunks of ``chunk`` tokens after
    its ``cached = (page_ids, num_cached_tokens)`` prefix (pages another request filled: a prefix hit), its own
    pages numbered from ``first_page``. Every page is kept (a mixed model's worker reports full attention).
    Returns (generated tokens, page table)."""
    from kvserve.common.wire.worker import SamplingParams, StepBatch, StepItem

    page_size = runner.info.page_size
    table, computed = list(cached[0]), cached[1]
    tokens, out = list(prompt), []
    while len(out) < new_tokens:
        n = min(chunk, len(prompt) - computed) if computed < len(prompt) else 1
        while len(table) < num_pages_for(computed + n, page_size):
            table.append(first_page + len(table))
        sample = computed + n >= len(prompt)
        item = StepItem("r", tuple(tokens[computed:computed + n]), computed, tuple(table), sample=sample,
                        sampling=SamplingParams(temperature=0.0))
        sampled = runner.step(StepBatch((item,))).sampled
        computed += n
        if sample:
            out.append(sampled[0].token_id)
            tokens.append(out[-1])
    return out, table
