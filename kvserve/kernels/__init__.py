"""Paged-attention kernels: one interface (paged_attention.py), several backends (reference.py, cpu_paged.py),
chosen by backends.get_backend; plus rotary embeddings.

The KV cache of one layer is a tensor ``[2, num_pages, page_size, num_kv_heads, head_dim]`` (K then V).
Backends read and write it through the slot arithmetic in :mod:`kvserve.kernels.paged_attention`.
"""
