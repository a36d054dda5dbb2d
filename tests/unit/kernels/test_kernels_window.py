"""Sliding windows and attention sinks in the cpu backend's C++ kernels (kvserve/kernels/paged_decode.cpp,
kvserve/kernels/paged_prefill.cpp) against the reference backend's gather (kvserve/kernels/window.py): windows across
page boundaries, page tables with HOLEs (released pages, NaN in the pool so that a read of one would show), the seam
between the sinks and the window, GQA, decodes on the split and the per-sequence paths, mixed steps of decodes
and prefill chunks, the generic (unspecialised) decode kernel, and quantised pages."""

from __future__ import annotations

import math

import pytest
import torch
from test_kernels import scattered_pages
from test_kernels_kvquant import QUANTISED, new_pool

from kvserve.common.attention_window import AttentionWindow
from kvserve.common.pages import HOLE
from kvserve.kernels.backends import get_backend
from kvserve.kernels.cpu_paged import CPUState
from kvserve.kernels.paged_attention import build_metadata, write_kv
from kvserve.kernels.reference import ReferenceBackend

CPU = torch.device("cpu")
TOL = dict(rtol=1e-5, atol=1e-5)
PAGE = 16  # the prefill kernel's page size


@pytest.fixture(scope="module")
def cpu_backend():
    return get_backend("cpu", CPU)


