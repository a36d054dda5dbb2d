"""The CPU backend over quantised KV pages (int8, float8_e4m3fn, float8_e5m2; one scale per token and kv head, or
none: the tensor scheme): its decode and prefill kernels against dense causal attention over the dequantised K/V
and against the float32 math within the format's precision, and rope_store's quantised writes against
kvserve/kernels/kv_quant.py's torch ones, byte for byte."""

from __future__ import annotations

import math

import pytest
import torch
from test_kernels import dense_attention, scattered_pages

from kvserve.kernels.cpu_paged import CPUPagedBackend
from kvserve.kernels.kv_quant import FORMAT_OF_DTYPE, quantise, write_kv_quantised
from kvserve.kernels.paged_attention import build_metadata
from kvserve.kernels.rotary import cos_sin_table, inverse_frequencies

QUANTISED = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
SCHEMES = {"token_head": True, "tensor": False}  # whether the pool keeps a scale per (token, kv head)
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
CPU = torch.device("cpu")


def spec_quantise(x: torch.Tensor, dtype: torch.dtype, per_token: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The quantisation spec, written out here independently of kv_quant.py: x [..., D] -> (stored, scales)."""
    qmax = QMAX[dtype]
    if per_token:
        s = x.abs().amax(-1) / qmax
        s = torch.where(s == 0, torch.ones_like(s), s)
        y = x / s[..., None]
    else:
        s, y = None, x
    if dtype == torch.int8:
        return torch.round(y).clamp(-127, 127).to(torch.int8), s  # torch.round: half to even
    return y.clamp(-qmax, qmax).to(dtype), s


def new_pool(num_pages, page_size, kv_heads, head_dim, dtype, per_token):
    """A layer's cache of 1-byte elements and its scales (None: the tensor scheme)."""
    cache = torch.zeros(2, num_pages, page_size, kv_heads, head_dim, dtype=torch.uint8).view(dtype)
    return cache, torch.zeros(2, num_pages, page_size, kv_heads) if per_token else None


def slots_of(table: list[int], n: int, page_size: int) -> torch.Tensor:
    pos = torch.arange(n)
    return torch.tensor(table)[pos // page_size] * page_size + pos % page_size


def stored_at(cache, scales, slots):
    """(bytes [2, n, kv_heads, D] uint8, scales [2, n, kv_heads] or None) of the slots."""
    flat = cache.view(torch.uint8).view(2, -1, *cache.shape[3:])
    return flat[:, slots], None if scales is None else scales.view(2, -1, cache.shape[3])[:, slots]


def dequantised(cache, scales, table, n):
    """K and V of a sequence's positions 0..n-1, as float(stored) * scale [n, kv_heads, D] each."""
    raw, s = stored_at(cache, scales, slots_of(table, n, cache.shape[2]))
    kv = raw.view(cache.dtype).float()
    if s is not None:
        kv = kv * s[..., None]
    return kv[0], kv[1]


def assert_stored_as_spec(cache, scales, table, k, v):
    """The pool holds k and v [n, kv_heads, D] of positions 0..n-1 as the spec quantises them, bit for bit."""
    raw, s = stored_at(cache, scales, slots_of(table, k.shape[0], cache.shape[2]))
    for i, x in enumerate((k, v)):
        want, want_s = spec_quantise(x, cache.dtype, scales is not None)
        assert torch.equal(raw[i], want.view(torch.uint8))
        if scales is not None:
            assert torch.equal(s[i], want_s)


def run_quant_case(lengths, cached, heads, kv_heads, page_size, dtype, per_token, seed=0, head_dim=16,
                   amplitude=1.0):
    """Sequences of total length lengths[b], of which cached[b] are already in the pool (written by earlier steps,
    kv_quant's torch write), through the CPU backend's forward. Checks each sequence's rows against dense causal
    attention over the dequantised K/V (1e-5) and the pool's bytes against the spec; returns (out, per sequence
    (q, k, v) in float32, the rows' offsets) for comparisons with the float32 math. K and V are randn * amplitude,
    q randn / amplitude."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // page_size) for n in lengths) + 3
    cache, scales = new_pool(num_pages, page_size, kv_heads, head_dim, dtype, per_token)
    tables = scattered_pages(len(lengths), lengths, page_size, num_pages, gen)
    full = [(torch.randn(n, heads, head_dim, generator=gen) / amplitude,
             torch.randn(n, kv_heads, head_dim, generator=gen) * amplitude,
             torch.randn(n, kv_heads, head_dim, generator=gen) * amplitude) for n in lengths]
    for (_, k, v), table, c in zip(full, tables, cached, strict=True):
        if c:
            meta = build_metadata([0], [c], [table], page_size, CPU)
            write_kv_quantised(k[:c], v[:c], cache, scales, meta.slot_mapping)
    q_lens = [n - c for n, c in zip(lengths, cached, strict=True)]
    meta = build_metadata(cached, q_lens, tables, page_size, CPU)
    cat = [torch.cat([t[i][c:] for t, c in zip(full, cached, strict=True)]) for i in range(3)]
    backend = CPUPagedBackend()
    out = backend.forward(*cat, cache, meta, backend.prepare(meta), 1 / math.sqrt(head_dim), scales)
    offsets = meta.cu_q_lens.tolist()
    for b, ((q, k, v), c, table) in enumerate(zip(full, cached, tables, strict=True)):
        assert_stored_as_spec(cache, scales, table, k, v)
        k_deq, v_deq = dequantised(cache, scales, table, k.shape[0])
        expected = dense_attention(q[c:], k_deq, v_deq, c)
        torch.testing.assert_close(out[offsets[b] : offsets[b + 1]], expected, rtol=1e-5, atol=1e-5)
    return out, full, offsets


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", QUANTISED)
@pytest.mark.parametrize("length", [1, 15, 16, 17, 31, 32, 33, 100])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1), (9, 3)])
def test_prefill_over_quantised_pages_matches_dense_attention(length, heads, kv_heads, dtype, scheme):
    run_quant_case([length], [0], heads, kv_heads, 16, dtype, SCHEMES[scheme], seed=length + heads)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", QUANTISED)
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (6, 1)])
def test_a_decode_step_over_quantised_pages_matches_dense_attention(page_size, heads, kv_heads, dtype, scheme):
    """Only decodes (paged_decode for the whole step): contexts from 1 to 300, on and off page boundaries."""
    lengths = [1, 2, 15, 16, 17, 33, 64, 65, 128, 300]
    run_quant_case(lengths, [n - 1 for n in lengths], heads, kv_heads, page_size, dtype, SCHEMES[scheme],
                   seed=page_size + heads)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", QUANTISED)
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_a_mixed_step_of_prefills_chunks_and_decodes_over_quantised_pages(page_size, dtype, scheme):
    lengths = [23, 40, 17, 16, 1, 64]
    cached = [0, 16, 16, 15, 0, 63]
    run_quant_case(lengths, cached, 9, 3, page_size, dtype, SCHEMES[scheme], seed=page_size)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", QUANTISED)
@pytest.mark.parametrize("head_dim,heads,kv_heads,page_size", [
    (64, 9, 3, 16),  # the default model's shape: decode_seq_fast
    (128, 8, 1, 32),  # a wider head, 8 query heads per kv head: decode_seq_fast
    (24, 6, 2, 16),  # head_dim not a multiple of 16: decode_seq_generic
    (16, 9, 1, 16),  # 9 query heads per kv head: decode_seq_generic
    (16, 4, 2, 80),  # pages over 64 tokens: decode_seq_generic
])
def test_the_decode_kernels_fast_and_generic_paths_read_quantised_pages(head_dim, heads, kv_heads, page_size,
                                                                         dtype, scheme):
    lengths = [1, 17, 64, 65, 200, 301]
    run_quant_case(lengths, [n - 1 for n in lengths], heads, kv_heads, page_size, dtype, SCHEMES[scheme],
                   seed=head_dim, head_dim=head_dim)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", QUANTISED)
@pytest.mark.parametrize("head_dim,heads,kv_heads,native", [
    (64, 9, 3, True),  # paged_prefill.cpp
    (128, 8, 1, True),
    (32, 2, 2, True),
    (24, 6, 2, False),  # head_dim not a multiple of 16: the reference groups
    (16, 9, 1, False),  # 9 query heads per kv head: the reference groups
])
def test_the_prefill_paths_read_quantised_pages(head_dim, heads, kv_heads, native, dtype, scheme, monkeypatch):
    """Chunks of odd and even lengths, fresh and on cached prefixes ending on and off page boundaries, decodes in
    the same step; and with the kernel turned off (KVSERVE_PREFILL_KERNEL=0)."""
    assert CPUPagedBackend().ext.paged_prefill_supports(head_dim, heads, kv_heads, 16) == native
    lengths = [70, 33, 200, 2, 1, 50, 129]
    cached = [0, 17, 100, 0, 0, 49, 32]
    run_quant_case(lengths, cached, heads, kv_heads, 16, dtype, SCHEMES[scheme], seed=head_dim, head_dim=head_dim)
    monkeypatch.setenv("KVSERVE_PREFILL_KERNEL", "0")
    run_quant_case(lengths, cached, heads, kv_heads, 16, dtype, SCHEMES[scheme], seed=head_dim, head_dim=head_dim)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", QUANTISED)
@pytest.mark.parametrize("chunk", [1, 5, 16, 33])
def test_chunked_prefill_over_quantised_pages_attends_to_the_cached_chunks(chunk, dtype, scheme):
    """70 tokens in chunks of `chunk`: each chunk reads the earlier ones from the quantised pages."""
    gen = torch.Generator().manual_seed(chunk)
    n, heads, kv_heads, head_dim, page_size = 70, 9, 3, 64, 16
    q, k, v = (torch.randn(n, h, head_dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    cache, scales = new_pool(8, page_size, kv_heads, head_dim, dtype, SCHEMES[scheme])
    table = [6, 0, 3, 1, 7]
    backend, outs = CPUPagedBackend(), []
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        meta = build_metadata([start], [end - start], [table], page_size, CPU)
        outs.append(backend.forward(q[start:end], k[start:end], v[start:end], cache, meta, backend.prepare(meta),
                                    1 / math.sqrt(head_dim), scales))
    k_deq, v_deq = dequantised(cache, scales, table, n)
    torch.testing.assert_close(torch.cat(outs), dense_attention(q, k_deq, v_deq, 0), rtol=1e-5, atol=1e-5)


# The format's step at the data's scale (randn q, K, V; int8 without scales: K, V * 16 and q / 16, so that its
# integer grid has steps of 1/16 of the data): int8 with scales: a row's max |x| (about 4) / 127; e4m3 and e5m2:
# their relative steps 2^-3 and 2^-2. The attention rows stay within two steps of the float32 ones.
FORMAT_STEP = {
    (torch.int8, True): 4 / 127, (torch.int8, False): 1 / 16,
    (torch.float8_e4m3fn, True): 2**-3, (torch.float8_e4m3fn, False): 2**-3,
    (torch.float8_e5m2, True): 2**-2, (torch.float8_e5m2, False): 2**-2,
}


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", QUANTISED)
def test_attention_over_quantised_pages_is_the_float32_attention_within_the_formats_precision(dtype, scheme):
    per_token = SCHEMES[scheme]
    amplitude = 16.0 if dtype == torch.int8 and not per_token else 1.0
    lengths, cached = [70, 33, 200, 2, 1, 50, 129], [0, 17, 100, 0, 0, 49, 32]
    out, full, offsets = run_quant_case(lengths, cached, 9, 3, 16, dtype, per_token, seed=3, head_dim=64,
                                        amplitude=amplitude)
    err = max((out[offsets[b] : offsets[b + 1]] - dense_attention(q[c:], k, v, c)).abs().max().item() / amplitude
              for b, ((q, k, v), c) in enumerate(zip(full, cached, strict=True)))
    assert 0 < err < 2 * FORMAT_STEP[dtype, per_token]


def rope_inputs(num_tokens, heads, kv_heads, head_dim, gen, magnitude=1.0):
    """qkv [tokens, (H + 2 Hkv) D] and the cos, sin rows of positions 0, 1, 2, ... (token 0: no rotation)."""
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * magnitude
    cos, sin = cos_sin_table(inverse_frequencies(head_dim, 10000.0, None), num_tokens)
    return qkv, cos, sin


def rope_store_both(ext, qkv, cos, sin, heads, kv_heads, dtype, per_token, slots, num_pages=4, page_size=16):
    """rope_store into a float32 cache and into a quantised one: (q, the float32 k and v [tokens, Hkv, D] it
    stored, the quantised cache and scales, q of the quantised call)."""
    head_dim = cos.shape[1]
    f32 = torch.zeros(2, num_pages, page_size, kv_heads, head_dim)
    q = ext.rope_store(qkv, cos, sin, heads, kv_heads, f32, None, slots)
    k, v = f32.view(2, -1, kv_heads, head_dim)[:, slots]
    cache, scales = new_pool(num_pages, page_size, kv_heads, head_dim, dtype, per_token)
    q_quant = ext.rope_store(qkv, cos, sin, heads, kv_heads, cache, scales, slots)
    return q, k, v, cache, scales, q_quant


# Values on the formats' rounding ties (kept by rope_store at position 0 and by v as they are), with -0: int8
# rounds half to even; e4m3 and e5m2 round to the nearest even mantissa, subnormals included.
TIES = {
    torch.int8: [0.5, 1.5, 2.5, -2.5, -0.5, 126.5, -126.5, 3.5, -0.0, 127.0],
    torch.float8_e4m3fn: [1.0625, 1.1875, -1.0625, 2**-10, 3 * 2**-10, -(2**-10), 432.0, -432.0, -0.0, 448.0],
    torch.float8_e5m2: [1.125, 1.375, -1.125, 2**-17, 3 * 2**-17, -(2**-17), 53248.0, -53248.0, -0.0, 57344.0],
}  # each ends with qmax, so that with scales too the row's scale is 1 and the ties stay ties


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", QUANTISED)
@pytest.mark.parametrize("head_dim", [64, 24])
def test_rope_store_writes_the_bytes_and_scales_kv_quant_writes(head_dim, dtype, scheme):
    """rope_store into a 1-byte cache stores what kv_quant (and the spec) make of the rotated k and the plain v
    that it stores into a float32 cache: the same bytes and scales, bit for bit; q is the same; no other slot is
    touched. Token 0 (no rotation) holds ties of the format's rounding in every head."""
    per_token = SCHEMES[scheme]
    heads, kv_heads, num_tokens = 9, 3, 21
    gen = torch.Generator().manual_seed(head_dim)
    qkv, cos, sin = rope_inputs(num_tokens, heads, kv_heads, head_dim, gen, 3.0)
    ties = torch.tensor(TIES[dtype] * head_dim)[:head_dim]
    qkv[0] = ties.repeat(heads + 2 * kv_heads)
    slots = torch.randperm(64, generator=gen)[:num_tokens]
    ext = CPUPagedBackend().ext
    q, k, v, cache, scales, q_quant = rope_store_both(ext, qkv, cos, sin, heads, kv_heads, dtype, per_token, slots)
    assert torch.equal(q, q_quant) and torch.equal(k[0], ties.repeat(kv_heads, 1))
    raw, stored_scales = stored_at(cache, scales, slots)
    fmt = FORMAT_OF_DTYPE[dtype]
    for i, x in enumerate((k, v)):
        want, want_scales = quantise(x, fmt, per_token)
        spec, spec_scales = spec_quantise(x, dtype, per_token)
        assert torch.equal(raw[i], want.view(torch.uint8)) and torch.equal(raw[i], spec.view(torch.uint8))
        if per_token:
            assert torch.equal(stored_scales[i], want_scales) and torch.equal(stored_scales[i], spec_scales)
    untouched = torch.ones(cache.shape[1] * cache.shape[2], dtype=torch.bool)
    untouched[slots] = False
    assert not cache.view(torch.uint8).view(2, -1, kv_heads, head_dim)[:, untouched].any()
    if per_token:
        assert not scales.view(2, -1, kv_heads)[:, untouched].any()


def finite_bytes(dtype: torch.dtype) -> torch.Tensor:
    """Every byte value that is a finite number of the format, as uint8."""
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return every[every.view(dtype).float().isfinite()]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", QUANTISED)
@pytest.mark.parametrize("path,head_dim,heads", [
    ("decode_seq_fast", 64, 1), ("decode_seq_generic", 16, 9), ("paged_prefill", 64, 1)])
def test_every_byte_value_reads_as_torchs_float_of_it(path, head_dim, heads, dtype, scheme):
    """Sequences whose first value row holds the format's byte values (subnormals, -0 and the largest included)
    and whose keys are 0: a query that sees only that key gets the row back, float(stored) * scale bit for bit."""
    per_token = SCHEMES[scheme]
    values = finite_bytes(dtype)
    rows = torch.zeros(-(-values.numel() // head_dim) * head_dim, dtype=torch.uint8)
    rows[: values.numel()] = values
    rows = rows.view(-1, 1, head_dim)  # one per sequence, kv head 0
    num_seqs, q_len = rows.shape[0], 1 if path.startswith("decode") else 2
    cache, scales = new_pool(num_seqs, 16, 1, head_dim, dtype, per_token)
    cache.view(torch.uint8)[1, :, 0] = rows  # token 0 of page b: sequence b's first value row
    if per_token:
        scales.uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(num_seqs))
    tables = [[b] for b in range(num_seqs)]
    meta = build_metadata([0] * num_seqs, [q_len] * num_seqs, tables, 16, CPU)
    q = torch.randn(num_seqs * q_len, heads, head_dim)
    ext = CPUPagedBackend().ext
    if q_len == 1:
        out = ext.paged_decode(q, cache, scales, meta.page_tables, meta.seq_lens, 0.125)
    else:
        out = ext.paged_prefill(q, cache, scales, meta.page_tables, meta.cu_q_lens[:-1], meta.q_lens, meta.start_pos,
                                0.125, torch.empty_like(q))[::2]
    want = rows.view(dtype).float()
    if per_token:
        want = want * scales[1, :, 0, :, None]
    assert torch.equal(out, want.expand(-1, heads, -1))


SATURATED = {  # what |x| = 1e4 and 1e5 are stored as without scales: the format's max, never inf or NaN
    torch.int8: (127.0, 127.0),
    torch.float8_e4m3fn: (448.0, 448.0),
    torch.float8_e5m2: (10240.0, 57344.0),
}


@pytest.mark.parametrize("writer", ["rope_store", "kv_quant"])
@pytest.mark.parametrize("dtype", QUANTISED)
def test_values_past_the_formats_range_saturate_and_attention_stays_finite(dtype, writer):
    heads, kv_heads, head_dim, page_size = 4, 2, 16, 16
    gen = torch.Generator().manual_seed(1)
    backend = CPUPagedBackend()
    for magnitude, want in zip((1e4, 1e5), SATURATED[dtype], strict=True):
        sign = torch.where(torch.rand(20, kv_heads, head_dim, generator=gen) < 0.5, -1.0, 1.0)
        k, v = sign * magnitude, -sign * magnitude
        q = torch.randn(20, heads, head_dim, generator=gen) / want  # scores of a few units
        cache, scales = new_pool(4, page_size, kv_heads, head_dim, dtype, False)
        table = [2, 0]
        meta = build_metadata([0], [20], [table], page_size, CPU)
        if writer == "kv_quant":
            write_kv_quantised(k, v, cache, None, meta.slot_mapping)
        else:
            qkv = torch.cat([torch.zeros(20, heads * head_dim), k.flatten(1), v.flatten(1)], dim=1)
            ones, zeros = torch.ones(20, head_dim), torch.zeros(20, head_dim)  # no rotation
            backend.ext.rope_store(qkv, ones, zeros, heads, kv_heads, cache, None, meta.slot_mapping)
        k_deq, v_deq = dequantised(cache, None, table, 20)
        assert torch.equal(k_deq, sign * want) and torch.equal(v_deq, -sign * want)
        decode = build_metadata([19], [1], [table], page_size, CPU)  # rewrites token 19 through kv_quant
        out = backend.forward(q[19:], k[19:], v[19:], cache, decode, backend.prepare(decode), 0.25, None)
        assert out.isfinite().all() and torch.equal(dequantised(cache, None, table, 20)[0], k_deq)
        torch.testing.assert_close(out / want, dense_attention(q[19:], k_deq, v_deq, 19) / want, rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", QUANTISED)
def test_zero_rows_are_stored_as_zeros_with_scale_one(dtype, scheme):
    per_token = SCHEMES[scheme]
    heads, kv_heads, head_dim = 9, 3, 64
    gen = torch.Generator().manual_seed(2)
    qkv, cos, sin = rope_inputs(17, heads, kv_heads, head_dim, gen)
    qkv[:, heads * head_dim :] = 0.0  # every k and v
    slots = torch.arange(17) + 5
    ext = CPUPagedBackend().ext
    _, _, _, cache, scales, _ = rope_store_both(ext, qkv, cos, sin, heads, kv_heads, dtype, per_token, slots)
    raw, stored_scales = stored_at(cache, scales, slots)
    assert (raw.view(dtype).float() == 0).all()  # +0 or -0, as RoPE left them
    if per_token:
        assert torch.equal(stored_scales, torch.ones_like(stored_scales))
    backend = CPUPagedBackend()
    meta = build_metadata([16], [1], [[0, 1]], 16, CPU)
    out = backend.forward(torch.randn(1, heads, head_dim, generator=gen), torch.zeros(1, kv_heads, head_dim),
                          torch.zeros(1, kv_heads, head_dim), cache, meta, backend.prepare(meta), 0.125, scales)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", QUANTISED)
@pytest.mark.parametrize("magnitude", [1e-30, 1e-40])  # float32 normal; float32 subnormal
def test_tiny_values_quantise_as_torch_does_and_attend_as_dense(magnitude, dtype, scheme):
    """With scales, 1e-30 keeps the format's relative precision (its scales are normal floats); 1e-40's scales
    are subnormal. Either way the bytes are torch's and the attention is dense attention over them."""
    per_token = SCHEMES[scheme]
    heads, kv_heads, head_dim = 9, 3, 64
    gen = torch.Generator().manual_seed(4)
    qkv, cos, sin = rope_inputs(33, heads, kv_heads, head_dim, gen)
    qkv[:, heads * head_dim :] *= magnitude
    slots = slots_of([3, 1, 0], 33, 16)
    ext = CPUPagedBackend().ext
    q, k, v, cache, scales, _ = rope_store_both(ext, qkv, cos, sin, heads, kv_heads, dtype, per_token, slots)
    raw, stored_scales = stored_at(cache, scales, slots)
    for i, x in enumerate((k, v)):
        want, want_scales = spec_quantise(x, dtype, per_token)
        assert torch.equal(raw[i], want.view(torch.uint8))
        if per_token:
            assert torch.equal(stored_scales[i], want_scales)
    k_deq, v_deq = dequantised(cache, scales, [3, 1, 0], 33)
    if per_token and magnitude == 1e-30:
        assert (v_deq - v).abs().max() <= v.abs().max() / 4  # the format's precision, at 1e-30
    backend = CPUPagedBackend()
    meta = build_metadata([0], [33], [[3, 1, 0]], 16, CPU)  # the same bytes again, through kv_quant
    out = backend.forward(q, k, v, cache, meta, backend.prepare(meta), 1 / math.sqrt(head_dim), scales)
    assert out.isfinite().all() and torch.equal(stored_at(cache, scales, slots)[0], raw)
    expected = dense_attention(q, k_deq, v_deq, 0)
    if magnitude == 1e-30:  # relative to the values: all normal floats on the way
        torch.testing.assert_close(out / magnitude, expected / magnitude, rtol=1e-5, atol=1e-5)
    else:  # subnormal values: only that nothing overflows or turns NaN
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", QUANTISED)
def test_a_prefix_written_by_one_request_is_read_by_another_from_the_same_pages(dtype, scheme):
    """A prefills 40 tokens (rope_store writes them) into pages 5, 2, 7; B's page table starts with A's two full
    pages (a prefix hit on 32 tokens), and B prefills 20 more tokens (kv_quant writes them) in the same step as
    A's first decode, then decodes. Each attends as dense attention over the dequantised pages its table names."""
    per_token = SCHEMES[scheme]
    heads, kv_heads, head_dim, page_size = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(6)
    cache, scales = new_pool(10, page_size, kv_heads, head_dim, dtype, per_token)
    table_a, table_b = [5, 2, 7], [5, 2, 8, 0]
    backend = CPUPagedBackend()
    qkv, cos, sin = rope_inputs(40, heads, kv_heads, head_dim, gen)
    meta = build_metadata([0], [40], [table_a], page_size, CPU)
    out_a = backend.qkv_attention(qkv, cos, sin, cache, meta, backend.prepare(meta), 0.125, heads, kv_heads, scales)
    q_a = backend.ext.rope_store(qkv, cos, sin, heads, kv_heads, torch.zeros(2, 10, page_size, kv_heads, head_dim),
                                 None, meta.slot_mapping)
    k_deq, v_deq = dequantised(cache, scales, table_a, 40)
    torch.testing.assert_close(out_a, dense_attention(q_a, k_deq, v_deq, 0), rtol=1e-5, atol=1e-5)
    prefix = stored_at(cache, scales, slots_of(table_a, 32, page_size))

    q, k, v = (torch.randn(21, h, head_dim, generator=gen) for h in (heads, kv_heads, kv_heads))  # B's 20, A's 1
    meta = build_metadata([32, 40], [20, 1], [table_b, table_a], page_size, CPU)
    out = backend.forward(q, k, v, cache, meta, backend.prepare(meta), 0.125, scales)
    after = stored_at(cache, scales, slots_of(table_a, 32, page_size))
    assert torch.equal(prefix[0], after[0]) and (not per_token or torch.equal(prefix[1], after[1]))
    for rows, table, start, n in ((slice(0, 20), table_b, 32, 52), (slice(20, 21), table_a, 40, 41)):
        k_deq, v_deq = dequantised(cache, scales, table, n)
        torch.testing.assert_close(out[rows], dense_attention(q[rows], k_deq, v_deq, start), rtol=1e-5, atol=1e-5)
    q_b = torch.randn(1, heads, head_dim, generator=gen)
    meta = build_metadata([52], [1], [table_b], page_size, CPU)
    out_b = backend.forward(q_b, k[:1], v[:1], cache, meta, backend.prepare(meta), 0.125, scales)
    k_deq, v_deq = dequantised(cache, scales, table_b, 53)
    torch.testing.assert_close(out_b, dense_attention(q_b, k_deq, v_deq, 52), rtol=1e-5, atol=1e-5)


def test_the_kernels_check_the_pool_and_its_scales():
    ext = CPUPagedBackend().ext
    q, tables, lens = torch.randn(1, 4, 16), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="only a 1-byte cache has scales"):
        ext.paged_decode(q, torch.zeros(2, 1, 16, 2, 16), torch.ones(2, 1, 16, 2), tables, lens, 0.25)
    cache, _ = new_pool(1, 16, 2, 16, torch.int8, False)
    with pytest.raises(RuntimeError, match="kv_scales: a contiguous float32"):
        ext.paged_decode(q, cache, torch.ones(2, 1, 16, 1), tables, lens, 0.25)
    with pytest.raises(RuntimeError, match="kv_cache: float32, int8, float8_e4m3fn or float8_e5m2"):
        ext.paged_decode(q, torch.zeros(2, 1, 16, 2, 16, dtype=torch.float16), None, tables, lens, 0.25)
    assert ext.paged_prefill_supports(64, 9, 3, 16)  # shapes only: every element type takes the same ones
