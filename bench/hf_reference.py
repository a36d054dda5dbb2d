"""The HF transformers side of the serving benchmark: what plain transformers does with the same workload, on CPU.

    python bench/hf_reference.py        # a tiny smoke run that prints JSON

Plain functions, meant to be imported by a benchmark driver:

- make_workload: a deterministic list of requests (prompt token ids, number of new tokens);
- hf_generate_serial: `model.generate()` one request at a time (the naive server);
- hf_generate_batch: transformers' own continuous batching (the paged `ContinuousBatchingManager` behind
  `model.generate_batch`), fed the whole workload at once;
- hf_ttft_s: the time to first token of `generate()`, no cache reuse;
- raw_forward_tokens_per_s: the batched decode forward pass with a DynamicCache, no scheduling at all: the ceiling
  a serving stack at 32-64 concurrent requests is compared against.

Everything is greedy, fp32, under `torch.inference_mode()`, timed with `time.perf_counter`. The model is the HF folder
of the default model, loaded as bench/bench_worker.py does (see `load_hf`).
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

SEED = 0

# Stdlib modules whose docstrings make the text prompts: stable for a Python version, and no download needed.
CORPUS_MODULES = ("argparse", "collections", "json", "logging", "pickle", "typing", "doctest", "decimal",
                  "dataclasses", "pathlib", "functools", "itertools", "textwrap", "string", "random", "inspect")


@dataclass(frozen=True)
class Workitem:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int


def load_hf(model_dir: Path | None = None):
    """The default model's HF folder (or `model_dir`) as an fp32 CausalLM in eval mode."""
    from transformers import AutoModelForCausalLM

    if model_dir is None:
        from kvserve.services.model_store import prepare_default_model

        model_dir = prepare_default_model(progress=False)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()


def corpus_token_ids(model_dir: Path | None = None) -> list[int]:
    """Real English text, tokenized: the docstrings of CORPUS_MODULES and of their public members (about 40k tokens).

    Pass the result as `make_workload(..., corpus=...)` for prompts that look like text.
    """
    from transformers import AutoTokenizer

    if model_dir is None:
        from kvserve.services.model_store import prepare_default_model

        model_dir = prepare_default_model(progress=False)
    parts = []
    with warnings.catch_warnings():  # typing.io and typing.re warn on access
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in CORPUS_MODULES:
            module = importlib.import_module(name)
            parts.append(inspect.cleandoc(module.__doc__ or ""))
            for attr in sorted(a for a in dir(module) if not a.startswith("_")):
                doc = getattr(getattr(module, attr, None), "__doc__", None)
                if isinstance(doc, str) and len(doc) > 200:
                    parts.append(inspect.cleandoc(doc))
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return [t for part in dict.fromkeys(parts)
            for t in tokenizer(part + "\n\n", add_special_tokens=False)["input_ids"]]


def make_workload(num_requests: int, seed: int, min_prompt: int = 32, max_prompt: int = 512, min_new: int = 16,
                  max_new: int = 128, vocab_lo: int = 100, vocab_hi: int = 40000,
                  corpus: Sequence[int] | None = None) -> list[Workitem]:
    """`num_requests` requests with uniform prompt lengths in [min_prompt, max_prompt] and new-token counts in
    [min_new, max_new], deterministic for `seed` (one `random.Random(seed)`).

    Prompts are windows of `corpus` at random offsets when it is given (see corpus_token_ids; it must hold at least
    max_prompt tokens), else random token ids in [vocab_lo, vocab_hi).
    """
    rng = random.Random(seed)
    if corpus is not None and len(corpus) < max_prompt:
        raise ValueError(f"corpus has {len(corpus)} tokens, fewer than max_prompt={max_prompt}")
    work = []
    for _ in range(num_requests):
        n_prompt, n_new = rng.randint(min_prompt, max_prompt), rng.randint(min_new, max_new)
        if corpus is None:
            prompt = tuple(rng.randrange(vocab_lo, vocab_hi) for _ in range(n_prompt))
        else:
            start = rng.randrange(len(corpus) - n_prompt + 1)
            prompt = tuple(int(t) for t in corpus[start:start + n_prompt])
        work.append(Workitem(prompt, n_new))
    return work


def _pad_id(model) -> int:
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.config.eos_token_id
    return int(pad[0] if isinstance(pad, list) else pad) if pad is not None else 0


def _generate_one(model, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=_pad_id(model))
    return out[0, ids.shape[1]:].tolist()


def _result(outputs: list[list[int]], wall_s: float, **extra) -> dict:
    tokens = sum(len(o) for o in outputs)
    return {"generated_tokens": tokens, "wall_s": wall_s, "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
            **extra, "outputs": outputs}


