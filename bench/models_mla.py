"""MLA's two attention modes (kvserve/worker/mla.py) timed against each other: one layer's attention for a batch-1
decode step over a paged latent pool, at each context length, at DeepSeek-V2-Lite's attention shape (16 heads,
kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128). The figures decided the decoder's DEFAULT_MODE; make
bench-models (bench/bench_models.py) runs this and reports them, results in bench/results/models-<date>.*.

Decompress up-projects every cached token's latent into the heads' keys and values each step (context x 512 x
4096 multiply-adds per layer), absorbed only the one query and its output (16 x 128 x 512 twice).

    .venv/bin/python bench/models_mla.py            # prints the dict as JSON
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from kvserve.worker.mla import ATTEND, MODES, SeqSpan
from kvserve.worker.mla_config import MLAParams

V2_LITE = dict(num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def time_modes(context_lens: tuple[int, ...] = (1024, 4096), *, num_heads: int = 16, kv_lora_rank: int = 512,
               qk_nope_head_dim: int = 128, qk_rope_head_dim: int = 64, v_head_dim: int = 128, page_size: int = 16,
               repeats: int = 20, seed: int = 0) -> dict:
    """Median milliseconds of one layer's MLA attention (attend only: the projections around it are the same in
    both modes) for one sequence decoding one token after ``context_len - 1`` cached ones, per mode and context:
    ``{"absorbed": {1024: ms, ...}, "decompress": {...}, "shape": {...}}``."""
    mla = MLAParams(q_lora_rank=None, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
                    qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim, rope_interleave=True,
                    interleave_output=True, softmax_scale=(qk_nope_head_dim + qk_rope_head_dim) ** -0.5)
    g = torch.Generator().manual_seed(seed)
    kv_b = torch.randn(num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank, generator=g) * 0.02
    q_nope = torch.randn(1, num_heads, qk_nope_head_dim, generator=g)
    q_rope = torch.randn(1, num_heads, qk_rope_head_dim, generator=g)
    result: dict = {mode: {} for mode in MODES}
    for context in context_lens:
        num_pages = (context + page_size - 1) // page_size
        cache = torch.randn(1, num_pages, page_size, 1, mla.latent_dim, generator=g)
        span = SeqSpan(0, 1, context - 1, context, torch.randperm(num_pages, generator=g))
        for mode in MODES:
            args = (q_nope, q_rope, kv_b, cache, None, [span], mla)
            result[mode][context] = _median_ms(lambda f=ATTEND[mode], a=args: f(*a), repeats)
    result["shape"] = dict(num_heads=num_heads, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
                           qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim, page_size=page_size,
                           threads=torch.get_num_threads())
    return result


def _median_ms(fn, repeats: int) -> float:
    with torch.inference_mode():
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(times), 3)


if __name__ == "__main__":
    print(json.dumps(time_modes(**V2_LITE), indent=1))
