"""One KV page as a self-checking value, for a store shared by workers (issue 38's second tier).

A value holds one page of every layer: its K and V elements ``[num_layers, 2, page_size, num_kv_heads,
head_dim]`` and, for a quantised pool with per-(token, kv head) scales, those scales ``[num_layers, 2,
page_size, num_kv_heads]`` float32, so ``bytes_per_token * page_size`` bytes of payload (kv_pool.py's layout,
one page of it), behind a header:

    magic "KVPG" | version u8 | element bytes u8 | scales u8 | reserved u8 | namespace (16) | block_hash (16)
    | payload bytes u64 | xxh3_64 of the payload u64

The namespace (the hash chain's seed: tenant, model, KV dtype and scales, page size, window) and the block hash
say what the bytes are; a reader that expects another block, another namespace or another layout, or whose
checksum does not match, gets PageMismatch and must recompute. Nothing here decides where values live.
"""

from __future__ import annotations

import struct

import numpy as np
import torch
import xxhash

MAGIC = b"KVPG"
VERSION = 1
HEADER = struct.Struct("<4sBBBx16s16sQQ")


class PageMismatch(ValueError):
    """A stored value that is not the page asked for (another block, namespace or layout), or is damaged."""


def page_payload(pool: torch.Tensor, scales: torch.Tensor | None, page_id: int) -> bytes:
    """The bytes of page ``page_id`` of every layer (K, V, then the scales if the pool has them)."""
    parts = [pool[:, :, page_id]] + ([scales[:, :, page_id]] if scales is not None else [])
    return b"".join(_as_bytes(p) for p in parts)


def value_size(pool: torch.Tensor, scales: torch.Tensor | None) -> int:
    """The bytes of one page's value in this pool's layout (header and payload)."""
    return HEADER.size + _page_bytes(pool) + (_page_bytes(scales) if scales is not None else 0)


def encode_page(namespace: bytes, block_hash: bytes, pool: torch.Tensor, scales: torch.Tensor | None,
                page_id: int) -> bytes:
    """Page ``page_id`` as a value: header, then payload."""
    payload = page_payload(pool, scales, page_id)
    header = HEADER.pack(MAGIC, VERSION, pool.element_size(), scales is not None, _digest16(namespace),
                         _digest16(block_hash), len(payload), xxhash.xxh3_64_intdigest(payload))
    return header + payload


def decode_page(value: bytes, namespace: bytes, block_hash: bytes, pool: torch.Tensor,
                scales: torch.Tensor | None, page_id: int) -> None:
    """Writes ``value`` into page ``page_id`` of the pool (and its scales) once it is verified to be that block
    of that namespace, in this pool's layout, undamaged. Raises PageMismatch, leaving the page untouched."""
    payload = _verified_payload(value, namespace, block_hash, pool, scales)
    kv_bytes = _page_bytes(pool)
    _write(pool[:, :, page_id], payload[:kv_bytes])
    if scales is not None:
        _write(scales[:, :, page_id], payload[kv_bytes:])


def _verified_payload(value: bytes, namespace: bytes, block_hash: bytes, pool: torch.Tensor,
                      scales: torch.Tensor | None) -> memoryview:
    if len(value) < HEADER.size:
        raise PageMismatch(f"a value of {len(value)} bytes is shorter than the {HEADER.size}-byte header")
    magic, version, elem, has_scales, ns, bh, size, checksum = HEADER.unpack_from(value)
    if (magic, version) != (MAGIC, VERSION):
        raise PageMismatch(f"not a page value of version {VERSION} (magic {magic!r}, version {version})")
    if (ns, bh) != (_digest16(namespace), _digest16(block_hash)):
        raise PageMismatch("the value holds another block or another namespace")
    expected = _page_bytes(pool) + (_page_bytes(scales) if scales is not None else 0)
    if (elem, bool(has_scales), size) != (pool.element_size(), scales is not None, expected):
        raise PageMismatch(f"layout: {size} payload bytes of {elem}-byte elements, scales {bool(has_scales)}; this "
                           f"pool's pages are {expected} bytes of {pool.element_size()}-byte elements, scales "
                           f"{scales is not None}")
    payload = memoryview(value)[HEADER.size:]
    if len(payload) != size or xxhash.xxh3_64_intdigest(payload) != checksum:
        raise PageMismatch("the payload does not match its checksum (damaged or cut short)")
    return payload


def _page_bytes(t: torch.Tensor) -> int:
    return t[:, :, 0].numel() * t.element_size()


def _digest16(b: bytes) -> bytes:
    if len(b) != 16:
        raise ValueError(f"namespace and block hash are 16 bytes (xxh3_128), got {len(b)}")
    return b


# On the CPU the bytes move through numpy views of the pool (its last dimension is contiguous, so a page of it
# views as bytes): numpy copies on the calling thread alone, where a torch copy of a big page would start an
# OpenMP team on it. Pages are read and written beside the compute thread (kvserve/worker/transfer.py serves and pulls
# them from gRPC threads), and every extra team costs the compute thread's ops (docs/design/worker.md).
def _as_bytes(t: torch.Tensor) -> bytes:
    return t.cpu().view(torch.uint8).numpy().tobytes()


def _write(dst: torch.Tensor, data) -> None:
    """Copies ``data`` (the bytes of a tensor of ``dst``'s dtype and shape) into ``dst``, a view into the pool."""
    if dst.device.type == "cpu":
        view = dst.view(torch.uint8).numpy()
        view[...] = np.frombuffer(data, dtype=np.uint8).reshape(view.shape)
        return
    dst.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dst.dtype).reshape(dst.shape))
