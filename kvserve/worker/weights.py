"""Loads HF-layout safetensors into the decoder's weight dataclasses.

Q/K/V projections are fused into one matrix and gate/up into another, so a layer runs three GEMMs for its
projections instead of five.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.worker.config import ModelConfig
from kvserve.worker.mla_weights import mla_layers, random_mla_layers
from kvserve.worker.moe import MoEWeights, gate_up, load_moe, random_moe
from kvserve.worker.random_draws import Draws


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # [(num_heads + 2 * num_kv_heads) * head_dim] (Qwen2)
    o: torch.Tensor  # [hidden, num_heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]
    q_norm: torch.Tensor | None = None  # [head_dim]: each query head's RMSNorm weight, before RoPE (Qwen3)
    k_norm: torch.Tensor | None = None  # [head_dim]: each key head's
    pre_mlp_norm: torch.Tensor | None = None  # [hidden]: Gemma 3's pre_feedforward_layernorm (the MLP's input)
    post_mlp_norm: torch.Tensor | None = None  # [hidden]: Gemma 3's post_feedforward_layernorm (its output)
    moe: MoEWeights | None = None  # a routed layer's experts (Qwen3-MoE): gate_up and down are then None


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor | None  # [vocab, hidden]; None once a tied embedding is read from the packed LM head
    layers: list[LayerWeights]  # MLA models (cfg.mla): kvserve/worker/mla_weights.py's MLALayerWeights
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden], the embedding itself when tied


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open  # here, not at import: a GPU check with random weights runs without it

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def _layer(t: dict[str, torch.Tensor], i: int, cast, cfg: ModelConfig) -> LayerWeights:
    p = f"model.layers.{i}."
    attn, mlp = p + "self_attn.", p + "mlp."
    routed = cfg.is_moe_layer(i)
    qkv = torch.cat([t[attn + f"{n}_proj.weight"] for n in ("q", "k", "v")])
    bias = None
    if attn + "q_proj.bias" in t:
        bias = cast(torch.cat([t[attn + f"{n}_proj.bias"] for n in ("q", "k", "v")]))
    return LayerWeights(
        input_norm=cast(t[p + "input_layernorm.weight"]),
        qkv=cast(qkv),
        qkv_bias=bias,
        o=cast(t[attn + "o_proj.weight"]),
        post_norm=cast(t[p + "post_attention_layernorm.weight"]),
        gate_up=None if routed else cast(gate_up(t, mlp)),
        down=None if routed else cast(t[mlp + "down_proj.weight"]),
        moe=load_moe(t, mlp, cfg.moe, cast) if routed else None,
        q_norm=_optional(t, attn + "q_norm.weight", cast),
        k_norm=_optional(t, attn + "k_norm.weight", cast),
        pre_mlp_norm=_optional(t, p + "pre_feedforward_layernorm.weight", cast),
        post_mlp_norm=_optional(t, p + "post_feedforward_layernorm.weight", cast),
    )


def _optional(t: dict[str, torch.Tensor], name: str, cast) -> torch.Tensor | None:
    """cast(t[name]), or None for a checkpoint without that tensor (Qwen3's q/k norms, Gemma 3's extra norms)."""
    return cast(t[name]) if name in t else None


# Where a multimodal wrapper keeps its text model's tensors (checkpoints, and transformers 5's own names).
TEXT_MODEL_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                       "language_model.lm_head.": "lm_head."}


def text_model_tensors(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A multimodal checkpoint's text-model tensors under a text model's names (``model.layers.0...``); the
    vision tower and projector are left out. A text-only checkpoint is returned as it is."""
    if "model.embed_tokens.weight" in t:
        return t
    out = {}
    for name, tensor in t.items():
        for prefix, to in TEXT_MODEL_PREFIXES.items():
            if name.startswith(prefix):
                out[to + name[len(prefix):]] = tensor
    return out


