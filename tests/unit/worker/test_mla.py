"""Multi-head latent attention (kvserve/worker/mla.py): tiny random DeepSeek-V3 (and V2) models generate exactly what
HF's DeepseekV3ForCausalLM (DeepseekV2ForCausalLM) does through ModelRunner.step, in both attention modes, through
chunked prefill (chunks smaller than a page, crossing pages), batched decode and a prefix hit; the pool holds one
latent row per layer and token, sized to the byte as kvserve kv-mem's MLA formula; a quantised latent stays close;
bad settings are refused before anything is allocated."""

from __future__ import annotations

import pytest
import torch
from family_models import generate_one, hf_generate, hf_model
from mla_models import save_tiny_mla
from window_models import paged_logits, run_windowed

from kvserve.common.kvmem import get_dtype, per_token
from kvserve.common.kvmem_models import ModelSpec
from kvserve.kernels.rotary import yarn_frequencies
from kvserve.worker.config import ModelConfig, UnsupportedModel
from kvserve.worker.kv_pool import allocate_pool, allocate_scales, size_pool
from kvserve.worker.mla import MLADecoder
from kvserve.worker.page_codec import decode_page, encode_page
from kvserve.worker.runner import ModelRunner, RunnerConfig

PAGE = 16
PROMPT_LENGTHS = (70, 23, 41)
NEW_TOKENS = 30
NS, BLOCK = bytes(range(16)), bytes(range(16, 32))  # a page value's namespace and block hash (16 bytes each)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("tiny_mla")
    return {v: save_tiny_mla(root / v, model_dir, v) for v in ("dense", "moe_yarn", "v2_moe")}


