"""Paged-attention checks for bench/gpu_check.py: each available backend against the reference on one mixed step,
and decode attention bandwidth (bytes of K/V read per second of kernel time) against the chip's HBM bandwidth.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from kvserve.kernels.backends import get_backend
from kvserve.kernels.paged_attention import build_metadata, write_kv

# HBM bandwidth of an NVIDIA H200 SXM: 4.8 TB/s (NVIDIA H200 Tensor Core GPU datasheet).
H200_HBM_BYTES_PER_S = 4.8e12
BACKEND_NAMES = ("reference", "triton", "flash-attn")


def available_backends(device: torch.device, dtype: torch.dtype) -> dict[str, object]:
    """{name: backend} for every backend that serves this device and dtype; {name: why not} for the others."""
    kv = str(dtype).removeprefix("torch.")
    out = {}
    for name in BACKEND_NAMES:
        try:
            if name == "triton":
                from kvserve.kernels.triton_paged import TritonBackend
                out[name] = TritonBackend()
            else:
                out[name] = get_backend(name, device, dtype, kv)
        except (ImportError, ValueError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def mixed_step(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
               page_size: int, seed: int = 0):
    """A step of a fresh prefill, a chunk on cached tokens and decodes across page boundaries, with their
    cached prefixes in a fresh cache: (cache, meta, q, k, v)."""
    lengths, cached = [70, 100, 17, 16, 1, 300], [0, 64, 16, 15, 0, 299]
    gen = torch.Generator().manual_seed(seed)
    tables, used = [], 0
    for n in lengths:
        tables.append(list(range(used, used + -(-n // page_size))))
        used += len(tables[-1])
    cache = torch.zeros(2, used + 1, page_size, kv_heads, head_dim, dtype=dtype, device=device)
    new = []
    for n, c, table in zip(lengths, cached, tables, strict=True):
        q, k, v = (torch.randn(n, h, head_dim, generator=gen).to(device, dtype) for h in (heads, kv_heads, kv_heads))
        if c:
            write_kv(k[:c], v[:c], cache, build_metadata([0], [c], [table], page_size, device).slot_mapping)
        new.append((q[c:], k[c:], v[c:]))
    meta = build_metadata(cached, [n - c for n, c in zip(lengths, cached, strict=True)], tables, page_size, device)
    return (cache, meta, *(torch.cat([t[i] for t in new]) for i in range(3)))


def backend_errors(device: torch.device, dtype: torch.dtype, head_dim: int = 128) -> dict[str, dict]:
    """Max abs difference of each backend's output from the reference's on one mixed step (GQA 32/8)."""
    backends = available_backends(device, dtype)
    scale = 1 / math.sqrt(head_dim)
    results = {}
    outputs = {}
    for name, backend in backends.items():
        if isinstance(backend, str):
            results[name] = {"available": False, "why": backend}
            continue
        cache, meta, q, k, v = mixed_step(device, dtype, 32, 8, head_dim, 16)
        try:
            outputs[name] = backend.forward(q, k, v, cache, meta, backend.prepare(meta), scale).float()
        except Exception as e:  # a backend that fails on the GPU is a finding, not the end of the check
            results[name] = {"available": True, "error": f"{type(e).__name__}: {e}"}
    for name, out in outputs.items():
        err = (out - outputs["reference"]).abs().max().item()
        results[name] = {"available": True, "max_abs_err": err, "backend": backends[name].name}
    return results


def timed_ms(fn, device: torch.device, repeats: int) -> float:
    """Median time of ``fn()`` in ms: CUDA events around each call on a GPU, perf_counter on CPU."""
    fn()  # warm-up: compiles kernels
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def decode_bandwidth(backend, device: torch.device, dtype: torch.dtype, context: int, batch: int,
                     heads: int = 32, kv_heads: int = 8, head_dim: int = 128, page_size: int = 16,
                     repeats: int = 10, hbm_bytes_per_s: float = H200_HBM_BYTES_PER_S) -> dict:
    """One layer's decode attention of ``batch`` sequences at ``context`` tokens over scattered pages: kernel
    time (forward: the new token's K/V write and the attention; prepare is per step, outside), the K/V bytes
    read, GB/s and the share of HBM bandwidth."""
    pages_per_seq = -(-context // page_size)
    num_pages = batch * pages_per_seq + 1
    gen = torch.Generator().manual_seed(context + batch)
    perm = torch.randperm(num_pages, generator=gen)
    tables = perm[:batch * pages_per_seq].view(batch, pages_per_seq).tolist()
    cache = torch.randn(2, num_pages, page_size, kv_heads, head_dim, device=device, dtype=dtype)  # drawn there
    meta = build_metadata([context - 1] * batch, [1] * batch, tables, page_size, device)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
    k = torch.randn(batch, kv_heads, head_dim, device=device, dtype=dtype)
    state = backend.prepare(meta)
    ms = timed_ms(lambda: backend.forward(q, k, k, cache, meta, state, 1 / math.sqrt(head_dim)), device, repeats)
    kv_bytes = batch * context * kv_heads * head_dim * 2 * cache.element_size()
    gbps = kv_bytes / (ms / 1000) / 1e9
    return {"context": context, "batch": batch, "ms": ms, "kv_bytes": kv_bytes, "gb_per_s": gbps,
            "hbm_share": gbps * 1e9 / hbm_bytes_per_s}
