"""The exact KV-cache memory calculator behind ``kvserve kv-mem``: pure arithmetic, no I/O but reading a config.json.

Per token, grouped-query (or multi-head) attention caches one K and one V vector per KV head per layer::

    bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * bytes_per_element

Multi-head latent attention (DeepSeek-V2/V3) caches one compressed latent per token per layer instead::

    bytes_per_token = num_layers * (kv_lora_rank + qk_rope_head_dim) * bytes_per_element

A sequence holds ``tokens * bytes_per_token``; a batch ``batch`` of them. On top of that: int8's per-token scales,
page padding (``ceil(tokens / page_size)`` whole pages), a sliding window with attention sinks (only
``min(seq_len, window + sinks)`` tokens kept), and the reverse question: given GPU memory and weights, how many
tokens, or requests of a given length, fit.

The worker sizes its page pool with :func:`kv_bytes_per_token` (``worker/kv_pool.py``), so the two agree by
construction. Every entry point raises :class:`KvMemError` (a ``ValueError``) with a one-line message on bad input.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path

from kvserve.common.pages import num_pages_for

GIB = 1 << 30


class KvMemError(ValueError):
    """Bad calculator input: an unknown model or dtype, a non-positive size, weights that do not fit."""


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Exact KV-cache bytes of one token: K and V, every layer, every KV head. The worker's pool uses this."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def mla_bytes_per_token(num_layers: int, latent_dim: int, dtype_bytes: int) -> int:
    """Exact MLA cache bytes of one token: one compressed latent (kv_lora_rank + qk_rope_head_dim) per layer."""
    return num_layers * latent_dim * dtype_bytes


# --- element types ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KvDtype:
    name: str
    bytes: int
    note: str = ""
    scale_bytes: int = 0  # bytes of one scale (int8: one fp32 per token per KV head per layer, for K and for V)


DTYPES: dict[str, KvDtype] = {
    "fp32": KvDtype("fp32", 4),
    "bf16": KvDtype("bf16", 2),
    "fp16": KvDtype("fp16", 2),
    "fp8": KvDtype("fp8", 1, note="fp8 (e4m3) uses one scale per layer: a few bytes per model, negligible, "
                   "not counted"),
    "int8": KvDtype("int8", 1, scale_bytes=4, note="int8 stores one fp32 scale per token per KV head per layer "
                    "for K and one for V (MLA: one per token per layer), counted as scale overhead"),
}
DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
                 "fp8_e4m3": "fp8", "fp8-e4m3": "fp8", "e4m3": "fp8", "float8_e4m3fn": "fp8"}


def get_dtype(name: str, what: str = "--kv-dtype") -> KvDtype:
    key = str(name).strip().lower()
    key = DTYPE_ALIASES.get(key, key)
    if key not in DTYPES:
        raise KvMemError(f"unknown {what} {name!r}; known: {', '.join(DTYPES)}")
    return DTYPES[key]


# --- models -----------------------------------------------------------------------------------------------------


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
                  sliding_window=window, default_kv_dtype=_TORCH_DTYPES.get(torch_dtype, "bf16"), source=source)
    if model_type in ("deepseek_v2", "deepseek_v3") or raw.get("kv_lora_rank"):
        latent = _positive_int(raw, "kv_lora_rank", source) + _positive_int(raw, "qk_rope_head_dim", source)
        return ModelSpec(latent_dim=latent, **common)
    heads = _positive_int(raw, "num_attention_heads", source)
    kv_heads = raw.get("num_key_value_heads") or heads
    head_dim = raw.get("head_dim") or _positive_int(raw, "hidden_size", source) // heads
    for key, value in (("num_key_value_heads", kv_heads), ("head_dim", head_dim)):
        _positive_int({key: value}, key, source)
    return ModelSpec(num_kv_heads=kv_heads, head_dim=head_dim, params=_dense_params(raw, model_type), **common)


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


@dataclass(frozen=True, slots=True)
class PerToken:
    kv_bytes: int  # the cached elements
    scale_bytes: int  # int8's scales, else 0
    bytes: int  # kv_bytes + scale_bytes
    formula: str
    scale_formula: str = ""


@dataclass(frozen=True, slots=True)
class Paging:
    page_size: int
    pages_per_sequence: int
    allocated_tokens_per_sequence: int
    allocated_bytes_per_sequence: int
    padding_tokens_per_sequence: int
    padding_bytes_per_sequence: int
    padding_percent: float  # padding / allocated
    total_pages: int
    total_allocated_bytes: int
    total_padding_bytes: int


@dataclass(frozen=True, slots=True)
class Capacity:
    gpu_memory_bytes: int
    memory_utilization: float
    usable_bytes: int  # floor(gpu_memory * memory_utilization)
    weights_bytes: int
    weights_source: str
    reserve_bytes: int
    kv_budget_bytes: int  # usable - weights - reserve
    max_tokens: int  # page-rounded down when paged
    max_pages: int | None
    request_tokens: int  # tokens one request of --seq-len keeps (window cap applied)
    request_pages: int | None
    request_bytes: int  # bytes one request takes (whole pages when paged)
    max_concurrent_requests: int
    batch_fits: bool  # the requested batch x seq_len fits in the KV budget


@dataclass(frozen=True, slots=True)
class KvMemReport:
    model: ModelSpec
    kv_dtype: KvDtype
    per_token: PerToken
    batch: int
    seq_len: int
    sliding_window: int | None  # the effective window (None: full attention)
    sinks: int
    tokens_per_sequence: int  # min(seq_len, window + sinks), or seq_len
    bytes_per_sequence: int
    total_tokens: int
    total_bytes: int
    paging: Paging | None = None
    capacity: Capacity | None = None
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        """JSON-ready: every figure in bytes, tokens or pages (ints)."""
        return {
            "model": self.model.to_dict(),
            "kv_dtype": self.kv_dtype.name,
            "dtype_bytes": self.kv_dtype.bytes,
            "per_token": asdict(self.per_token),
            "bytes_per_token": self.per_token.bytes,
            "batch": self.batch,
            "seq_len": self.seq_len,
            "sliding_window": self.sliding_window,
            "sinks": self.sinks,
            "tokens_per_sequence": self.tokens_per_sequence,
            "bytes_per_sequence": self.bytes_per_sequence,
            "total_tokens": self.total_tokens,
            "total_bytes": self.total_bytes,
            "total_gib": self.total_bytes / GIB,
            "paging": asdict(self.paging) if self.paging else None,
            "capacity": asdict(self.capacity) if self.capacity else None,
            "notes": list(self.notes),
        }


def _check_positive(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise KvMemError(f"{what} must be a positive integer, got {value!r}")
    return value


def _check_non_negative(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise KvMemError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def per_token(model: ModelSpec, dtype: KvDtype) -> PerToken:
    """Bytes of one cached token, with the formula filled in."""
    b, L = dtype.bytes, model.num_layers
    elem = f"{b} B ({dtype.name})"
    if model.attention == "mla":
        kv = mla_bytes_per_token(L, model.latent_dim, b)
        formula = f"{L} layers x {model.latent_dim} latent x {elem} = {kv:,} B"
        scales = L * dtype.scale_bytes
        scale_formula = f"{L} layers x {dtype.scale_bytes} B (fp32 scale) = {scales:,} B" if scales else ""
    else:
        kv = kv_bytes_per_token(L, model.num_kv_heads, model.head_dim, b)
        formula = f"2 x {L} layers x {model.num_kv_heads} kv heads x {model.head_dim} head_dim x {elem} = {kv:,} B"
        scales = 2 * L * model.num_kv_heads * dtype.scale_bytes
        scale_formula = (f"2 x {L} layers x {model.num_kv_heads} kv heads x {dtype.scale_bytes} B (fp32 scale) "
                         f"= {scales:,} B" if scales else "")
    return PerToken(kv_bytes=kv, scale_bytes=scales, bytes=kv + scales, formula=formula, scale_formula=scale_formula)


def kept_tokens(seq_len: int, window: int | None, sinks: int) -> int:
    """Tokens a sequence of seq_len keeps: StreamingLLM keeps the first ``sinks`` plus the last ``window``."""
    return min(seq_len, window + sinks) if window else seq_len


def weights_bytes_from_params(params: float, dtype: KvDtype) -> int:
    return int(round(params)) * dtype.bytes


def calculate(
    model: ModelSpec,
    *,
    batch: int = 1,
    seq_len: int | None = None,
    kv_dtype: str | None = None,
    page_size: int | None = None,
    sliding_window: int | None = None,
    sinks: int = 0,
    gpu_memory: int | None = None,
    weights_bytes: int | None = None,
    weights_dtype: str = "bf16",
    memory_utilization: float = 0.9,
    reserve: int = 0,
) -> KvMemReport:
    """The full answer. ``seq_len`` None: the model's max context. ``kv_dtype`` None: the model's own dtype.
    ``sliding_window`` None: the model's own window; 0: none. ``gpu_memory`` set: also the reverse question.

    Raises KvMemError on bad input, or when weights + reserve exceed the usable GPU memory.
    """
    _check_positive(batch, "--batch")
    if seq_len is None:
        if model.max_context is None:
            raise KvMemError(f"{model.name} has no max context in its config; give --seq-len")
        seq_len = model.max_context
    _check_positive(seq_len, "--seq-len")
    dtype = get_dtype(kv_dtype or model.default_kv_dtype)
    if page_size is not None:
        _check_positive(page_size, "--page-size")
    _check_non_negative(sinks, "--sinks")
    if sliding_window is not None:
        _check_non_negative(sliding_window, "--sliding-window")
    window = model.sliding_window if sliding_window is None else (sliding_window or None)
    if sinks and not window:
        raise KvMemError(f"--sinks needs a sliding window ({model.name} has none; give --sliding-window W)")

    notes = [n for n in (dtype.note,) if n]
    if model.attention == "mla":
        notes.append("MLA caches one compressed latent per token per layer (kv_lora_rank + qk_rope_head_dim): "
                     "no K/V factor 2, no heads")
    if model.max_context is not None and seq_len > model.max_context:
        notes.append(f"--seq-len {seq_len:,} exceeds {model.name}'s max context of {model.max_context:,}")
    if window:
        notes.append(f"sliding window {window:,} + {sinks} sinks: a sequence keeps its first {sinks} tokens and "
                     f"its last {window:,} (StreamingLLM)")

    pt = per_token(model, dtype)
    tokens = kept_tokens(seq_len, window, sinks)
    paging = None
    if page_size is not None:
        pages = num_pages_for(tokens, page_size)
        alloc_tokens = pages * page_size
        pad = alloc_tokens - tokens
        paging = Paging(
            page_size=page_size, pages_per_sequence=pages, allocated_tokens_per_sequence=alloc_tokens,
            allocated_bytes_per_sequence=alloc_tokens * pt.bytes, padding_tokens_per_sequence=pad,
            padding_bytes_per_sequence=pad * pt.bytes, padding_percent=100.0 * pad / alloc_tokens,
            total_pages=batch * pages, total_allocated_bytes=batch * alloc_tokens * pt.bytes,
            total_padding_bytes=batch * pad * pt.bytes,
        )
    capacity = None
    if gpu_memory is not None:
        capacity = _capacity(model, pt, batch, tokens, paging, page_size, gpu_memory=gpu_memory,
                             weights_bytes=weights_bytes, weights_dtype=weights_dtype,
                             memory_utilization=memory_utilization, reserve=reserve)
    return KvMemReport(
        model=model, kv_dtype=dtype, per_token=pt, batch=batch, seq_len=seq_len, sliding_window=window, sinks=sinks,
        tokens_per_sequence=tokens, bytes_per_sequence=tokens * pt.bytes, total_tokens=batch * tokens,
        total_bytes=batch * tokens * pt.bytes, paging=paging, capacity=capacity, notes=tuple(notes),
    )


def _capacity(model, pt, batch, tokens, paging, page_size, *, gpu_memory, weights_bytes, weights_dtype,
              memory_utilization, reserve) -> Capacity:
    _check_positive(gpu_memory, "--gpu-memory")
    _check_non_negative(reserve, "--reserve")
    if not isinstance(memory_utilization, (int, float)) or not 0 < memory_utilization <= 1:
        raise KvMemError(f"--memory-utilization must be in (0, 1], got {memory_utilization!r}")
    if weights_bytes is None:
        wdtype = get_dtype(weights_dtype, "--weights-dtype")
        if model.params is None:
            raise KvMemError(f"the parameter count of {model.name} is unknown; give --weights-bytes")
        weights_bytes = weights_bytes_from_params(model.params, wdtype)
        source = f"{params_text(model.params)} params x {wdtype.bytes} B ({wdtype.name})"
    else:
        _check_non_negative(weights_bytes, "--weights-bytes")
        source = "--weights-bytes"
    usable = math.floor(gpu_memory * Fraction(str(memory_utilization)))
    budget = usable - weights_bytes - reserve
    if budget <= 0:
        raise KvMemError(
            f"the weights ({weights_bytes:,} B = {weights_bytes / GIB:.2f} GiB) plus reserve ({reserve:,} B) do not "
            f"fit in the usable GPU memory ({gpu_memory:,} B x {memory_utilization} = {usable:,} B = "
            f"{usable / GIB:.2f} GiB)")
    if paging is None:
        max_pages, max_tokens = None, budget // pt.bytes
        request_pages, request_bytes = None, tokens * pt.bytes
        requests = budget // request_bytes
        need = batch * request_bytes
    else:
        max_pages = budget // (page_size * pt.bytes)
        max_tokens = max_pages * page_size
        request_pages, request_bytes = paging.pages_per_sequence, paging.allocated_bytes_per_sequence
        requests = max_pages // request_pages
        need = paging.total_allocated_bytes
    return Capacity(
        gpu_memory_bytes=gpu_memory, memory_utilization=memory_utilization, usable_bytes=usable,
        weights_bytes=weights_bytes, weights_source=source, reserve_bytes=reserve, kv_budget_bytes=budget,
        max_tokens=max_tokens, max_pages=max_pages, request_tokens=tokens, request_pages=request_pages,
        request_bytes=request_bytes, max_concurrent_requests=requests, batch_fits=need <= budget,
    )


# --- human-readable text (the CLI prints it) --------------------------------------------------------------------


def human_bytes(n: int) -> str:
    """'1,073,741,824 B (1.00 GiB)'; small sizes in KiB/MiB."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n:,} B ({n / scale:.2f} {unit})"
    return f"{n:,} B"


