"""Workloads driven through the OpenAI protocol (the official `openai` client, streaming completions, greedy,
``ignore_eos``), so that kvserve and any OpenAI server (vLLM) are measured by the same client code:

  burst      every request at once; generated tokens / wall time, TTFT and TPOT medians, and on request each
             completion's text (for the greedy agreement between servers)
  prefix     one ~2,000-token system prompt and 10 user turns after it, one at a time: TTFT of the first against
             the mean of the rest, and the cached prompt tokens the server reports (prompt_tokens_details)
  latency    closed-loop clients (1, 4, 16), each sending its requests one after another: TTFT and TPOT percentiles
  long       one long prompt, fresh: TTFT and TPOT
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time

import openai

CLIENT_COUNTS = (1, 4, 16)


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered) + 0.5) - 1))]


def _client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=3600)


async def stream_one(client: openai.AsyncOpenAI, model: str, text: str, max_tokens: int) -> dict:
    """One streamed greedy completion: its text, token count, TTFT, TPOT and the cached prompt tokens."""
    t0 = time.perf_counter()
    times, parts, usage = [], [], None
    chunks = await client.completions.create(model=model, prompt=text, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    async for chunk in chunks:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
            parts.append(chunk.choices[0].text)
        usage = chunk.usage or usage
    n = usage.completion_tokens
    details = usage.prompt_tokens_details
    return {"text": "".join(parts), "tokens": n, "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": (details.cached_tokens or 0) if details else 0,
            "ttft_s": times[0] - t0, "tpot_s": (times[-1] - times[0]) / (n - 1) if n > 1 else 0.0}


def burst(base_url: str, model: str, jobs: list[tuple[str, int]], texts: bool = False) -> dict:
    """Every job at once: tokens / wall time, TTFT and TPOT medians, and with ``texts`` the completions in job
    order (for ``agreement``)."""
    async def run():
        async with _client(base_url) as client:
            t0 = time.perf_counter()
            results = await asyncio.gather(*(stream_one(client, model, t, n) for t, n in jobs))
            return results, time.perf_counter() - t0

    results, wall = asyncio.run(run())
    tokens = sum(r["tokens"] for r in results)
    return {"generated_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_s": statistics.median(r["ttft_s"] for r in results),
            "tpot_p50_s": statistics.median(r["tpot_s"] for r in results),
            **({"texts": [r["text"] for r in results]} if texts else {})}


def _sequential(base_url: str, model: str, jobs: list[tuple[str, int]]) -> list[dict]:
    async def run():
        async with _client(base_url) as client:
            return [await stream_one(client, model, t, n) for t, n in jobs]

    return asyncio.run(run())


def prefix(base_url: str, model: str, prompts: list[str], max_tokens: int = 4) -> dict:
    """The prompts one after another (after a short warm-up): the first computes the shared system prompt,
    the rest can reuse it."""
    _sequential(base_url, model, [("warm up", 2)])
    runs = _sequential(base_url, model, [(p, max_tokens) for p in prompts])
    rest = [r["ttft_s"] for r in runs[1:]]
    return {"ttft_first_s": runs[0]["ttft_s"], "ttft_rest_mean_s": statistics.mean(rest),
            "rest_over_first": statistics.mean(rest) / runs[0]["ttft_s"],
            "prompt_tokens": runs[0]["prompt_tokens"],
            "cached_tokens_rest_mean": statistics.mean(r["cached_tokens"] for r in runs[1:])}


def latency(base_url: str, model: str, prompts: list[str], clients: int, per_client: int, max_tokens: int) -> dict:
    """``clients`` closed-loop clients, each sending ``per_client`` requests one after another."""
    async def client_loop(client, i: int) -> list[dict]:
        return [await stream_one(client, model, prompts[(i * per_client + j) % len(prompts)], max_tokens)
                for j in range(per_client)]

    async def run():
        async with _client(base_url) as client:
            return await asyncio.gather(*(client_loop(client, i) for i in range(clients)))

    runs = [r for rs in asyncio.run(run()) for r in rs]
    ttft, tpot = [r["ttft_s"] for r in runs], [r["tpot_s"] for r in runs]
    return {"clients": clients, "requests": len(runs),
            **{f"ttft_p{p}_s": percentile(ttft, p) for p in (50, 90, 99)},
            **{f"tpot_p{p}_s": percentile(tpot, p) for p in (50, 90, 99)}}


def long_prompt(base_url: str, model: str, text: str, max_tokens: int) -> dict:
    run = _sequential(base_url, model, [(text, max_tokens)])[0]
    return {"ttft_s": run["ttft_s"], "tpot_s": run["tpot_s"], "prompt_tokens": run["prompt_tokens"],
            "cached_tokens": run["cached_tokens"]}


def agreement(texts_a: list[str], texts_b: list[str]) -> dict:
    """How many greedy completions two servers agree on exactly, and for the others the length of the common
    prefix of their texts (in characters) against the shorter text."""
    same = sum(a == b for a, b in zip(texts_a, texts_b, strict=True))
    prefixes = [_common_prefix(a, b) / max(1, min(len(a), len(b)))
                for a, b in zip(texts_a, texts_b, strict=True) if a != b]
    return {"identical": same, "of": len(texts_a),
            "differing_common_prefix_median": statistics.median(prefixes) if prefixes else None}


def _common_prefix(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))
