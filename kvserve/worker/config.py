"""Model configuration: the subset of an HF ``config.json`` that a Llama-family decoder needs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.common.attention_window import FLAG_NAMES, AttentionWindow
from kvserve.common.kvmem import kv_bytes_per_token

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModel(ValueError):
    """The model folder describes an architecture this worker cannot run."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shapes and constants of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: dict | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: int | None = None
    sliding_window: int = 0  # every layer attends to the last W positions (Mistral; Qwen2's use_sliding_window)
    qk_norm: bool = False  # an RMSNorm over each head's query and key before RoPE (Qwen3)

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        """Reads an HF config dict; raises UnsupportedModel for other architectures."""
        model_type = raw.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModel(f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
        if raw.get("hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"hidden_act {raw['hidden_act']!r} is not supported; only silu")
        num_heads = int(raw["num_attention_heads"])
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
            rope_scaling=_rope_scaling(raw),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            sliding_window=_sliding_window(raw, model_type),
            qk_norm=model_type == "qwen3",
        )

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        return cls.from_dict(json.loads((Path(folder) / "config.json").read_text()))

    def kv_bytes_per_token(self, dtype_bytes: int, scale_bytes: int = 0) -> int:
        """Exact KV-cache bytes of one token: K and V, every layer, every KV head, elements and per-head scale
        (kvserve kv-mem's formula)."""
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, dtype_bytes, scale_bytes)


def _sliding_window(raw: dict, model_type: str) -> int:
    """The window every layer attends with (0: full attention). A layout of full and sliding layers mixed
    (Qwen2's max_window_layers, a layer_types list of both kinds) is refused: it would be served wrongly."""
    window = raw.get("sliding_window")
    qwen = model_type in ("qwen2", "qwen3")
    if model_type == "llama" or (qwen and not raw.get("use_sliding_window", False)):
        window = None  # their HF models ignore the field
    kinds = set(raw.get("layer_types") or [])
    if qwen and window and not kinds:
        first = int(raw.get("max_window_layers", 0))  # HF Qwen2: layers from this index on slide
        kinds = {"sliding_attention"} if first == 0 else \
            {"full_attention"} | ({"sliding_attention"} if first < int(raw["num_hidden_layers"]) else set())
    if kinds - {"full_attention", "sliding_attention"}:
        raise UnsupportedModel(f"layer_types {sorted(kinds)} are not supported; only full_attention and "
                               "sliding_attention")
    if len(kinds) > 1 and window:
        raise UnsupportedModel("this model mixes full-attention and sliding-window layers; kvserve serves one "
                               "attention layout for every layer")
    if kinds == {"full_attention"} or not window:
        return 0
    if int(window) <= 0:
        raise UnsupportedModel(f"sliding_window must be > 0, got {window}")
    return int(window)


def resolve_window(model: ModelConfig, sliding_window: int, sinks: int, page_size: int) -> AttentionWindow:
    """The attention window a worker serves: the model's own window, or --sliding-window for a model trained
    with full attention (with --attention-sinks, StreamingLLM). Raises ValueError on a bad combination."""
    own = model.sliding_window
    if sliding_window > 0 and own and sliding_window != own:
        raise ValueError(f"the model declares sliding_window {own}; --sliding-window {sliding_window} "
                         "would serve it wrongly (leave it out)")
    return AttentionWindow.checked(sliding_window or own, sinks, page_size, FLAG_NAMES)


def _rope_scaling(raw: dict) -> dict | None:
    """transformers < 5 writes ``rope_scaling``; transformers 5 writes ``rope_parameters`` with a rope_type."""
    if raw.get("rope_scaling"):
        return raw["rope_scaling"]
    params = raw.get("rope_parameters") or {}
    return params if params.get("rope_type", "default") != "default" else None