def hf_generate_serial(model, work: Sequence[Workitem], warmup: bool = True) -> dict:
    """`model.generate()` one request at a time, greedy, exactly `max_new_tokens` each.

    `min_new_tokens = max_new_tokens` keeps EOS from ending a request early; note that HF does it by masking EOS out
    of the logits until then, where an ignore_eos server would emit EOS as an ordinary token and go on: the two agree
    token for token unless greedy decoding picks EOS. `warmup` runs one untimed 2-token generate first.
    """
    torch.manual_seed(SEED)
    with torch.inference_mode():
        if warmup and work:
            _generate_one(model, work[0].prompt_ids[:8], 2)
        t0 = time.perf_counter()
        outputs = [_generate_one(model, item.prompt_ids, item.max_new_tokens) for item in work]
        wall = time.perf_counter() - t0
    return _result(outputs, wall)


def _cb_configs(model, work: Sequence[Workitem], max_new_tokens: int, page_size: int, max_batch_tokens: int,
                num_blocks: int | None):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    # eos_token_id=-1 disables stopping at EOS (the CB equivalent of ignore_eos); no sampling, no logits processors.
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1,
                           pad_token_id=_pad_id(model))
    if num_blocks is None:  # just enough pages for every request at once, so nothing is ever evicted
        num_blocks = sum(-(-(len(w.prompt_ids) + max_new_tokens) // page_size) for w in work) + 2
    cb = ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                  allow_block_sharing=False, auto_switch_to_flash=False)
    return gen, cb


def _match(outputs: list[list[int]], reference: Sequence[Sequence[int]]) -> dict:
    """Exact-match fraction against `reference` (in order, over the first len(reference) requests), and the mean
    fraction of tokens before the first difference."""
    pairs = list(zip(outputs, reference, strict=False))
    if not pairs:
        return {}
    prefix = []
    for out, ref in pairs:
        same = next((i for i, (a, b) in enumerate(zip(out, ref, strict=False)) if a != b), min(len(out), len(ref)))
        prefix.append(same / max(len(ref), 1))
    return {"match_serial": sum(list(o) == list(r) for o, r in pairs) / len(pairs),
            "match_serial_prefix": sum(prefix) / len(prefix), "match_serial_checked": len(pairs)}


def hf_generate_batch(model, work: Sequence[Workitem], *, per_request_lengths: bool = True, page_size: int = 256,
                      max_batch_tokens: int = 1024, num_blocks: int | None = None, check_serial: int = 0,
                      reference_outputs: Sequence[Sequence[int]] | None = None) -> dict:
    """transformers' own continuous batching over the whole workload, greedy, exactly `max_new_tokens` each.

    How it is driven. `model.generate_batch(inputs, generation_config, continuous_batching_config)` takes ONE
    max_new_tokens for all requests (a kwarg or `GenerationConfig.max_new_tokens`); the manager underneath takes one
    per request (`ContinuousBatchingManager.add_request(max_new_tokens=...)`). So:

    - per_request_lengths=True (default): the same steps as generate_batch (`model.continuous_batching_context_manager`
      with the same workload hints, then submit, then collect), but each request is added with its own
      max_new_tokens. wall_s runs from the first submission to the last result; the manager's setup (paged cache
      allocation, warm-up forward) is reported apart as setup_s, as a serving process would have done it at start.
    - per_request_lengths=False: a literal `model.generate_batch(...)` call with max_new_tokens = the largest in the
      workload; every request runs that long and is cut to its own length afterwards. generated_tokens counts only
      the tokens the requests asked for (computed_tokens counts them all), so tokens_per_s is penalised by the
      wasted decode steps; wall_s covers the whole call, setup included.

    Configuration on CPU: the model keeps `attn_implementation="sdpa"` (what it loads with); the manager accepts
    sdpa, "paged|eager" (it switches eager to that by itself) or flash kernels, and flash is CUDA only, so
    auto_switch_to_flash is off. Its sdpa path attends over the flattened batch with a dense [q, kv] mask, so
    attention cost grows with the sum of the contexts in a step, not each request's own. EOS stopping is off
    (eos_token_id=-1); nothing masks EOS, unlike the serial min_new_tokens. The cache is sized to the workload
    (num_blocks pages of page_size tokens, every request fits at once) instead of 60% of the machine's RAM, which is
    the CPU default; prefix sharing (allow_block_sharing) is off, the prompts share no prefixes anyway.
    max_batch_tokens bounds the tokens of one forward (prefill is chunked to it).

    check_serial > 0 also runs `generate()` on the first check_serial requests (untimed) and reports match_serial
    (exact-match fraction), match_serial_prefix (mean fraction of tokens before the first difference);
    reference_outputs (e.g. hf_generate_serial(...)["outputs"]) does the same without rerunning them.
    """
    torch.manual_seed(SEED)
    if not work:
        return _result([], 0.0)
    longest = max(w.max_new_tokens for w in work)
    inputs = [list(w.prompt_ids) for w in work]
    extra: dict = {"per_request_lengths": per_request_lengths, "page_size": page_size,
                   "max_batch_tokens": max_batch_tokens}
    with torch.inference_mode():
        if per_request_lengths:
            outputs, wall, extra["setup_s"] = _run_manager(model, work, longest, page_size, max_batch_tokens,
                                                           num_blocks)
        else:
            gen, cb = _cb_configs(model, work, longest, page_size, max_batch_tokens, num_blocks)
            t0 = time.perf_counter()
            results = model.generate_batch(inputs, generation_config=gen, continuous_batching_config=cb)
            wall = time.perf_counter() - t0
            ordered = list(results.values())
            if len(ordered) != len(work) or any(r.error for r in ordered):
                raise RuntimeError(f"generate_batch returned {len(ordered)}/{len(work)} results or errors")
            extra["computed_tokens"] = sum(len(r.generated_tokens) for r in ordered)
            outputs = [list(r.generated_tokens[:w.max_new_tokens]) for r, w in zip(ordered, work, strict=True)]
        if reference_outputs is None and check_serial > 0:
            reference_outputs = [_generate_one(model, w.prompt_ids, w.max_new_tokens) for w in work[:check_serial]]
    if reference_outputs is not None:
        extra.update(_match(outputs, reference_outputs))
    return _result(outputs, wall, **extra)


def _run_manager(model, work, longest, page_size, max_batch_tokens, num_blocks) -> tuple[list[list[int]], float, float]:
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen, cb = _cb_configs(model, work, longest, page_size, max_batch_tokens, num_blocks)
    hints = WorkloadHints(max_prompt_length=max(len(w.prompt_ids) for w in work), max_generated_length=longest,
                          num_requests=len(work))
    t_setup = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb, block=True,
                                                   timeout=30, workload_hints=hints) as manager:
        t0 = time.perf_counter()
        ids = [manager.add_request(list(w.prompt_ids), request_id=f"req_{i}", max_new_tokens=w.max_new_tokens,
                                   eos_token_id=-1) for i, w in enumerate(work)]
        done: dict = {}
        while len(done) < len(work):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError(f"continuous batching stopped with {len(done)}/{len(work)} requests done")
        wall = time.perf_counter() - t0
    setup = t0 - t_setup
    failed = [i for i in ids if done[i].error]
    if failed:
        raise RuntimeError(f"continuous batching failed requests {failed}: {done[failed[0]].error}")
    return [list(done[i].generated_tokens) for i in ids], wall, setup


