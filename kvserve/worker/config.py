"""Model configuration: the subset of an HF ``config.json`` that the worker's decoders need (model.py, gemma.py,
mla.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvserve.common.attention_window import FLAG_NAMES, AttentionWindow
from kvserve.common.kvmem import kv_bytes_per_token, mla_bytes_per_token
from kvserve.worker.gemma_config import GEMMA_MODEL_TYPES, GemmaParams, gemma_layer_kinds, gemma_overrides
from kvserve.worker.mla_config import MLA_MODEL_TYPES, MLAParams, mla_moe_params, mla_params
from kvserve.worker.moe import MoEParams

# Multimodal wrappers whose text model is served alone (text in, text out): their model_type -> the text model's.
WRAPPED_TEXT_MODELS = {"gemma3": "gemma3_text"}
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "ministral", *GEMMA_MODEL_TYPES)


class UnsupportedModel(ValueError):
    """The model folder describes an architecture this worker cannot run."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shapes and constants of a decoder: a Llama-family one's fields, and each other family's own in ``mla``,
    ``gemma`` and ``moe``."""

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
    mla: MLAParams | None = None  # multi-head latent attention (DeepSeek-V2/V3): one latent "KV head" of width
    # head_dim = kv_lora_rank + qk_rope_head_dim, no V plane (kvserve/worker/mla_config.py)
    layer_windows: tuple[int, ...] = ()  # per layer when full and sliding layers mix (0 = full attention);
    # () = every layer attends with sliding_window. A mixed model's sliding_window is 0: its worker keeps the
    # sliding layers' pages in a group of their own (page_groups.py), or every page in one pool
    gemma: GemmaParams | None = None  # Gemma 2's and 3's own constants (kvserve/worker/gemma.py runs them)
    moe: MoEParams | None = None  # routed experts (Qwen3-MoE, DeepSeek; kvserve/worker/moe.py); None: every MLP dense

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        """Reads an HF config dict; raises UnsupportedModel for other architectures."""
        model_type = raw.get("model_type", "")
        quantized = (raw.get("quantization_config") or {}).get("quant_method")
        if quantized:  # fp8 blocks with weight_scale_inv (DeepSeek-V3), AWQ, GPTQ: read as plain floats, wrong
            raise UnsupportedModel(f"quantised checkpoint weights ({quantized}) are not supported: give an "
                                   "unquantised (bf16/fp16/fp32) folder")
        if model_type in MLA_MODEL_TYPES:
            return _mla_model(cls, raw)
        if model_type in WRAPPED_TEXT_MODELS and isinstance(raw.get("text_config"), dict):
            return cls.from_dict(_text_model(raw))
        if model_type not in SUPPORTED_MODEL_TYPES:
            served = ", ".join((*SUPPORTED_MODEL_TYPES, *MLA_MODEL_TYPES, *WRAPPED_TEXT_MODELS))
            architectures = ", ".join(raw.get("architectures") or []) or "no architectures listed"
            raise UnsupportedModel(f"model_type {model_type!r} ({architectures}) is not served; served: {served}")
        if model_type not in GEMMA_MODEL_TYPES:
            _check_silu(raw)
        num_heads = int(raw["num_attention_heads"])
        windows = _layer_windows(raw, model_type)
        mixed = len(set(windows)) > 1
        cfg = cls(
            **_shared_fields(raw),
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // num_heads),
            attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
            sliding_window=0 if mixed else windows[0],
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            moe=_qwen3_moe(raw) if model_type == "qwen3_moe" else None,
            layer_windows=windows if mixed else (),
        )
        return _with_gemma(cfg, raw) if model_type in GEMMA_MODEL_TYPES else cfg

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        return cls.from_dict(json.loads((Path(folder) / "config.json").read_text()))

    @property
    def logits_soft_cap(self) -> float:
        """The soft cap on every attention score (Gemma 2's attn_logit_softcapping); 0.0: none."""
        return (self.gemma.attn_logit_softcapping or 0.0) if self.gemma is not None else 0.0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer``'s MLP routes over experts."""
        return self.moe is not None and self.moe.is_moe_layer(layer)

    def kv_bytes_per_token(self, dtype_bytes: int, scale_bytes: int = 0, num_layers: int | None = None) -> int:
        """Exact KV-cache bytes of one token: K and V, every layer (or ``num_layers`` of them: a page group's),
        every KV head, elements and per-head scale (kvserve kv-mem's formula). MLA: one latent per layer and one
        scale per layer."""
        L = self.num_layers if num_layers is None else num_layers
        if self.mla is not None:
            return mla_bytes_per_token(L, self.mla.latent_dim, dtype_bytes) + L * scale_bytes
        return kv_bytes_per_token(L, self.num_kv_heads, self.head_dim, dtype_bytes, scale_bytes)


def _layer_windows(raw: dict, model_type: str) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention), as the model's HF implementation attends: Mistral's and
    Ministral's ``sliding_window`` on the layers ``layer_types`` marks sliding (all, without the list), Qwen2's
    and Qwen3's on the layers from ``max_window_layers`` on (with ``use_sliding_window``), Gemma 3's on all but
    every ``sliding_window_pattern``-th layer. Raises UnsupportedModel for other layer types."""
    num_layers = int(raw["num_hidden_layers"])
    unknown = sorted(set(raw.get("layer_types") or []) - {"full_attention", "sliding_attention"})
    if unknown:
        raise UnsupportedModel(f"layer_types {unknown} are not supported; only full_attention and sliding_attention")
    window = raw.get("sliding_window")
    qwen = model_type in ("qwen2", "qwen3", "qwen3_moe")
    if model_type == "llama" or (qwen and not raw.get("use_sliding_window", False)) or not window:
        return (0,) * num_layers  # their HF models ignore the field
    if int(window) <= 0:
        raise UnsupportedModel(f"sliding_window must be > 0, got {window}")
    if model_type in GEMMA_MODEL_TYPES:
        kinds = gemma_layer_kinds(raw, num_layers)
    elif raw.get("layer_types"):
        kinds = list(raw["layer_types"])
    else:
        first = int(raw.get("max_window_layers", 0)) if qwen else 0  # HF Qwen2: layers from this index on slide
        kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if len(kinds) != num_layers:
        raise UnsupportedModel(f"layer_types has {len(kinds)} entries for {num_layers} layers")
    return tuple(int(window) if kind == "sliding_attention" else 0 for kind in kinds)


def _qwen3_moe(raw: dict) -> MoEParams | None:
    """Qwen3-MoE's experts: every decoder_sparse_step-th layer but mlp_only_layers routes, softmax top-k
    (renormalised with norm_topk_prob), no shared experts; None when no layer routes."""
    num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    if not num_experts:
        return None
    return MoEParams(first_k_dense_replace=0, n_routed_experts=num_experts,
                     num_experts_per_tok=int(raw["num_experts_per_tok"]),
                     moe_intermediate_size=int(raw["moe_intermediate_size"]), n_shared_experts=0, n_group=1,
                     topk_group=1, norm_topk_prob=bool(raw.get("norm_topk_prob", False)), routed_scaling_factor=1.0,
                     scoring_func="softmax", topk_method="greedy",
                     dense_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
                     sparse_step=int(raw.get("decoder_sparse_step") or 1))


def _text_model(raw: dict) -> dict:
    """A multimodal wrapper's text model as a config of its own (Gemma 3 4B-27B are Gemma3ForConditionalGeneration):
    its text_config, tied as the wrapper says, with the wrapper's token ids where the text_config has none."""
    text = dict(raw["text_config"], model_type=WRAPPED_TEXT_MODELS[raw["model_type"]])
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
        if key in raw and (key == "tie_word_embeddings" or text.get(key) is None):
            text[key] = raw[key]
    return text


