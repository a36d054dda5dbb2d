"""The chaos run's prompts and their reference outputs: HF transformers' greedy tokens, computed once at start.

The prompts are token ids (sent as prompt_token_ids, so that both sides see the same tokens); two share a
system prompt of several pages, so recomputed requests hit the prefix cache. The reference is HF's greedy
``generate`` (fp32, batch 1); none of the prompts reaches EOS within the tokens asked, so the load's
ignore_eos requests must give exactly these tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

SYSTEM = ("You are a careful assistant for an operating systems course. Answer in two or three plain sentences, "
          "define each term you use, and never invent facts about hardware you do not know.\n\n")
PROMPT_TEXTS = (
    "The history of the railway in Europe began",
    "A short guide to growing tomatoes at home:",
    "In mathematics, a prime number is",
    "The old lighthouse keeper looked out at the sea and",
    SYSTEM + "Question: what is a page table?\nAnswer:",
    SYSTEM + "Question: why does a cache need an eviction policy?\nAnswer:",
    "Once upon a time, in a small village by the river,",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
)


def prompt_token_ids(tokenizer) -> list[list[int]]:
    """PROMPT_TEXTS through kvserve's tokenizer (kvserve/common/tokenizer.py)."""
    return [list(tokenizer.encode(text)) for text in PROMPT_TEXTS]


def hf_greedy(model, prompt_ids: Sequence[int], max_tokens: int) -> list[int]:
    """HF transformers' ``generate``, greedy, batch 1, as tests/conftest.py's hf_greedy."""
    ids = torch.tensor([list(prompt_ids)])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def reference_outputs(model, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """The greedy tokens of each prompt, on one torch thread (batch 1 of a small model gains little from two, and
    on a shared 2-core machine OpenMP's threads wait on each other: 4x slower there). Raises ValueError if one
    stops at EOS before ``max_tokens``: the load asks for ignore_eos, so such a prompt has no reference."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        outputs = [hf_greedy(model, p, max_tokens) for p in prompts]
    finally:
        torch.set_num_threads(threads)
    short = [i for i, out in enumerate(outputs) if len(out) != max_tokens]
    if short:
        raise ValueError(f"prompts {short} reach EOS within {max_tokens} greedy tokens; the reference needs "
                         "prompts that do not")
    return outputs