def hf_ttft_s(model, prompt_ids: Sequence[int]) -> float:
    """Time to first token of HF generate, no cache reuse: the wall time of `generate(max_new_tokens=1)`."""
    torch.manual_seed(SEED)
    with torch.inference_mode():
        t0 = time.perf_counter()
        _generate_one(model, prompt_ids, 1)
        return time.perf_counter() - t0


def raw_forward_tokens_per_s(model, batch: int, context: int, steps: int, seed: int = SEED) -> float:
    """HF's raw batched decode: prefill `batch` random sequences of `context` tokens into a DynamicCache (untimed),
    then time `steps` single-token forwards of the whole batch, each fed the previous step's greedy tokens.
    Returns batch * steps / time. No sampling loop, no scheduling, no padding: the ceiling to compare against."""
    from transformers.cache_utils import DynamicCache

    torch.manual_seed(seed)
    ids = torch.randint(100, 40000, (batch, context), generator=torch.Generator().manual_seed(seed))
    cache = DynamicCache()
    with torch.inference_mode():
        logits = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits
        tokens = logits[:, -1].argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for _ in range(steps):
            logits = model(tokens, cache=cache, use_cache=True).logits
            tokens = logits[:, -1].argmax(-1, keepdim=True)
        wall = time.perf_counter() - t0
    return batch * steps / wall


def _smoke() -> dict:
    timings: dict[str, float] = {}

    def timed(name, fn):
        t0 = time.perf_counter()
        out = fn()
        timings[name] = round(time.perf_counter() - t0, 2)
        return out

    model = timed("load_s", load_hf)
    corpus = timed("corpus_s", corpus_token_ids)
    work = make_workload(3, seed=1, min_prompt=32, max_prompt=64, min_new=8, max_new=16, corpus=corpus)
    serial = timed("serial_s", lambda: hf_generate_serial(model, work))
    batch = timed("batch_s", lambda: hf_generate_batch(model, work, reference_outputs=serial["outputs"]))
    plain = timed("generate_batch_s", lambda: hf_generate_batch(model, work, per_request_lengths=False,
                                                                reference_outputs=serial["outputs"]))
    ttft = timed("ttft_call_s", lambda: hf_ttft_s(model, work[0].prompt_ids))
    raw = timed("raw_forward_s", lambda: raw_forward_tokens_per_s(model, batch=4, context=64, steps=8))

    def brief(r):
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "outputs"}

    return {"corpus_tokens": len(corpus),
            "workload": [{"prompt": len(w.prompt_ids), "new": w.max_new_tokens} for w in work],
            "serial": brief(serial), "batch": brief(batch), "generate_batch": brief(plain),
            "ttft_s": round(ttft, 4), "raw_forward_tok_s_b4_c64": round(raw, 1), "timings_s": timings}


if __name__ == "__main__":
    print(json.dumps(_smoke(), indent=2))