def _with_gemma(cfg: ModelConfig, raw: dict) -> ModelConfig:
    """A gemma2 or gemma3_text config: its full layers' rope, tied embeddings by default, and GemmaParams."""
    try:
        return replace(cfg, **gemma_overrides(raw))
    except ValueError as e:
        raise UnsupportedModel(str(e)) from e


def resolve_window(model: ModelConfig, sliding_window: int, sinks: int, page_size: int) -> AttentionWindow:
    """The attention window a worker serves: the model's own window, or --sliding-window for a model trained
    with full attention (with --attention-sinks, StreamingLLM). Raises ValueError on a bad combination."""
    own = model.sliding_window
    if (model.layer_windows or model.gemma) and (sliding_window or sinks):
        raise ValueError(f"{model.model_type} attends with its own window per layer type: leave out "
                         "--sliding-window and --attention-sinks")
    if model.mla is not None and (sliding_window or sinks):
        raise ValueError(f"{model.model_type} uses multi-head latent attention (MLA): kvserve serves it with full "
                         "attention only (leave out --sliding-window and --attention-sinks)")
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


def _mla_model(cls, raw: dict) -> ModelConfig:
    """A DeepSeek-V2/V3 config: the Llama-shaped fields (intermediate_size is the dense layers' MLP) and MLAParams;
    the pool sees one "KV head" of the latent's width."""
    _check_silu(raw)
    fields = _shared_fields(raw)
    mla = mla_params(raw, fields["rope_scaling"], UnsupportedModel)
    return cls(**fields, num_kv_heads=1, head_dim=mla.latent_dim, mla=mla, moe=mla_moe_params(raw, UnsupportedModel))


def _check_silu(raw: dict) -> None:
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act {raw['hidden_act']!r} is not supported; only silu")


def _shared_fields(raw: dict) -> dict:
    """The fields every family reads alike from an HF config: sizes, norms' eps, RoPE, embeddings, special tokens."""
    eos = raw.get("eos_token_id")
    return dict(
        model_type=raw["model_type"],
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=int(raw["num_attention_heads"]),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        rope_scaling=_rope_scaling(raw),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        bos_token_id=raw.get("bos_token_id"),
    )
