"""Gemma 3 text models and the other layouts that mix full-attention and sliding-window layers (Qwen2's
max_window_layers, a layer_types list) through the worker: tiny random models generate exactly what HF generates,
with chunked prefill, batched requests and a prefix hit; every page is kept (the worker reports full attention,
so nothing is released) while the sliding layers mask; settings the worker does not compute are refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from family_models import generate_one, hf_generate, hf_model
from gemma_models import GEMMA2_ATTN_CAP, MIXED, WINDOW, save_gemma2, save_gemma3, save_gemma3_multimodal, save_mixed
from window_models import run_windowed

from kvserve.common.attention_window import FULL_ATTENTION
from kvserve.common.pages import HOLE
from kvserve.worker.config import ModelConfig, UnsupportedModel, resolve_window
from kvserve.worker.gemma import GemmaDecoder
from kvserve.worker.runner import ModelRunner, RunnerConfig

PAGE = 16
PROMPT_LENGTHS = (100, 37, 70)
NEW_TOKENS = 30
BACKENDS = ("reference", "cpu")
GEMMA_WINDOWS = tuple(WINDOW if kind == "sliding_attention" else 0 for kind in MIXED)  # (24, 24, 0, 24, 24, 0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("mixed")
    ministral = save_mixed(root / "ministral", model_dir, "ministral", sliding_window=WINDOW,
                           layer_types=["full_attention", "sliding_attention"] * 2)
    mistral = shutil.copytree(ministral, root / "mistral")  # the same checkpoint, labelled mistral
    raw = json.loads((mistral / "config.json").read_text())
    (mistral / "config.json").write_text(json.dumps(raw | {"model_type": "mistral"}))
    return {
        "gemma3": save_gemma3(root / "gemma3", model_dir),
        "gemma2": save_gemma2(root / "gemma2", model_dir),  # layer_types left to HF: every other layer slides
        # layer_types left out: the worker and HF both derive it from max_window_layers (layers 2 and 3 slide)
        "qwen2": save_mixed(root / "qwen2", model_dir, "qwen2", use_sliding_window=True, sliding_window=WINDOW,
                            max_window_layers=2, drop=("layer_types",)),
        "ministral": ministral,
        "mistral": mistral,
        "llama": save_mixed(root / "llama", model_dir, "llama", sliding_window=WINDOW,
                            layer_types=["full_attention", "sliding_attention"] * 2),
    }


def make_runner(folder, backend: str = "cpu", **kw) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_dir=folder, num_pages=256, page_size=PAGE, device="cpu", dtype="float32",
                                    attention_backend=backend, **kw))


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def assert_matches_hf(runner: ModelRunner, hf, use_cache: bool = True) -> None:
    """Every prompt, batched with chunked prefill (decodes and chunks in one step), generates HF's tokens, and
    no page was ever released."""
    seqs = run_windowed(runner, prompts(), NEW_TOKENS, budget=48)
    for s in seqs:
        assert s.output == hf_generate(hf, s.prompt, NEW_TOKENS, use_cache)
        assert HOLE not in s.page_table


@pytest.mark.parametrize("backend", BACKENDS)
def test_gemma3_greedy_matches_hf_with_chunked_prefill(tiny, backend):
    runner = make_runner(tiny["gemma3"], backend)
    assert isinstance(runner.model, GemmaDecoder)
    assert runner.model_cfg.layer_windows == GEMMA_WINDOWS
    # a mixed model's worker serves (and reports) full attention: the gateway releases none of its pages
    assert runner.window == FULL_ATTENTION and runner.info.sliding_window == 0
    assert_matches_hf(runner, hf_model(tiny["gemma3"]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gemma2_greedy_matches_hf_with_chunked_prefill(tiny, backend):
    """Gemma 2: no q/k norms, one rope, every other layer sliding, and every attention score soft-capped in the
    backend's kernels (HF computes it in its eager attention)."""
    runner = make_runner(tiny["gemma2"], backend)
    assert isinstance(runner.model, GemmaDecoder) and not runner.model_cfg.gemma.qk_norm
    assert runner.model_cfg.layer_windows == (WINDOW, 0) * 3
    assert runner.model_cfg.logits_soft_cap == GEMMA2_ATTN_CAP
    assert_matches_hf(runner, hf_model(tiny["gemma2"]))


