"""Which paged-attention backend a worker runs: by name, or "auto" for the best that applies to its device and
dtype. The interface is paged_attention.py's; each backend is a module of its own, and each has a small function
here that builds it or says why it cannot."""

from __future__ import annotations

import logging

import torch

from kvserve.kernels import cpu_paged, triton_paged
from kvserve.kernels.paged_attention import PagedAttentionBackend
from kvserve.kernels.reference import ReferenceBackend

log = logging.getLogger(__name__)


def get_backend(name: str, device: torch.device, dtype: torch.dtype = torch.float32,
                kv_dtype: str = "float32", page_size: int = 16) -> PagedAttentionBackend:
    """Returns the backend called ``name`` for a model of ``dtype`` on ``device`` over pages of ``kv_dtype`` and
    ``page_size`` tokens: "reference", "cpu" (the in-place kernels: float32 compute on CPU, over float32, int8 or
    fp8 pages), "triton" (the in-place Triton kernels: CUDA, or the CPU under TRITON_INTERPRET=1), "flash-attn"
    (CUDA, bf16/fp16: kvserve/kernels/flash_attn_backend.py), or "auto": on CPU "cpu" where it applies and builds, else
    "reference"; on CUDA "triton" where it runs, else "reference" (never flash-attn: it is untested on hardware).
    ValueError for a backend that cannot serve."""
    if name == "reference":
        return ReferenceBackend()
    if name == "triton":
        reason = _triton_reason(device, kv_dtype)
        if reason is not None:
            raise ValueError(f"the triton attention backend is not available: {reason}")
        return triton_paged.TritonBackend()
    if name == "flash-attn":
        return flash_attn_backend(device, dtype, kv_dtype, page_size)
    if name == "auto" and device.type == "cuda":
        return _auto_cuda(device, kv_dtype)
    if name in ("cpu", "auto"):
        return _cpu_or_reference(name, device, dtype, kv_dtype)
    raise ValueError(f"unknown attention backend {name!r}; known: reference, cpu, triton, flash-attn, auto")


def _cpu_or_reference(name: str, device: torch.device, dtype: torch.dtype, kv_dtype: str) -> PagedAttentionBackend:
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


def _triton_reason(device: torch.device, kv_dtype: str) -> str | None:
    """Why the triton backend cannot serve pages of ``kv_dtype`` on ``device``, or None."""
    if kv_dtype not in triton_paged.TritonBackend.kv_dtypes:
        return f"it reads {', '.join(triton_paged.TritonBackend.kv_dtypes)} pages, not {kv_dtype}"
    return triton_paged.unavailable_reason(device)


def _triton_backend(device: torch.device, kv_dtype: str) -> PagedAttentionBackend | None:
    """The triton backend (kvserve/kernels/triton_paged.py) when it runs on ``device`` over ``kv_dtype``, else None."""
    reason = _triton_reason(device, kv_dtype)
    if reason is not None:
        log.warning("attention backend: triton is not available (%s)", reason)
        return None
    return triton_paged.TritonBackend()


def _auto_cuda(device: torch.device, kv_dtype: str) -> PagedAttentionBackend:
    backend = _triton_backend(device, kv_dtype) or ReferenceBackend()
    log.info("attention backend auto on cuda: %s (flash-attn is never picked by auto: untested on hardware; "
             "--attention-backend flash-attn forces it)", backend.name)
    return backend


def flash_attn_backend(device: torch.device, dtype: torch.dtype, kv_dtype: str,
                       page_size: int) -> PagedAttentionBackend:
    """The flash-attn backend, its other ops from the triton backend where that imports. ValueError saying why
    not: not CUDA, a dtype or page format it does not read, flash-attn not importable, no kernel for this GPU
    and page size."""
    from kvserve.kernels import flash_attn_backend as fa

    if device.type != "cuda":
        raise ValueError(f"the flash-attn attention backend runs on CUDA, not {device}")
    if dtype not in fa.DTYPES or kv_dtype not in fa.FlashAttnBackend.kv_dtypes:
        raise ValueError(f"the flash-attn attention backend runs bfloat16 or float16 models over pages of the same "
                         f"dtype, not {dtype} over {kv_dtype} (--attention-backend triton or reference)")
    varlen, kvcache, why = fa.load_kernels()
    if varlen is None and kvcache is None:
        raise ValueError(f"the flash-attn attention backend is not available: {why} (pip install flash-attn-4)")
    kernel = fa.pick_kernel(varlen, kvcache, torch.cuda.get_device_capability(device), page_size, why)
    backend = fa.FlashAttnBackend(**kernel, ops=_triton_backend(device, kv_dtype))
    log.warning("attention backend: %s with %s ops (UNTESTED ON HARDWARE: no GPU run has compared it with the "
                "reference yet)", backend.kernel, backend.ops.name)
    return backend
