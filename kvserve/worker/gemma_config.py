"""What a Gemma 2 (``gemma2``) or Gemma 3 text model (``gemma3_text``) needs beyond a Llama-family config, read
from its HF config dict.

Both interleave sliding-window layers (``sliding_attention``) with full-attention layers (``full_attention``):
Gemma 2 every other layer, Gemma 3 five of every six. Gemma 3's sliding layers rotate with their own RoPE base
(``rope_local_base_freq``) and the full ones with ``rope_theta`` and the checkpoint's rope scaling; Gemma 2 has one
rope for every layer. Gemma 3 normalises each query and key head (q_norm, k_norm); Gemma 2 instead soft-caps the
attention scores (``attn_logit_softcapping``). transformers < 5 writes the ropes as flat fields; transformers 5
writes ``rope_parameters`` (keyed by layer type for Gemma 3). Settings this worker does not compute are refused
here, at start-up, by name.
"""

from __future__ import annotations

from dataclasses import dataclass

GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
FAMILY_NAMES = {"gemma2": "Gemma 2", "gemma3_text": "Gemma 3"}
GEMMA_ACTIVATION = "gelu_pytorch_tanh"
FULL_THETA, SLIDING_THETA = 1_000_000.0, 10_000.0  # HF Gemma3TextConfig's defaults
GEMMA2_THETA = 10_000.0  # HF Gemma2Config's
DEFAULT_SLIDING_PATTERN = {"gemma2": 2, "gemma3_text": 6}  # HF: every n-th layer is a full-attention one when
# layer_types is absent


@dataclass(frozen=True, slots=True)
class GemmaParams:
    """The Gemma-only constants of a model (ModelConfig.gemma; None for Llama-family models)."""

    query_pre_attn_scalar: float  # queries are scaled by its ** -0.5 (not head_dim ** -0.5)
    sliding_rope_theta: float  # the RoPE base of the sliding layers (rope_local_base_freq)
    sliding_rope_scaling: dict | None  # their rope scaling (None: default RoPE)
    sliding_layers: tuple[bool, ...]  # per layer: a sliding_attention one (its rope is the sliding one, even when
    # sliding_window is null and it attends to every key)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap) when set
    attn_logit_softcapping: float | None = None  # every attention score s = cap * tanh(s / cap) (Gemma 2)
    qk_norm: bool = True  # an RMSNorm over each query and key head before RoPE (Gemma 3; not Gemma 2)

    @classmethod
    def from_dict(cls, raw: dict) -> GemmaParams:
        """Reads a gemma2 or gemma3_text config dict. Raises ValueError naming a setting this worker cannot
        compute."""
        family = FAMILY_NAMES[raw["model_type"]]
        refused = {
            "use_bidirectional_attention": raw.get("use_bidirectional_attention"),  # an encoder's mask
            "attention_bias": raw.get("attention_bias"),  # Gemma's would bias o_proj too
        }
        if set_ := sorted(k for k, v in refused.items() if v):
            raise ValueError(f"{family} settings not supported: {', '.join(f'{k}={refused[k]!r}' for k in set_)}")
        act = raw.get("hidden_activation") or raw.get("hidden_act") or GEMMA_ACTIVATION
        if act != GEMMA_ACTIVATION:
            raise ValueError(f"hidden_activation {act!r} is not supported for {family}; only {GEMMA_ACTIVATION}")
        _, sliding = gemma_rope(raw)
        final_cap, attn_cap = raw.get("final_logit_softcapping"), raw.get("attn_logit_softcapping")
        return cls(query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
                   sliding_rope_theta=float(sliding["rope_theta"]), sliding_rope_scaling=_scaling(sliding),
                   sliding_layers=tuple(k == "sliding_attention"
                                        for k in gemma_layer_kinds(raw, int(raw["num_hidden_layers"]))),
                   final_logit_softcapping=float(final_cap) if final_cap else None,
                   attn_logit_softcapping=float(attn_cap) if attn_cap else None,
                   qk_norm=raw["model_type"] != "gemma2")


def gemma_rope(raw: dict) -> tuple[dict, dict]:
    """The RoPE parameters of the full-attention and of the sliding layers, each with its ``rope_theta``, as
    HF's Gemma3TextConfig resolves them (rope_scaling applies to the full-attention layers only); Gemma 2's one
    rope twice."""
    params = raw.get("rope_parameters") or {}
    if raw.get("model_type") == "gemma2":
        rope = dict(params or {"rope_type": "default", **(raw.get("rope_scaling") or {})})
        rope.setdefault("rope_theta", raw.get("rope_theta", GEMMA2_THETA))
        return rope, rope
    full = dict(params.get("full_attention") or {"rope_type": "default", **(raw.get("rope_scaling") or {})})
    full.setdefault("rope_theta", raw.get("rope_theta", FULL_THETA))
    sliding = dict(params.get("sliding_attention") or {"rope_type": "default"})
    sliding.setdefault("rope_theta", raw.get("rope_local_base_freq", SLIDING_THETA))
    return full, sliding


def gemma_overrides(raw: dict) -> dict:
    """The ModelConfig fields whose Gemma meaning differs from Llama's reading of the same dict: the full layers'
    rope, tied embeddings by default, and the Gemma params."""
    full, _ = gemma_rope(raw)
    return dict(rope_theta=float(full["rope_theta"]), rope_scaling=_scaling(full),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)), attention_bias=False,
                gemma=GemmaParams.from_dict(raw))


def gemma_layer_kinds(raw: dict, num_layers: int) -> list[str]:
    """Gemma's layer types: the config's list, else every ``sliding_window_pattern``-th layer full (Gemma 2:
    every second one)."""
    pattern = int(raw.get("sliding_window_pattern") or DEFAULT_SLIDING_PATTERN[raw["model_type"]])
    return list(raw.get("layer_types") or
                ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)])


def _scaling(rope: dict) -> dict | None:
    """A rope parameter dict as ModelConfig.rope_scaling (None for default RoPE)."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    return None if kind == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}
