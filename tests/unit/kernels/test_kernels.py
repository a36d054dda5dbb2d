"""The paged-attention backends (reference, and the CPU one with its in-place decode kernel) against dense
causal attention."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvserve.kernels.backends import get_backend
from kvserve.kernels.cpu_paged import CPUPagedBackend
from kvserve.kernels.paged_attention import build_metadata, write_kv
from kvserve.kernels.reference import ReferenceBackend
from kvserve.kernels.rotary import apply_rotary, cos_sin_table, inverse_frequencies

HEAD_DIM = 16


def dense_attention(q, k, v, start: int) -> torch.Tensor:
    """q: [n, H, D] at positions start..start+n-1; k, v: [start+n, Hkv, D]. Plain causal attention."""
    n, heads, _ = q.shape
    group = heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    qpos = torch.arange(start, start + n)[:, None]
    kpos = torch.arange(k.shape[0])[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def scattered_pages(num_seqs: int, lengths: list[int], page_size: int, num_pages: int, gen) -> list[list[int]]:
    """Non-contiguous, non-overlapping page tables, so slot arithmetic mistakes show."""
    perm = torch.randperm(num_pages, generator=gen).tolist()
    tables, used = [], 0
    for length in lengths:
        n = -(-length // page_size)
        tables.append(perm[used : used + n])
        used += n
    return tables


BACKENDS = {"reference": ReferenceBackend, "cpu": CPUPagedBackend}


def run_case(lengths, cached, heads, kv_heads, page_size, seed=0, backend="reference", head_dim=HEAD_DIM):
    """Sequences of total length lengths[b], of which cached[b] are already in the cache."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // page_size) for n in lengths) + 3
    cache = torch.zeros(2, num_pages, page_size, kv_heads, head_dim)
    tables = scattered_pages(len(lengths), lengths, page_size, num_pages, gen)
    full = [(torch.randn(n, heads, head_dim, generator=gen), torch.randn(n, kv_heads, head_dim, generator=gen),
             torch.randn(n, kv_heads, head_dim, generator=gen)) for n in lengths]
    # Earlier steps wrote the cached prefix.
    for (_, k, v), table, c in zip(full, tables, cached, strict=True):
        if c:
            meta = build_metadata([0], [c], [table], page_size, torch.device("cpu"))
            write_kv(k[:c], v[:c], cache, meta.slot_mapping)
    q_lens = [n - c for n, c in zip(lengths, cached, strict=True)]
    meta = build_metadata(cached, q_lens, tables, page_size, torch.device("cpu"))
    cat = [torch.cat([t[i][c:] for t, c in zip(full, cached, strict=True)]) for i in range(3)]
    backend = BACKENDS[backend]()
    out = backend.forward(*cat, cache, meta, backend.prepare(meta), 1 / math.sqrt(head_dim))
    offsets = meta.cu_q_lens.tolist()
    for b, ((q, k, v), c) in enumerate(zip(full, cached, strict=True)):
        expected = dense_attention(q[c:], k, v, c)
        torch.testing.assert_close(out[offsets[b] : offsets[b + 1]], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("length", [1, 15, 16, 17, 31, 32, 33, 100])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1), (9, 3)])
def test_prefill_matches_dense_attention(length, heads, kv_heads, backend):
    run_case([length], [0], heads, kv_heads, page_size=16, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_mixed_batch_of_prefills_chunks_and_decodes(page_size, backend):
    # a fresh prefill, a chunk on top of 16 cached tokens, decodes at and across page boundaries
    lengths = [23, 40, 17, 16, 1, 64]
    cached = [0, 16, 16, 15, 0, 63]
    run_case(lengths, cached, heads=9, kv_heads=3, page_size=page_size, seed=page_size, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_chunks_over_thousands_of_cached_tokens_match_dense_attention(backend):
    """Chunks on top of long cached contexts, as a long prompt's later chunks are: the cached part ending on a
    page boundary (2,048) and off one (1,203, 3,001), chunks of more rows than one work item of the prefill
    kernel (16) and not a multiple of it, with a decode of a long sequence in the same step."""
    lengths = [2048 + 100, 1203 + 33, 3001 + 17, 2500]
    cached = [2048, 1203, 3001, 2499]
    run_case(lengths, cached, heads=9, kv_heads=3, page_size=16, seed=7, backend=backend, head_dim=64)


@pytest.mark.parametrize("lengths", [[4000], [2049, 17], [1, 300, 3001]])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1)])
def test_a_few_long_decodes_split_over_the_threads_match_dense_attention(lengths, heads, kv_heads):
    """Fewer sequences than twice the threads: the cpu kernel splits each into parts over ranges of its pages
    and merges their softmax states (a part of a one-token sequence included)."""
    run_case(lengths, [n - 1 for n in lengths], heads, kv_heads, 16, seed=len(lengths) + heads, backend="cpu",
             head_dim=64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (6, 1)])
