"""The models the KV-memory calculator knows: a table of well-known shapes, and any HF ``config.json`` (a file or
a model folder). Only what sizes the cache is kept: layers, KV heads and head_dim (or MLA's latent), context,
sliding window, and an approximate parameter count for the default weight bytes."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvserve.common.kvmem import KvMemError


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The cache-relevant shape of a model. ``attention`` is "gqa" (K and V per KV head) or "mla" (one latent)."""

    name: str
    num_layers: int
    num_kv_heads: int | None = None  # gqa
    head_dim: int | None = None  # gqa
    latent_dim: int | None = None  # mla: kv_lora_rank + qk_rope_head_dim
    max_context: int | None = None
    sliding_window: int | None = None
    # A model of sliding and full layers mixed (Gemma 3): how many layers slide, and their window. Its
    # sliding_window is None (the worker keeps every layer's pages); these size what page groups would hold.
    sliding_layers: int = 0
    layer_window: int | None = None
    params: float | None = None  # approximate parameter count, for the default weight bytes
    default_kv_dtype: str = "bf16"
    source: str = "built-in"
    aliases: tuple[str, ...] = field(default=(), repr=False, compare=False)

    @property
    def attention(self) -> str:
        return "mla" if self.latent_dim is not None else "gqa"

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("aliases")
        d["attention"] = self.attention
        return d


BUILTIN_MODELS: tuple[ModelSpec, ...] = (
    # meta-llama/Meta-Llama-3-8B: num_hidden_layers 32, num_key_value_heads 8, hidden_size 4096 /
    # num_attention_heads 32 = head_dim 128, max_position_embeddings 8192; ~8.03e9 params.
    ModelSpec("Llama-3-8B", 32, 8, 128, max_context=8192, params=8.03e9,
              aliases=("llama-3-8b", "llama3-8b", "meta-llama-3-8b")),
    # meta-llama/Llama-3.1-8B: same shapes as Llama-3-8B (32 layers, 8 KV heads, head_dim 128),
    # max_position_embeddings 131072 (llama3 rope scaling); ~8.03e9 params.
    ModelSpec("Llama-3.1-8B", 32, 8, 128, max_context=131072, params=8.03e9,
              aliases=("llama-3.1-8b", "llama3.1-8b", "meta-llama-3.1-8b")),
    # meta-llama/Meta-Llama-3-70B: num_hidden_layers 80, num_key_value_heads 8, hidden_size 8192 /
    # num_attention_heads 64 = head_dim 128, max_position_embeddings 8192; ~70.6e9 params.
    ModelSpec("Llama-3-70B", 80, 8, 128, max_context=8192, params=70.6e9,
              aliases=("llama-3-70b", "llama3-70b", "meta-llama-3-70b")),
    # meta-llama/Llama-3.1-70B: same shapes as Llama-3-70B (80 layers, 8 KV heads, head_dim 128),
    # max_position_embeddings 131072; ~70.6e9 params.
    ModelSpec("Llama-3.1-70B", 80, 8, 128, max_context=131072, params=70.6e9,
              aliases=("llama-3.1-70b", "llama3.1-70b", "meta-llama-3.1-70b")),
    # Qwen/Qwen2.5-7B: num_hidden_layers 28, num_key_value_heads 4, hidden_size 3584 / num_attention_heads 28 =
    # head_dim 128, max_position_embeddings 131072 (32,768 native, YaRN beyond), use_sliding_window false;
    # ~7.6e9 params.
    ModelSpec("Qwen2.5-7B", 28, 4, 128, max_context=131072, params=7.6e9,
              aliases=("qwen2.5-7b", "qwen-2.5-7b", "qwen2-5-7b")),
    # Qwen/Qwen3-8B: num_hidden_layers 36, num_key_value_heads 8, head_dim 128 (hidden_size 4096 / 32 heads),
    # max_position_embeddings 40960, use_sliding_window false; ~8.2e9 params.
    ModelSpec("Qwen3-8B", 36, 8, 128, max_context=40960, params=8.2e9, aliases=("qwen3-8b", "qwen-3-8b")),
    # google/gemma-3-27b-it's text_config: num_hidden_layers 62, num_key_value_heads 16, head_dim 128,
    # max_position_embeddings 131072; five sliding layers (window 1024) to one full. No window here: the worker
    # keeps every layer's pages for a mixed model (docs/features/models.md); ~27e9 params.
    ModelSpec("Gemma-3-27B", 62, 16, 128, max_context=131072, sliding_layers=52, layer_window=1024, params=27e9,
              aliases=("gemma-3-27b", "gemma3-27b")),
    # mistralai/Mistral-7B-v0.1: num_hidden_layers 32, num_key_value_heads 8, hidden_size 4096 /
    # num_attention_heads 32 = head_dim 128, sliding_window 4096, max_position_embeddings 32768; ~7.24e9 params.
    ModelSpec("Mistral-7B", 32, 8, 128, max_context=32768, sliding_window=4096, params=7.24e9,
              aliases=("mistral-7b", "mistral-7b-v0.1", "mistral-7b-v01")),
    # deepseek-ai/DeepSeek-V3: num_hidden_layers 61, MLA caches kv_lora_rank 512 + qk_rope_head_dim 64 = 576
    # elements per token per layer (no K/V factor 2, no heads), max_position_embeddings 163840; ~671e9 params.
    ModelSpec("DeepSeek-V3", 61, latent_dim=512 + 64, max_context=163840, params=671e9,
              aliases=("deepseek-v3", "deepseekv3", "deepseek-v3-0324")),
    # HuggingFaceTB/SmolLM2-135M: num_hidden_layers 30, num_key_value_heads 3, hidden_size 576 /
    # num_attention_heads 9 = head_dim 64, max_position_embeddings 8192; ~135e6 params (the worker's default model).
    ModelSpec("SmolLM2-135M", 30, 3, 64, max_context=8192, params=135e6,
              aliases=("smollm2-135m", "smollm2")),
)

