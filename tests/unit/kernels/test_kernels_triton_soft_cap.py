"""The triton backend's soft cap on the attention scores (``meta.logits_soft_cap``, Gemma 2: cap * tanh(s / cap)
after the scale, before the masks) against the reference backend, in Triton's CPU interpreter (tests/conftest.py):
decodes, prefill chunks on cached tokens and mixed steps with GQA and MHA, the split-K decode path, sliding windows
and sinks (sink keys capped too), quantised pages, and scores far past the cap. The queries are scaled up so that
scores run to several units and a cap of 1-2 moves the output far past the tolerance: each case also asserts
that the capped output is not the uncapped one, so a kernel that ignored the cap would fail."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from test_kernels_kvquant import QUANTISED
from test_kernels_triton import TOL, D, run_both, step_inputs

from kvserve.common.pages import HOLE
from kvserve.kernels.reference import ReferenceBackend
from kvserve.kernels.triton_paged import TritonBackend, plan_splits

GAIN = 4.0  # q times this: with scale 1/sqrt(D), scores of standard deviation about 4, well past a cap of 1-2
CAP_SHOWS = 0.05  # the least largest difference a cap makes to the output here (it is ~0.5): far past TOL


def capped(step, cap: float, gain: float = GAIN):
    """The step's forward() arguments with q (and q_sink) times gain and the metadata's soft cap set."""
    q, k, v, q_sink, cache, scales, meta = step[:7]
    q_sink = None if q_sink is None else q_sink * gain
    return q * gain, k, v, q_sink, cache, scales, replace(meta, logits_soft_cap=cap)


def assert_capped_as_the_reference(step, cap: float, triton: TritonBackend | None = None, gain: float = GAIN):
    """Triton's capped output equals the reference's; and differs from the uncapped one (the cap was applied)."""
    q, k, v, q_sink, cache, scales, meta = capped(step, cap, gain)
    out, ref = run_both(q, k, v, q_sink, cache, scales, meta, triton)
    assert out.isfinite().all()
    torch.testing.assert_close(out, ref, **TOL)
    plain = replace(meta, logits_soft_cap=0.0)
    reference = ReferenceBackend()
    uncapped = reference.forward(q, k, v, cache.clone(), plain, reference.prepare(plain), 1 / math.sqrt(D),
                                 None if scales is None else scales.clone(), q_sink)
    assert (out - uncapped).abs().max() > CAP_SHOWS
    return out


@pytest.mark.parametrize("heads,kv_heads,cap", [(6, 2, 1.0), (4, 4, 2.0)], ids=["gqa", "mha"])
def test_a_mixed_step_of_prefill_chunks_and_decodes_is_capped_as_the_reference(heads, kv_heads, cap):
    """Fresh prefills, chunks on cached prefixes (one starting mid-page) and decodes, across page boundaries."""
    lengths, cached = [23, 40, 17, 1, 64, 9], [0, 16, 15, 0, 63, 8]
    assert_capped_as_the_reference(step_inputs(lengths, cached, heads, kv_heads, 4, seed=heads), cap)


@pytest.mark.parametrize("window,sinks", [(0, 0), (48, 3)])
def test_split_decodes_are_capped_before_the_reduce(window, sinks):
    """The flash-decoding path (splits of 32 keys merged by reduce_splits_kernel): every split caps its scores,
    so the partial maxima and sums the reduce merges are of capped scores."""
    lengths = [1, 33, 100]
    step = step_inputs(lengths, [n - 1 for n in lengths], 4, 2, 4, seed=5, window=window, sinks=sinks)
    meta = step[6]
    assert plan_splits(meta.window.tokens_kept(meta.max_seq_len), len(lengths), 2, 32, 1 << 20)[0] > 1
    assert_capped_as_the_reference(step, 1.5, TritonBackend(min_split_tokens=32, target_programs=1 << 20))


@pytest.mark.parametrize("window,sinks,page_size", [(8, 3, 4), (6, 2, 1)])
def test_sliding_windows_and_sinks_are_capped_as_the_reference(window, sinks, page_size):
    """Sink keys (scored against q_sink) capped as the window's keys, over page tables with HOLEs: decodes far
    past the window, a chunk whose rows' windows start on different pages, a fresh prefill longer than it."""
    lengths, cached = [61, 50, 30, 9, 1], [60, 31, 0, 8, 0]
    step = step_inputs(lengths, cached, 4, 2, page_size, seed=window + sinks, window=window, sinks=sinks)
    assert (step[6].page_tables == HOLE).any()
    assert_capped_as_the_reference(step, 1.0)


@pytest.mark.parametrize("dtype", QUANTISED, ids=str)
def test_quantised_pages_are_dequantised_then_capped(dtype):
    lengths, cached = [40, 17, 1, 33], [16, 0, 0, 32]
    step = step_inputs(lengths, cached, 4, 2, 4, seed=7, dtype=dtype, per_token=True)
    assert_capped_as_the_reference(step, 2.0)


def test_scores_far_past_the_cap_saturate_without_nan():
    """Scores of hundreds of units: tanh's exp must neither overflow nor lose its sign (every score at +-cap)."""
    lengths, cached = [20, 5, 1], [4, 4, 0]
    assert_capped_as_the_reference(step_inputs(lengths, cached, 4, 2, 4, seed=9), 2.0, gain=300.0)