def test_a_decode_step_of_many_lengths_matches_dense_attention(page_size, heads, kv_heads, backend):
    """Only decodes (the CPU kernel's whole-step path): contexts from 1 to 300, on and off page boundaries."""
    lengths = [1, 2, 15, 16, 17, 33, 64, 65, 128, 300]
    run_case(lengths, [n - 1 for n in lengths], heads, kv_heads, page_size, seed=page_size + heads,
             backend=backend)


@pytest.mark.parametrize("head_dim,heads,kv_heads,page_size", [
    (64, 9, 3, 16),  # the default model's shape, on the kernel specialised for it
    (128, 8, 1, 32),  # a wider head, 8 query heads per kv head
    (24, 6, 2, 16),  # head_dim not a multiple of 16: the generic kernel
    (16, 9, 1, 16),  # 9 query heads per kv head: the generic kernel
    (16, 4, 2, 80),  # pages over 64 tokens: the generic kernel
])
def test_the_cpu_kernels_specialised_and_generic_paths_match_dense_attention(head_dim, heads, kv_heads, page_size):
    lengths = [1, 17, 64, 65, 200, 301]
    run_case(lengths, [n - 1 for n in lengths], heads, kv_heads, page_size, seed=head_dim, backend="cpu",
             head_dim=head_dim)


@pytest.mark.parametrize("head_dim,heads,kv_heads,native", [
    (64, 9, 3, True),  # the default model's shape: kvserve/kernels/paged_prefill.cpp
    (128, 8, 1, True),  # a wider head, 8 query heads per kv head: paged_prefill.cpp
    (32, 2, 2, True),  # one query head per kv head: paged_prefill.cpp
    (24, 6, 2, False),  # head_dim not a multiple of 16: the reference groups
    (16, 9, 1, False),  # 9 query heads per kv head: the reference groups
])
def test_the_cpu_backends_prefill_paths_match_dense_attention(head_dim, heads, kv_heads, native, monkeypatch):
    """Chunks of odd and even lengths, fresh and on top of cached prefixes that end on and off page boundaries,
    with decodes in the same step; and with the kernel turned off (KVSERVE_PREFILL_KERNEL=0)."""
    assert CPUPagedBackend().ext.paged_prefill_supports(head_dim, heads, kv_heads, 16) == native
    lengths = [70, 33, 200, 2, 1, 50, 129]
    cached = [0, 17, 100, 0, 0, 49, 32]
    run_case(lengths, cached, heads, kv_heads, 16, seed=head_dim + heads, backend="cpu", head_dim=head_dim)
    monkeypatch.setenv("KVSERVE_PREFILL_KERNEL", "0")
    assert not CPUPagedBackend().prefill_kernel
    run_case(lengths, cached, heads, kv_heads, 16, seed=head_dim + heads, backend="cpu", head_dim=head_dim)