def params_text(params: float) -> str:
    """8.03e9 -> '8.03 billion', 135e6 -> '135 million'."""
    for word, scale in (("trillion", 1e12), ("billion", 1e9), ("million", 1e6)):
        if params >= scale:
            return f"{params / scale:.3g} {word}"
    return f"{params:,.0f}"


def describe_model(m: ModelSpec) -> str:
    shape = (f"{m.num_layers} layers, MLA latent {m.latent_dim}" if m.attention == "mla" else
             f"{m.num_layers} layers, {m.num_kv_heads} KV heads, head_dim {m.head_dim}")
    extra = [f"max context {m.max_context:,}"] if m.max_context else []
    if m.sliding_window:
        extra.append(f"sliding window {m.sliding_window:,}")
    if m.params:
        extra.append(f"~{params_text(m.params)} params")
    return f"{m.name} ({m.source}: {', '.join([shape, *extra])})"


def format_report(r: KvMemReport) -> str:
    pt = r.per_token
    lines = [f"model         {describe_model(r.model)}",
             f"per token     {pt.formula}"]
    if pt.scale_bytes:
        lines += [f"  + scales    {pt.scale_formula}",
                  f"  = total     {pt.kv_bytes:,} + {pt.scale_bytes:,} = {pt.bytes:,} B per token"]
    if r.tokens_per_sequence != r.seq_len:
        lines.append(f"window        min({r.seq_len:,}, {r.sliding_window:,} window + {r.sinks} sinks) = "
                     f"{r.tokens_per_sequence:,} tokens kept per sequence")
    elif r.sliding_window:
        lines.append(f"window        {r.sliding_window:,} window + {r.sinks} sinks >= {r.seq_len:,}: "
                     "the whole sequence is kept")
    lines.append(f"per sequence  {r.tokens_per_sequence:,} tokens x {pt.bytes:,} B = "
                 f"{human_bytes(r.bytes_per_sequence)}")
    lines.append(f"total         {r.batch} x {r.tokens_per_sequence:,} tokens = {r.total_tokens:,} tokens = "
                 f"{human_bytes(r.total_bytes)}")
    if p := r.paging:
        lines += [
            f"pages         ceil({r.tokens_per_sequence:,} / {p.page_size}) = {p.pages_per_sequence:,} pages per "
            f"sequence = {p.allocated_tokens_per_sequence:,} tokens = {human_bytes(p.allocated_bytes_per_sequence)}",
            f"padding       {p.padding_tokens_per_sequence:,} tokens = {p.padding_bytes_per_sequence:,} B per sequence "
            f"({p.padding_percent:.2f} % of allocated); batch total {human_bytes(p.total_padding_bytes)}",
            f"allocated     {r.batch} x {p.pages_per_sequence:,} = {p.total_pages:,} pages = "
            f"{human_bytes(p.total_allocated_bytes)}",
        ]
    if c := r.capacity:
        paged = f" = {c.max_pages:,} pages x {r.paging.page_size}" if c.max_pages is not None else ""
        per_req = (f"{c.request_pages:,} pages = {human_bytes(c.request_bytes)}" if c.request_pages is not None
                   else human_bytes(c.request_bytes))
        lines += [
            f"GPU memory    {human_bytes(c.gpu_memory_bytes)} x {c.memory_utilization} = {human_bytes(c.usable_bytes)}"
            " usable",
            f"weights       {c.weights_source} = {human_bytes(c.weights_bytes)}",
            f"reserve       {human_bytes(c.reserve_bytes)}",
            f"KV budget     {human_bytes(c.kv_budget_bytes)}",
            f"fits          {c.max_tokens:,} tokens{paged}",
            f"requests      {c.max_concurrent_requests:,} concurrent requests of {r.seq_len:,} tokens "
            f"({c.request_tokens:,} kept, {per_req} each)",
            f"batch         {r.batch} x {r.seq_len:,} tokens {'fits' if c.batch_fits else 'does NOT fit'}",
        ]
    lines += [f"note          {n}" for n in r.notes]
    return "\n".join(lines)
