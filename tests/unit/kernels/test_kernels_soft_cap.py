"""Attention logit soft-capping (Gemma 2: every score s, after the scale, becomes cap * tanh(s / cap) before the
softmax) in the cpu backend's C++ kernels (kvserve/kernels/paged_decode.cpp, kvserve/kernels/paged_prefill.cpp)
against the reference backend (kvserve/kernels/window.py's scored_attention): decodes on the per-sequence and the
split paths, prefill chunks over cached prefixes beside decodes, GQA and MHA, with windows and sinks (the sink
keys' scores are capped too), quantised pages (the cap on the score after the K scale), the generic decode kernel
and the reference prefill fallback. Queries are scaled up so that scores run to several units, far past the caps
used: each case also checks that the capped attention differs clearly from the uncapped one, so a kernel that
ignored the cap would fail."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_kernels_kvquant import QUANTISED
from test_kernels_window import TOL, run_both, window_step

from kvserve.kernels.backends import get_backend

CPU = torch.device("cpu")
SHARP = 4.0  # queries times this: scores of standard deviation 4 (q, k ~ N(0, 1), scale 1 / sqrt(head_dim))
CAPS = [0.5, 2.0]
CAPPED_APART = 0.05  # the least max |capped - uncapped| of a case's reference outputs


@pytest.fixture(scope="module")
def cpu_backend():
    return get_backend("cpu", CPU)


@pytest.fixture
def threads():
    """Sets torch's intra-op threads for one test (the decode kernel splits a step of fewer sequences than twice
    the threads over them), and restores them."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def sharp_step(*args, **kwargs):
    """window_step's step with its queries (and sink queries) scaled by SHARP."""
    q, k, v, q_sink, cache, scales, meta = window_step(*args, **kwargs)
    return q * SHARP, k, v, None if q_sink is None else q_sink * SHARP, cache, scales, meta


def check_capped(cpu, step, cap):
    """The cpu backend's capped attention equals the reference's, which differs clearly from the uncapped one."""
    *inputs, meta = step
    out, ref = run_both(cpu, *inputs, dataclasses.replace(meta, logits_soft_cap=cap))
    torch.testing.assert_close(out, ref, **TOL)
    _, uncapped = run_both(cpu, *inputs, meta)
    assert (ref - uncapped).abs().max() > CAPPED_APART


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (2, 2)])
@pytest.mark.parametrize("window,sinks", [(0, 0), (40, 0), (40, 4)])
def test_decodes_of_many_lengths_one_sequence_per_thread(cpu_backend, threads, window, sinks, heads, kv_heads, cap):
    """One thread: every decode on the per-sequence path (decode_seq_fast), pages of 16 tokens, lengths across
    page and window boundaries."""
    threads(1)
    lengths = [1, 15, 16, 17, 31, 40, 41, 57, 64, 65, 100, 130]
    step = sharp_step(lengths, [n - 1 for n in lengths], heads, kv_heads, window, sinks, seed=window + heads)
    check_capped(cpu_backend, step, cap)


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("window,sinks", [(0, 0), (64, 4), (300, 8)])
def test_a_few_long_decodes_split_over_the_threads(cpu_backend, threads, window, sinks, cap):
    """Four threads and two long decodes: each sequence's keys in parts (their sinks one more) whose capped
    partial softmaxes are merged (decode_split)."""
    threads(4)
    lengths = [2000, 700]
    check_capped(cpu_backend, sharp_step(lengths, [n - 1 for n in lengths], 6, 2, window, sinks, seed=sinks), cap)


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4)])
@pytest.mark.parametrize("window,sinks", [(0, 0), (24, 3), (40, 16)])
def test_prefill_chunks_over_cached_prefixes_beside_decodes(cpu_backend, window, sinks, heads, kv_heads, cap):
    """A mixed step: a fresh prefill, chunks over cached prefixes (the prefill kernel), a chunk shorter than a
    block of rows, and decodes."""
    lengths, cached = [90, 200, 61, 45, 1, 80], [0, 150, 50, 44, 0, 79]
    step = sharp_step(lengths, cached, heads, kv_heads, window, sinks, seed=window + sinks + heads)
    check_capped(cpu_backend, step, cap)


@pytest.mark.parametrize("dtype", QUANTISED)
@pytest.mark.parametrize("window,sinks", [(0, 0), (24, 5)])
def test_quantised_pages(cpu_backend, dtype, window, sinks):
    """int8 and float8 pools with a scale per token and kv head: the cap applies to the score after its K
    scale, in decodes (both paths) and prefill chunks."""
    for lengths, cached in (([70, 33, 1, 50, 17, 90], [69, 32, 0, 30, 0, 60]), ([300], [299])):
        step = sharp_step(lengths, cached, 6, 2, window, sinks, seed=len(lengths), dtype=dtype)
        check_capped(cpu_backend, step, 1.0)


@pytest.mark.parametrize("window,sinks", [(0, 0), (128, 5)])
@pytest.mark.parametrize("head_dim,page_size", [(24, 16), (16, 128)])
def test_the_generic_decode_kernel_and_the_reference_prefill_fallback(cpu_backend, head_dim, page_size, window,
                                                                     sinks):
    """Shapes the specialised kernels do not take: the generic decode kernel caps its scores, and prefill chunks
    go through the reference groups, which read the cap from the step's metadata."""
    lengths, cached = [300, 150, 140, 9, 200], [299, 149, 100, 0, 199]
    step = sharp_step(lengths, cached, 6, 2, window, sinks, seed=head_dim, page_size=page_size, head_dim=head_dim)
    check_capped(cpu_backend, step, 1.5)


def test_a_cap_past_every_score_leaves_the_attention_as_it_was(cpu_backend):
    """cap * tanh(s / cap) -> s as the cap grows: a cap far past the scores gives the uncapped output."""
    *inputs, meta = window_step([50, 1, 40], [49, 0, 20], 6, 2, 0, 0, seed=3)
    out, _ = run_both(cpu_backend, *inputs, dataclasses.replace(meta, logits_soft_cap=1e4))
    uncapped, _ = run_both(cpu_backend, *inputs, meta)
    torch.testing.assert_close(out, uncapped, **TOL)


def test_the_kernels_refuse_a_negative_cap(cpu_backend):
    ext = cpu_backend.ext
    q, cache = torch.zeros(1, 2, 16), torch.zeros(2, 2, 16, 2, 16)
    tables, lens = torch.tensor([[0, 1]]), torch.tensor([20])
    with pytest.raises(RuntimeError, match="logits_soft_cap"):
        ext.paged_decode(q, cache, None, tables, lens, 0.25, logits_soft_cap=-1.0)
    with pytest.raises(RuntimeError, match="logits_soft_cap"):
        ext.paged_prefill(q, cache, None, tables, torch.tensor([0]), torch.tensor([1]), torch.tensor([19]), 0.25,
                          torch.empty_like(q), logits_soft_cap=float("nan"))