def test_the_cpu_kernel_runs_on_every_intra_op_thread():
    """Built without OpenMP, at::parallel_for runs inline on one thread: correct, and half as fast here."""
    from kvserve.kernels.cpu_paged import load_extension

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert load_extension().parallel_threads(8) == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 3, 8, 13, 24, 200])
def test_the_cpu_backends_packed_linear_matches_f_linear(rows):
    """Every row-tile size of the micro-kernel (1..8 rows, and several tiles), with and without a bias."""
    backend, gen = CPUPagedBackend(), torch.Generator().manual_seed(rows)
    w, bias = torch.randn(96, 40, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(rows, 40, generator=gen)
    packed = backend.pack_weight(w)
    assert packed.shape == (3, 40, 32)  # panels of 32 output columns
    torch.testing.assert_close(backend.linear(x, packed), F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(backend.linear(x, packed, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    odd = torch.randn(50, 40, generator=gen)  # 50 output features: not a whole number of panels
    assert backend.pack_weight(odd) is odd
    torch.testing.assert_close(backend.linear(x, backend.pack_weight(odd)), F.linear(x, odd))


@pytest.mark.parametrize("tied", [True, False])
def test_packed_weights_keep_a_tied_embedding_once_and_read_it_from_the_lm_head(tied):
    from kvserve.worker.model import embedding, pack_weights
    from kvserve.worker.weights import LayerWeights, ModelWeights

    gen = torch.Generator().manual_seed(3)
    mat = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    embed = mat(128, 40)
    layer = LayerWeights(mat(40), mat(96, 40), None, mat(40, 32), mat(40), mat(64, 40), mat(40, 32))
    weights = ModelWeights(embed, [layer], mat(40), embed if tied else mat(128, 40))
    lm_head = weights.lm_head
    packed = pack_weights(weights, CPUPagedBackend().pack_weight)
    assert (packed.embed is None) == tied and packed.lm_head.shape == (4, 40, 32)
    assert packed.layers[0].qkv.dim() == 3 and packed.layers[0].o.dim() == 2  # 40 outputs: not whole panels
    ids = torch.tensor([0, 31, 32, 127, 5, 5])
    assert torch.equal(embedding(ids, packed), embed[ids])
    x = mat(3, 40)
    torch.testing.assert_close(CPUPagedBackend().linear(x, packed.lm_head), F.linear(x, lm_head))


def test_auto_picks_the_cpu_kernel_for_float32_on_cpu_and_the_reference_otherwise():
    assert get_backend("auto", torch.device("cpu")).name == "cpu"
    assert get_backend("auto", torch.device("cpu"), torch.bfloat16).name == "reference"
    assert get_backend("reference", torch.device("cpu")).name == "reference"
    with pytest.raises(ValueError, match="runs float32 on CPU"):
        get_backend("cpu", torch.device("cpu"), torch.bfloat16)


@pytest.mark.parametrize("chunk", [1, 5, 16, 33])
def test_chunked_prefill_equals_one_shot(chunk):
    """Prefill of 70 tokens in chunks of `chunk`: each chunk attends to all earlier ones via the cache."""
    gen = torch.Generator().manual_seed(chunk)
    n, heads, kv_heads, page_size = 70, 4, 2, 16
    q, k, v = (torch.randn(n, h, HEAD_DIM, generator=gen) for h in (heads, kv_heads, kv_heads))
    cache = torch.zeros(2, 8, page_size, kv_heads, HEAD_DIM)
    table = [6, 0, 3, 1, 7]
    backend, outs = ReferenceBackend(), []
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        meta = build_metadata([start], [end - start], [table], page_size, torch.device("cpu"))
        outs.append(backend.forward(q[start:end], k[start:end], v[start:end], cache, meta, backend.prepare(meta),
                                    1 / math.sqrt(HEAD_DIM)))
    torch.testing.assert_close(torch.cat(outs), dense_attention(q, k, v, 0), rtol=1e-5, atol=1e-5)


def test_slot_mapping_follows_the_page_table():
    meta = build_metadata([3], [6], [[7, 2, 9]], 4, torch.device("cpu"))
    # positions 3..8 -> page 7 slot 3, page 2 slots 0..3, page 9 slot 0
    assert meta.positions.tolist() == [3, 4, 5, 6, 7, 8]
    assert meta.slot_mapping.tolist() == [31, 8, 9, 10, 11, 36]
    assert meta.seq_lens.tolist() == [9]


def test_write_kv_touches_only_the_named_slots():
    cache = torch.zeros(2, 4, 4, 1, 2)
    meta = build_metadata([0], [2], [[3]], 4, torch.device("cpu"))
    write_kv(torch.ones(2, 1, 2), 2 * torch.ones(2, 1, 2), cache, meta.slot_mapping)
    assert cache[0, 3, :2].eq(1).all() and cache[1, 3, :2].eq(2).all()
    assert cache.count_nonzero() == 8  # 2 tokens x (K + V) x 2 dims


def test_rotary_matches_complex_rotation():
    """RoPE in the rotate-half layout is a rotation of (x_i, x_{i+d/2}) by position * inv_freq_i."""
    inv_freq = inverse_frequencies(8, 10000.0, None)
    cos, sin = cos_sin_table(inv_freq, 32)
    x = torch.randn(5, 2, 8)
    pos = torch.tensor([0, 1, 7, 20, 31])
    out = apply_rotary(x, cos[pos], sin[pos])
    z = torch.complex(x[..., :4], x[..., 4:]) * torch.polar(torch.ones(5, 4), pos[:, None] * inv_freq)[:, None, :]
    torch.testing.assert_close(out, torch.cat([z.real, z.imag], dim=-1), rtol=1e-5, atol=1e-5)


def test_decodes_share_one_group_and_each_prefill_chunk_is_padded_alone():
    tables = [[0, 1, 2, 3], [4], [5, 6], [7]]
    meta = build_metadata([0, 3, 20, 9], [50, 1, 4, 1], tables, 16, torch.device("cpu"))
    groups = ReferenceBackend().prepare(meta).groups
    assert [(g.num_seqs, g.max_q_len, g.num_keys) for g in groups] == [(2, 1, 16), (1, 50, 64), (1, 4, 32)]
    assert [g.token_index.tolist() for g in groups[:1]] == [[50, 55]]
    decode_only = build_metadata([3, 9], [1, 1], [[4], [7]], 16, torch.device("cpu"))
    (group,) = ReferenceBackend().prepare(decode_only).groups
    assert group.token_index is None and not group.padded


def test_decodes_of_very_different_lengths_are_bucketed_and_still_exact():
    lengths = [3, 200, 17, 150, 40, 90, 5, 120, 64, 180, 33, 9]  # 12 decodes, 1 to 13 pages
    cached = [n - 1 for n in lengths]
    meta = build_metadata(cached, [1] * len(lengths), [list(range(13))] * len(lengths), 16, torch.device("cpu"))
    groups = ReferenceBackend().prepare(meta).groups
    assert len(groups) == 4 and sorted(i for g in groups for i in g.token_index.tolist()) == list(range(12))
    assert [g.num_keys // 16 for g in groups] == [1, 3, 8, 13]  # each gathers only up to its own longest
    run_case(lengths, cached, heads=4, kv_heads=2, page_size=16, seed=7)


def test_decodes_of_similar_lengths_stay_one_group():
    lengths = [100 + i for i in range(12)]
    meta = build_metadata([n - 1 for n in lengths], [1] * 12, [list(range(7))] * 12, 16, torch.device("cpu"))
    (group,) = ReferenceBackend().prepare(meta).groups
    assert group.token_index is None


def test_without_a_compiler_auto_falls_back_to_the_reference_and_cpu_says_why(monkeypatch, caplog):
    from kvserve.kernels import cpu_paged

    def no_compiler():
        raise RuntimeError("Error building extension 'kvserve_paged_decode': c++: command not found")

    monkeypatch.setattr(cpu_paged, "load_extension", no_compiler)
    assert get_backend("auto", torch.device("cpu")).name == "reference"
    assert "c++: command not found" in caplog.text
    with pytest.raises(ValueError, match="cpu attention backend is not available: RuntimeError: .*command not found"):
        get_backend("cpu", torch.device("cpu"))


def test_a_compiler_without_openmp_gets_the_kernels_built_without_it(monkeypatch, caplog):
    """Apple clang has no -fopenmp: the module is built again without it (one thread) rather than not at all."""
    import torch.utils.cpp_extension as cpp_extension

    from kvserve.kernels import cpu_paged

    builds = []

    def fake_load(name, sources, extra_cflags=(), extra_ldflags=(), verbose=False, build_directory=None):
        builds.append((name, list(extra_cflags), list(extra_ldflags)))
        if "-fopenmp" in extra_cflags:
            raise RuntimeError("clang: error: unsupported option '-fopenmp'")
        return "module"

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    cpu_paged.load_extension.cache_clear()
    try:
        assert cpu_paged.load_extension() == "module"
    finally:
        cpu_paged.load_extension.cache_clear()  # the next caller builds (loads from cache) the real one
    (first, with_omp, _), (second, without, ldflags) = builds
    assert "-fopenmp" in with_omp and "-fopenmp" not in without and not ldflags and first != second
    assert "unsupported option '-fopenmp'" in caplog.text and "one thread" in caplog.text


def block_matrix(n: int, k: int, bits: int, seed: int) -> torch.Tensor:
    """float32 [n, k] whose every block of 32 along k is d * q + m (4 bits) or d * q (8 bits) with float16 d and
    m: what a Q4_1 / Q8_0 GGUF dequantises to. As llama.cpp's quantiser, each block reaches q = 0 and 15
    (4 bits) or 127 (8 bits)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = (n, k // 32, 1)
    d = (torch.rand(blocks, generator=gen) * 0.01 + 1e-3).half().float()
    if bits == 4:
        q = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
        q[..., 0], q[..., 1] = 0, 15
        return (d * q + (torch.randn(blocks, generator=gen) * 0.05).half().float()).reshape(n, k)
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=gen).float()
    q[..., 0] = 127
    return (d * q).reshape(n, k)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 5, 8, 13, 32, 33, 200])
def test_exact_block_weights_give_the_float32_panels_result_bit_for_bit(bits, rows):
    """96 outputs: a pair of panels and a single one; 64 inputs: two blocks per column. Up to 32 rows the weights
    are unpacked in registers (in passes of up to 8 rows), from 33 into a buffer; 200 rows are three work items
    of up to 96 rows per pair of panels."""
    from kvserve.kernels.cpu_paged import BlockPanels

    backend = CPUPagedBackend(block_weights=True)
    w = block_matrix(96, 64, bits, seed=rows)
    blocks = backend.pack_weight(w)
    assert isinstance(blocks, BlockPanels)
    assert blocks.q.dtype == (torch.uint8 if bits == 4 else torch.int8)
    assert blocks.q.numel() * blocks.q.element_size() == w.numel() * bits // 8  # 4 or 8 bits a weight
    x, bias = torch.randn(rows, 64), torch.randn(96)
    panels = backend.ext.pack_panels(w)
    assert same_bits(backend.linear(x, blocks), backend.linear(x, panels))
    assert same_bits(backend.linear(x, blocks, bias), backend.linear(x, panels, bias))
    torch.testing.assert_close(backend.linear(x, blocks), F.linear(x, w), rtol=1e-5, atol=1e-5)
    ids = torch.tensor([0, 15, 16, 31, 32, 95, 7, 7])  # both nibbles of a byte, every panel
    assert same_bits(blocks.rows(ids), w[ids])


@pytest.mark.parametrize("bits", [4, 8])
def test_a_matrix_with_one_weight_off_its_block_grid_stays_float32(bits):
    backend = CPUPagedBackend(block_weights=True)
    w = block_matrix(64, 64, bits, seed=bits)
    w[37, 50] = torch.nextafter(w[37, 50], torch.tensor(1.0))  # one ulp: no d, q (and m) give it back
    packed = backend.pack_weight(w)
    assert isinstance(packed, torch.Tensor) and packed.shape == (2, 64, 32)
    exact = block_matrix(64, 64, bits, seed=bits)
    assert isinstance(CPUPagedBackend(block_weights=False).pack_weight(exact), torch.Tensor)


def test_a_tied_block_embedding_is_kept_once_and_read_from_the_lm_head():
    from kvserve.kernels.cpu_paged import BlockPanels
    from kvserve.worker.model import embedding, pack_weights
    from kvserve.worker.weights import LayerWeights, ModelWeights

    embed, mat = block_matrix(128, 64, 8, seed=1), lambda *shape: torch.randn(*shape)  # noqa: E731
    layer = LayerWeights(mat(64), block_matrix(96, 64, 4, seed=2), None, mat(64, 32), mat(64),
                         block_matrix(64, 64, 4, seed=3), mat(64, 32))
    packed = pack_weights(ModelWeights(embed, [layer], mat(64), embed), CPUPagedBackend(block_weights=True).pack_weight)
    assert packed.embed is None and isinstance(packed.lm_head, BlockPanels)
    assert isinstance(packed.layers[0].qkv, BlockPanels) and isinstance(packed.layers[0].gate_up, BlockPanels)
    ids = torch.tensor([0, 31, 32, 127, 5, 5])
    assert same_bits(embedding(ids, packed), embed[ids])


def test_the_default_models_weights_are_packed_as_exact_blocks():
    """SmolLM2's GGUF is Q4_1 with a Q8_0 embedding: every projection is 4-bit blocks, the LM head 8-bit."""
    from kvserve.kernels.cpu_paged import BlockPanels
    from kvserve.services.model_store import prepare_default_model
    from kvserve.worker.config import ModelConfig
    from kvserve.worker.model import describe_weights, pack_weights
    from kvserve.worker.weights import load_weights

    model_dir = prepare_default_model(progress=False)
    weights = load_weights(model_dir, ModelConfig.from_folder(model_dir), torch.float32, torch.device("cpu"))
    packed = pack_weights(weights, CPUPagedBackend(block_weights=True).pack_weight)
    matrices = [m for layer in packed.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(isinstance(m, BlockPanels) and m.q.dtype == torch.uint8 for m in matrices)
    assert isinstance(packed.lm_head, BlockPanels) and packed.lm_head.q.dtype == torch.int8
    assert describe_weights(packed).startswith("120 as 4-bit blocks, 1 as 8-bit blocks (")  # the ready line's


@pytest.mark.parametrize("rows", [1, 7, 130])  # 130: more rows than one parallel chunk
def test_the_cpu_backends_one_pass_norm_and_silu_match_the_reference(rows):
    cpu, ref = CPUPagedBackend(), ReferenceBackend()
    gen = torch.Generator().manual_seed(rows)
    x, delta, w = torch.randn(rows, 96, generator=gen), torch.randn(rows, 96, generator=gen), torch.randn(96)
    torch.testing.assert_close(cpu.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5), rtol=1e-6, atol=1e-6)
    x_cpu, x_ref = x.clone(), x.clone()
    y_cpu, y_ref = cpu.add_rms_norm_(x_cpu, delta, w, 1e-5), ref.add_rms_norm_(x_ref, delta, w, 1e-5)
    assert torch.equal(x_cpu, x + delta) and torch.equal(x_ref, x + delta)  # the residual, updated in place
    torch.testing.assert_close(y_cpu, y_ref, rtol=1e-6, atol=1e-6)
    gate_up = torch.randn(rows, 2 * 80, generator=gen) * 4
    torch.testing.assert_close(cpu.silu_mul(gate_up), ref.silu_mul(gate_up), rtol=1e-6, atol=1e-6)


def test_the_cpu_backends_rope_and_store_writes_the_slots_and_attends_as_the_reference():
    """One pass: RoPE on q and k, k and v into their slots, q split into heads; then the same attention."""
    heads, kv_heads, head_dim, page_size = 9, 3, 64, 16
    lengths, cached = [23, 40, 1, 17], [0, 16, 0, 16]
    gen = torch.Generator().manual_seed(5)
    num_pages = 12
    tables = scattered_pages(len(lengths), lengths, page_size, num_pages, gen)
    q_lens = [n - c for n, c in zip(lengths, cached, strict=True)]
    meta = build_metadata(cached, q_lens, tables, page_size, torch.device("cpu"))
    cos, sin = cos_sin_table(inverse_frequencies(head_dim, 10000.0, None), 128)
    cos, sin = cos[meta.positions], sin[meta.positions]
    qkv = torch.randn(sum(q_lens), (heads + 2 * kv_heads) * head_dim, generator=gen)
    prior = torch.randn(2, num_pages, page_size, kv_heads, head_dim, generator=gen)  # the cached prefixes
    outs, caches = [], []
    for backend in (CPUPagedBackend(), ReferenceBackend()):
        cache = prior.clone()
        outs.append(backend.qkv_attention(qkv, cos, sin, cache, meta, backend.prepare(meta), 0.125, heads,
                                          kv_heads))
        caches.append(cache)
    torch.testing.assert_close(caches[0], caches[1], rtol=1e-6, atol=1e-6)
    slots = meta.slot_mapping
    flat = caches[0].view(2, -1, kv_heads, head_dim)
    assert torch.equal(flat[1, slots], qkv[:, (heads + kv_heads) * head_dim:].view(-1, kv_heads, head_dim))
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat[:, untouched], prior.view(2, -1, kv_heads, head_dim)[:, untouched])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_the_cpu_backends_argmax_and_logsumexp_match_torch_and_take_the_first_of_a_tie():
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(5, 49152, generator=gen) * 6
    logits[2, 100] = logits[2, 40000] = logits[2].max() + 1  # a tie: torch.argmax returns the first
    ids, lse = CPUPagedBackend().argmax_logsumexp(logits)
    assert ids.tolist() == logits.argmax(-1).tolist() and ids[2] == 100
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1), rtol=1e-6, atol=1e-5)


def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next_load():
    """torch marks a build in progress with a `lock` file that only the builder removes; a worker killed during
    its first start's build left one, and every later start waited for it forever (seen: a test's timeout
    killed a building worker, and each worker after it hung without a word)."""
    from torch.utils.cpp_extension import _get_build_directory

    from kvserve.kernels.cpu_paged import OPENMP, _build_name, compile_flags, load_extension

    load_extension()  # built, or loaded, here first
    lock = Path(_get_build_directory(_build_name(compile_flags() + OPENMP), verbose=False)) / "lock"
    lock.touch()  # what a killed build leaves
    code = "from kvserve.kernels.cpu_paged import load_extension; load_extension(); print('loaded')"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    finally:
        left = lock.exists()
        lock.unlink(missing_ok=True)  # never leave it for the tests after this one
    assert out.returncode == 0 and out.stdout.strip() == "loaded", out.stderr
    assert not left and "left by a build that was killed" in out.stderr, (lock, out.stderr)
