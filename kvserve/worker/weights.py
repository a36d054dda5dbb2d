"""Loads HF-layout safetensors into the decoder's weight dataclasses.

Q/K/V projections are fused into one matrix and gate/up into another, so a layer runs three GEMMs for its
projections instead of five.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.worker.config import ModelConfig
from kvserve.worker.mla_weights import mla_layers


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


def _layer(t: dict[str, torch.Tensor], i: int, cast) -> LayerWeights:
    p = f"model.layers.{i}."
    attn, mlp = p + "self_attn.", p + "mlp."
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
        gate_up=cast(torch.cat([t[mlp + "gate_proj.weight"], t[mlp + "up_proj.weight"]])),
        down=cast(t[mlp + "down_proj.weight"]),
        q_norm=cast(t[attn + "q_norm.weight"]) if attn + "q_norm.weight" in t else None,
        k_norm=cast(t[attn + "k_norm.weight"]) if attn + "k_norm.weight" in t else None,
        pre_mlp_norm=_optional(t, p + "pre_feedforward_layernorm.weight", cast),
        post_mlp_norm=_optional(t, p + "post_feedforward_layernorm.weight", cast),
    )


def _optional(t: dict[str, torch.Tensor], name: str, cast) -> torch.Tensor | None:
    """cast(t[name]), or None for a checkpoint without that tensor (Gemma 3's extra norms)."""
    return cast(t[name]) if name in t else None


def load_weights(folder: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> ModelWeights:
    """Reads every tensor of the folder, fuses projections, and moves them to ``device`` in ``dtype``."""
    t = _read_tensors(folder)

    def cast(x: torch.Tensor) -> torch.Tensor:
        return x.to(device=device, dtype=dtype).contiguous()

    embed = cast(t["model.embed_tokens.weight"])
    lm_head = embed if cfg.tie_word_embeddings or "lm_head.weight" not in t else cast(t["lm_head.weight"])
    return ModelWeights(
        embed=embed,
        layers=mla_layers(t, cfg, cast) if cfg.mla is not None else [_layer(t, i, cast) for i in range(cfg.num_layers)],
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


def random_weights(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0,
                   std: float = 0.02, draw_device: str | torch.device | None = None) -> ModelWeights:
    """Weights of cfg's shapes drawn on ``device`` (normal, ``std``; norms at 1): a model to benchmark or test
    without any download, e.g. an 8B-shaped one created on the GPU in seconds. CPU and CUDA generators draw
    different numbers from one seed: ``draw_device="cpu"`` gives every device the same weights."""
    draw = torch.device(draw_device or device)
    gen = torch.Generator(device=draw).manual_seed(seed)

    def mat(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=draw, dtype=torch.float32) * std).to(device, dtype)

    def ones(size: int = cfg.hidden_size) -> torch.Tensor:
        return torch.ones(size, device=device, dtype=dtype)

    def head_norm() -> torch.Tensor | None:
        return ones(cfg.head_dim) if cfg.qk_norm else None

    qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    layers = [LayerWeights(input_norm=ones(), qkv=mat(qkv_rows, cfg.hidden_size),
                           qkv_bias=mat(qkv_rows) if cfg.attention_bias else None,
                           o=mat(cfg.hidden_size, cfg.num_heads * cfg.head_dim), post_norm=ones(),
                           gate_up=mat(2 * cfg.intermediate_size, cfg.hidden_size),
                           down=mat(cfg.hidden_size, cfg.intermediate_size), q_norm=head_norm(),
                           k_norm=head_norm()) for _ in range(cfg.num_layers)]
    embed = mat(cfg.vocab_size, cfg.hidden_size)
    lm_head = embed if cfg.tie_word_embeddings else mat(cfg.vocab_size, cfg.hidden_size)
    return ModelWeights(embed=embed, layers=layers, final_norm=ones(), lm_head=lm_head)
