"""The KV page pool: one zero-initialised tensor holding every page of every layer, and for a quantised pool with
per-(token, kv head) scales, one beside it holding those scales. A worker with page groups (page_groups.py) has
two such pools, each of its group's layers only (``num_layers``).

Layout ``[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]`` in the pool's element type (float32,
bfloat16, float16, or the 1-byte int8 / fp8 of kvserve/kernels/kv_quant.py), and the scales
``[num_layers, 2, num_pages, page_size, num_kv_heads]`` float32. Together their ``nbytes`` are exactly
``bytes_per_token * page_size * num_pages`` with kvserve kv-mem's
``bytes_per_token = 2 * num_layers * num_kv_heads * (head_dim * element_bytes + scale_bytes)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.kernels.kv_quant import FORMAT_OF_DTYPE, SCALE_SCHEMES, KVFormat, kv_format
from kvserve.worker.config import ModelConfig

SCALE_BYTES = 4  # one float32 scale


@dataclass(frozen=True, slots=True)
class PoolSize:
    """Size of a page pool, decided before the tensors are allocated."""

    num_pages: int
    page_size: int
    fmt: KVFormat
    kv_scales: str  # "token_head" or "tensor" for a quantised format, "" for the others
    bytes_per_token: int
    num_layers: int  # the layers whose K/V it holds: the model's, or a page group's

    @property
    def dtype(self) -> torch.dtype:
        return self.fmt.dtype

    @property
    def stores_scales(self) -> bool:
        return self.kv_scales == "token_head"

    @property
    def page_bytes(self) -> int:
        return self.bytes_per_token * self.page_size

    @property
    def pool_bytes(self) -> int:
        return self.page_bytes * self.num_pages


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def check_kv_format(kv_cache_dtype: str, kv_scales: str) -> None:
    """ValueError, naming the known values, for an unknown ``--kv-cache-dtype`` (``auto`` aside) or ``--kv-scales``."""
    if kv_cache_dtype != "auto":
        kv_format(kv_cache_dtype)
    if kv_scales not in SCALE_SCHEMES:
        raise ValueError(f"unknown KV scales {kv_scales!r}; known: {', '.join(SCALE_SCHEMES)}")


def size_pool(
    cfg: ModelConfig,
    kv: torch.dtype | str | KVFormat,
    page_size: int,
    *,
    kv_scales: str = "token_head",
    kv_cache_bytes: int | None = None,
    num_pages: int | None = None,
    num_layers: int | None = None,
) -> PoolSize:
    """Sizes the pool of element type ``kv`` (a torch dtype, a format name or a format) from a byte budget (rounded
    down to whole pages) or an explicit page count. ``kv_scales`` applies to quantised formats only.
    ``num_layers``: a pool of that many of the model's layers (a page group's; default all of them).

    Raises ValueError when neither or both are given, when the budget holds no page, or on an unknown format or
    scale scheme.
    """
    fmt = kv if isinstance(kv, KVFormat) else FORMAT_OF_DTYPE[kv] if isinstance(kv, torch.dtype) else kv_format(kv)
    check_kv_format(fmt.name, kv_scales)
    if (kv_cache_bytes is None) == (num_pages is None):
        raise ValueError("give exactly one of kv_cache_bytes and num_pages")
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    scales = kv_scales if fmt.quantised else ""
    num_layers = cfg.num_layers if num_layers is None else num_layers
    per_token = cfg.kv_bytes_per_token(dtype_bytes(fmt.dtype), SCALE_BYTES if scales == "token_head" else 0,
                                       num_layers)
    if num_pages is None:
        num_pages = kv_cache_bytes // (per_token * page_size)
    if num_pages <= 0:
        raise ValueError(
            f"the KV budget holds no page: one page of {page_size} tokens needs {per_token * page_size} bytes"
        )
    return PoolSize(num_pages=num_pages, page_size=page_size, fmt=fmt, kv_scales=scales, bytes_per_token=per_token,
                    num_layers=num_layers)


def kv_planes(cfg: ModelConfig) -> int:
    """2 (K and V) per layer; 1 for MLA, whose one plane holds the latent and rope key (worker/mla_config.py)."""
    return 1 if cfg.mla is not None else 2


def allocate_pool(cfg: ModelConfig, size: PoolSize, device: torch.device) -> torch.Tensor:
    """The pool's elements, zero-initialised, shaped as in the module docstring."""
    shape = (size.num_layers, kv_planes(cfg), size.num_pages, size.page_size, cfg.num_kv_heads, cfg.head_dim)
    return torch.zeros(shape, dtype=size.dtype, device=device)


def allocate_scales(cfg: ModelConfig, size: PoolSize, device: torch.device) -> torch.Tensor | None:
    """The pool's per-(token, kv head) scales, ones (a zero page dequantises to zeros either way), or None when the
    pool stores none."""
    if not size.stores_scales:
        return None
    shape = (size.num_layers, kv_planes(cfg), size.num_pages, size.page_size, cfg.num_kv_heads)
    return torch.ones(shape, dtype=torch.float32, device=device)
