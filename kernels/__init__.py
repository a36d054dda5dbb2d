"""Paged-attention kernels: one interface, several backends, plus rotary embeddings.

The KV cache of one layer is a tensor ``[2, num_pages, page_size, num_kv_heads, head_dim]`` (K then V).
Backends read and write it through the slot arithmetic in :mod:`kvserve.kernels.paged_attention`.
"""

from kvserve.kernels.paged_attention import (
    AttentionMetadata,
    PagedAttentionBackend,
    build_metadata,
    get_backend,
)

__all__ = ["AttentionMetadata", "PagedAttentionBackend", "build_metadata", "get_backend"]
