"""A quantised KV pool through the whole stack: `kvserve up --kv-cache-dtype int8` serves the tokens an
in-process int8 runner generates, prefix hits included, and the kvmanager reports the pool's KV dtype."""

from __future__ import annotations

import json

import pytest
from gateway_stack import running_stack
from test_cli_process import cli_env, run_cli

from kvserve.common.tokenizer import Tokenizer
from kvserve.services.client import Client
from kvserve.services.gateway.llm import LLM
from kvserve.worker.runner import ModelRunner, RunnerConfig

PROMPT = "A short history of the printing press. " * 8 + "Summarise it in one sentence:"
NEW_TOKENS = 16


@pytest.mark.slow
def test_an_int8_stack_serves_what_an_int8_runner_generates_and_reports_its_kv_dtype(tmp_path, model_dir):
    tok = Tokenizer(model_dir)
    local = ModelRunner(RunnerConfig(model_dir=model_dir, num_pages=32, kv_cache_dtype="int8", device="cpu"))
    (expected,) = LLM(local).generate([tok.encode(PROMPT)], NEW_TOKENS)
    assert (local.info.kv_dtype, local.info.kv_scales) == ("int8", "token_head")
    del local

    with running_stack(tmp_path, cli_env(), "--num-pages", "64", "--kv-cache-dtype", "int8") as stack:
        with Client(stack.gateway, timeout_s=120) as client:
            first = client.complete(prompt=PROMPT, max_tokens=NEW_TOKENS)
            again = client.complete(prompt=PROMPT, max_tokens=NEW_TOKENS)  # reads the int8 pages first wrote
        assert list(first.token_ids) == expected
        assert list(again.token_ids) == expected and again.usage.cached_tokens > 0
        pool = stack.admin_stats().pools[0]
        assert (pool.kv_dtype, pool.kv_scales, pool.num_pages) == ("int8", "token_head", 64)
        assert pool.pool_bytes == 64 * 16 * 2 * 30 * 3 * (64 + 4)  # the elements and their scales
        out = run_cli("admin", "stats", "--kvmanager", stack.kvmanager, "--data-dir", str(stack.data_dir))
        assert out.returncode == 0, out.stderr
        header, row = out.stdout.splitlines()[1:3]
        assert dict(zip(header.split(), row.split(), strict=True))["KV_DTYPE"] == "int8"
        stats = json.loads(run_cli("admin", "stats", "--json", "--kvmanager", stack.kvmanager, "--data-dir",
                                   str(stack.data_dir)).stdout)
        assert (stats["pools"][0]["kv_dtype"], stats["pools"][0]["kv_scales"]) == ("int8", "token_head")