_NAME_SUFFIXES = ("-instruct", "-chat", "-base", "-hf")


def _normalise(name: str) -> str:
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    key = key.rsplit("/", 1)[-1]  # "meta-llama/Meta-Llama-3-8B" -> "meta-llama-3-8b"
    for suffix in _NAME_SUFFIXES:
        key = key.removesuffix(suffix)
    return key


def _index() -> dict[str, ModelSpec]:
    out = {}
    for m in BUILTIN_MODELS:
        for key in (m.name, *m.aliases):
            out[_normalise(key)] = m
    return out


def lookup_model(name: str) -> ModelSpec:
    """A built-in model by name or alias, case-insensitive ("llama-3-8b", "meta-llama/Meta-Llama-3-8B-Instruct")."""
    model = _index().get(_normalise(name))
    if model is None:
        known = ", ".join(m.name for m in BUILTIN_MODELS)
        raise KvMemError(f"unknown model {name!r} (not a built-in name, nor a config.json or model folder); "
                         f"known: {known}")
    return model


_TORCH_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_DENSE_LLAMA_FAMILY = ("llama", "mistral", "qwen2")


def _positive_int(raw: dict, key: str, where: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise KvMemError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def model_from_hf_config(raw: dict, name: str = "config.json", source: str = "config.json") -> ModelSpec:
    """The cache shape an HF ``config.json`` describes (Llama-family GQA, or DeepSeek-V2/V3 MLA)."""
    if not isinstance(raw, dict):
        raise KvMemError(f"{source}: not a JSON object")
    if "num_hidden_layers" not in raw and isinstance(raw.get("text_config"), dict):
        raw = raw["text_config"]  # multimodal wrappers keep the decoder's config one level down
    layers = _positive_int(raw, "num_hidden_layers", source)
    model_type = str(raw.get("model_type", ""))
    window = raw.get("sliding_window")
    if raw.get("use_sliding_window") is False or not isinstance(window, int) or window <= 0:
        window = None
    torch_dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")
    common = dict(name=name, num_layers=layers, max_context=raw.get("max_position_embeddings"),
                  default_kv_dtype=_TORCH_DTYPES.get(torch_dtype, "bf16"), source=source)
    mixed = _sliding_layers(raw, model_type, layers) if window else 0
    if mixed:  # the worker keeps every layer's pages for a model of sliding and full layers (one page table), so
        common.update(sliding_layers=mixed, layer_window=window)  # every token of every layer counts
        window = None
    if model_type in ("deepseek_v2", "deepseek_v3") or raw.get("kv_lora_rank"):
        latent = _positive_int(raw, "kv_lora_rank", source) + _positive_int(raw, "qk_rope_head_dim", source)
        return ModelSpec(latent_dim=latent, sliding_window=window, **common)
    heads = _positive_int(raw, "num_attention_heads", source)
    kv_heads = raw.get("num_key_value_heads") or heads
    head_dim = raw.get("head_dim") or _positive_int(raw, "hidden_size", source) // heads
    for key, value in (("num_key_value_heads", kv_heads), ("head_dim", head_dim)):
        _positive_int({key: value}, key, source)
    return ModelSpec(num_kv_heads=kv_heads, head_dim=head_dim, params=_dense_params(raw, model_type),
                     sliding_window=window, **common)


def _sliding_layers(raw: dict, model_type: str, num_layers: int) -> int:
    """How many layers slide when sliding-window and full-attention layers mix (0 when they do not): a
    layer_types list of both, Gemma 3 (every sliding_window_pattern-th layer full, 6 by default), Gemma 2 (every
    other layer full), or Qwen2/3's max_window_layers inside the stack."""
    if raw.get("layer_types"):
        kinds = list(raw["layer_types"])
        return kinds.count("sliding_attention") if len(set(kinds)) > 1 else 0
    if model_type.startswith("gemma3") or model_type == "gemma2":
        pattern = int(raw.get("sliding_window_pattern") or (2 if model_type == "gemma2" else 6))
        return num_layers - num_layers // pattern
    first = raw.get("max_window_layers")
    return num_layers - first if model_type in ("qwen2", "qwen3") and isinstance(first, int) and \
        0 < first < num_layers else 0


def _dense_params(raw: dict, model_type: str) -> int | None:
    """Parameter count of a Llama-family decoder (gated MLP, RMSNorm), or None for other architectures."""
    try:
        if model_type not in _DENSE_LLAMA_FAMILY:
            return None
        vocab, hidden, inter = int(raw["vocab_size"]), int(raw["hidden_size"]), int(raw["intermediate_size"])
        heads, layers = int(raw["num_attention_heads"]), int(raw["num_hidden_layers"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
    except (KeyError, TypeError, ValueError):
        return None
    q, kv = heads * head_dim, kv_heads * head_dim
    attn = hidden * q + 2 * hidden * kv + q * hidden
    if raw.get("attention_bias", model_type == "qwen2"):
        attn += q + 2 * kv
    per_layer = attn + 3 * hidden * inter + 2 * hidden  # q/k/v/o, gate/up/down, two norms
    embeddings = vocab * hidden * (1 if raw.get("tie_word_embeddings", False) else 2)
    return embeddings + layers * per_layer + hidden  # + the final norm


def load_hf_config(path: str | Path) -> ModelSpec:
    """Reads ``path`` (a config.json, or a folder holding one)."""
    p = Path(path).expanduser()
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        raise KvMemError(f"no config.json in {p}" if p.is_dir() else f"no such file: {p}")
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KvMemError(f"cannot read {file}: {e}") from None
    name = raw.get("_name_or_path") if isinstance(raw, dict) else None
    return model_from_hf_config(raw, name=str(name or file.resolve().parent.name), source=str(file))


def find_model(text: str) -> ModelSpec:
    """An existing config.json or model folder, else a built-in name."""
    p = Path(text).expanduser()
    if p.is_file() or (p.is_dir() and (p / "config.json").is_file()):
        return load_hf_config(p)
    if p.is_dir() or text.endswith(".json"):
        return load_hf_config(p)  # raises, naming what is missing
    return lookup_model(text)


# --- the calculation --------------------------------------------------------------------------------------------
