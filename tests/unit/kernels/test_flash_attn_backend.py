"""The flash-attn backend's adapter (kvserve/kernels/flash_attn_backend.py) on CPU, behind flash-attn's own signatures.

flash-attn needs a GPU (and is not installed here), so its two entry points are replaced by torch functions of
the same signatures and semantics, written from the libraries' docstrings: FA4's
``flash_attn_varlen_func(q, k, v, cu_seqlens_q=, seqused_k=, page_table=, max_seqlen_q=, causal=, window_size=)``
and FA2's ``flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=, block_table=, causal=, window_size=)``,
each asserting the argument dtypes and shapes the real ones assert, with causal and window masks aligned to the
bottom right. The backend's outputs must equal the reference backend's on mixed steps, GQA and lengths across
page boundaries; the conversion, refusals and selection are checked exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.common.attention_window import AttentionWindow
from kvserve.common.pages import HOLE
from kvserve.kernels import flash_attn_backend as fa
from kvserve.kernels.backends import get_backend
from kvserve.kernels.flash_attn_backend import FlashAttnBackend, convert_metadata, pick_kernel
from kvserve.kernels.paged_attention import build_metadata, write_kv
from kvserve.kernels.reference import ReferenceBackend

DIM = 16


def dense_rows(q, k_pages, v_pages, table, num_keys: int, left: int | None, softcap: float = 0.0) -> torch.Tensor:
    """One sequence's q [L_q, H, D] over its first num_keys keys read through its page table; bottom-right
    causal (row i sees j <= i + L_k - L_q), and with a left window j >= i + L_k - L_q - left; scores soft-capped
    (softcap * tanh(s / softcap)) when softcap > 0. Rows that see no key are zeros, as flash-attn writes them."""
    page_size = k_pages.shape[1]
    pages = table[: -(-num_keys // page_size)].long()
    k = k_pages[pages].reshape(-1, *k_pages.shape[2:])[:num_keys].float()
    v = v_pages[pages].reshape(-1, *v_pages.shape[2:])[:num_keys].float()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) / math.sqrt(q.shape[-1])
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    row = torch.arange(q.shape[0])[:, None] + num_keys - q.shape[0]
    col = torch.arange(num_keys)[None, :]
    seen = col <= row
    if left is not None:
        seen &= col >= row - left
    probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", probs, v)


def fake_fa4_varlen(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                    min_seqlen_k=None, seqused_q=None, seqused_k=None, gather_kv_indices=None, page_table=None,
                    softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0, **_):
    batch = cu_seqlens_q.shape[0] - 1
    assert cu_seqlens_k is None and page_table.dtype == torch.int32 and page_table.shape[0] == batch
    assert k.shape == v.shape and k.dim() == 4 and q.dtype == k.dtype and q.dtype in (torch.bfloat16, torch.float16)
    assert cu_seqlens_q.dtype == seqused_k.dtype == torch.int32 and seqused_k.shape == (batch,)
    assert causal and softmax_scale == pytest.approx(1 / math.sqrt(q.shape[-1])) and window_size[1] in (None, 0)
    assert max_seqlen_q == int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    out = torch.zeros(q.shape, dtype=torch.float32)
    for b in range(batch):
        lo, hi = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        out[lo:hi] = dense_rows(q[lo:hi], k, v, page_table[b], int(seqused_k[b]), window_size[0], softcap)
    return out.to(q.dtype), torch.zeros(q.shape[1], q.shape[0])


def fake_fa2_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None, softmax_scale=None,
                     causal=False, window_size=(-1, -1), softcap=0.0, **_):
    assert k is None and v is None and k_cache.shape[1] % 256 == 0 and q.dim() == 4
    assert cache_seqlens.dtype == block_table.dtype == torch.int32 and causal and window_size[1] in (-1, 0)
    left = None if window_size[0] < 0 else window_size[0]
    return torch.stack([dense_rows(q[b], k_cache, v_cache, block_table[b], int(cache_seqlens[b]), left, softcap)
                        for b in range(q.shape[0])]).to(q.dtype)


def step_case(lengths, cached, heads, kv_heads, page_size, window=0, holes=False, seed=0, softcap=0.0):
    """A bf16 cache holding each sequence's cached prefix, and the step's q, k, v and metadata."""
    gen = torch.Generator().manual_seed(seed)
    tables, used = [], 0
    for n in lengths:
        tables.append(list(range(used, used + -(-n // page_size))))
        used += len(tables[-1])
    perm = torch.randperm(used + 2, generator=gen).tolist()
    tables = [[perm[p] for p in t] for t in tables]
    cache = torch.zeros(2, used + 2, page_size, kv_heads, DIM, dtype=torch.bfloat16)
    new = []
    for n, c, table in zip(lengths, cached, tables, strict=True):
        q, k, v = (torch.randn(n, h, DIM, generator=gen) for h in (heads, kv_heads, kv_heads))
        q, k, v = (q * (4 if softcap else 1)).bfloat16(), k.bfloat16(), v.bfloat16()  # scores a cap bends
        if c:
            slots = build_metadata([0], [c], [table], page_size, torch.device("cpu")).slot_mapping
            write_kv(k[:c], v[:c], cache, slots)
        new.append((q[c:], k[c:], v[c:]))
    if holes:  # pages wholly before every window still to come, released (kvserve/common/attention_window.py)
        tables = [[HOLE if (p + 1) * page_size <= c - window + 1 else page for p, page in enumerate(t)]
                  for t, c in zip(tables, cached, strict=True)]
    meta = build_metadata(cached, [n - c for n, c in zip(lengths, cached, strict=True)], tables, page_size,
                          torch.device("cpu"), window=AttentionWindow(window))
    meta.logits_soft_cap = softcap
    q, k, v = (torch.cat([t[i] for t in new]) for i in range(3))
    return cache, meta, q, k, v


def check_against_reference(backend, lengths, cached, heads, kv_heads, page_size, **kw):
    cache, meta, q, k, v = step_case(lengths, cached, heads, kv_heads, page_size, **kw)
    scale = 1 / math.sqrt(DIM)
    out = backend.forward(q, k, v, cache, meta, backend.prepare(meta), scale)
    ref = ReferenceBackend()
    expected = ref.attend(q.float(), cache.float(), ref.prepare(meta), scale)  # the pages as written by forward
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


MIXED = ([23, 40, 17, 16, 1, 64, 33], [0, 16, 16, 15, 0, 63, 32])  # prefill, chunks on cached, decodes at boundaries


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_fa4_adapter_matches_the_reference_on_mixed_steps(heads, kv_heads):
    check_against_reference(FlashAttnBackend(varlen=fake_fa4_varlen), *MIXED, heads, kv_heads, page_size=16)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_fa4_adapter_matches_on_decodes_across_page_boundaries(page_size):
    lengths = [1, 2, 15, 16, 17, 31, 32, 33, 100]
    check_against_reference(FlashAttnBackend(varlen=fake_fa4_varlen), lengths, [n - 1 for n in lengths], 8, 2,
                            page_size, seed=page_size)


def test_fa4_adapter_sliding_window_over_released_pages():
    """window (W - 1, 0) is kvserve's p - W < j <= p; the HOLEs a window leaves in page tables are read as page 0
    (masked), never as -1."""
    lengths, cached = [100, 70, 45], [99, 50, 0]
    check_against_reference(FlashAttnBackend(varlen=fake_fa4_varlen), lengths, cached, 8, 2, 16, window=20,
                            holes=True)


@pytest.mark.parametrize("window", [0, 300])
def test_fa2_adapter_front_pads_queries_and_matches_the_reference(window):
    lengths, cached = [600, 300, 257, 512], [256, 299, 0, 511]
    check_against_reference(FlashAttnBackend(kvcache=fake_fa2_kvcache), lengths, cached, 4, 2, 256, window=window)


@pytest.mark.parametrize("kernel", ["fa4", "fa2"])
def test_both_adapters_pass_the_soft_cap(kernel):
    """Gemma 2's soft cap reaches flash-attn's softcap: the outputs equal the reference's capped ones, and
    differ from the uncapped ones (so a dropped cap would show)."""
    fa4 = kernel == "fa4"
    backend = FlashAttnBackend(varlen=fake_fa4_varlen) if fa4 else FlashAttnBackend(kvcache=fake_fa2_kvcache)
    page_size = 16 if fa4 else 256
    lengths, cached = ([40, 17, 1], [16, 0, 0]) if fa4 else ([300, 257], [256, 0])
    check_against_reference(backend, lengths, cached, 4, 2, page_size, softcap=1.0)
    capped, plain = (step_case(lengths, cached, 4, 2, page_size, softcap=1.0) for _ in range(2))
    plain[1].logits_soft_cap = 0.0
    outs = [backend.forward(q, k, v, c, m, backend.prepare(m), 1 / math.sqrt(DIM)) for c, m, q, k, v in (capped, plain)]
    assert (outs[0].float() - outs[1].float()).abs().max() > 0.1


def test_conversion_is_int32_with_holes_as_page_zero_and_front_padded_rows():
    tables = [[5, HOLE, 7], [2], [3, 4]]
    meta = build_metadata([16, 0, 17], [3, 1, 2], tables, 8, torch.device("cpu"), window=AttentionWindow(8))
    a = convert_metadata(meta, padded_rows=True)
    assert all(t.dtype == torch.int32 for t in (a.cu_seqlens_q, a.seqused_k, a.page_table))
    assert a.cu_seqlens_q.tolist() == [0, 3, 4, 6] and a.seqused_k.tolist() == [19, 1, 19]
    assert a.page_table.tolist() == [[5, 0, 7], [2, 0, 0], [3, 4, 0]] and a.page_table.is_contiguous()
    assert (a.max_seqlen_q, a.max_seqlen_k, a.window_size) == (3, 19, (7, 0))
    assert a.q_rows.tolist() == [0, 1, 2, 5, 7, 8]  # each sequence's rows at the end of its block of 3
    assert convert_metadata(build_metadata([0], [4], [[0]], 8, torch.device("cpu"))).window_size is None


def test_refusals_say_why():
    meta = build_metadata([0], [4], [[0]], 16, torch.device("cpu"))
    q, k = torch.zeros(4, 2, DIM, dtype=torch.bfloat16), torch.zeros(4, 1, DIM, dtype=torch.bfloat16)
    backend = FlashAttnBackend(varlen=fake_fa4_varlen)
    with pytest.raises(ValueError, match="quantised int8"):
        backend.forward(q, k, k, torch.zeros(2, 2, 16, 1, DIM, dtype=torch.int8), meta, backend.prepare(meta), 1.0)
    with pytest.raises(ValueError, match="not torch.float32 over torch.float32"):
        backend.forward(q.float(), k.float(), k.float(), torch.zeros(2, 2, 16, 1, DIM), meta, backend.prepare(meta),
                        1.0)
    sinks = build_metadata([0], [4], [[0]], 16, torch.device("cpu"), window=AttentionWindow(16, 4))
    with pytest.raises(ValueError, match="attention sinks"):
        backend.prepare(sinks)
    with pytest.raises(ValueError, match="multiple of 256 tokens, not 16"):
        FlashAttnBackend(kvcache=fake_fa2_kvcache).prepare(meta)
    with pytest.raises(ValueError, match="exactly one"):
        FlashAttnBackend()


def test_pick_kernel_prefers_fa4_on_hopper_and_fa2_only_on_pages_of_256():
    assert pick_kernel(fake_fa4_varlen, fake_fa2_kvcache, (9, 0), 16) == {"varlen": fake_fa4_varlen}
    assert pick_kernel(fake_fa4_varlen, fake_fa2_kvcache, (8, 0), 256) == {"kvcache": fake_fa2_kvcache}
    with pytest.raises(ValueError, match="needs sm90 or newer, this GPU is sm80.*multiple of 256 tokens, not 16"):
        pick_kernel(fake_fa4_varlen, fake_fa2_kvcache, (8, 0), 16)


def test_selection_forces_flash_attn_only_where_it_serves_and_auto_never_picks_it(monkeypatch):
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match="runs on CUDA, not cpu"):
        get_backend("flash-attn", torch.device("cpu"), torch.bfloat16, "bfloat16")
    with pytest.raises(ValueError, match="not torch.float32 over float32"):
        get_backend("flash-attn", cuda, torch.float32, "float32")
    with pytest.raises(ValueError, match="not torch.bfloat16 over int8"):
        get_backend("flash-attn", cuda, torch.bfloat16, "int8")
    monkeypatch.setattr(fa, "load_kernels", lambda: (None, None, "flash_attn.cute: ModuleNotFoundError"))
    with pytest.raises(ValueError, match="not available: flash_attn.cute: ModuleNotFoundError"):
        get_backend("flash-attn", cuda, torch.bfloat16, "bfloat16")
    monkeypatch.setattr(fa, "load_kernels", lambda: (fake_fa4_varlen, fake_fa2_kvcache, ""))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    forced = get_backend("flash-attn", cuda, torch.bfloat16, "bfloat16", page_size=16)
    assert forced.name == "flash-attn" and forced.kernel == "flash-attn 4"
    assert not fa.HARDWARE_TESTED
    assert get_backend("auto", cuda, torch.bfloat16, "bfloat16").name in ("triton", "reference")
    assert get_backend("auto", torch.device("cpu"), torch.bfloat16, "bfloat16").name == "reference"