@pytest.fixture(scope="module")
def hf_tokens(tiny):
    """HF's greedy tokens per variant and prompt, on one thread (two shared cores: see conftest's
    hf_greedy_alone)."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {v: [hf_generate(hf_model(folder), p, NEW_TOKENS) for p in prompts()] for v, folder in tiny.items()}
    finally:
        torch.set_num_threads(num_threads)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def make_runner(folder, backend: str = "cpu", mode: str = "absorbed", **kw) -> ModelRunner:
    runner = ModelRunner(RunnerConfig(model_dir=folder, num_pages=48, page_size=PAGE, device="cpu",
                                      dtype="float32", attention_backend=backend, **kw))
    assert isinstance(runner.model, MLADecoder)
    runner.model.mode = mode
    return runner


@pytest.mark.parametrize(("variant", "backend", "mode"), [
    ("dense", "cpu", "absorbed"), ("dense", "reference", "decompress"),
    ("moe_yarn", "cpu", "decompress"), ("moe_yarn", "reference", "absorbed"), ("v2_moe", "cpu", "absorbed"),
])
def test_greedy_matches_hf_through_chunked_prefill_and_batched_decode(tiny, hf_tokens, variant, backend, mode):
    runner = make_runner(tiny[variant], backend, mode)
    seqs = run_windowed(runner, prompts(), NEW_TOKENS, budget=12)  # chunks of <= 12 tokens: inside and across pages
    for s, expected in zip(seqs, hf_tokens[variant], strict=True):
        assert s.output == expected
    assert all(len(set(e)) > 3 for e in hf_tokens[variant])  # not a model stuck on one token


def test_the_triton_backends_ops_serve_mla_too(tiny, hf_tokens):
    """The attention is plain torch on any backend; under the triton one the projections and norms are its kernels
    (Triton's interpreter on a machine without CUDA)."""
    runner = make_runner(tiny["dense"], "triton", "absorbed")
    assert runner.model.backend.name == "triton"
    n = NEW_TOKENS // 3
    seqs = run_windowed(runner, prompts()[1:], n, budget=12)
    assert [s.output for s in seqs] == [e[:n] for e in hf_tokens["dense"][1:]]


@pytest.mark.parametrize("mode", ["absorbed", "decompress"])
def test_prefix_hit_reuses_the_first_requests_full_pages(tiny, hf_tokens, mode):
    """A second request starts on the first one's two full pages (num_cached_tokens = 32) and computes only its
    own tokens; its answer is HF's for its whole prompt."""
    runner = make_runner(tiny["dense"], "cpu", mode)
    free = list(range(runner.info.num_pages))
    first = prompts()[0]
    out, table = generate_one(runner, "a", first, NEW_TOKENS, chunk=7, free=free)
    assert out == hf_tokens["dense"][0]
    shared = 2
    second = first[:shared * PAGE] + prompts()[1]
    before = runner.kv_cache[:, :, table[:shared]].clone()
    out2, table2 = generate_one(runner, "b", second, NEW_TOKENS, chunk=PAGE, free=free,
                                page_table=table[:shared], num_cached_tokens=shared * PAGE)
    assert table2[:shared] == table[:shared] and not set(table2[shared:]) & set(table)
    assert torch.equal(runner.kv_cache[:, :, table[:shared]], before)  # the shared pages were only read
    assert out2 == hf_generate(hf_model(tiny["dense"]), second, NEW_TOKENS)


@pytest.mark.parametrize(("kv_dtype", "kv_scales", "calc_dtype"), [
    ("float32", "token_head", "fp32"), ("bfloat16", "token_head", "bf16"), ("int8", "token_head", "int8"),
    ("fp8_e4m3", "token_head", "fp8_e4m3"), ("fp8_e5m2", "tensor", "fp8_e5m2"),
])
def test_pool_bytes_per_token_equal_the_calculators_mla_formula(tiny, kv_dtype, kv_scales, calc_dtype):
    cfg = ModelConfig.from_folder(tiny["dense"])
    size = size_pool(cfg, kv_dtype, PAGE, kv_scales=kv_scales, num_pages=5)
    spec = ModelSpec("tiny-mla", cfg.num_layers, latent_dim=32 + 8)
    assert size.bytes_per_token == per_token(spec, get_dtype(calc_dtype), kv_scales).bytes
    pool, scales = allocate_pool(cfg, size, torch.device("cpu")), allocate_scales(cfg, size, torch.device("cpu"))
    assert pool.shape == (2, 1, 5, PAGE, 1, 40)  # one latent row per layer and token, nothing per head
    assert (scales is None) == (kv_scales == "tensor" or kv_dtype in ("float32", "bfloat16"))
    held = pool.nbytes + (0 if scales is None else scales.nbytes)
    assert held == size.pool_bytes == size.bytes_per_token * PAGE * 5
    if scales is not None:
        assert scales.shape == (2, 1, 5, PAGE, 1)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_a_quantised_latent_stays_close_to_the_float_pool(tiny, kv_dtype):
    tokens = prompts()[0] + prompts()[2]
    exact = paged_logits(make_runner(tiny["dense"], "reference"), tokens, [13, 1, 1, 30])
    runner = make_runner(tiny["dense"], "reference", kv_cache_dtype=kv_dtype)
    assert runner.kv_cache.element_size() == 1 and runner.kv_scales.shape[1] == 1
    quantised = paged_logits(runner, tokens, [13, 1, 1, 30])
    err = (quantised - exact).abs().max().item()
    assert 0 < err < 0.05 * exact.abs().max().item()  # quantised (not the float path), and close
    assert (quantised.argmax(-1) == exact.argmax(-1)).float().mean() > 0.9


def test_an_mla_page_round_trips_through_the_page_codec(tiny):
    runner = make_runner(tiny["dense"], "cpu", kv_cache_dtype="int8")
    generate_one(runner, "a", prompts()[0], 1, chunk=PAGE, free=[3, 4, 5, 6, 7])
    page = runner.kv_cache[:, :, 4].clone(), runner.kv_scales[:, :, 4].clone()
    value = encode_page(NS, BLOCK, runner.kv_cache, runner.kv_scales, 4)
    runner.kv_cache[:, :, 9].zero_()
    decode_page(value, NS, BLOCK, runner.kv_cache, runner.kv_scales, 9)
    assert page[0].abs().sum() > 0
    assert torch.equal(runner.kv_cache[:, :, 9], page[0]) and torch.equal(runner.kv_scales[:, :, 9], page[1])


def test_yarn_frequencies_and_scale_match_transformers():
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
    hf_cfg = DeepseekV3Config(max_position_embeddings=163840, rope_parameters=dict(rope))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    ours, our_factor = yarn_frequencies(64, 10000.0, rope, 163840)
    assert torch.equal(ours, inv_freq) and our_factor == factor
    raw = hf_cfg.to_dict()
    cfg = ModelConfig.from_dict(raw)
    assert cfg.mla.latent_dim == 512 + 64 and cfg.num_kv_heads == 1 and cfg.mla.q_lora_rank == 1536
    assert cfg.moe.first_k_dense_replace == 3 and cfg.moe.n_routed_experts == 256
    assert cfg.mla.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * 1.0 * torch.tensor(40.0).log().item() + 1) ** 2)


def base_config(**changes) -> dict:
    raw = dict(model_type="deepseek_v3", vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
               v_head_dim=16, first_k_dense_replace=2)
    raw.update(changes)
    return raw


@pytest.mark.parametrize(("changes", "message"), [
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope type 'dynamic' is not supported with MLA"),
    ({"attention_bias": True}, "attention_bias is not supported with MLA"),
    ({"first_k_dense_replace": 0, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
      "scoring_func": "softmax"}, "scoring_func='softmax', topk_method='noaux_tc' is not supported"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim must be even"),
])
def test_unsupported_mla_configs_are_refused_clearly(changes, message):
    with pytest.raises(UnsupportedModel, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.from_dict(base_config(**changes))


@pytest.mark.parametrize("window", [dict(sliding_window=32), dict(sliding_window=32, attention_sinks=4)])
def test_windows_and_sinks_are_refused_with_mla_at_start_up(tiny, window):
    with pytest.raises(ValueError, match="multi-head latent attention .* --sliding-window and --attention-sinks"):
        make_runner(tiny["dense"], "cpu", **window)


def test_an_unknown_attention_mode_is_refused(tiny):
    runner = make_runner(tiny["dense"], "reference")
    with pytest.raises(ValueError, match="unknown MLA attention mode 'fast'"):
        MLADecoder(runner.model_cfg, runner.model.weights, runner.model.backend, mode="fast")
