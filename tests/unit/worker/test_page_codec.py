"""A KV page as a self-checking value (kvserve/worker/page_codec.py): it comes back byte for byte into another pool's
page, for float32 and the quantised formats with and without scales, and any value that is not exactly the page
asked for (another block or namespace, another layout, a flipped or missing byte) is refused with the page left
as it was."""

from __future__ import annotations

import pytest
import torch
import xxhash

from kvserve.worker.page_codec import HEADER, PageMismatch, decode_page, encode_page

LAYERS, PAGES, PAGE, HEADS, DIM = 3, 5, 4, 2, 8
NS = xxhash.xxh3_128_digest(b"tenant A, model, float32, 4")
BLOCK = xxhash.xxh3_128_digest(NS + b"tokens")


def pool_of(dtype: torch.dtype, with_scales: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, 2, PAGES, PAGE, HEADS, DIM)
    if dtype == torch.int8:
        pool = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
    else:
        pool = torch.randn(shape, generator=g).to(dtype)
    scales = torch.rand(shape[:-1], generator=g) + 0.5 if with_scales else None
    return pool, scales


def empty_like(pool, scales):
    return torch.zeros_like(pool), (torch.ones_like(scales) if scales is not None else None)


FORMATS = [(torch.float32, False), (torch.int8, True), (torch.float8_e4m3fn, True), (torch.float8_e5m2, False)]


@pytest.mark.parametrize(("dtype", "with_scales"), FORMATS)
def test_a_page_comes_back_byte_for_byte_into_another_pools_page(dtype, with_scales):
    src, src_scales = pool_of(dtype, with_scales, seed=1)
    dst, dst_scales = empty_like(src, src_scales)
    value = encode_page(NS, BLOCK, src, src_scales, page_id=3)
    per_token = 2 * LAYERS * HEADS * (DIM * src.element_size() + (4 if with_scales else 0))
    assert len(value) == HEADER.size + per_token * PAGE  # kv-mem's bytes_per_token x page_size, and the header
    decode_page(value, NS, BLOCK, dst, dst_scales, page_id=1)
    assert torch.equal(dst[:, :, 1].view(torch.uint8), src[:, :, 3].view(torch.uint8))
    assert not dst[:, :, [0, 2, 3, 4]].view(torch.uint8).any()  # no other page written
    if with_scales:
        assert torch.equal(dst_scales[:, :, 1], src_scales[:, :, 3])
        assert torch.equal(dst_scales[:, :, 0], torch.ones_like(dst_scales[:, :, 0]))


def _flip_last_byte(v: bytes) -> bytes:
    return v[:-1] + bytes([v[-1] ^ 1])


BAD = {
    "another block": (lambda v: v, NS, xxhash.xxh3_128_digest(b"other"), "another block"),
    "another namespace (tenant)": (lambda v: v, xxhash.xxh3_128_digest(b"tenant B"), BLOCK, "another namespace"),
    "a flipped payload byte": (_flip_last_byte, NS, BLOCK, "checksum"),
    "cut short": (lambda v: v[:-7], NS, BLOCK, "checksum"),
    "only half a header": (lambda v: v[: HEADER.size // 2], NS, BLOCK, "shorter than"),
    "not a page value": (lambda v: b"JUNK" + v[4:], NS, BLOCK, "not a page value"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_value_that_is_not_exactly_the_page_asked_for_is_refused_and_the_page_left_as_it_was(case):
    change, ns, block, message = BAD[case]
    src, scales = pool_of(torch.int8, True, seed=2)
    dst, dst_scales = pool_of(torch.int8, True, seed=3)
    before, before_scales = dst.clone(), dst_scales.clone()
    value = change(encode_page(NS, BLOCK, src, scales, page_id=0))
    with pytest.raises(PageMismatch, match=message):
        decode_page(value, ns, block, dst, dst_scales, page_id=2)
    assert torch.equal(dst, before) and torch.equal(dst_scales, before_scales)


@pytest.mark.parametrize(("into_dtype", "into_scales"), [(torch.float8_e4m3fn, True), (torch.int8, False),
                                                         (torch.float32, False)])
def test_a_page_of_another_layout_is_refused(into_dtype, into_scales):
    src, scales = pool_of(torch.int8, True, seed=4)
    dst, dst_scales = pool_of(into_dtype, into_scales, seed=5)
    before = dst.clone()
    value = encode_page(NS, BLOCK, src, scales, page_id=0)
    if into_dtype == torch.float8_e4m3fn:  # same element size and scales: only the namespace tells them apart
        with pytest.raises(PageMismatch, match="another namespace"):
            decode_page(value, xxhash.xxh3_128_digest(b"fp8 pool"), BLOCK, dst, dst_scales, page_id=0)
    else:
        with pytest.raises(PageMismatch, match="layout"):
            decode_page(value, NS, BLOCK, dst, dst_scales, page_id=0)
    assert torch.equal(dst.view(torch.uint8), before.view(torch.uint8))
