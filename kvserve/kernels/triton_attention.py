"""Triton paged-attention kernels: decode split over the KV length (flash-decoding) with its reduce, and prefill
chunks on top of cached tokens. Both read K/V in place through the page table (kvserve/kernels/triton_paged.py says the
design; this module holds only the kernels, imported once triton is known to be importable).

Keys are walked in a *key index* space that skips what no query of the program reads under a sliding window
(kvserve/kernels/window.py): the sink keys that are not already in the window come first, then the window::

    window 6, sinks 2, a decode at p = 13:   key index  0 1 | 2  3  4  5  6  7
                                             position   0 1 | 8  9 10 11 12 13
    position = v                  for v < num_sink  (= min(sinks, window_lo))
             = window_lo + v - num_sink  otherwise  (window_lo = max(0, p - window + 1))

Without a window, num_sink = window_lo = 0 and the key index is the position. Every key's page is looked up
per token (``page_tables[b, pos // page_size]``), so any page size works and pages the window released (HOLEs)
are never dereferenced: the walk never reaches them, and a negative page id masks its load besides.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LOG2E_C: tl.constexpr = tl.constexpr(LOG2E)  # LOG2E for the kernels: they may read only constexpr globals

# KV_KIND: how a cache element becomes a value
KV_VALUES, KV_INT8, KV_FP8_E4M3, KV_FP8_E5M2 = 0, 1, 2, 3


@triton.jit
def cast(x, DT: tl.constexpr):
    """float32 x -> DT, rounding to nearest even. bfloat16 is rounded on its bits: Triton's CPU interpreter
    truncates in its own conversion (a GPU's is exact, and this gives the same bits)."""
    if DT == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DT)


@triton.jit
def _dequantise(raw, KV_KIND: tl.constexpr):
    """Stored elements -> float32: values as they are, int8 as its integer, fp8 bytes (uint8) bitcast."""
    if KV_KIND == 2:
        return raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    elif KV_KIND == 3:
        return raw.to(tl.float8e5, bitcast=True).to(tl.float32)
    else:
        return raw.to(tl.float32)


@triton.jit
def _key_range(first_pos, last_pos, WINDOW: tl.constexpr, SINKS: tl.constexpr):
    """(num_sink, window_lo, num_keys) of the key index space that queries at first_pos..last_pos read."""
    if WINDOW > 0:
        window_lo = tl.maximum(first_pos - WINDOW + 1, 0)
        num_sink = tl.minimum(window_lo, SINKS)
    else:
        window_lo = first_pos * 0
        num_sink = window_lo
    return num_sink, window_lo, num_sink + tl.maximum(last_pos + 1 - window_lo, 0)


@triton.jit
def _load_kv(cache_ptr, scales_ptr, table_ptr, pos, valid, kvh, offs_d, d_mask, stride_page, stride_tok,
             stride_head, s_stride_page, s_stride_tok, PAGE_SIZE: tl.constexpr, KV_KIND: tl.constexpr,
             HAS_SCALES: tl.constexpr):
    """K (or V) of the keys at ``pos`` [BLOCK_N] of one kv head, as float32 [BLOCK_N, BLOCK_D], read in place
    through the sequence's page table row; masked keys (and HOLE pages) read as 0 and load nothing."""
    page = tl.load(table_ptr + pos // PAGE_SIZE, mask=valid, other=0)
    valid = valid & (page >= 0)
    in_page = pos % PAGE_SIZE
    base = page * stride_page + in_page * stride_tok + kvh * stride_head
    raw = tl.load(cache_ptr + base[:, None] + offs_d[None, :], mask=valid[:, None] & d_mask[None, :], other=0)
    x = _dequantise(raw, KV_KIND)
    if HAS_SCALES:
        s = tl.load(scales_ptr + page * s_stride_page + in_page * s_stride_tok + kvh, mask=valid, other=0.0)
        x = x * s[:, None]
    return x


@triton.jit
def _tanh(x):
    """tanh in float32 from one exp of -2|x| (in (0, 1]: no overflow, 1 at x = 0, -> 0 far out), the sign put back;
    the interpreter has no libdevice tanh. Within 1e-7 of torch.tanh (absolute: a score cap * 1e-7 off at most)."""
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _scores(q, q_sink, k, pos, qk_scale, SINKS: tl.constexpr, HAS_SINKS: tl.constexpr, SOFT_CAP: tl.constexpr,
            DOT_DTYPE: tl.constexpr, PREC: tl.constexpr):
    """q @ k.T times qk_scale (log2 units); with sinks, sink keys scored against q_sink (kvserve/kernels/window.py).
    SOFT_CAP > 0: the natural-unit score s = q.k * scale is capped, SOFT_CAP * tanh(s / SOFT_CAP), then put in log2
    units; qk_scale is then scale / SOFT_CAP (tanh's argument in one multiply, see _AttendArgs.build). 0: the
    branch is compiled out."""
    kt = tl.trans(cast(k, DOT_DTYPE))
    s = tl.dot(q, kt, input_precision=PREC)
    if HAS_SINKS:
        s = tl.where(pos[None, :] < SINKS, tl.dot(q_sink, kt, input_precision=PREC), s)
    if SOFT_CAP > 0:
        s = _tanh(s * qk_scale) * (SOFT_CAP * LOG2E_C)
    else:
        s = s * qk_scale
    return s


@triton.jit
def _online_softmax_step(s, m, lsum, acc, v, DOT_DTYPE: tl.constexpr, PREC: tl.constexpr):
    """One block of masked scores s (-inf = masked) folded into the running (max, sum, acc). Rows with every
    score so far masked keep m = -inf, sum 0, acc = 0 (no NaN)."""
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m - m_safe)
    lsum = lsum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(cast(p, DOT_DTYPE), cast(v, DOT_DTYPE), input_precision=PREC)
    return m_new, lsum, acc


