"""Which paged-attention backend a worker runs: by name, or "auto" for the best that applies to its device and
dtype. The interface is paged_attention.py's; each backend is a module of its own."""

from __future__ import annotations

import logging

import torch

from kvserve.kernels import cpu_paged, triton_paged
from kvserve.kernels.paged_attention import PagedAttentionBackend
from kvserve.kernels.reference import ReferenceBackend

log = logging.getLogger(__name__)


def get_backend(name: str, device: torch.device, dtype: torch.dtype = torch.float32,
                kv_dtype: str = "float32") -> PagedAttentionBackend:
    """Returns the backend called ``name`` for a model of ``dtype`` on ``device`` over pages of ``kv_dtype``:
    "reference", "cpu" (the in-place kernels: float32 compute on CPU, over float32, int8 or fp8 pages),
    "triton" (the in-place Triton kernels: CUDA, or the CPU under TRITON_INTERPRET=1), or "auto": on CUDA
    "triton" when triton imports, on CPU "cpu" where it applies and builds, else "reference". ValueError for a
    backend that cannot serve."""
    if name == "reference":
        return ReferenceBackend()
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        reason = triton_paged.unavailable_reason(device)
        if reason is None:
            if name == "auto":
                log.info("attention backend: triton (auto on %s)", device)
            return triton_paged.TritonBackend()
        if name == "triton":
            raise ValueError(f"the triton attention backend is not available: {reason}")
        log.warning("attention backend: triton is not available (%s); using the reference", reason)
        return ReferenceBackend()
    if name in ("cpu", "auto"):
        kinds = cpu_paged.CPUPagedBackend.kv_dtypes
        applies = device.type == "cpu" and dtype == torch.float32 and kv_dtype in kinds
        reason = cpu_paged.unavailable_reason() if applies else (
            f"it reads {', '.join(kinds)} pages, not {kv_dtype}" if kv_dtype not in kinds else
            f"it runs float32 on CPU, not {dtype} on {device}")
        if reason is None:
            return cpu_paged.CPUPagedBackend()
        if name == "cpu":
            raise ValueError(f"the cpu attention backend is not available: {reason} (--attention-backend "
                             f"reference serves every KV cache dtype)")
        if applies:
            log.warning("attention backend: the cpu kernel is not available (%s); using the reference", reason)
        return ReferenceBackend()
    raise ValueError(f"unknown attention backend {name!r}; known: reference, cpu, triton, auto")