def window_step(lengths, cached, heads, kv_heads, window, sinks, seed, page_size=PAGE, head_dim=16,
                dtype=torch.float32):
    """A step whose sequences' cached prefixes earlier steps wrote: (q, k, v, q_sink, cache, scales, meta). Pages
    no row of the step reads are HOLEs in the tables; pages in no table hold NaN (float32) or NaN scales
    (quantised), so a kernel that read one would give NaN."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // page_size) for n in lengths) + 3
    if dtype in QUANTISED:
        cache, scales = new_pool(num_pages, page_size, kv_heads, head_dim, dtype, True)
    else:
        cache, scales = torch.zeros((2, num_pages, page_size, kv_heads, head_dim)), None
    tables = scattered_pages(len(lengths), lengths, page_size, num_pages, gen)
    full = [tuple(torch.randn(n, h, head_dim, generator=gen) for h in (heads, kv_heads, kv_heads)) for n in lengths]
    for (_, k, v), table, c in zip(full, tables, cached, strict=True):
        if c:
            write_kv(k[:c], v[:c], cache, build_metadata([0], [c], [table], page_size, CPU).slot_mapping, scales)
    policy = AttentionWindow(window, sinks)
    for table, c, n in zip(tables, cached, lengths, strict=True):
        read = set(policy.pages_read(c, n, page_size))
        table[:] = [p if i in read else HOLE for i, p in enumerate(table)]
    unused = sorted(set(range(1, num_pages)) - {p for t in tables for p in t})  # page 0: the reference's padding
    if scales is None:
        cache[:, unused] = float("nan")
    else:
        scales[:, unused] = float("nan")
    meta = build_metadata(cached, [n - c for n, c in zip(lengths, cached, strict=True)], tables, page_size, CPU,
                          policy)
    q, k, v = (torch.cat([t[i][c:] for t, c in zip(full, cached, strict=True)]) for i in range(3))
    q_sink = torch.randn(q.shape, generator=gen) if sinks else None
    return q, k, v, q_sink, cache, scales, meta


def run_both(cpu, q, k, v, q_sink, cache, scales, meta):
    """(the cpu backend's output, the reference's) of forward() on copies of the pool; asserts the cpu backend
    took its kernels (no reference state) and wrote the same bytes."""
    outs, pools = [], []
    for backend in (cpu, ReferenceBackend()):
        c, s = cache.clone(), None if scales is None else scales.clone()
        state = backend.prepare(meta)
        if backend is cpu:
            assert isinstance(state, CPUState)
        outs.append(backend.forward(q, k, v, c, meta, state, 1 / math.sqrt(q.shape[-1]), s, q_sink))
        pools.append(c.view(torch.uint8))
    assert torch.equal(*pools)
    assert outs[0].isfinite().all()
    return outs


def check(cpu, *step):
    out, ref = run_both(cpu, *step)
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (2, 2)])
@pytest.mark.parametrize("window,sinks", [(16, 0), (40, 0), (40, 4), (33, 16), (20, 20)])
def test_decodes_far_past_the_window_skip_the_holes(cpu_backend, window, sinks, heads, kv_heads):
    """Decodes of many lengths (the per-sequence path: more sequences than twice the threads), their windows
    starting at every offset inside a page; the pages between the sinks and the window are HOLEs."""
    lengths = [1, 15, 16, 17, 31, 40, 41, 57, 64, 65, 100, 130]
    step = window_step(lengths, [n - 1 for n in lengths], heads, kv_heads, window, sinks, seed=window + sinks)
    assert (step[-1].page_tables == HOLE).any()
    check(cpu_backend, *step)


@pytest.mark.parametrize("window,sinks", [(64, 0), (64, 4), (300, 8)])
def test_a_few_long_decodes_split_over_the_threads(cpu_backend, window, sinks):
    """Fewer sequences than twice the threads: the window's keys in parts over the threads, the sinks as one
    more part, merged."""
    lengths = [2000, 700]
    step = window_step(lengths, [n - 1 for n in lengths], 6, 2, window, sinks, seed=sinks)
    check(cpu_backend, *step)


@pytest.mark.parametrize("n", [30, 36, 48, 200])
def test_the_seam_between_sinks_and_window(cpu_backend, n):
    """sinks 4, window 20: the window's first key inside the sink page (n 30: keys 10..), right after it (36:
    16..), a page later (48: 28..) and far after (200); a decode and a prefill chunk ending at n."""
    for lengths, cached in (([n], [n - 1]), ([n], [n - 7]), ([n, n], [n - 1, n - 9])):
        check(cpu_backend, *window_step(lengths, cached, 6, 2, 20, 4, seed=n))


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4)])
@pytest.mark.parametrize("window,sinks", [(16, 0), (24, 3), (40, 16), (70, 20)])
def test_prefill_chunks_whose_rows_windows_start_on_different_pages(cpu_backend, window, sinks, heads, kv_heads):
    """A fresh prefill longer than the window (its rows' windows slide across pages inside a block of 16 rows),
    chunks over a cached prefix with holes, a chunk shorter than a block; beside decodes."""
    lengths, cached = [90, 200, 61, 45, 1, 80], [0, 150, 50, 44, 0, 79]
    step = window_step(lengths, cached, heads, kv_heads, window, sinks, seed=window * sinks + heads)
    assert (step[-1].page_tables == HOLE).any()
    check(cpu_backend, *step)


@pytest.mark.parametrize("dtype", QUANTISED)
@pytest.mark.parametrize("window,sinks", [(24, 0), (24, 5)])
def test_quantised_pages(cpu_backend, dtype, window, sinks):
    """int8 and float8 pools with a scale per token and kv head: decodes (both paths) and prefill chunks."""
    for lengths, cached in (([70, 33, 1, 50, 17, 90], [69, 32, 0, 30, 0, 60]), ([300], [299])):
        check(cpu_backend, *window_step(lengths, cached, 6, 2, window, sinks, seed=len(lengths), dtype=dtype))


@pytest.mark.parametrize("head_dim,page_size", [(24, 16), (16, 128)])
def test_the_generic_decode_kernel_and_the_reference_prefill_fallback(cpu_backend, head_dim, page_size):
    """Shapes the specialised kernels do not take: the generic decode kernel reads the window too, and prefill
    chunks go through the reference groups (paged_prefill_supports refuses them) with their sinks."""
    lengths = [300, 150, 140, 9, 200]
    cached = [299, 149, 100, 0, 199]
    check(cpu_backend, *window_step(lengths, cached, 6, 2, 128, 5, seed=head_dim, page_size=page_size,
                                    head_dim=head_dim))


def test_without_a_window_the_sink_query_is_never_read(cpu_backend):
    """The dense path ignores q_sink (none is passed): same output as before windows existed."""
    lengths, cached = [50, 1, 40], [49, 0, 20]
    q, k, v, _, cache, scales, meta = window_step(lengths, cached, 6, 2, 0, 0, seed=3)
    check(cpu_backend, q, k, v, None, cache, scales, meta)


def test_the_kernels_refuse_sinks_without_their_query(cpu_backend):
    ext = cpu_backend.ext
    q = torch.zeros(1, 2, 16)
    cache = torch.zeros(2, 2, 16, 2, 16)
    tables, lens = torch.tensor([[0, 1]]), torch.tensor([20])
    with pytest.raises(RuntimeError, match="q_sink"):
        ext.paged_decode(q, cache, None, tables, lens, 0.25, 16, 4, None)
    with pytest.raises(RuntimeError, match="sinks only with a window"):
        ext.paged_decode(q, cache, None, tables, lens, 0.25, 0, 4, q)
    out = ext.paged_decode(q, cache, None, tables, lens, 0.25, 16, 4, q)
    assert out.shape == q.shape
