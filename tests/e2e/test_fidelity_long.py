"""Fidelity after long prompts: greedy generation after a prompt of more than 4,000 tokens, prefilled in
512-token chunks through the worker's pool, equals HF transformers token for token; so does a second prompt
that shares the first one's leading 3,008 tokens (188 pages) as a prefix hit and prefills only the rest.

The chunks after the first attend over thousands of cached tokens: the case the paged prefill kernel's row
blocks exist for (kvserve/kernels/paged_prefill.cpp), and the decodes after them take the split path of the decode
kernel (one sequence, so its pages are spread over the threads).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from kvserve.common.wire.worker import SamplingParams, StepBatch, StepItem

PROMPT_TOKENS = 4200
SHARED_PAGES = 188  # 3,008 tokens of the first prompt reused by the second
NEW_TOKENS = 16
CHUNK = 512
PAGE_SIZE = 16


@pytest.fixture(scope="module")
def long_runner(model_dir):
    from kvserve.worker.runner import ModelRunner, RunnerConfig

    return ModelRunner(RunnerConfig(model_dir=model_dir, num_pages=2 * PROMPT_TOKENS // PAGE_SIZE + 16,
                                    page_size=PAGE_SIZE, device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def prompts(tokenizer) -> tuple[list[int], list[int]]:
    """Real text (the standard library's argparse source): the first prompt, and a second one that shares its
    first SHARED_PAGES pages and goes on with text from further on."""
    ids = tokenizer.encode(Path(argparse.__file__).read_text())
    assert len(ids) > 2 * PROMPT_TOKENS
    first = ids[:PROMPT_TOKENS]
    second = first[:SHARED_PAGES * PAGE_SIZE] + ids[PROMPT_TOKENS + 500:PROMPT_TOKENS + 1700]
    return first, second


def generate(runner, req_id: str, prompt: list[int], table: list[int], start: int) -> list[int]:
    """Prefill prompt[start:] in CHUNK-token steps on top of the cached prompt[:start], then greedy decode."""
    greedy = SamplingParams(temperature=0.0)
    out = None
    for pos in range(start, len(prompt), CHUNK):
        chunk = tuple(prompt[pos:pos + CHUNK])
        last = pos + len(chunk) == len(prompt)
        out = runner.step(StepBatch((StepItem(req_id, chunk, pos, tuple(table), sample=last, sampling=greedy),)))
    tokens = [out.sampled[0].token_id]
    while len(tokens) < NEW_TOKENS:
        item = StepItem(req_id, (tokens[-1],), len(prompt) + len(tokens) - 1, tuple(table), sampling=greedy)
        tokens.append(runner.step(StepBatch((item,))).sampled[0].token_id)
    return tokens


def hf_greedy(hf_model, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                do_sample=False, pad_token_id=2)
    return out[0, len(prompt):].tolist()


def test_greedy_after_a_4200_token_prompt_and_after_a_prefix_hit_on_it_equals_hf(long_runner, hf_model, prompts):
    assert long_runner.info.attention_backend == "cpu"
    first, second = prompts
    pages = -(-(PROMPT_TOKENS + NEW_TOKENS) // PAGE_SIZE)
    # scattered pages: the first request on the odd ones, descending; the second reuses its leading pages
    table_a = list(range(long_runner.info.num_pages - 1, 0, -2))[:pages]
    ours = generate(long_runner, "long-a", first, table_a, 0)
    assert ours == hf_greedy(hf_model, first), "greedy output after a 4,200-token prompt diverged from HF"

    own = -(-(len(second) + NEW_TOKENS) // PAGE_SIZE) - SHARED_PAGES
    table_b = table_a[:SHARED_PAGES] + list(range(0, long_runner.info.num_pages, 2))[:own]
    hit = generate(long_runner, "long-b", second, table_b, SHARED_PAGES * PAGE_SIZE)
    assert hit == hf_greedy(hf_model, second), "greedy output after a prefix hit of 3,008 tokens diverged from HF"
