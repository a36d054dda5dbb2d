"""The KV page pool: one zero-initialised tensor holding every page of every layer.

Layout ``[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]``; its ``nbytes`` is exactly
``bytes_per_token * page_size * num_pages`` with
``bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * dtype_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.worker.config import ModelConfig


@dataclass(frozen=True, slots=True)
class PoolSize:
    """Size of a page pool, decided before the tensor is allocated."""

    num_pages: int
    page_size: int
    dtype: torch.dtype
    bytes_per_token: int

    @property
    def page_bytes(self) -> int:
        return self.bytes_per_token * self.page_size

    @property
    def pool_bytes(self) -> int:
        return self.page_bytes * self.num_pages


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def size_pool(
    cfg: ModelConfig,
    dtype: torch.dtype,
    page_size: int,
    *,
    kv_cache_bytes: int | None = None,
    num_pages: int | None = None,
) -> PoolSize:
    """Sizes the pool from a byte budget (rounded down to whole pages) or an explicit page count.

    Raises ValueError when neither or both are given, or when the budget holds no page.
    """
    if (kv_cache_bytes is None) == (num_pages is None):
        raise ValueError("give exactly one of kv_cache_bytes and num_pages")
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    per_token = cfg.kv_bytes_per_token(dtype_bytes(dtype))
    if num_pages is None:
        num_pages = kv_cache_bytes // (per_token * page_size)
    if num_pages <= 0:
        raise ValueError(
            f"the KV budget holds no page: one page of {page_size} tokens needs {per_token * page_size} bytes"
        )
    return PoolSize(num_pages=num_pages, page_size=page_size, dtype=dtype, bytes_per_token=per_token)


def allocate_pool(cfg: ModelConfig, size: PoolSize, device: torch.device) -> torch.Tensor:
    """The pool tensor, zero-initialised, shaped as in the module docstring."""
    shape = (cfg.num_layers, 2, size.num_pages, size.page_size, cfg.num_kv_heads, cfg.head_dim)
    return torch.zeros(shape, dtype=size.dtype, device=device)
