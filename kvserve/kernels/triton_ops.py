"""Triton kernels for the small ops around attention: RoPE on q and k with the K/V write into their slots
(quantised on write for 1-byte pools, as kvserve/kernels/kv_quant.py specifies, byte for byte), RMSNorm with and without
the residual add, and silu(gate) * up. Imported once triton is known to be importable (kvserve/kernels/triton_paged.py).

Elementwise arithmetic rounds to the model's dtype after each op, as torch's bf16/fp16 ops do, so that what is
stored is what the reference backend stores. Quantisation never uses the hardware's float -> fp8 conversion:
it is encoded with integer arithmetic (``_encode_fp8``), which gives torch's bytes (round to nearest even,
subnormals included) on every target, Triton's CPU interpreter too (whose own conversion rounds otherwise).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvserve.kernels.triton_attention import cast


@triton.jit
def _round(x, DT: tl.constexpr):
    """x (float32) rounded to the model dtype DT and back: one torch op's result in DT."""
    if DT == tl.float32:
        return x
    else:
        return cast(x, DT).to(tl.float32)


@triton.jit
def _rint(y):
    """Round half to even (torch.round), for |y| < 2^22."""
    f = tl.floor(y)
    d = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)


@triton.jit
def _encode_fp8(y, EXP_BIAS: tl.constexpr, MANT: tl.constexpr):
    """Finite float32 y, already clamped to the format's range -> its fp8 byte (uint8), round to nearest even.

    In the binade [2^e, 2^(e+1)) (e at least the format's smallest normal exponent 1 - bias, below which the
    subnormals share its quantum), y is n quanta of 2^(e - MANT), n in [0, 2^(MANT+1)]; the byte is then
    ``(e + bias - 1) << MANT + n`` (n = 2^MANT.. carries into the exponent field by itself)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    e = ((bits >> 23) & 0xFF) - 127
    e = tl.maximum(e, 1 - EXP_BIAS)
    inv_quantum = ((MANT - e + 127) << 23).to(tl.float32, bitcast=True)  # 2^(MANT - e), exact
    n = _rint(tl.abs(y) * inv_quantum).to(tl.int32)
    code = ((e + EXP_BIAS - 1) << MANT) + n
    code = tl.where(n == 0, 0, code)
    return ((sign << 7) | code).to(tl.uint8)


@triton.jit
def _quantise_rows(x, d_mask, QMAX: tl.constexpr, KV_KIND: tl.constexpr, PER_TOKEN: tl.constexpr):
    """x [rows, BLOCK_D] float32 -> (stored elements, scales [rows]) as kv_quant.quantise computes them."""
    if PER_TOKEN:
        amax = tl.max(tl.where(d_mask[None, :], tl.abs(x), 0.0), 1)
        s = tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32))
        s = tl.where(s == 0.0, 1.0, s)
        y = tl.math.div_rn(x, s[:, None])
    else:
        s = tl.full([x.shape[0]], 1.0, tl.float32)
        y = x
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if KV_KIND == 1:
        stored = _rint(y).to(tl.int8)
    elif KV_KIND == 2:
        stored = _encode_fp8(y, 7, 3)
    else:
        stored = _encode_fp8(y, 15, 2)
    return stored, s


@triton.jit
def _rope_rows(ptr, row_off, row_mask, cos_ptr, sin_ptr, t, stride_ct, HEAD_DIM: tl.constexpr,
               BLOCK_D: tl.constexpr, DT: tl.constexpr):
    """Rotate-half RoPE of the rows at ptr + row_off [rows] (each HEAD_DIM values) with token t's cos and sin,
    as float32 [rows, BLOCK_D]: x c + rotate_half(x) s, rounded per op as torch's apply_rotary in DT."""
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    first = d < HEAD_DIM // 2
    partner = tl.where(first, d + HEAD_DIM // 2, d - HEAD_DIM // 2)
    mask = row_mask[:, None] & d_mask[None, :]
    x = tl.load(ptr + row_off[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    other = tl.load(ptr + row_off[:, None] + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_ct + d, mask=d_mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_ct + d, mask=d_mask, other=0.0).to(tl.float32)
    rot = _round(other * s[None, :], DT)
    return _round(_round(x * c[None, :], DT) + tl.where(first[None, :], -rot, rot), DT)


@triton.jit
def _store_kv_rows(cache_ptr, scales_ptr, x, slot, kv_rows, d_offs, d_mask, stride_tok, stride_head,
                   s_stride_tok, KV_KIND: tl.constexpr, QMAX: tl.constexpr, PER_TOKEN: tl.constexpr):
    """x [BLOCK_KVH, BLOCK_D] (the token's K or V per kv head) into slot ``slot`` of the cache (viewed as flat
    slots), quantised for a 1-byte cache."""
    mask = (kv_rows[:, None] >= 0) & d_mask[None, :]
    off = slot * stride_tok + kv_rows[:, None] * stride_head + d_offs[None, :]
    if KV_KIND == 0:
        tl.store(cache_ptr + off, cast(x, cache_ptr.dtype.element_ty), mask=mask)
    else:
        stored, s = _quantise_rows(x, d_mask, QMAX, KV_KIND, PER_TOKEN)
        tl.store(cache_ptr + off, stored, mask=mask)
        if PER_TOKEN:
            tl.store(scales_ptr + slot * s_stride_tok + kv_rows, s, mask=kv_rows >= 0)


@triton.jit
def rope_store_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, sink_cos_ptr, sink_sin_ptr, q_out_ptr, q_sink_out_ptr,
    k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, slots_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_ot, stride_oh,
    cache_stride_tok, cache_stride_head, s_stride_tok, num_heads, num_kv_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr,
    ROTATE: tl.constexpr, HAS_SINKS: tl.constexpr, KV_KIND: tl.constexpr, QMAX: tl.constexpr,
    PER_TOKEN: tl.constexpr, DT: tl.constexpr,
):
    """Program t: token t's q heads rotated into q_out (and at its sink position into q_sink_out), its k
    rotated and its v into slot slots[t] (nothing when that is negative: a padding token). ROTATE=False: k and
    v are stored as given (forward()'s path) and q is not touched."""
    t = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    if ROTATE:
        h = tl.arange(0, BLOCK_H)
        h_mask = h < num_heads
        o_off = t * stride_ot + h[:, None] * stride_oh + d[None, :]
        o_mask = h_mask[:, None] & d_mask[None, :]
        q = _rope_rows(q_ptr, t * stride_qt + h * stride_qh, h_mask, cos_ptr, sin_ptr, t, stride_ct, HEAD_DIM,
                       BLOCK_D, DT)
        tl.store(q_out_ptr + o_off, cast(q, q_out_ptr.dtype.element_ty), mask=o_mask)
        if HAS_SINKS:
            q = _rope_rows(q_ptr, t * stride_qt + h * stride_qh, h_mask, sink_cos_ptr, sink_sin_ptr, t,
                           stride_ct, HEAD_DIM, BLOCK_D, DT)
            tl.store(q_sink_out_ptr + o_off, cast(q, q_out_ptr.dtype.element_ty), mask=o_mask)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        kvh = tl.arange(0, BLOCK_KVH)
        kv_mask = kvh < num_kv_heads
        kv_rows = tl.where(kv_mask, kvh, -1)
        km = kv_mask[:, None] & d_mask[None, :]
        if ROTATE:
            k = _rope_rows(k_ptr, t * stride_kt + kvh * stride_kh, kv_mask, cos_ptr, sin_ptr, t, stride_ct,
                           HEAD_DIM, BLOCK_D, DT)
        else:
            k = tl.load(k_ptr + t * stride_kt + kvh[:, None] * stride_kh + d[None, :], mask=km,
                        other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * stride_vt + kvh[:, None] * stride_vh + d[None, :], mask=km, other=0.0)
        _store_kv_rows(k_cache_ptr, k_scales_ptr, k, slot, kv_rows, d, d_mask, cache_stride_tok,
                       cache_stride_head, s_stride_tok, KV_KIND, QMAX, PER_TOKEN)
        _store_kv_rows(v_cache_ptr, v_scales_ptr, v.to(tl.float32), slot, kv_rows, d, d_mask, cache_stride_tok,
                       cache_stride_head, s_stride_tok, KV_KIND, QMAX, PER_TOKEN)


@triton.jit
def rms_norm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, num_rows, hidden, eps, stride_x, stride_d, stride_o,
                    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HAS_DELTA: tl.constexpr, DT: tl.constexpr):
    """Rows [BLOCK_R * pid, +BLOCK_R): with HAS_DELTA first x += delta (in place, in x's dtype); then
    out = weight * (x * rsqrt(mean(x^2) + eps)) computed in float32, cast to x's dtype before the weight (HF)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    mask = (r < num_rows)[:, None] & (d < hidden)[None, :]
    x = tl.load(x_ptr + r[:, None] * stride_x + d[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + r[:, None] * stride_d + d[None, :], mask=mask, other=0.0).to(tl.float32)
        x = _round(x + delta, DT)
        tl.store(x_ptr + r[:, None] * stride_x + d[None, :], cast(x, x_ptr.dtype.element_ty), mask=mask)
    mean = tl.sum(x * x, 1) / hidden
    inv = tl.math.div_rn(tl.full(mean.shape, 1.0, tl.float32), tl.sqrt_rn(mean + eps))
    w = tl.load(w_ptr + d, mask=d < hidden, other=0.0).to(tl.float32)
    y = _round(x * inv[:, None], DT)
    tl.store(out_ptr + r[:, None] * stride_o + d[None, :], cast(w[None, :] * y, out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def silu_mul_kernel(x_ptr, out_ptr, num_rows, inter, stride_x, stride_o, BLOCK_R: tl.constexpr,
                    BLOCK_I: tl.constexpr, DT: tl.constexpr):
    """out[:, j] = silu(x[:, j]) * x[:, inter + j] for the program's rows and columns (rounded per op)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    j = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (r < num_rows)[:, None] & (j < inter)[None, :]
    gate = tl.load(x_ptr + r[:, None] * stride_x + j[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + r[:, None] * stride_x + inter + j[None, :], mask=mask, other=0.0).to(tl.float32)
    silu = _round(gate / (1.0 + tl.exp(-gate)), DT)
    tl.store(out_ptr + r[:, None] * stride_o + j[None, :], cast(silu * up, out_ptr.dtype.element_ty), mask=mask)
