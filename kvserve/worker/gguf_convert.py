"""One-time conversion of a llama-architecture GGUF file into a Hugging Face style model folder.

    model.gguf ──▶ out_dir/
                     config.json              LlamaForCausalLM config from the GGUF metadata
                     model.safetensors        fp32, dequantised, HF tensor names, q/k rows un-permuted
                     tokenizer.json           byte-level BPE built with `tokenizers`
                     tokenizer_config.json    chat template, special tokens, add_bos_token
                     special_tokens_map.json
                     generation_config.json
                     kvserve_convert.json     written last: the folder is complete

The folder is written into a temporary sibling and renamed into place, so an interrupted conversion never
leaves a half folder behind. Plain Python: gguf, numpy, safetensors and tokenizers; no transformers.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderField, TokenType
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm

COMPLETE_MARKER = "kvserve_convert.json"
CONVERT_FORMAT_VERSION = 1

# GGUF tensor name suffix (after `blk.N.`) -> HF name suffix (after `model.layers.N.`).
_LAYER_TENSORS = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# tokenizer.ggml.pre -> the split llama.cpp applies before byte-level BPE.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer that matches llama.cpp's `tokenizer.ggml.pre` value."""
    if pre in ("default", "gpt2", "gpt-2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # digits one by one, then the GPT-2 split (HF's SmolLM2 tokenizer.json)
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in ("llama3", "llama-v3", "llama-bpe"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r}: add its split to gguf_convert._pre_tokenizer")


def _field_value(field: ReaderField) -> Any:
    """A metadata field as a Python value; float32 scalars in their shortest float32 spelling (1e-05)."""
    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        if field.types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [v for i in field.data for v in field.parts[i].tolist()]
    if kind == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    value = field.parts[field.data[0]][0]
    if kind == GGUFValueType.FLOAT32:
        return float(str(np.float32(value)))
    return value.item()


def _metadata(reader: GGUFReader, key: str, default: Any = ...) -> Any:
    """Metadata value `key`; raises KeyError naming the key when it is absent and no default is given."""
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise KeyError(f"GGUF metadata has no {key!r}")
        return default
    return _field_value(field)


def build_config(reader: GGUFReader) -> dict[str, Any]:
    """The LlamaForCausalLM config.json contents described by a llama-architecture GGUF's metadata."""
    arch = _metadata(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only general.architecture 'llama' is supported, not {arch!r}")

    def meta(key: str, default: Any = ...) -> Any:
        return _metadata(reader, f"{arch}.{key}", default)

    hidden_size = meta("embedding_length")
    num_heads = meta("attention.head_count")
    tensor_names = {t.name for t in reader.tensors}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": meta("feed_forward_length"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": meta("attention.head_count_kv", num_heads),
        "num_hidden_layers": meta("block_count"),
        "head_dim": meta("attention.key_length", hidden_size // num_heads),
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta("rope.freq_base", 10000.0),
        "max_position_embeddings": meta("context_length"),
        "vocab_size": meta("vocab_size", None) or len(_metadata(reader, "tokenizer.ggml.tokens")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    config.update(_rope_scaling(reader, arch))
    for name in ("bos", "eos", "padding"):
        token_id = _metadata(reader, f"tokenizer.ggml.{name}_token_id", None)
        if token_id is not None:
            config[f"{name.replace('padding', 'pad')}_token_id"] = token_id
    return config


def _rope_scaling(reader: GGUFReader, arch: str) -> dict[str, Any]:
    """`{"rope_scaling": ...}` for linear scaling, `{}` for none; other kinds are refused, not guessed."""
    kind = _metadata(reader, f"{arch}.rope.scaling.type", "none")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError("llama3-style rope_freqs are not supported by this converter")
    if kind == "none":
        return {}
    if kind == "linear":
        factor = _metadata(reader, f"{arch}.rope.scaling.factor")
        return {"rope_scaling": {"rope_type": "linear", "factor": factor}}
    raise ValueError(f"unsupported rope scaling type {kind!r}")


def hf_tensor_name(gguf_name: str) -> str:
    """The HF (LlamaForCausalLM) name of a GGUF tensor; raises ValueError for one it does not know."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and suffix in _LAYER_TENSORS:
        return f"model.layers.{layer}.{_LAYER_TENSORS[suffix]}"
    raise ValueError(f"unknown GGUF tensor {gguf_name!r}")


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp stores each head's rows as interleaved rotary pairs (x0, x1), (x2, x3), ...; HF keeps the
    first halves of the pairs, then the second halves (rotate_half layout). Per head, rows go

        GGUF [half, 2] ──transpose──▶ HF [2, half]

    `num_heads` is the number of heads this projection has (key/value heads for k_proj).
    """
    rows = weight.shape[0]
    assert rows % (2 * num_heads) == 0, (rows, num_heads)
    half = rows // num_heads // 2
    per_head = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return np.ascontiguousarray(per_head.swapaxes(1, 2).reshape(weight.shape))


def _dequantized(tensor: Any) -> np.ndarray:
    """A GGUF tensor as a float32 array in numpy (row-major, HF) shape."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        values = np.asarray(tensor.data)
    else:
        values = dequantize(tensor.data, tensor.tensor_type)
    return np.ascontiguousarray(values.astype(np.float32, copy=False).reshape(shape))


def iter_hf_tensors(
    reader: GGUFReader, config: dict[str, Any], *, progress: bool = True
) -> Iterator[tuple[str, np.ndarray]]:
    """Yield `(hf_name, float32 array)` for every tensor, q/k rows un-permuted to HF's layout."""
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for tensor in tqdm(reader.tensors, desc="converting GGUF tensors", unit="tensor", disable=not progress):
        name = hf_tensor_name(tensor.name)
        weight = _dequantized(tensor)
        proj = name.split(".")[-2]
        if proj in heads:
            weight = unpermute_rotary(weight, heads[proj])
        yield name, weight


def _byte_level_vocab(tokens: list[str]) -> dict[str, int]:
    """token -> id, respelling any token not already written in the byte-level alphabet."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    spelling = _bytes_to_unicode()
    vocab = {}
    for index, token in enumerate(tokens):
        if not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[token] = index
    return vocab


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _special_tokens(reader: GGUFReader) -> dict[str, str]:
    """{"bos_token": "<|im_start|>", ...} for the special token ids the GGUF names."""
    tokens = _metadata(reader, "tokenizer.ggml.tokens")
    keys = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
    named = {}
    for key, gguf_key in keys.items():
        token_id = _metadata(reader, f"tokenizer.ggml.{gguf_key}_token_id", None)
        if token_id is not None:
            named[key] = tokens[token_id]
    return named


def build_tokenizer(reader: GGUFReader) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` equivalent to the GGUF's gpt2-style vocabulary."""
    kind = _metadata(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"only byte-level BPE (tokenizer.ggml.model 'gpt2') is supported, not {kind!r}")
    tokens = _metadata(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _metadata(reader, "tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(vocab=_byte_level_vocab(tokens), merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(_metadata(reader, "tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = _post_processor(reader, tokens)
    control = _tokens_of_type(reader, TokenType.CONTROL)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    user_defined = _tokens_of_type(reader, TokenType.USER_DEFINED)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])
    return tokenizer


def _tokens_of_type(reader: GGUFReader, token_type: TokenType) -> list[str]:
    """Tokens whose tokenizer.ggml.token_type is `token_type` (none when the GGUF has no types)."""
    tokens = _metadata(reader, "tokenizer.ggml.tokens")
    token_types = _metadata(reader, "tokenizer.ggml.token_type", None)
    if token_types is None:
        return []
    return [t for t, k in zip(tokens, token_types, strict=True) if k == token_type]


def _post_processor(reader: GGUFReader, tokens: list[str]) -> processors.PostProcessor:
    """Prepend BOS when the GGUF asks for it; otherwise the plain byte-level post-processor."""
    bos_id = _metadata(reader, "tokenizer.ggml.bos_token_id", None)
    if not _metadata(reader, "tokenizer.ggml.add_bos_token", False) or bos_id is None:
        return processors.ByteLevel(trim_offsets=False)
    bos = tokens[bos_id]
    return processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
    )


def tokenizer_files(reader: GGUFReader, max_length: int) -> dict[str, dict[str, Any]]:
    """Contents of tokenizer_config.json, special_tokens_map.json and generation_config.json."""
    special = _special_tokens(reader)
    control = _tokens_of_type(reader, TokenType.CONTROL)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": bool(_metadata(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_metadata(reader, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "additional_special_tokens": control,
    }
    template = _metadata(reader, "tokenizer.chat_template", None)
    if template is not None:
        tokenizer_config["chat_template"] = template
    generation = {
        key: _metadata(reader, f"tokenizer.ggml.{gguf_key}_token_id", None)
        for key, gguf_key in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding"))
    }
    return {
        "tokenizer_config.json": tokenizer_config,
        "special_tokens_map.json": {**special, "additional_special_tokens": control},
        "generation_config.json": {k: v for k, v in generation.items() if v is not None},
    }


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_folder(reader: GGUFReader, gguf_path: Path, folder: Path, progress: bool) -> None:
    """Write every file of the converted model into `folder`, the completion marker last."""
    config = build_config(reader)
    _write_json(folder / "config.json", config)
    build_tokenizer(reader).save(str(folder / "tokenizer.json"))
    for name, payload in tokenizer_files(reader, config["max_position_embeddings"]).items():
        _write_json(folder / name, payload)
    weights = dict(iter_hf_tensors(reader, config, progress=progress))
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "model.safetensors").chmod(0o644)  # safetensors creates it owner-only
    marker = {
        "format_version": CONVERT_FORMAT_VERSION,
        "source": gguf_path.name,
        "source_bytes": gguf_path.stat().st_size,
    }
    _write_json(folder / COMPLETE_MARKER, marker)


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> Path:
    """Convert a llama-architecture GGUF file into an HF-layout model folder at `out_dir`.

    Writes config.json, model.safetensors (fp32), tokenizer.json, tokenizer_config.json,
    special_tokens_map.json, generation_config.json and, last, the COMPLETE_MARKER file. The folder is
    built in a temporary sibling and renamed into place; an existing `out_dir` is replaced only once
    the new folder is complete. Returns `out_dir`.

    Raises ValueError for an architecture, tokenizer or tensor this converter does not handle.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = GGUFReader(gguf_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        _write_folder(reader, gguf_path, staging, progress)
        _replace_dir(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def _replace_dir(new: Path, target: Path) -> None:
    """Rename `new` to `target`, moving an existing `target` aside first and deleting it after."""
    if not target.exists():
        os.replace(new, target)
        return
    old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
    os.replace(target, old)
    try:
        os.replace(new, target)
    except OSError:
        os.replace(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)