@triton.jit
def decode_split_kernel(
    q_ptr, q_sink_ptr, k_ptr, v_ptr, k_scales_ptr, v_scales_ptr, tables_ptr, seq_lens_ptr, rows_ptr, seq_ids_ptr,
    out_ptr, part_acc_ptr, part_ml_ptr, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_table, stride_page, stride_tok, stride_head,
    s_stride_page, s_stride_tok, num_heads, num_splits,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_TOKENS: tl.constexpr, WINDOW: tl.constexpr,
    SINKS: tl.constexpr, KV_KIND: tl.constexpr, HAS_SCALES: tl.constexpr, HAS_SINKS: tl.constexpr,
    SOFT_CAP: tl.constexpr, DIRECT: tl.constexpr, DOT_DTYPE: tl.constexpr, PREC: tl.constexpr,
):
    """Program (i, kv head, split): decode sequence seq_ids[i]'s query heads of that kv head over keys
    [split * SPLIT_TOKENS, +SPLIT_TOKENS) of its key index space. DIRECT (one split): normalises and writes the
    output row; else writes the unnormalised partial (acc, max, sum) for reduce_splits_kernel. A split past
    the sequence's keys loops zero times; seq_len 0 (a padding row) reads no key and gives zeros."""
    i, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b = tl.load(seq_ids_ptr + i)
    seq_len = tl.load(seq_lens_ptr + b)
    row = tl.load(rows_ptr + b)
    num_sink, window_lo, num_keys = _key_range(seq_len - 1, seq_len - 1, WINDOW, SINKS)
    offs_g, offs_d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
    g_mask, d_mask = offs_g < GROUP, offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q_off = row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    qd_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + q_off, mask=qd_mask, other=0.0).to(DOT_DTYPE)
    q_sink = q
    if HAS_SINKS:
        q_sink = tl.load(q_sink_ptr + q_off, mask=qd_mask, other=0.0).to(DOT_DTYPE)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    start = split * SPLIT_TOKENS
    end = tl.minimum(start + SPLIT_TOKENS, num_keys)
    table = tables_ptr + b * stride_table
    for v0 in range(start, end, BLOCK_N):
        idx = v0 + tl.arange(0, BLOCK_N)
        valid = idx < end
        pos = tl.where(idx < num_sink, idx, window_lo + idx - num_sink)
        k = _load_kv(k_ptr, k_scales_ptr, table, pos, valid, kvh, offs_d, d_mask, stride_page, stride_tok,
                     stride_head, s_stride_page, s_stride_tok, PAGE_SIZE, KV_KIND, HAS_SCALES)
        s = _scores(q, q_sink, k, pos, qk_scale, SINKS, HAS_SINKS, SOFT_CAP, DOT_DTYPE, PREC)
        s = tl.where(valid[None, :], s, float("-inf"))
        v = _load_kv(v_ptr, v_scales_ptr, table, pos, valid, kvh, offs_d, d_mask, stride_page, stride_tok,
                     stride_head, s_stride_page, s_stride_tok, PAGE_SIZE, KV_KIND, HAS_SCALES)
        m, lsum, acc = _online_softmax_step(s, m, lsum, acc, v, DOT_DTYPE, PREC)
    if DIRECT:
        out = acc / tl.where(lsum > 0, lsum, 1.0)[:, None]
        o_off = row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + o_off, cast(out, out_ptr.dtype.element_ty), mask=qd_mask)
    else:
        part = (i * num_heads + heads) * num_splits + split  # [BLOCK_G] rows of [seqs, heads, splits]
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=qd_mask)
        tl.store(part_ml_ptr + part * 2, m, mask=g_mask)
        tl.store(part_ml_ptr + part * 2 + 1, lsum, mask=g_mask)


