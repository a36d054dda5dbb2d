"""The families beyond Llama through the whole stack: `kvserve up --model <tiny random model>` serves HF's own
greedy tokens for a prompt longer than a step's token budget (so it is prefilled in chunks), and a second request
hits the first one's prefix in the kvmanager and gets the same tokens: Qwen3 (q/k norms), Gemma 3 (sliding and full
layers mixed, its norms and scales; and the multimodal wrapper's text model), Gemma 2 (soft-capped scores),
Qwen3-MoE and a DeepSeek-V3 (MLA's latent pages, MoE, yarn). The Gemmas run with page groups: their sliding layers'
pages are released past their window while their full layers keep theirs."""

from __future__ import annotations

import pytest
from family_models import hf_generate, hf_model, save_tiny_qwen3, save_tiny_qwen3_moe
from gateway_stack import running_stack
from gemma_models import WINDOW, save_gemma2, save_gemma3, save_gemma3_multimodal
from mla_models import save_tiny_mla
from test_cli_process import cli_env

from kvserve.common.tokenizer import Tokenizer
from kvserve.services.client import Client

NEW_TOKENS = 32
PROMPT = ("The printing press spread across Europe within fifty years of its invention, and with it came cheaper "
          "books, new readers and arguments about what they should read. ") * 3
BUILDERS = {"qwen3": save_tiny_qwen3, "qwen3_moe": save_tiny_qwen3_moe,  # q/k norms; routed experts
            "gemma3": save_gemma3,  # sliding and full layers mixed: page groups
            "gemma2": save_gemma2,  # every other layer sliding, scores soft-capped in the kernels: page groups
            "gemma3_multimodal": save_gemma3_multimodal,  # Gemma 3 4B-27B's wrapper: its text model served
            "deepseek_v3": lambda folder, tok: save_tiny_mla(folder, tok, "moe_yarn")}  # MLA, MoE, yarn


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_the_stack_serves_hfs_tokens_in_chunks_and_again_from_a_prefix_hit(tmp_path, model_dir, family):
    folder = BUILDERS[family](tmp_path / family, model_dir)
    prompt_ids = Tokenizer(folder).encode(PROMPT)
    assert len(prompt_ids) > 64 > 2 * WINDOW  # several of the Gemma's windows
    expected = hf_generate(hf_model(folder), prompt_ids, NEW_TOKENS)

    with running_stack(tmp_path, cli_env(), "--model", str(folder), "--num-pages", "32",
                       "--max-num-batched-tokens", "32") as stack:
        with Client(stack.gateway, timeout_s=120) as client:
            first = client.complete(prompt=PROMPT, max_tokens=NEW_TOKENS, ignore_eos=True)
            again = client.complete(prompt=PROMPT, max_tokens=NEW_TOKENS, ignore_eos=True)
        (pool,) = stack.admin_stats().pools
    if family.startswith("gemma"):  # the sliding layers' pages fell out of their window; the full ones stayed
        assert pool.sliding_group.sliding_window == WINDOW and pool.sliding_group.num_window_released_pages > 0
        assert pool.num_window_released_pages == 0
    else:
        assert not pool.HasField("sliding_group")
    assert list(first.token_ids) == expected
    assert list(again.token_ids) == expected
    assert again.usage.cached_tokens >= len(prompt_ids) // 16 * 16 - 16  # every full page but the last
