"""Quantised KV pages: the formats, and quantise-on-write / dequantise-on-read as torch ops (the reference
backend's path, and the specification the CPU kernels follow byte for byte on write).

A pool of a quantised dtype stores 1-byte elements. With the default scheme, ``token_head``, each (token, kv
head) of K and of V has one float32 scale beside the pages, computed on write (no calibration)::

    s = max(|x|) / qmax      over the head's head_dim values; s = 1 where that is 0
    q = saturate(x / s)      int8: round half to even, clamp to +-127; fp8: clamp to +-qmax, round to nearest even
    x ~ float(q) * s

With ``tensor`` there are no stored scales: one per-tensor scale of 1.0 (vLLM's default when nothing is
calibrated), so q = saturate(x). Saturation means an overflow stores +-qmax, never inf or NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_SCHEMES = ("token_head", "tensor")


@dataclass(frozen=True, slots=True)
class KVFormat:
    """A pool element type: its name (``--kv-cache-dtype``), torch storage dtype and, when quantised, qmax."""

    name: str
    dtype: torch.dtype
    qmax: float | None = None  # the largest stored magnitude; None: not quantised (the elements are the values)

    @property
    def quantised(self) -> bool:
        return self.qmax is not None


FORMATS: dict[str, KVFormat] = {f.name: f for f in (
    KVFormat("float32", torch.float32),
    KVFormat("bfloat16", torch.bfloat16),
    KVFormat("float16", torch.float16),
    KVFormat("int8", torch.int8, 127.0),
    KVFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0),
    KVFormat("fp8_e5m2", torch.float8_e5m2, 57344.0),
)}
FORMAT_OF_DTYPE = {f.dtype: f for f in FORMATS.values()}


def kv_format(name: str) -> KVFormat:
    """The format called ``name``; ValueError naming the known ones otherwise."""
    if name not in FORMATS:
        raise ValueError(f"unknown KV cache dtype {name!r}; known: auto, {', '.join(FORMATS)}")
    return FORMATS[name]


def quantise(x: torch.Tensor, fmt: KVFormat, per_token_head: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., head_dim] float -> (stored elements of x's shape in fmt.dtype, scales [...] float32 or None)."""
    x = x.float()
    if per_token_head:
        scales = x.abs().amax(dim=-1) / fmt.qmax
        scales = torch.where(scales == 0, torch.ones_like(scales), scales)
        y = x / scales.unsqueeze(-1)
    else:
        scales, y = None, x
    y = y.clamp(-fmt.qmax, fmt.qmax)
    stored = y.round().to(torch.int8) if fmt.dtype == torch.int8 else y.to(fmt.dtype)
    return stored, scales


def dequantise(stored: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float(stored) * scale (scales [...] broadcast over the last dim), in ``dtype``."""
    x = stored.to(torch.float32)
    if scales is not None:
        x = x * scales.unsqueeze(-1)
    return x.to(dtype)


def write_kv_quantised(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None,
                       slot_mapping: torch.Tensor) -> None:
    """Quantises the new tokens' K and V ([tokens, kv_heads, head_dim]) into their slots of a 1-byte layer cache
    ``[2, num_pages, page_size, kv_heads, head_dim]``, and their scales into ``kv_scales`` ``[2, num_pages,
    page_size, kv_heads]`` (None: the tensor scheme)."""
    fmt = FORMAT_OF_DTYPE[kv_cache.dtype]
    _, num_pages, page_size, num_kv_heads, head_dim = kv_cache.shape
    # as bytes: torch has no index_copy_ for fp8
    flat = kv_cache.view(torch.uint8).view(2, num_pages * page_size, num_kv_heads, head_dim)
    for i, x in enumerate((k, v)):
        stored, scales = quantise(x, fmt, kv_scales is not None)
        flat[i].index_copy_(0, slot_mapping, stored.view(torch.uint8))
        if scales is not None:
            kv_scales.view(2, num_pages * page_size, num_kv_heads)[i].index_copy_(0, slot_mapping, scales)
