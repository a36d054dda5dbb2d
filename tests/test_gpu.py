"""CUDA checks: run only where a GPU is present (the device machine); skipped elsewhere."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.kernels.paged_attention import build_metadata, write_kv
from kvserve.kernels.reference import ReferenceBackend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_reference_backend_on_cuda_matches_cpu(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    lengths, cached, page_size, heads, kv_heads, dim = [40, 17, 1], [16, 0, 0], 16, 8, 2, 64
    tables = [[5, 1, 7], [2, 3], [0]]
    outs = {}
    tensors = [(torch.randn(n, heads, dim, generator=gen), torch.randn(n, kv_heads, dim, generator=gen),
                torch.randn(n, kv_heads, dim, generator=gen)) for n in lengths]
    for device in ("cpu", "cuda"):
        cache = torch.zeros(2, 8, page_size, kv_heads, dim, device=device, dtype=dtype if device == "cuda" else
                            torch.float32)
        for (_, k, v), table, c in zip(tensors, tables, cached, strict=True):
            if c:
                meta = build_metadata([0], [c], [table], page_size, torch.device(device))
                write_kv(k[:c].to(device), v[:c].to(device), cache, meta.slot_mapping)
        meta = build_metadata(cached, [n - c for n, c in zip(lengths, cached, strict=True)], tables, page_size,
                              torch.device(device))
        q, k, v = (torch.cat([t[i][c:] for t, c in zip(tensors, cached, strict=True)]).to(device)
                   for i in range(3))
        if device == "cuda":
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        backend = ReferenceBackend()
        outs[device] = backend.forward(q, k, v, cache, meta, backend.prepare(meta), 1 / math.sqrt(dim))
    torch.testing.assert_close(outs["cuda"].float().cpu(), outs["cpu"], rtol=tol, atol=tol)


def test_runner_on_cuda_fp32_matches_cpu(model_dir, runner):
    from kvserve.common.wire.worker import StepBatch, StepItem
    from kvserve.worker.runner import ModelRunner, RunnerConfig

    gpu = ModelRunner(RunnerConfig(model_dir=model_dir, num_pages=16, device="cuda", dtype="float32"))
    assert gpu.info.device.startswith("cuda") and gpu.kv_cache.nbytes == gpu.info.pool_bytes
    prompt = tuple(range(200, 237))
    outs = []
    for r in (runner, gpu):
        table = (0, 1, 2, 3)
        tokens = [r.step(StepBatch((StepItem("g", prompt, 0, table),))).sampled[0].token_id]
        for i in range(7):
            out = r.step(StepBatch((StepItem("g", (tokens[-1],), len(prompt) + i, table),)))
            tokens.append(out.sampled[0].token_id)
        outs.append(tokens)
    assert outs[0] == outs[1]
