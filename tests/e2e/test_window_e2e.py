"""A sliding-window model through the whole stack: `kvserve up --model <tiny Mistral, window 40>` serves what
HF's MistralForCausalLM generates for a prompt several windows long, a second request hits the first one's
prefix and gets the same tokens, and the kvmanager counts the pages the window released."""

from __future__ import annotations

import pytest
from family_models import hf_generate, hf_model
from gateway_stack import running_stack
from test_cli_process import cli_env
from window_models import WINDOW, save_tiny

from kvserve.common.tokenizer import Tokenizer
from kvserve.services.client import Client

NEW_TOKENS = 48
PROMPT = ("The printing press spread across Europe within fifty years of its invention, and with it came cheaper "
          "books, new readers and arguments about what they should read. ") * 3


@pytest.mark.slow
def test_a_windowed_stack_serves_hfs_tokens_and_a_prefix_hit_the_same(tmp_path, model_dir):
    folder = save_tiny(tmp_path / "mistral", "mistral", model_dir, sliding_window=WINDOW)
    prompt_ids = Tokenizer(folder).encode(PROMPT)
    assert len(prompt_ids) > 2 * WINDOW
    expected = hf_generate(hf_model(folder), prompt_ids, NEW_TOKENS)

    with running_stack(tmp_path, cli_env(), "--model", str(folder), "--num-pages", "24",
                       "--max-num-batched-tokens", "32") as stack:
        with Client(stack.gateway, timeout_s=120) as client:
            first = client.complete(prompt=PROMPT, max_tokens=NEW_TOKENS, ignore_eos=True)
            again = client.complete(prompt=PROMPT, max_tokens=NEW_TOKENS, ignore_eos=True)
        assert list(first.token_ids) == expected
        assert list(again.token_ids) == expected and again.usage.cached_tokens > 0
        pool = stack.admin_stats().pools[0]
        assert (pool.sliding_window, pool.attention_sinks) == (WINDOW, 0)
        assert pool.num_window_released_pages > 0 and pool.num_used_pages == 0
