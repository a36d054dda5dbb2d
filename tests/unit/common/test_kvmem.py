"""``kvserve kv-mem``: the calculator's pinned figures, its bad input, and its agreement with the worker's pool."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvserve.common.kvmem import GIB, KvMemError, calculate, get_dtype, per_token
from kvserve.common.kvmem_models import (
    BUILTIN_MODELS,
    ModelSpec,
    find_model,
    load_hf_config,
    lookup_model,
    model_from_hf_config,
)

# --- pinned figures ---------------------------------------------------------------------------------------------


def test_llama3_8b_bf16_is_131072_bytes_per_token_and_1_gib_at_8192_tokens():
    r = calculate(lookup_model("Llama-3-8B"), seq_len=8192, kv_dtype="bf16")
    assert r.per_token.bytes == 2 * 32 * 8 * 128 * 2 == 131_072
    assert r.bytes_per_sequence == r.total_bytes == 8192 * 131_072 == GIB
    assert r.per_token.formula == "2 x 32 layers x 8 kv heads x 128 head_dim x 2 B (bf16) = 131,072 B"


def test_llama3_70b_is_327680_bytes_per_token_and_40_gib_at_128k():
    r = calculate(lookup_model("llama-3.1-70b"), seq_len=131_072)
    assert r.per_token.bytes == 2 * 80 * 8 * 128 * 2 == 327_680
    assert r.total_bytes == 40 * GIB
    assert calculate(lookup_model("Llama-3-70B"), seq_len=128_000).total_bytes / GIB == pytest.approx(39.06, abs=0.01)


@pytest.mark.parametrize("name,per_token_bf16,max_context", [
    ("Llama-3-8B", 131_072, 8192), ("Llama-3.1-8B", 131_072, 131_072), ("Llama-3-70B", 327_680, 8192),
    ("Llama-3.1-70B", 327_680, 131_072), ("Qwen2.5-7B", 2 * 28 * 4 * 128 * 2, 131_072),
    ("Mistral-7B", 131_072, 32_768), ("DeepSeek-V3", 61 * 576 * 2, 163_840),
    ("SmolLM2-135M", 2 * 30 * 3 * 64 * 2, 8192),
])
def test_builtin_table(name, per_token_bf16, max_context):
    m = lookup_model(name)
    assert per_token(m, get_dtype("bf16")).bytes == per_token_bf16
    assert m.max_context == max_context and m.params > 0


def test_deepseek_v3_mla_caches_one_576_latent_per_layer():
    m = lookup_model("deepseek-ai/DeepSeek-V3")
    pt = per_token(m, get_dtype("bf16"))
    assert m.attention == "mla" and pt.bytes == 61 * 576 * 2 == 70_272
    assert pt.formula == "61 layers x 576 latent x 2 B (bf16) = 70,272 B"


def test_dtypes_and_quantised_scale_overhead_exact():
    m = lookup_model("Llama-3-8B")
    assert [per_token(m, get_dtype(d)).bytes for d in ("fp32", "bf16", "fp16")] == [262_144, 131_072, 131_072]
    for name in ("int8", "fp8_e4m3", "fp8_e5m2"):  # token_head scales: one fp32 per token, layer, kv head, K and V
        q = per_token(m, get_dtype(name))
        assert (q.kv_bytes, q.scale_bytes, q.bytes) == (65_536, 2 * 32 * 8 * 4, 65_536 + 2048)
        assert per_token(m, get_dtype(name), "tensor").bytes == 65_536  # one per-tensor scale, nothing per token
    mla = per_token(lookup_model("DeepSeek-V3"), get_dtype("int8"))
    assert (mla.kv_bytes, mla.scale_bytes) == (61 * 576, 61 * 4)
    assert get_dtype("fp8").name == "fp8_e4m3" and get_dtype("float8_e5m2").name == "fp8_e5m2"
    assert get_dtype("BFloat16").name == "bf16"
    report = calculate(m, seq_len=1, kv_dtype="fp8", kv_scales="tensor")
    assert report.kv_scales == "tensor" and report.per_token.bytes == 65_536
    assert calculate(m, seq_len=1, kv_dtype="bf16").kv_scales == ""
    with pytest.raises(KvMemError, match="unknown --kv-scales 'channel'"):
        calculate(m, seq_len=1, kv_dtype="int8", kv_scales="channel")


def test_names_are_case_insensitive_with_aliases():
    for name in ("llama-3-8b", "LLAMA3-8B", "meta-llama/Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-8B-Instruct"):
        assert lookup_model(name).name == "Llama-3-8B"
    assert lookup_model("mistralai/Mistral-7B-v0.1").sliding_window == 4096
    assert lookup_model("HuggingFaceTB/SmolLM2-135M-Instruct").name == "SmolLM2-135M"
    assert len({m.name for m in BUILTIN_MODELS}) == len(BUILTIN_MODELS)


# --- pages, windows, the reverse question -----------------------------------------------------------------------


def test_page_padding_exact():
    r = calculate(lookup_model("Llama-3-8B"), batch=3, seq_len=1000, page_size=16)
    p = r.paging
    assert p.pages_per_sequence == 63 and p.allocated_tokens_per_sequence == 1008
    assert p.padding_tokens_per_sequence == 8 and p.padding_bytes_per_sequence == 8 * 131_072
    assert p.padding_percent == pytest.approx(100 * 8 / 1008)
    assert p.total_pages == 189 and p.total_allocated_bytes == 3 * 1008 * 131_072
    assert p.total_padding_bytes == p.total_allocated_bytes - r.total_bytes


def test_sliding_window_and_sinks_cap():
    mistral = lookup_model("Mistral-7B")
    assert calculate(mistral, seq_len=32_768).tokens_per_sequence == 4096  # the model's own window
    r = calculate(mistral, seq_len=32_768, sinks=4, page_size=16, batch=2)
    assert r.tokens_per_sequence == 4100 and r.total_bytes == 2 * 4100 * 131_072
    assert r.paging.pages_per_sequence == 257
    assert calculate(mistral, seq_len=1000, sinks=4).tokens_per_sequence == 1000
    assert calculate(mistral, seq_len=32_768, sliding_window=0).tokens_per_sequence == 32_768
    assert calculate(lookup_model("Llama-3-8B"), seq_len=8192, sliding_window=1024, sinks=4).tokens_per_sequence == 1028
    with pytest.raises(KvMemError, match="--sinks needs a sliding window"):
        calculate(lookup_model("Llama-3-8B"), seq_len=8192, sinks=4)


TINY = ModelSpec("tiny", num_layers=2, num_kv_heads=1, head_dim=4, params=250)  # fp32: 2*2*1*4*4 = 64 B/token


def test_reverse_question_exact():
    kw = dict(seq_len=10, kv_dtype="fp32", gpu_memory=10_000, memory_utilization=0.5, reserve=500)
    c = calculate(TINY, weights_bytes=1000, **kw).capacity
    assert (c.usable_bytes, c.kv_budget_bytes) == (5000, 3500)
    assert c.max_tokens == 3500 // 64 == 54 and c.max_pages is None
    assert c.request_bytes == 640 and c.max_concurrent_requests == 5 and c.batch_fits
    c = calculate(TINY, weights_bytes=1000, page_size=4, **kw).capacity  # 256 B pages
    assert (c.max_pages, c.max_tokens, c.request_pages, c.max_concurrent_requests) == (13, 52, 3, 4)
    c = calculate(TINY, weights_bytes=1000, page_size=4, sliding_window=4, sinks=2, **kw).capacity
    # positions keep their slots: sinks 0, 1 in page 0, the window 6..9 across pages 1 and 2 (not packed)
    assert (c.request_tokens, c.request_pages, c.max_concurrent_requests) == (6, 3, 4)
    c = calculate(TINY, batch=6, **kw).capacity  # weights default: 250 params x 2 B (bf16)
    assert c.weights_bytes == 500 and c.kv_budget_bytes == 4000 and c.max_concurrent_requests == 6 and c.batch_fits
    assert not calculate(TINY, batch=7, **kw).capacity.batch_fits
    assert calculate(TINY, weights_dtype="fp32", **kw).capacity.weights_bytes == 1000


def test_reverse_question_80gib_llama3_8b():
    c = calculate(lookup_model("Llama-3-8B"), seq_len=8192, page_size=16, gpu_memory=80 * GIB).capacity
    assert c.usable_bytes == 72 * GIB and c.weights_bytes == 8_030_000_000 * 2
    assert c.max_pages == (72 * GIB - 16_060_000_000) // (16 * 131_072) and c.max_tokens == 16 * c.max_pages
    assert c.max_concurrent_requests == c.max_pages // 512


@pytest.mark.parametrize("kw,message", [
    (dict(batch=0), "--batch must be a positive integer"), (dict(seq_len=-5), "--seq-len must be a positive"),
    (dict(kv_dtype="fp4"), "unknown --kv-dtype 'fp4'"), (dict(page_size=0), "--page-size must be a positive"),
    (dict(sinks=-1), "--sinks must be a non-negative"),
    (dict(gpu_memory=GIB, weights_bytes=2 * GIB), "do not fit in the usable GPU memory"),
    (dict(gpu_memory=GIB, memory_utilization=1.5), "--memory-utilization must be in"),
])
def test_bad_input(kw, message):
    with pytest.raises(KvMemError, match=message):
        calculate(lookup_model("Llama-3-8B"), **{"seq_len": 8192, **kw})


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(KvMemError, match="unknown model 'gpt-5'.*known: Llama-3-8B, .*SmolLM2-135M"):
        find_model("gpt-5")


# --- HF config.json ---------------------------------------------------------------------------------------------


def test_hf_config_json(tmp_path):
    cfg = {"model_type": "mistral", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 32000, "sliding_window": 4096,
           "max_position_embeddings": 32768, "torch_dtype": "float16", "_name_or_path": "my-mistral"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for where in (tmp_path, tmp_path / "config.json", str(tmp_path / "config.json")):
        m = find_model(str(where))
        assert (m.name, m.num_layers, m.num_kv_heads, m.head_dim, m.sliding_window) == ("my-mistral", 32, 8, 128, 4096)
        assert m.default_kv_dtype == "fp16" and m.params == pytest.approx(7.24e9, rel=0.01)
    assert calculate(m, seq_len=8192).tokens_per_sequence == 4096

    qwen = model_from_hf_config({"model_type": "qwen2", "num_hidden_layers": 28, "num_attention_heads": 28,
                                 "num_key_value_heads": 4, "hidden_size": 3584, "sliding_window": 131072,
                                 "use_sliding_window": False, "torch_dtype": "bfloat16"})
    assert qwen.sliding_window is None and per_token(qwen, get_dtype("bf16")).bytes == 57_344
    mha = model_from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
                                "sliding_window": None})
    assert (mha.num_kv_heads, mha.head_dim, mha.sliding_window, mha.default_kv_dtype) == (4, 16, None, "bf16")
    ds = model_from_hf_config({"model_type": "deepseek_v3", "num_hidden_layers": 61, "kv_lora_rank": 512,
                               "qk_rope_head_dim": 64, "num_attention_heads": 128})
    assert ds.latent_dim == 576 and per_token(ds, get_dtype("bf16")).bytes == 70_272
    gemma = model_from_hf_config({"model_type": "gemma3_text", "num_hidden_layers": 6, "num_attention_heads": 4,
                                  "num_key_value_heads": 1, "head_dim": 256, "hidden_size": 640, "sliding_window": 512,
                                  "layer_types": ["sliding_attention"] * 5 + ["full_attention"]})
    assert gemma.sliding_window is None  # mixed layers: not one window for every layer
    assert (gemma.sliding_layers, gemma.layer_window) == (5, 512)
    gemma2 = model_from_hf_config({"model_type": "gemma2", "num_hidden_layers": 42, "num_attention_heads": 16,
                                   "num_key_value_heads": 8, "head_dim": 256, "hidden_size": 3584,
                                   "sliding_window": 4096})  # gemma-2-9b's config.json: no layer_types
    assert (gemma2.sliding_window, gemma2.sliding_layers, gemma2.layer_window) == (None, 21, 4096)
    for mixed in ({"model_type": "gemma3_text", "sliding_window_pattern": 6},
                  {"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 3}):
        assert model_from_hf_config({**mixed, "num_hidden_layers": 6, "num_attention_heads": 4, "hidden_size": 64,
                                     "sliding_window": 512}).sliding_window is None
    assert model_from_hf_config({"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 0,
                                 "num_hidden_layers": 6, "num_attention_heads": 4, "hidden_size": 64,
                                 "sliding_window": 512}).sliding_window == 512  # every layer slides
    assert calculate(gemma, seq_len=4096).tokens_per_sequence == 4096

    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(KvMemError, match="cannot read"):
        find_model(str(tmp_path / "bad.json"))
    with pytest.raises(KvMemError, match="no such file"):
        find_model(str(tmp_path / "missing.json"))
    with pytest.raises(KvMemError, match="num_hidden_layers must be a positive integer"):
        model_from_hf_config({"num_attention_heads": 4})


# --- the worker's pool equals the calculator --------------------------------------------------------------------


def test_worker_pool_bytes_equal_the_calculator(model_dir):
    import torch

    from kvserve.worker.config import ModelConfig
    from kvserve.worker.kv_pool import size_pool
    from kvserve.worker.runner import ModelRunner, RunnerConfig

    m = load_hf_config(model_dir)
    assert (m.num_layers, m.num_kv_heads, m.head_dim) == (30, 3, 64)  # the built-in SmolLM2-135M row
    builtin = lookup_model("SmolLM2-135M")
    assert (builtin.num_layers, builtin.num_kv_heads, builtin.head_dim) == (m.num_layers, m.num_kv_heads, m.head_dim)

    runner = ModelRunner(RunnerConfig(model_dir=model_dir, num_pages=8, page_size=16, device="cpu", dtype="float32"))
    r = calculate(m, kv_dtype="fp32", seq_len=8 * 16, page_size=16)
    assert runner.info.bytes_per_token == r.per_token.bytes == 46_080
    assert runner.info.pool_bytes == r.paging.total_allocated_bytes == r.total_bytes == 8 * 16 * 46_080
    assert runner.kv_cache.nbytes == r.total_bytes

    cfg = ModelConfig.from_folder(model_dir)
    for torch_dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        spec = size_pool(cfg, torch_dtype, 16, num_pages=3)
        assert spec.bytes_per_token == cfg.kv_bytes_per_token(get_dtype(name).bytes)
        assert spec.bytes_per_token == per_token(m, get_dtype(name)).bytes
        assert spec.pool_bytes == calculate(m, kv_dtype=name, seq_len=48, page_size=16).paging.total_allocated_bytes


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("kv_scales", ["token_head", "tensor"])
def test_a_quantised_worker_pool_is_the_calculators_bytes_to_the_byte(model_dir, kv_dtype, kv_scales):
    from kvserve.worker.runner import ModelRunner, RunnerConfig

    m = load_hf_config(model_dir)
    budget = 512 << 20
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, kv_cache_bytes=budget, kv_cache_dtype=kv_dtype,
                                      kv_scales=kv_scales, device="cpu", dtype="float32"))
    i = runner.info
    calc = calculate(m, kv_dtype=kv_dtype, kv_scales=kv_scales, seq_len=16, page_size=16, gpu_memory=budget,
                     weights_bytes=0, memory_utilization=1.0)
    scales_bytes = 0 if runner.kv_scales is None else runner.kv_scales.nbytes
    assert (i.kv_dtype, i.kv_scales) == (kv_dtype, kv_scales)
    assert i.bytes_per_token == calc.per_token.bytes == 11_520 + (720 if kv_scales == "token_head" else 0)
    assert i.num_pages == calc.capacity.max_pages and i.num_pages * 16 == calc.capacity.max_tokens
    assert i.pool_bytes == runner.kv_cache.nbytes + scales_bytes == i.num_pages * 16 * i.bytes_per_token
    assert runner.kv_cache.element_size() == 1 and (runner.kv_scales is None) == (kv_scales == "tensor")
    float_pages = budget // (16 * 46_080)
    assert i.num_pages >= 3.5 * float_pages  # the 1-byte pool holds ~3.8x (token_head) or 4x the tokens


def test_params_estimate_matches_the_real_checkpoint(model_dir):
    from safetensors import safe_open

    total = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                shape = st.get_slice(key).get_shape()
                n = 1
                for d in shape:
                    n *= d
                total += n
    assert load_hf_config(model_dir).params == total


# --- the command line -------------------------------------------------------------------------------------------


def _kv_mem(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVE_")}
    return subprocess.run([sys.executable, "-m", "kvserve.services.cli", "kv-mem", *args], capture_output=True,
                          text=True, timeout=60, env=env)


def test_cli_human_output_shows_the_formula():
    out = _kv_mem("llama-3-8b", "--seq-len", "8192", "--page-size", "16", "--gpu-memory", "80GiB")
    assert out.returncode == 0, out.stderr
    assert "2 x 32 layers x 8 kv heads x 128 head_dim x 2 B (bf16) = 131,072 B" in out.stdout
    assert "1,073,741,824 B (1.00 GiB)" in out.stdout
    for label in ("pages", "padding", "GPU memory", "KV budget", "requests"):
        assert label in out.stdout


def test_cli_json():
    out = _kv_mem("Mistral-7B", "--seq-len", "32768", "--sinks", "4", "--page-size", "16", "--kv-dtype", "int8",
                  "--gpu-memory", "24GiB", "--json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert {"model", "kv_dtype", "per_token", "bytes_per_token", "batch", "seq_len", "sliding_window", "sinks",
            "tokens_per_sequence", "bytes_per_sequence", "total_tokens", "total_bytes", "paging", "capacity",
            "notes"} <= d.keys()
    assert d["bytes_per_token"] == 65_536 + 2048 and d["per_token"]["scale_bytes"] == 2048
    assert d["tokens_per_sequence"] == 4100 and d["paging"]["pages_per_sequence"] == 257
    assert d["capacity"]["weights_bytes"] == 7_240_000_000 * 2 and d["capacity"]["max_concurrent_requests"] > 0


def test_cli_config_json_path(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4,
                                                      "hidden_size": 64, "torch_dtype": "float32"}))
    out = _kv_mem(str(tmp_path / "config.json"), "--seq-len", "10", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["total_bytes"] == 10 * 2 * 2 * 4 * 16 * 4


@pytest.mark.parametrize("args,message", [
    (["gpt-5"], "unknown model 'gpt-5'"),
    (["llama-3-8b", "--batch", "0"], "--batch: must be positive"),
    (["llama-3-8b", "--seq-len", "-5"], "--seq-len: must be positive"),
    (["llama-3-8b", "--kv-dtype", "fp4"],
     "unknown --kv-dtype 'fp4'; known: fp32, bf16, fp16, fp8_e4m3, fp8_e5m2, int8"),
    (["llama-3-70b", "--gpu-memory", "80GiB"], "do not fit in the usable GPU memory"),
    (["llama-3-8b", "--gpu-memory", "80GiB", "--weights-bytes", "100GiB"], "do not fit"),
    (["llama-3-8b", "--page-size", "x"], "--page-size: not an integer"),
    (["llama-3-8b", "--kv-dtype", "int8", "--kv-scales", "row"], "unknown --kv-scales 'row'"),
    (["llama-3-8b", "--reserve", "1GiB"], "--reserve only apply with --gpu-memory"),
])
def test_cli_bad_input_is_one_clear_line_and_exit_2(args, message):
    out = _kv_mem(*args)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and out.stdout == ""


@pytest.mark.parametrize("kv_dtype,torch_dtype,scales", [("fp32", "float32", False), ("int8", "int8", True)])
def test_the_kv_store_sizing_counts_the_values_a_worker_writes_byte_for_byte(kv_dtype, torch_dtype, scales):
    """--kv-store-bytes: one value per page, as kvserve/worker/page_codec.py encodes it (header included), which is what
    the kvmanager counts against the bound."""
    import torch

    from kvserve.worker.page_codec import HEADER, encode_page

    model = ModelSpec(name="tiny", num_layers=3, num_kv_heads=2, head_dim=8, max_context=4096)
    r = calculate(model, seq_len=1200, kv_dtype=kv_dtype, page_size=16, store_bytes=10_000_000)
    pool = torch.zeros(3, 2, 4, 16, 2, 8, dtype=getattr(torch, torch_dtype))
    scale = torch.ones(3, 2, 4, 16, 2) if scales else None
    value = encode_page(b"n" * 16, b"h" * 16, pool, scale, 1)
    assert HEADER.size == r.store.value_bytes - 16 * r.per_token.bytes
    assert len(value) == r.store.value_bytes
    assert r.store.max_pages == 10_000_000 // len(value) and r.store.max_tokens == 16 * r.store.max_pages
    assert r.store.max_sequences == r.store.max_pages // 75  # 1,200 tokens: 75 full pages each


def test_page_groups_size_what_a_mixed_model_would_hold_with_a_table_per_group():
    """Gemma 3 27B in bf16 at 128k tokens, pages of 16: its 10 full layers keep every page (8,192 pages), its 52
    sliding layers the window's pages while a decode step runs (ceil(1024 / 16) + 1 = 65 pages)."""
    gemma = lookup_model("gemma-3-27b")
    r = calculate(gemma, seq_len=131_072, page_size=16)
    assert r.tokens_per_sequence == 131_072 and r.per_token.bytes == 62 * 8192  # every layer's pages: the worker's
    g = r.page_groups
    assert (g.full_layers, g.sliding_layers, g.window, g.full_tokens, g.sliding_tokens) == (10, 52, 1024, 131_072,
                                                                                             65 * 16)
    assert g.bytes_per_sequence == 8192 * (10 * 131_072 + 52 * 65 * 16) and g.every_page_bytes == r.bytes_per_sequence
    assert 5.9 < g.saving < 6.0
    unpaged = calculate(gemma, seq_len=131_072).page_groups
    assert unpaged.sliding_tokens == 1024 and unpaged.full_tokens == 131_072
    short = calculate(gemma, seq_len=512).page_groups  # inside the window: nothing to save
    assert short.saving == 1.0
    assert calculate(lookup_model("llama-3-8b"), seq_len=4096).page_groups is None
    from kvserve.services.cli_kvmem import format_report

    assert "page groups" in format_report(r) and "5.95x less" in format_report(r)