def load_weights(folder: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> ModelWeights:
    """Reads every tensor of the folder (a multimodal one's text model), fuses projections, and moves them to
    ``device`` in ``dtype``."""
    t = text_model_tensors(_read_tensors(folder))

    def cast(x: torch.Tensor) -> torch.Tensor:
        return x.to(device=device, dtype=dtype).contiguous()

    embed = cast(t["model.embed_tokens.weight"])
    lm_head = embed if cfg.tie_word_embeddings or "lm_head.weight" not in t else cast(t["lm_head.weight"])
    return ModelWeights(
        embed=embed,
        layers=mla_layers(t, cfg, cast) if cfg.mla is not None else
        [_layer(t, i, cast, cfg) for i in range(cfg.num_layers)],
        final_norm=cast(t["model.norm.weight"]),
        lm_head=lm_head,
    )


def model_fingerprint(folder: Path) -> str:
    """xxh3-128 over config.json and every safetensors file: equal fingerprints mean equal KV."""
    import xxhash

    h = xxhash.xxh3_128()
    for path in [Path(folder) / "config.json", *sorted(Path(folder).glob("*.safetensors"))]:
        h.update(path.name.encode())
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def _llama_layer(cfg: ModelConfig, d: Draws, i: int) -> LayerWeights:
    """A Llama-family layer: fused QKV (with Qwen2's bias), fused gate/up or Qwen3-MoE's experts, norms at 1
    (Qwen3's q/k norms too)."""
    h, qkv_rows = cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    qkv = d.mat(qkv_rows, h)  # drawn in this order: one seed, the same model as ever
    qkv_bias = d.mat(qkv_rows) if cfg.attention_bias else None
    o = d.mat(h, cfg.num_heads * cfg.head_dim)
    routed = cfg.is_moe_layer(i)
    gate_up, down = (None, None) if routed else d.gated_mlp(h, cfg.intermediate_size)
    return LayerWeights(input_norm=d.ones(h), qkv=qkv, qkv_bias=qkv_bias, o=o, post_norm=d.ones(h), gate_up=gate_up,
                        down=down, moe=random_moe(cfg.moe, h, d) if routed else None,
                        q_norm=d.ones(cfg.head_dim) if cfg.qk_norm else None,
                        k_norm=d.ones(cfg.head_dim) if cfg.qk_norm else None)


def _gemma_layer(cfg: ModelConfig, d: Draws, i: int) -> LayerWeights:
    """A Gemma 3 layer: its six norms drawn near 0 (normal, ``std``), since GemmaDecoder scales by ``1 + w``
    (norms at 1 would double every activation they touch); q/k norms head_dim wide; no bias."""
    h, qkv_rows = cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    return LayerWeights(input_norm=d.mat(h), qkv=d.mat(qkv_rows, h), qkv_bias=None,
                        o=d.mat(h, cfg.num_heads * cfg.head_dim), post_norm=d.mat(h),
                        gate_up=d.mat(2 * cfg.intermediate_size, h), down=d.mat(h, cfg.intermediate_size),
                        q_norm=d.mat(cfg.head_dim), k_norm=d.mat(cfg.head_dim), pre_mlp_norm=d.mat(h),
                        post_mlp_norm=d.mat(h))


def random_weights(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0,
                   std: float = 0.02, draw_device: str | torch.device | None = None) -> ModelWeights:
    """Weights of cfg's shapes drawn on ``device`` (normal, ``std``; norms at 1, Gemma 3's near 0 as it scales by
    1 + w): a model to benchmark or test without any download, e.g. an 8B-shaped one created on the GPU in
    seconds. Llama-family, Gemma 3 (cfg.gemma) and MLA (cfg.mla, DeepSeek-V2/V3, MoE layers included) shapes, in
    load_weights' layout. CPU and CUDA generators draw different numbers from one seed: ``draw_device="cpu"``
    gives every device the same weights."""
    d = Draws(device, dtype, seed, std, torch.device(draw_device or device))
    if cfg.mla is not None:
        layers = random_mla_layers(cfg, d)
    else:
        layer = _gemma_layer if cfg.gemma is not None else _llama_layer
        layers = [layer(cfg, d, i) for i in range(cfg.num_layers)]
    embed = d.mat(cfg.vocab_size, cfg.hidden_size)
    lm_head = embed if cfg.tie_word_embeddings else d.mat(cfg.vocab_size, cfg.hidden_size)
    final_norm = d.mat(cfg.hidden_size) if cfg.gemma is not None else d.ones(cfg.hidden_size)
    return ModelWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)
