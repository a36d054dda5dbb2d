"""The prefix index's hash chain over full pages.

    h_0 = seed(ns)          ns = (scheme version, tenant, model fingerprint, KV dtype, page size[, KV scales]
                                  [, sliding window, attention sinks])
    h_i = xxh3_128(h_{i-1} || tokens of page i as little-endian uint32)

The same tokens under another tenant, model, KV dtype, scale scheme, page size, attention window or number of
sinks never produce the same chain (a windowed model's K/V differ from a dense one's past the window). The
scale scheme of a quantised pool and the window of a windowed one are appended; other pools have neither, so
their seeds are unchanged. Hashes depend on nothing else (no per-process seed), so they stay valid across
processes and restarts, and in Redis.
"""

from __future__ import annotations

import xxhash

from kvserve.common.tokens import le_uint32

HASH_SCHEME_VERSION = 1


def namespace_seed(tenant: str, model_fingerprint: str, kv_dtype: str, page_size: int, kv_scales: str = "",
                   sliding_window: int = 0, attention_sinks: int = 0) -> bytes:
    """h_0: 16 bytes derived from everything that must match for two blocks to be interchangeable."""
    parts = (f"kvserve-prefix-v{HASH_SCHEME_VERSION}", tenant, model_fingerprint, kv_dtype, str(page_size))
    parts += (kv_scales,) if kv_scales else ()
    # Named, so that a window can never read as a scale scheme (or the other way round).
    parts += (f"sliding_window={sliding_window}", f"attention_sinks={attention_sinks}") if (
        sliding_window or attention_sinks) else ()
    return xxhash.xxh3_128_digest("\x00".join(parts).encode())


def chain_hashes(prev: bytes, token_ids: list[int] | tuple[int, ...], page_size: int) -> list[bytes]:
    """Hashes of the full pages of ``token_ids`` continuing the chain after ``prev``; a partial tail is ignored."""
    return list(iter_chain_hashes(prev, token_ids, page_size))


def iter_chain_hashes(prev: bytes, token_ids, page_size: int):
    """chain_hashes, lazily: a prefix lookup stops hashing at the first block that is not cached."""
    data = le_uint32(token_ids[: len(token_ids) // page_size * page_size])
    step = page_size * 4
    for start in range(0, len(data), step):
        prev = xxhash.xxh3_128_digest(prev + data[start : start + step])
        yield prev


def hex_hash(block_hash: bytes) -> str:
    return block_hash.hex()
