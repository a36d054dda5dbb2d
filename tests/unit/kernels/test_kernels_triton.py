"""The triton backend (kvserve/kernels/triton_paged.py) against dense causal attention and the reference backend, run in
Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1 where there is no CUDA device): lengths
across page boundaries, GQA ratios, page sizes, chunked prefill on cached tokens, mixed steps, every KV format,
sliding windows and sinks over page tables with holes, padding rows, the split-K decode path; its fused ops
(rope + store, byte for byte on quantised pools; the norms; argmax); its selection; and the real model's greedy
tokens. Shapes are small: the interpreter runs every program of a grid in Python."""

from __future__ import annotations

import math

import pytest
import torch
from test_kernels import dense_attention, scattered_pages
from test_kernels_kvquant import QUANTISED, SCHEMES, new_pool

from kvserve.common.attention_window import AttentionWindow
from kvserve.common.pages import HOLE
from kvserve.kernels.backends import get_backend
from kvserve.kernels.kv_quant import FORMAT_OF_DTYPE, FORMATS, write_kv_quantised
from kvserve.kernels.paged_attention import build_metadata, write_kv
from kvserve.kernels.reference import ReferenceBackend, rope_split, sink_query
from kvserve.kernels.rotary import cos_sin_table, inverse_frequencies
from kvserve.kernels.triton_paged import TritonBackend

CPU = torch.device("cpu")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the interpreter on CPU (conftest.py)
TOL = dict(rtol=1e-5, atol=1e-5) if DEVICE.type == "cpu" else dict(rtol=1e-4, atol=1e-4)
D = 16
VALUE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_pool(num_pages, page_size, kv_heads, head_dim, dtype, per_token):
    """A layer's pool of ``dtype``, zeros, and its scales (None: the tensor scheme)."""
    if dtype in QUANTISED:
        return new_pool(num_pages, page_size, kv_heads, head_dim, dtype, per_token)
    return torch.zeros((2, num_pages, page_size, kv_heads, head_dim), dtype=dtype), None