def test_gemma2_logits_match_hfs_forward(tiny):
    """Every position's logits, fed in chunks across pages and the window, equal HF's forward pass: both soft
    caps (attention scores and final logits) as HF applies them."""
    from window_models import paged_logits

    runner, tokens = make_runner(tiny["gemma2"]), prompts()[0]
    ours = paged_logits(runner, tokens, [37, 5, 1, 1, 30])
    with torch.no_grad():
        theirs = hf_model(tiny["gemma2"])(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def test_the_text_model_of_a_multimodal_gemma3_matches_hfs_conditional_generation(tmp_path, model_dir):
    """Gemma 3 4B-27B are Gemma3ForConditionalGeneration folders (model_type gemma3, a text_config, the text
    model's tensors under language_model.*, a vision tower): the worker serves their text model, and generates
    what HF's multimodal class generates from text alone."""
    from transformers import Gemma3ForConditionalGeneration

    folder = save_gemma3_multimodal(tmp_path / "gemma3-mm", model_dir)
    raw = json.loads((folder / "config.json").read_text())
    assert raw["model_type"] == "gemma3" and "text_config" in raw
    runner = make_runner(folder)
    assert isinstance(runner.model, GemmaDecoder) and runner.model_cfg.layer_windows == GEMMA_WINDOWS
    assert_matches_hf(runner, hf_model(folder, Gemma3ForConditionalGeneration))


def test_gemma3_prefix_hit_matches_hf(tiny):
    """A second request computes only what follows the first one's full pages, reading those pages' K/V (written
    by the first request, in every layer, sliding and full), and still generates HF's tokens."""
    runner, hf = make_runner(tiny["gemma3"]), hf_model(tiny["gemma3"])
    first = prompts()[0]  # 100 tokens: pages 0 .. 5 full (positions 0 .. 95)
    free = list(range(runner.info.num_pages))
    out, table = generate_one(runner, "a", first, NEW_TOKENS, chunk=40, free=free)
    assert out == hf_generate(hf, first, NEW_TOKENS)
    second = first[:96] + prompts()[1][:20]
    out2, table2 = generate_one(runner, "b", second, NEW_TOKENS, chunk=7, free=free, page_table=table[:6],
                                num_cached_tokens=96)
    assert table2[:6] == table[:6] and set(table2[6:]).isdisjoint(table)  # the hit pages, then its own
    assert out2 == hf_generate(hf, second, NEW_TOKENS)


@pytest.mark.parametrize("cap", [None, 5.0])
def test_gemma3_logits_match_hfs_forward(tiny, tmp_path, model_dir, cap):
    """Every position's logits, fed in chunks across pages and the window, equal HF's forward pass (float32
    tolerance); with final_logit_softcapping (which greedy tokens cannot show: tanh keeps the argmax) too."""
    from window_models import paged_logits

    folder = tiny["gemma3"] if cap is None else save_gemma3(tmp_path / "capped", model_dir,
                                                           final_logit_softcapping=cap)
    runner, tokens = make_runner(folder), prompts()[0]
    ours = paged_logits(runner, tokens, [37, 5, 1, 1, 30])
    with torch.no_grad():
        theirs = hf_model(folder)(torch.tensor([tokens])).logits[0]
    assert (cap is None) or theirs.abs().max() <= cap
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def test_the_windows_decide_the_tokens(tiny):
    """The tiny models are ones where the sliding layers' window matters: with a window longer than every
    prompt, HF generates other tokens (so the tests above would catch a worker that ignored the window)."""
    p = prompts()[0]
    for name in ("gemma3", "gemma2", "qwen2"):
        windowed, dense = hf_model(tiny[name]), hf_model(tiny[name], sliding_window=1024)
        assert hf_generate(windowed, p, NEW_TOKENS) != hf_generate(dense, p, NEW_TOKENS), name


def test_the_soft_cap_decides_gemma2s_tokens(tiny):
    """Likewise the attention soft cap: without it HF generates other tokens from the tiny Gemma 2."""
    p = prompts()[0]
    capped, uncapped = hf_model(tiny["gemma2"]), hf_model(tiny["gemma2"], attn_logit_softcapping=None)
    assert hf_generate(capped, p, NEW_TOKENS) != hf_generate(uncapped, p, NEW_TOKENS)


def test_qwen2_max_window_layers_matches_hf(tiny):
    runner = make_runner(tiny["qwen2"])
    assert runner.model_cfg.layer_windows == (0, 0, WINDOW, WINDOW) and runner.info.sliding_window == 0
    assert_matches_hf(runner, hf_model(tiny["qwen2"]))


@pytest.mark.parametrize("name", ["ministral", "mistral"])
def test_a_layer_types_list_matches_hfs_ministral(tiny, name):
    """A layer_types list mixing both kinds: served per layer. HF's MinistralForCausalLM reads the list; its
    MistralForCausalLM ignores it (every layer slides, with a warning to use Ministral), so a mistral-labelled
    checkpoint with the list is compared with Ministral on the same weights."""
    from transformers import MinistralForCausalLM

    runner = make_runner(tiny[name])
    assert runner.model_cfg.layer_windows == (0, WINDOW, 0, WINDOW)
    assert_matches_hf(runner, hf_model(tiny["ministral"], MinistralForCausalLM))


def test_llama_ignores_its_layer_types_as_hf_does(tiny):
    """HF's LlamaAttention ignores sliding_window and layer_types: full attention in every layer. (Its generate
    does not: DynamicCache(config) keeps only the window's keys for the "sliding" layers, so HF's cached decode
    drifts from its own forward pass. The worker matches the forward pass, HF's generate without a cache.)"""
    runner = make_runner(tiny["llama"])
    assert runner.model_cfg.layer_windows == () and runner.window == FULL_ATTENTION
    assert_matches_hf(runner, hf_model(tiny["llama"]), use_cache=False)


def gemma_raw(**kw) -> dict:
    from gemma_models import gemma3_config

    return gemma3_config().to_dict() | kw


@pytest.mark.parametrize(("raw", "named"), [
    (gemma_raw(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (gemma_raw(hidden_activation="gelu"), "hidden_activation 'gelu'"),
    (gemma_raw(layer_types=["chunked_attention"] * 6), "chunked_attention"),
    (gemma_raw(layer_types=MIXED[:4]), "4 entries for 6 layers"),
])
def test_settings_the_worker_does_not_compute_are_refused_by_name(raw, named):
    with pytest.raises(UnsupportedModel, match=named):
        ModelConfig.from_dict(raw)


def test_a_mixed_model_takes_no_window_or_sinks_flag():
    cfg = ModelConfig.from_dict(gemma_raw())
    for window, sinks in ((WINDOW, 0), (32, 4)):
        with pytest.raises(ValueError, match="own window per layer type"):
            resolve_window(cfg, window, sinks, PAGE)
    assert resolve_window(cfg, 0, 0, PAGE) == FULL_ATTENTION


def test_gemma3_config_of_either_transformers_generation():
    """transformers 5 writes rope_parameters per layer type and layer_types; transformers 4 wrote flat fields and
    sliding_window_pattern. Both give the same config."""
    new = ModelConfig.from_dict(gemma_raw())
    old_raw = {k: v for k, v in gemma_raw().items() if k not in ("rope_parameters", "layer_types")}
    old = ModelConfig.from_dict(old_raw | {"rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window_pattern": 3,
                                           "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert new == old
    assert new.layer_windows == GEMMA_WINDOWS and new.sliding_window == 0
    assert new.rope_theta == 1e6 and new.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert new.gemma.sliding_rope_theta == 1e4 and new.gemma.sliding_rope_scaling is None
    assert new.gemma.query_pre_attn_scalar == 24 and new.tie_word_embeddings
    assert new.gemma.sliding_layers == tuple(k == "sliding_attention" for k in MIXED)


@pytest.mark.parametrize(("raw", "windows", "window"), [
    (gemma_raw(layer_types=["sliding_attention"] * 6), (), WINDOW),  # every layer slides: pages are released
    (gemma_raw(sliding_window=None), (), 0),
    ({**gemma_raw(), "layer_types": None, "sliding_window_pattern": 2}, (WINDOW, 0) * 3, 0),
])
def test_gemma3_layouts(raw, windows, window):
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.layer_windows, cfg.sliding_window) == (windows, window)
