"""Qwen3 in the worker: its per-head q/k RMSNorm before RoPE and its head_dim wider than hidden / heads. A tiny
random Qwen3 generates exactly what HF's Qwen3ForCausalLM does through ModelRunner.step, in chunks that cross
pages, and again from a prefix hit on the first request's pages."""

from __future__ import annotations

import pytest
import torch
from family_models import hf_generate, hf_model, save_tiny_qwen3, save_tiny_qwen3_moe
from window_models import run_windowed

from kvserve.kernels.paged_attention import build_metadata
from kvserve.worker.config import ModelConfig
from kvserve.worker.runner import ModelRunner, RunnerConfig

PAGE = 16
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, model_dir):
    return save_tiny_qwen3(tmp_path_factory.mktemp("qwen3") / "qwen3", model_dir)


def make_runner(folder, backend: str) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_dir=folder, num_pages=64, page_size=PAGE, device="cpu", dtype="float32",
                                    attention_backend=backend))


def prompts(*lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]


def test_the_config_reads_qwen3s_head_dim_and_q_k_norms(qwen3):
    cfg = ModelConfig.from_folder(qwen3)
    assert (cfg.model_type, cfg.qk_norm, cfg.head_dim, cfg.hidden_size // cfg.num_heads) == ("qwen3", True, 32, 16)
    assert not cfg.attention_bias and cfg.sliding_window == 0
    assert cfg.kv_bytes_per_token(4) == 2 * 2 * 2 * 32 * 4  # K and V x layers x kv heads x head_dim x fp32


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_greedy_tokens_equal_hfs_through_chunked_prefill(qwen3, backend):
    runner = make_runner(qwen3, backend)
    seqs = run_windowed(runner, prompts(70, 23, 41), NEW_TOKENS, budget=24)  # chunks of 24 across pages of 16
    hf = hf_model(qwen3)
    for s in seqs:
        assert s.output == hf_generate(hf, s.prompt, NEW_TOKENS)


def test_the_q_k_norms_decide_the_tokens(qwen3):
    """Without them the same weights generate other tokens, so the test above would catch a worker that skipped
    them."""
    hf = hf_model(qwen3)
    p = prompts(70)[0]
    expected = hf_generate(hf, p, NEW_TOKENS)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.q_norm.weight.fill_(1.0)
            layer.self_attn.k_norm.weight.fill_(1.0)
    assert hf_generate(hf, p, NEW_TOKENS) != expected


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory, model_dir):
    return save_tiny_qwen3_moe(tmp_path_factory.mktemp("qwen3-moe") / "qwen3-moe", model_dir)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_qwen3_moe_greedy_tokens_equal_hfs(qwen3_moe, backend):
    """Qwen3-MoE: Qwen3's attention, and in its routed layers a softmax top-2 of 4 experts, renormalised."""
    runner = make_runner(qwen3_moe, backend)
    cfg = runner.model_cfg
    assert cfg.qk_norm and [cfg.moe.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert runner.model.weights.layers[0].moe is None and runner.model.weights.layers[1].gate_up is None
    seqs = run_windowed(runner, prompts(70, 23, 41), NEW_TOKENS, budget=24)
    hf = hf_model(qwen3_moe)
    for s in seqs:
        assert s.output == hf_generate(hf, s.prompt, NEW_TOKENS)


def test_the_experts_routing_decides_qwen3_moes_tokens(qwen3_moe):
    """Without renormalising the top-2 weights the same model generates other tokens: the test above would catch
    a router computed otherwise."""
    hf = hf_model(qwen3_moe)
    p = prompts(70)[0]
    expected = hf_generate(hf, p, NEW_TOKENS)
    for layer in hf.model.layers[1:]:
        layer.mlp.gate.norm_topk_prob = False
    assert hf_generate(hf, p, NEW_TOKENS) != expected


def test_a_prefix_hit_on_another_requests_pages_gives_the_same_logits(qwen3):
    """Request b shares a's first 48 tokens (3 full pages): it starts at num_cached_tokens = 48 on a's pages and
    computes only its own tail; its logits equal those of computing every token itself."""
    runner = make_runner(qwen3, "cpu")
    a, tail = prompts(60, 20)
    b = a[:48] + tail

    def forward(tokens, start, page_table):
        meta = build_metadata([start], [len(tokens)], [page_table], PAGE, runner.device)
        return runner.call(lambda: runner.model.logits(
            runner.model.forward(torch.tensor(tokens), meta, runner.kv_cache, runner.kv_scales)))

    forward(a, 0, [0, 1, 2, 3])
    hit = forward(b[48:], 48, [0, 1, 2, 10, 11])
    alone = forward(b, 0, [20, 21, 22, 23, 24])
    torch.testing.assert_close(hit, alone[48:], rtol=1e-4, atol=1e-4)
    assert torch.equal(hit.argmax(-1), alone[48:].argmax(-1))


@pytest.fixture(scope="module")
def qwen3_yarn(tmp_path_factory, model_dir):
    """Qwen3's long-context setting: yarn over its original 256 positions, four times longer (max 1,024)."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 10000.0}
    return save_tiny_qwen3(tmp_path_factory.mktemp("qwen3-yarn") / "qwen3-yarn", model_dir, rope_parameters=rope)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_yarn_rope_scaling_gives_hfs_tokens(qwen3_yarn, backend):
    """YaRN's blended frequencies and its attention factor on cos and sin (rotary.frequencies), for every
    decoder, not only MLA's: a prompt past the original 256 positions generates HF's tokens."""
    runner = make_runner(qwen3_yarn, backend)
    assert runner.model.rope_factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    seqs = run_windowed(runner, prompts(300), NEW_TOKENS, budget=128)
    hf = hf_model(qwen3_yarn)
    assert seqs[0].output == hf_generate(hf, seqs[0].prompt, NEW_TOKENS)