def step_inputs(lengths, cached, heads, kv_heads, page_size, seed, dtype=torch.float32, per_token=True,
                window=0, sinks=0, model_dtype=torch.float32):
    """A step over a pool whose cached prefixes earlier steps wrote: (q, k, v, q_sink, cache, scales, meta,
    per-sequence full (q, k, v) in float32). With a window the pages no row of the step reads are HOLEs. Pages
    in no table (released ones included) hold NaN where the format can, so that a read of one would show."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // page_size) for n in lengths) + 3
    cache, scales = make_pool(num_pages, page_size, kv_heads, D, dtype, per_token)
    tables = scattered_pages(len(lengths), lengths, page_size, num_pages, gen)
    full = [tuple(torch.randn(n, h, D, generator=gen) for h in (heads, kv_heads, kv_heads)) for n in lengths]
    for (_, k, v), table, c in zip(full, tables, cached, strict=True):
        if c:
            meta = build_metadata([0], [c], [table], page_size, CPU)
            write_kv(k[:c].to(model_dtype), v[:c].to(model_dtype), cache, meta.slot_mapping, scales)
    if window:
        for table, c, n in zip(tables, cached, lengths, strict=True):
            read = set(AttentionWindow(window, sinks).pages_read(c, n, page_size))
            table[:] = [p if i in read else HOLE for i, p in enumerate(table)]
    if dtype not in QUANTISED:
        unused = sorted(set(range(1, num_pages)) - {p for t in tables for p in t})  # page 0: the reference's pad
        cache[:, unused] = float("nan")
    q_lens = [n - c for n, c in zip(lengths, cached, strict=True)]
    meta = build_metadata(cached, q_lens, tables, page_size, DEVICE, AttentionWindow(window, sinks))
    q, k, v = (torch.cat([t[i][c:] for t, c in zip(full, cached, strict=True)]).to(DEVICE, model_dtype)
               for i in range(3))
    q_sink = torch.randn(q.shape, generator=gen).to(DEVICE, model_dtype) if sinks else None
    return q, k, v, q_sink, cache.to(DEVICE), None if scales is None else scales.to(DEVICE), meta, full


def run_both(q, k, v, q_sink, cache, scales, meta, triton=None):
    """(triton's output, the reference's output) of forward() on copies of the pool; asserts both wrote the
    same bytes."""
    outs, pools = [], []
    for backend in (triton or TritonBackend(), ReferenceBackend()):
        c, s = cache.clone(), None if scales is None else scales.clone()
        outs.append(backend.forward(q, k, v, c, meta, backend.prepare(meta), 1 / math.sqrt(D), s, q_sink))
        pools.append((c, s))
    (c0, s0), (c1, s1) = pools
    assert torch.equal(c0.view(torch.uint8), c1.view(torch.uint8))
    assert s0 is None or torch.equal(s0, s1)
    return outs


def assert_dense(out, meta, full, **tol):
    offsets = meta.cu_q_lens.tolist()
    for b, ((q, k, v), c) in enumerate(zip(full, meta.start_pos.tolist(), strict=True)):
        torch.testing.assert_close(out[offsets[b]:offsets[b + 1]].cpu(), dense_attention(q[c:], k, v, c),
                                   **(tol or TOL))


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_prefills_of_lengths_across_page_boundaries_match_dense_attention(heads, kv_heads):
    lengths = [1, 15, 16, 17, 33, 100]
    q, k, v, _, cache, scales, meta, full = step_inputs(lengths, [0] * 6, heads, kv_heads, 16, seed=heads + kv_heads)
    out, ref = run_both(q, k, v, None, cache, scales, meta)
    assert_dense(out, meta, full)
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_a_decode_step_of_many_lengths_matches_dense_attention(page_size, heads, kv_heads):
    lengths = [1, 2, 15, 16, 17, 33, 64, 100]
    step = step_inputs(lengths, [n - 1 for n in lengths], heads, kv_heads, page_size, seed=page_size + heads)
    out, _ = run_both(*step[:7])
    assert_dense(out, step[6], step[7])


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_a_mixed_step_of_prefills_chunks_on_cached_tokens_and_decodes(page_size):
    lengths, cached = [23, 40, 17, 16, 1, 64], [0, 16, 16, 15, 0, 63]
    step = step_inputs(lengths, cached, 6, 2, page_size, seed=page_size)
    out, ref = run_both(*step[:7])
    assert_dense(out, step[6], step[7])


def test_chunked_prefill_on_cached_chunks_equals_dense_attention():
    """A 100-token prompt in chunks of 37, 37 and 26, each attending to the chunks before it in the pool."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, page_size, n = 4, 2, 4, 100
    q, k, v = (torch.randn(n, h, D, generator=gen) for h in (heads, kv_heads, kv_heads))
    cache = make_pool(30, page_size, kv_heads, D, torch.float32, False)[0].to(DEVICE)
    table = torch.randperm(30, generator=gen)[:25].tolist()
    backend, outs = TritonBackend(), []
    for start in (0, 37, 74):
        end = min(start + 37, n)
        meta = build_metadata([start], [end - start], [table], page_size, DEVICE)
        outs.append(backend.forward(*(x[start:end].to(DEVICE) for x in (q, k, v)), cache, meta,
                                    backend.prepare(meta), 1 / math.sqrt(D)))
    torch.testing.assert_close(torch.cat(outs).cpu(), dense_attention(q, k, v, 0), **TOL)


KV_CASES = [(torch.float32, True), (torch.bfloat16, True), (torch.float16, True)] + [
    (dtype, per_token) for dtype in QUANTISED for per_token in SCHEMES.values()]


@pytest.mark.parametrize("dtype,per_token", KV_CASES, ids=lambda x: str(x).replace("torch.", ""))
def test_every_kv_format_reads_as_the_reference_dequantises_it(dtype, per_token):
    """A mixed step over pages of every format: the same bytes written as the reference (kv_quant's write) and
    the same attention over the dequantised K/V; the float32 math within the format's precision."""
    lengths, cached = [40, 17, 1, 33], [16, 0, 0, 32]
    step = step_inputs(lengths, cached, 4, 2, 4, seed=7, dtype=dtype, per_token=per_token)
    out, ref = run_both(*step[:7])
    torch.testing.assert_close(out, ref, **TOL)
    if per_token or dtype != torch.int8:  # int8 with scale 1 holds randn as -3..3: no precision to compare
        assert_dense(out, step[6], step[7], rtol=0.2, atol=0.2)  # against float32 K/V: the format's precision


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_half_precision_model_over_its_own_pages_matches_the_reference(model_dtype):
    lengths, cached = [40, 1, 33], [16, 0, 32]
    step = step_inputs(lengths, cached, 4, 2, 16, seed=8, dtype=model_dtype, model_dtype=model_dtype)
    out, ref = run_both(*step[:7])
    assert out.dtype == model_dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("window,sinks,page_size", [(8, 0, 4), (8, 3, 4), (20, 5, 16), (6, 2, 1)])
