"""Fidelity, the heart of the worker: greedy generation through Step equals HF transformers token for token.

Eight prompts of different lengths run together through the worker's gRPC Step API with a small token budget,
so long prompts are prefilled in chunks while short ones already decode, and page boundaries are crossed.
HF transformers (same weights, fp32) generates each prompt alone.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

import pytest
import torch

from kvserve.v1 import common_pb2, worker_pb2

PROMPT_LENGTHS = [3, 16, 17, 31, 48, 90, 150, 260]  # tokens; 16 = one full page, 17 crosses into a second
MAX_NEW_TOKENS = 32
STEP_TOKEN_BUDGET = 64  # forces chunked prefill for the longer prompts
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based inks and a wooden press adapted from wine making. Within fifty years, "
    "presses operated in more than two hundred European cities and had printed millions of books. Scholars "
    "argue about its effects: some credit it with the Reformation and the scientific revolution, others point "
    "to the slow spread of literacy. def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        "
    "a, b = b, a + b\n    return a\n\nQuestion: what is 17 * 23? Answer: 391. Les imprimeurs de Lyon "
    "travaillaient pour toute l'Europe; 東京の印刷所もまた、明治時代に急速に増えた。 The press also changed how "
    "music, maps and scientific diagrams were shared, because identical copies could be compared across "
    "distant cities, corrected, and printed again in improved editions that built on each other. "
) * 3


def make_prompts(tokenizer) -> list[list[int]]:
    ids = tokenizer.encode(TEXT)
    assert len(ids) > max(PROMPT_LENGTHS) + 20
    return [ids[i * 7 : i * 7 + n] for i, n in enumerate(PROMPT_LENGTHS)]


@dataclass
class Seq:
    req_id: str
    prompt: list[int]
    num_computed: int = 0
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    page_table: list[int] = field(default_factory=list)
    done: bool = False

    def pending(self) -> list[int]:
        if self.num_computed < len(self.prompt):
            return self.prompt[self.num_computed :]
        return [self.output[-1]]


def run_through_step(stub, prompts, *, eos_id, page_size, free_pages) -> list[Seq]:
    """A tiny continuous-batching loop: decodes first, then prefill chunks under the token budget."""
    seqs = [Seq(f"req-{i}", p) for i, p in enumerate(prompts)]
    while not all(s.done for s in seqs):
        items, budget = [], STEP_TOKEN_BUDGET
        decoding = [s for s in seqs if not s.done and s.output]
        prefilling = [s for s in seqs if not s.done and not s.output]
        for s in decoding + prefilling:
            if budget <= 0:
                break
            tokens = s.pending()[:budget]
            budget -= len(tokens)
            end = s.num_computed + len(tokens)
            while len(s.page_table) * page_size < end:
                s.page_table.append(free_pages.pop())
            items.append(worker_pb2.StepItem(
                req_id=s.req_id, token_ids=tokens, start_pos=s.num_computed, page_table=s.page_table,
                sample=end >= len(s.prompt), sampling=common_pb2.SamplingParams(temperature=0.0)))
        resp = stub.Step(worker_pb2.StepBatch(items=items), timeout=120)
        by_id = {r.req_id: r for r in resp.results}
        for it in items:
            s = next(x for x in seqs if x.req_id == it.req_id)
            s.num_computed += len(it.token_ids)
            if it.req_id in by_id:
                s.output.append(by_id[it.req_id].token_id)
                s.logprobs.append(by_id[it.req_id].logprob)
                s.done = s.output[-1] == eos_id or len(s.output) == MAX_NEW_TOKENS
    return seqs


@pytest.fixture(scope="module")
def hf_reference(hf_model, tokenizer):
    """Each prompt generated alone by HF transformers, greedy, with its per-step logits."""
    out = []
    for prompt in make_prompts(tokenizer):
        gen = hf_model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                output_logits=True, return_dict_in_generate=True, pad_token_id=2)
        ids = gen.sequences[0, len(prompt):].tolist()
        out.append((ids, torch.cat(gen.logits).float()))
    return out


def test_batched_step_greedy_equals_hf(worker_stub, runner, tokenizer, hf_reference):
    assert runner.info.attention_backend == "cpu"  # the default on CPU: decodes run the in-place kernel
    prompts = make_prompts(tokenizer)
    free_pages = list(range(runner.info.num_pages))[::-1][::3] + list(range(runner.info.num_pages))[1::3]
    seqs = run_through_step(worker_stub, prompts, eos_id=runner.info.eos_token_ids[0],
                            page_size=runner.info.page_size, free_pages=free_pages)
    worst_logprob = 0.0
    for s, (hf_ids, hf_logits) in zip(seqs, hf_reference, strict=True):
        assert s.output == hf_ids, f"{s.req_id} (prompt {len(s.prompt)} tokens) diverged from HF"
        hf_lp = torch.log_softmax(hf_logits, -1)[torch.arange(len(hf_ids)), torch.tensor(hf_ids)]
        worst_logprob = max(worst_logprob, (torch.tensor(s.logprobs) - hf_lp).abs().max().item())
    print(f"\n[fidelity] 8 batched requests x {MAX_NEW_TOKENS} tokens identical to HF; "
          f"max |logprob diff| = {worst_logprob:.2e}")
    assert worst_logprob < 1e-3


def test_logits_match_hf(runner, hf_model, tokenizer, hf_reference):
    """Full-vocabulary logits of every position, chunked paged prefill vs HF's dense forward."""
    from kvserve.kernels.paged_attention import build_metadata

    worst = 0.0
    for prompt, (hf_ids, _) in zip(make_prompts(tokenizer), hf_reference, strict=True):
        seq = prompt + hf_ids
        table = list(range(200, 200 + -(-len(seq) // runner.info.page_size)))
        ours = []
        for start in range(0, len(seq), 37):  # chunks that straddle page boundaries
            chunk = seq[start : start + 37]
            meta = build_metadata([start], [len(chunk)], [table], runner.info.page_size, runner.device)
            hidden = runner.model.forward(torch.tensor(chunk), meta, runner.kv_cache)
            ours.append(runner.model.logits(hidden))
        with torch.inference_mode():
            ref = hf_model(torch.tensor([seq])).logits[0].float()
        worst = max(worst, (torch.cat(ours) - ref).abs().max().item())
    print(f"\n[fidelity] max |logit diff| vs HF over all positions of 8 sequences = {worst:.2e}")
    assert worst < 2e-3


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat"])
def test_generate_local_cli_equals_hf(model_dir, hf_model, tokenizer, chat):
    prompt = "What is the capital of France? Explain in one sentence." if chat else "The three primary colors are"
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    ids = tokenizer.encode(text)
    hf_ids = hf_model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                               pad_token_id=2)[0, len(ids):].tolist()
    cmd = [sys.executable, "-m", "kvserve.services.cli", "generate", "--local", "--prompt", prompt,
           "--max-tokens", "24", "--temperature", "0", "--model", str(model_dir), "--num-pages", "16"]
    if chat:
        cmd.append("--chat")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout == tokenizer.decode(hf_ids) + "\n"
    assert len(hf_ids) > 3