@triton.jit
def reduce_splits_kernel(
    part_acc_ptr, part_ml_ptr, seq_lens_ptr, rows_ptr, seq_ids_ptr, out_ptr, stride_ot, stride_oh, num_heads,
    num_splits, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    SPLIT_TOKENS: tl.constexpr, WINDOW: tl.constexpr, SINKS: tl.constexpr,
):
    """Program (i, head): merges the partials of the splits that held keys (from the real seq_len, on device)
    into the output row; no split held any (seq_len 0): zeros."""
    i, h = tl.program_id(0), tl.program_id(1)
    b = tl.load(seq_ids_ptr + i)
    seq_len = tl.load(seq_lens_ptr + b)
    row = tl.load(rows_ptr + b)
    _, _, num_keys = _key_range(seq_len - 1, seq_len - 1, WINDOW, SINKS)
    num_active = (num_keys + SPLIT_TOKENS - 1) // SPLIT_TOKENS
    offs_s, offs_d = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    s_mask, d_mask = offs_s < num_active, offs_d < HEAD_DIM
    part = (i * num_heads + h) * num_splits + offs_s
    m = tl.load(part_ml_ptr + part * 2, mask=s_mask, other=float("-inf"))
    lsum = tl.load(part_ml_ptr + part * 2 + 1, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :],
                  other=0.0)
    m_all = tl.max(m, 0)
    w = tl.where(s_mask & (m > float("-inf")), tl.math.exp2(m - tl.where(m_all > float("-inf"), m_all, 0.0)), 0.0)
    total = tl.sum(w * lsum, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * stride_ot + h * stride_oh + offs_d, cast(out, out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def prefill_kernel(
    q_ptr, q_sink_ptr, k_ptr, v_ptr, k_scales_ptr, v_scales_ptr, tables_ptr, q_lens_ptr, start_pos_ptr, rows_ptr,
    item_seq_ptr, item_q_ptr, out_ptr, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_table, stride_page, stride_tok, stride_head,
    s_stride_page, s_stride_tok,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
    SINKS: tl.constexpr, KV_KIND: tl.constexpr, HAS_SCALES: tl.constexpr, HAS_SINKS: tl.constexpr,
    SOFT_CAP: tl.constexpr, DOT_DTYPE: tl.constexpr, PREC: tl.constexpr,
):
    """Program (item, kv head): BLOCK_Q query rows of one prefill chunk (item_seq, first row item_q), all the
    query heads of that kv head folded into the tile's rows (row r: query r // BLOCK_G, head r % BLOCK_G), over
    the keys those rows read, causally (and inside the window / the sinks)."""
    item, kvh = tl.program_id(0), tl.program_id(1)
    b = tl.load(item_seq_ptr + item)
    q0 = tl.load(item_q_ptr + item)
    q_len = tl.load(q_lens_ptr + b)
    start = tl.load(start_pos_ptr + b)
    first_row = tl.load(rows_ptr + b)
    r = tl.arange(0, BLOCK_Q * BLOCK_G)
    qi, g = q0 + r // BLOCK_G, r % BLOCK_G
    r_mask = (qi < q_len) & (g < GROUP)
    q_pos = start + qi
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + g
    qd_mask = r_mask[:, None] & d_mask[None, :]
    q_off = (first_row + qi)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=qd_mask, other=0.0).to(DOT_DTYPE)
    q_sink = q
    if HAS_SINKS:
        q_sink = tl.load(q_sink_ptr + q_off, mask=qd_mask, other=0.0).to(DOT_DTYPE)
    last_pos = start + tl.minimum(q0 + BLOCK_Q, q_len) - 1
    num_sink, window_lo, num_keys = _key_range(start + q0, last_pos, WINDOW, SINKS)
    m = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
    table = tables_ptr + b * stride_table
    for v0 in range(0, num_keys, BLOCK_N):
        idx = v0 + tl.arange(0, BLOCK_N)
        valid = idx < num_keys
        pos = tl.where(idx < num_sink, idx, window_lo + idx - num_sink)
        k = _load_kv(k_ptr, k_scales_ptr, table, pos, valid, kvh, offs_d, d_mask, stride_page, stride_tok,
                     stride_head, s_stride_page, s_stride_tok, PAGE_SIZE, KV_KIND, HAS_SCALES)
        s = _scores(q, q_sink, k, pos, qk_scale, SINKS, HAS_SINKS, SOFT_CAP, DOT_DTYPE, PREC)
        seen = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            seen = seen & ((pos[None, :] > q_pos[:, None] - WINDOW) | (pos[None, :] < SINKS))
        s = tl.where(seen, s, float("-inf"))
        v = _load_kv(v_ptr, v_scales_ptr, table, pos, valid, kvh, offs_d, d_mask, stride_page, stride_tok,
                     stride_head, s_stride_page, s_stride_tok, PAGE_SIZE, KV_KIND, HAS_SCALES)
        m, lsum, acc = _online_softmax_step(s, m, lsum, acc, v, DOT_DTYPE, PREC)
    out = acc / tl.where(lsum > 0, lsum, 1.0)[:, None]
    o_off = (first_row + qi)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptr + o_off, cast(out, out_ptr.dtype.element_ty), mask=qd_mask)


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(n)