def test_sliding_windows_and_sinks_over_page_tables_with_holes_match_the_reference(window, sinks, page_size):
    """Decodes far past the window, a chunk whose rows' windows start on different pages, a fresh prefill longer
    than the window; released pages are HOLEs in the tables and NaN in the pool (a read of one would show)."""
    lengths, cached = [61, 50, 30, 9, 1], [60, 31, 0, 8, 0]
    q, k, v, q_sink, cache, scales, meta, _ = step_inputs(lengths, cached, 4, 2, page_size, seed=window + sinks,
                                                          window=window, sinks=sinks)
    assert (meta.page_tables == HOLE).any()
    out, ref = run_both(q, k, v, q_sink, cache, scales, meta)
    assert out.isfinite().all()
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("window,sinks", [(0, 0), (24, 3)])
def test_decodes_split_over_the_kv_length_with_a_captured_max_seq_len(window, sinks):
    """The flash-decoding path: splits of 32 keys, and meta.max_seq_len raised to 300 as a CUDA graph's
    capture would set it: more splits than any sequence fills, each reading its real length on the device."""
    lengths = [1, 31, 33, 64, 100]
    q, k, v, q_sink, cache, scales, meta, _ = step_inputs(lengths, [n - 1 for n in lengths], 6, 2, 4, seed=11,
                                                          window=window, sinks=sinks)
    backend = TritonBackend(min_split_tokens=32, target_programs=1 << 20)
    for max_seq_len in (meta.max_seq_len, 300):
        meta.max_seq_len = max_seq_len
        state = backend.prepare(meta)
        out, ref = run_both(q, k, v, q_sink, cache, scales, meta, triton=backend)
        torch.testing.assert_close(out, ref, **TOL)
        state_out = backend.forward(q, k, v, cache.clone(), meta, state, 1 / math.sqrt(D), None, q_sink)
        torch.testing.assert_close(state_out, out, rtol=0, atol=0)
        want_keys = min(max_seq_len, window + sinks) if window else max_seq_len
        assert state.splits == (-(-want_keys // 32), 32)


def test_a_pure_decode_step_is_prepared_without_reading_the_device(monkeypatch):
    """CUDA-graph safety of the routing: prepare() of a decode step calls nothing that syncs with the host."""
    step = step_inputs([5, 17], [4, 16], 4, 2, 4, seed=1)
    meta = step[6]

    def synced(*_args, **_kw):
        raise AssertionError("a host sync in a pure-decode prepare()")

    backend = TritonBackend()
    for name in ("tolist", "item", "__bool__", "__int__", "__index__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, synced)
    state = backend.prepare(meta)
    monkeypatch.undo()
    assert state.item_seq is None and state.decode_ids.tolist() == [0, 1]


def test_padding_rows_of_a_decode_batch_read_and_write_nothing():
    """Rows 1 and 3 with seq_len 0, slot -1 and page table 0s (a captured batch's padding): zeros out, no slot
    written, nothing read; rows 0 and 2 are what the batch without them gives."""
    q, k, v, _, cache, _, meta, _ = step_inputs([9, 30], [8, 29], 4, 2, 4, seed=4)
    backend = TritonBackend()
    want = backend.forward(q, k, v, cache.clone(), meta, backend.prepare(meta), 0.25)
    real = [0, 2]
    padded = build_metadata([0, 0, 0, 0], [1, 1, 1, 1], [[0]] * 4, 4, DEVICE)
    padded.start_pos = torch.tensor([8, -1, 29, -1], device=DEVICE)
    padded.seq_lens = torch.tensor([9, 0, 30, 0], device=DEVICE)
    padded.positions = torch.tensor([8, 0, 29, 0], device=DEVICE)
    padded.slot_mapping = torch.full((4,), -1, device=DEVICE)
    padded.slot_mapping[real] = meta.slot_mapping
    padded.page_tables = torch.zeros((4, meta.page_tables.shape[1]), dtype=torch.int64, device=DEVICE)
    padded.page_tables[real] = meta.page_tables
    padded.max_seq_len = 30
    x = [torch.full((4, t.shape[1], D), float("nan"), device=DEVICE) for t in (q, k, v)]
    for t, src in zip(x, (q, k, v), strict=True):
        t[real] = src
    before = cache.clone()
    out = backend.forward(*x, cache, padded, backend.prepare(padded), 0.25)
    assert not out[[1, 3]].any()
    torch.testing.assert_close(out[real], want, rtol=0, atol=0)
    changed = (cache.view(torch.int32) != before.view(torch.int32)).flatten(3).any(-1).view(2, -1).any(0)
    assert changed.nonzero().flatten().tolist() == sorted(meta.slot_mapping.tolist())


def split_heads(qkv, heads, kv_heads, head_dim):
    """The fused projection's output as (q, k, v) views [tokens, heads, D], not rotated."""
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim), v.view(-1, kv_heads, head_dim)


def rope_step(heads, kv_heads, head_dim, sinks=0):
    gen = torch.Generator().manual_seed(head_dim)
    lengths, cached = [23, 40, 1, 17], [0, 16, 0, 16]
    tables = scattered_pages(4, lengths, 16, 12, gen)
    meta = build_metadata(cached, [n - c for n, c in zip(lengths, cached, strict=True)], tables, 16, DEVICE)
    cos, sin = (t.to(DEVICE) for t in cos_sin_table(inverse_frequencies(head_dim, 10000.0, None), 128))
    qkv = (torch.randn(meta.num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3).to(DEVICE)
    sink_rope = (cos[meta.positions.clamp(max=5)], sin[meta.positions.clamp(max=5)]) if sinks else None  # any
    return qkv, cos[meta.positions], sin[meta.positions], meta, sink_rope


@pytest.mark.parametrize("dtype,per_token", KV_CASES[:1] + KV_CASES[3:], ids=lambda x: str(x).replace("torch.", ""))
def test_rope_and_store_writes_the_slots_the_reference_writes_with_its_bytes(dtype, per_token):
    """The fused RoPE + K/V write: q (and q at the sink positions) as the reference rotates it, every slot of the
    step written with the reference's bytes (quantised: kv_quant's, ties of the rounding included) and its
    scales, no other slot touched, padding tokens (slot -1) not written."""
    heads, kv_heads, head_dim = 6, 2, 32
    qkv, cos, sin, meta, sink_rope = rope_step(heads, kv_heads, head_dim, sinks=1)
    qkv[0, :] = 0.5 + torch.arange(qkv.shape[1], device=DEVICE) % 7  # token 0 is not rotated: halves of int8's rounding
    meta.slot_mapping[5] = -1
    prior, prior_scales = make_pool(12, 16, kv_heads, head_dim, dtype, per_token)
    prior = (prior if dtype in QUANTISED else prior + 7.0).to(DEVICE)
    prior_scales = None if prior_scales is None else prior_scales.to(DEVICE)
    c, s = prior.clone(), None if prior_scales is None else prior_scales.clone()
    q_t = qkv.new_empty((meta.num_tokens, heads, head_dim))
    q_sink_t = torch.empty_like(q_t)
    TritonBackend()._store(*split_heads(qkv, heads, kv_heads, head_dim), c, s, meta.slot_mapping, (cos, sin),
                           sink_rope, q_t, q_sink_t)
    pools = [(c, s)]
    q_r, k_r, v_r = rope_split(qkv, cos, sin, heads, kv_heads)
    keep = meta.slot_mapping >= 0
    c, s = prior.clone(), None if prior_scales is None else prior_scales.clone()
    if dtype in QUANTISED:
        write_kv_quantised(k_r[keep], v_r[keep], c, s, meta.slot_mapping[keep])
    else:
        write_kv(k_r[keep], v_r[keep], c, meta.slot_mapping[keep])
    pools.append((c, s))
    assert torch.equal(q_t, q_r) and torch.equal(q_sink_t, sink_query(qkv, sink_rope, heads))
    (c0, s0), (c1, s1) = pools
    assert torch.equal(c0.view(torch.uint8), c1.view(torch.uint8))
    assert s0 is None or torch.equal(s0, s1)
    assert not torch.equal(c0.view(torch.uint8), prior.view(torch.uint8))


def test_qkv_attention_equals_the_references_with_sinks_and_a_window():
    heads, kv_heads, head_dim = 4, 2, 16
    qkv, cos, sin, meta, _ = rope_step(heads, kv_heads, head_dim)
    meta.window = AttentionWindow(12, 2)
    meta.sink_positions = meta.positions.clamp(max=13)
    table_cos, table_sin = (t.to(DEVICE) for t in cos_sin_table(inverse_frequencies(head_dim, 10000.0, None), 128))
    sink_rope = (table_cos[meta.sink_positions], table_sin[meta.sink_positions])
    prior = torch.randn(2, 12, 16, kv_heads, head_dim, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    outs = []
    for backend in (TritonBackend(), ReferenceBackend()):
        outs.append(backend.qkv_attention(qkv, cos, sin, prior.clone(), meta, backend.prepare(meta), 0.25, heads,
                                          kv_heads, None, sink_rope=sink_rope))
    torch.testing.assert_close(outs[0], outs[1], **TOL)


@pytest.mark.parametrize("dtype", QUANTISED, ids=str)
def test_quantised_writes_round_every_value_as_torch_does(dtype):
    """The kernel's own float -> int8 / fp8 encoding (no hardware conversion) against torch's, over every finite
    value of the format, the midpoints between neighbours (ties: to even), just off them, subnormals, values
    past the range (saturated) and signed zeros; the tensor scheme, so the values are stored unscaled."""
    qmax = FORMAT_OF_DTYPE[dtype].qmax
    if dtype == torch.int8:
        grid = torch.arange(-127, 128, dtype=torch.float32)
    else:
        every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
        grid = every[every.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    values = torch.cat([grid, mids, mids.nextafter(grid[1:]), mids.nextafter(grid[:-1]),
                        torch.tensor([qmax * 1.01, -qmax * 3, 1e30, -1e30, 1e-30, -1e-30, 0.0, -0.0])])
    pad = -len(values) % 16
    values = torch.cat([values, torch.zeros(pad)]).view(-1, 1, 16).to(DEVICE)
    cache = new_pool(-(-values.shape[0] // 4), 4, 1, 16, dtype, False)[0].to(DEVICE)
    want = cache.clone()
    slots = torch.arange(values.shape[0], device=DEVICE)
    TritonBackend()._store(None, values, values, cache, None, slots, None, None, None, None)
    write_kv_quantised(values, values, want, None, slots)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_norms_and_silu_match_the_reference(dtype):
    triton, ref = TritonBackend(), ReferenceBackend()
    gen = torch.Generator().manual_seed(1)
    x, delta = (torch.randn(7, 96, generator=gen).to(DEVICE, dtype) for _ in range(2))
    w = torch.randn(96, generator=gen).to(DEVICE, dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(triton.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5), **tol)
    x_t, x_r = x.clone(), x.clone()
    y_t, y_r = triton.add_rms_norm_(x_t, delta, w, 1e-5), ref.add_rms_norm_(x_r, delta, w, 1e-5)
    assert torch.equal(x_t, x + delta) and torch.equal(x_r, x + delta)  # the residual, updated in place
    torch.testing.assert_close(y_t, y_r, **tol)
    gate_up = (torch.randn(5, 2 * 80, generator=gen) * 4).to(DEVICE, dtype)
    torch.testing.assert_close(triton.silu_mul(gate_up), ref.silu_mul(gate_up), **tol)


def test_argmax_takes_the_first_of_a_tie():
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(2))
    logits[1, 7] = logits[1, 300] = logits[1].max() + 1
    ids, lse = TritonBackend().argmax_logsumexp(logits)
    assert ids.tolist() == logits.argmax(-1).tolist() and ids[1] == 7
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1))


def test_selection_by_name_and_auto(monkeypatch, caplog):
    """--attention-backend triton selects it (on CPU only under the interpreter, else a ValueError naming why);
    auto picks it on CUDA, and on CPU stays what it was (cpu or reference)."""
    from kvserve.kernels import triton_paged

    assert get_backend("triton", DEVICE, torch.float32, "fp8_e5m2").name == "triton"
    assert set(TritonBackend.kv_dtypes) == set(FORMATS)
    assert get_backend("auto", CPU, torch.bfloat16).name == "reference"  # test_kernels: float32 on CPU
    assert get_backend("auto", torch.device("cuda"), torch.bfloat16).name == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="runs on CUDA, not cpu"):
        get_backend("triton", CPU)

    def missing():
        raise ImportError("No module named 'triton'")

    monkeypatch.setattr(triton_paged, "_kernels", missing)
    with pytest.raises(ValueError, match="triton is not importable"):
        get_backend("triton", torch.device("cuda"))
    assert get_backend("auto", torch.device("cuda")).name == "reference"
    assert "triton is not available" in caplog.text


def greedy(runner, prompts: list[list[int]], new_tokens: int, chunk: int) -> list[list[tuple[int, float]]]:
    """Greedy generation through runner.step, the prompts prefilled in chunks of ``chunk`` tokens beside the
    others' decodes (mixed steps): per prompt, its (token_id, logprob)s."""
    from kvserve.common.wire.worker import SamplingParams, StepBatch, StepItem

    page_size = runner.info.page_size
    tables = [tuple(range(i * 8, i * 8 + 8)) for i in range(len(prompts))]  # 8 pages each, scattered by i
    done = [0] * len(prompts)
    outs: list[list[tuple[int, float]]] = [[] for _ in prompts]
    while any(len(o) < new_tokens for o in outs):
        items = []
        for i, p in enumerate(prompts):
            tokens = p + [t for t, _ in outs[i]]
            if len(outs[i]) >= new_tokens:
                continue
            n = min(chunk, len(p) - done[i]) if done[i] < len(p) else 1
            assert done[i] + n <= len(tables[i]) * page_size
            items.append(StepItem(f"r{i}", tuple(tokens[done[i]:done[i] + n]), done[i], tables[i],
                                  sample=done[i] + n >= len(p), sampling=SamplingParams(temperature=0.0)))
        sampled = {s.req_id: s for s in runner.step(StepBatch(tuple(items))).sampled}
        for item in items:
            i = int(item.req_id[1:])
            done[i] += len(item.token_ids)
            if item.req_id in sampled:
                outs[i].append((sampled[item.req_id].token_id, sampled[item.req_id].logprob))
    return outs


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, model_dir):
    from window_models import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny") / "llama", "llama", model_dir)


@pytest.mark.parametrize("window,sinks", [(0, 0), (16, 4)])
def test_a_tiny_llama_generates_the_references_greedy_tokens(tiny_llama, window, sinks):
    """End to end through the worker's model (a 2-layer random-weight Llama of the default model's vocabulary:
    the real model's 30 layers take minutes in the interpreter): chunked prefills across pages beside decodes,
    then decodes; the same greedy tokens as the reference backend, logprobs within float32 noise."""
    from kvserve.worker.runner import ModelRunner, RunnerConfig

    prompts = [list(range(1000, 1040)), list(range(7000, 7009))]
    results = []
    for backend in ("triton", "reference"):
        runner = ModelRunner(RunnerConfig(model_dir=tiny_llama, num_pages=16, page_size=16, device=DEVICE.type,
                                          dtype="float32", attention_backend=backend, sliding_window=window,
                                          attention_sinks=sinks))
        assert runner.model.backend.name == backend
        results.append(greedy(runner, prompts, new_tokens=5, chunk=24))
    for got, want in zip(*results, strict=True):
        assert [t for t, _ in got] == [t for t, _ in want]
        torch.testing.assert_close(torch.tensor([lp for _, lp in got]), torch.tensor([lp for _, lp in want]),
                                   rtol=1e-4, atol=1e-4)
