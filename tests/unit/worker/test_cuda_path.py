"""The CUDA model path's host-side logic on CPU: batch and length buckets, the padded static inputs of a decode
graph, pinned staging's packing, and a padded, bucketed decode giving the same hidden states and tokens as the
unpadded eager one (kvserve/worker/cuda_graphs.py with capture=False runs the graph's buffers eagerly).

A graph's padding rows rely on two rules of the backend it captures (the triton backend's): a token whose slot is
-1 writes no K/V, and a row with seq_len 0 attends to nothing (zeros). PaddedReference below is the reference
backend with those two rules, in torch, so that the padding logic is checked here without triton or a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvserve.common.attention_window import AttentionWindow
from kvserve.common.wire.worker import StepItem
from kvserve.kernels.paged_attention import build_metadata, write_kv
from kvserve.kernels.reference import ReferenceBackend, rope_split, sink_query
from kvserve.worker.config import ModelConfig
from kvserve.worker.cuda_graphs import DecodeGraphs, batch_buckets, host_inputs, length_bucket
from kvserve.worker.model import LlamaDecoder
from kvserve.worker.staging import pack, stage, stage_metadata, unpack
from kvserve.worker.weights import random_weights

PAGE = 4
CPU = torch.device("cpu")
TINY = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                   max_position_embeddings=4096, tie_word_embeddings=False)


class PaddedReference(ReferenceBackend):
    """The reference backend plus the padding rules a graph's padding rows need (slot -1, seq_len 0)."""

    def qkv_attention(self, qkv, cos, sin, kv_cache, meta, state, scale, num_heads, num_kv_heads,
                      kv_scales=None, sink_rope=None):
        q, k, v = rope_split(qkv, cos, sin, num_heads, num_kv_heads)
        real = meta.slot_mapping >= 0
        write_kv(k[real], v[real], kv_cache, meta.slot_mapping[real], kv_scales)
        out = self.attend(q, kv_cache, state, scale, kv_scales, sink_query(qkv, sink_rope, num_heads))
        empty = (meta.seq_lens == 0)[meta.token_seq]
        return torch.where(empty[:, None, None], torch.zeros_like(out), out)


def test_batch_and_length_buckets():
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert batch_buckets(100) == (1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100)
    assert batch_buckets(40) == (1, 2, 4, 8, 16, 32, 40) and batch_buckets(1) == (1,) and batch_buckets(3) == (1, 2, 3)
    assert [length_bucket(n, 8192) for n in (1, 2048, 2049, 5000, 8192)] == [2048, 2048, 4096, 8192, 8192]
    assert length_bucket(3000, 2500) == 2500  # never past the model's context


def test_host_inputs_pad_rows_with_slot_minus_one_and_seq_len_zero():
    block, layout = host_inputs([11, 12, 13], [5, 0, 11], [[7, 2], [3], [1, 4, 6, 9]], rows=4, width=3,
                                page_size=4, pin=False)
    tokens, positions, slots, seq_lens, start_pos, tables = unpack(block, layout)
    assert tokens.tolist() == [11, 12, 13, 0] and positions.tolist() == [5, 0, 11, 0]
    assert slots.tolist() == [2 * 4 + 1, 3 * 4, 6 * 4 + 3, -1]
    assert seq_lens.tolist() == [6, 1, 12, 0] and start_pos.tolist() == positions.tolist()
    assert tables.tolist() == [[7, 2, 0], [3, 0, 0], [1, 4, 6], [0, 0, 0]]  # cut to the bucket's pages


def test_staging_packs_one_block_and_views_it_back():
    a, b = torch.arange(5), torch.arange(6).view(2, 3) * 7
    block, layout = pack([a, b], pin=False)
    assert block.shape == (11,) and [x.tolist() for x in unpack(block, layout)] == [a.tolist(), b.tolist()]
    assert [x.tolist() for x in stage([a, b], CPU)] == [a.tolist(), b.tolist()]
    meta = build_metadata([3, 0], [1, 4], [[2], [0, 1]], PAGE, CPU, window=AttentionWindow(4, 1))
    meta.logits_soft_cap = 50.0  # a float constant: not staged, kept
    staged, (extra,) = stage_metadata(meta, [torch.tensor([9, 8])], CPU)
    assert staged.logits_soft_cap == 50.0
    assert extra.tolist() == [9, 8] and staged.max_seq_len == meta.max_seq_len and staged.window.sinks == 1
    for name in ("q_lens", "start_pos", "seq_lens", "cu_q_lens", "positions", "token_seq", "slot_mapping",
                 "page_tables", "sink_positions"):
        assert torch.equal(getattr(staged, name), getattr(meta, name)), name


def eager(model, items, cache) -> torch.Tensor:
    """The runner's unpadded forward pass: hidden states of each item's last token."""
    meta = build_metadata([i.start_pos for i in items], [len(i.token_ids) for i in items],
                          [list(i.page_table) for i in items], PAGE, CPU)
    tokens = torch.tensor([t for i in items for t in i.token_ids])
    return model.forward(tokens, meta, cache)[meta.cu_q_lens[1:] - 1]


def prefilled(model, prompts, tables):
    cache = torch.zeros(TINY.num_layers, 2, 40, PAGE, TINY.num_kv_heads, TINY.head_dim)
    eager(model, [StepItem(f"r{b}", tuple(p), 0, t) for b, (p, t) in enumerate(zip(prompts, tables, strict=True))],
          cache)
    return cache


@pytest.mark.parametrize("num_seqs", [1, 3, 5])
def test_a_padded_bucketed_decode_matches_the_unpadded_eager_one(num_seqs):
    model = LlamaDecoder(TINY, random_weights(TINY, torch.float32, CPU, seed=num_seqs, std=0.1), PaddedReference())
    gen = torch.Generator().manual_seed(num_seqs)
    lengths = [4, 7, 8, 1, 13][:num_seqs]  # decodes at and across page boundaries
    tables = [tuple(range(4 * b, 4 * b + 4)) for b in range(num_seqs)]
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
    cache = prefilled(model, prompts, tables)
    graphs_cache = cache.clone()
    graphs = DecodeGraphs(model, graphs_cache, None, PAGE, max_seqs=8, max_model_len=4096, capture=False)
    tokens = [[p[-1]] for p in prompts]
    for step in range(3):  # the same buckets' buffers reused over steps
        items = [StepItem(f"r{b}", (tokens[b][-1],), lengths[b] + step, tables[b]) for b in range(num_seqs)]
        assert graphs.applies(items)
        expected, got = eager(model, items, cache), graphs.run(items)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        ids = model.logits(expected).argmax(-1)
        assert torch.equal(model.logits(got).argmax(-1), ids)
        for b in range(num_seqs):
            tokens[b].append(int(ids[b]))
    torch.testing.assert_close(graphs_cache, cache, rtol=1e-5, atol=1e-5)  # padding rows wrote nothing
    rows = next(b for b in graphs.buckets if b >= num_seqs)
    assert list(graphs.entries) == [(rows, 2048)]


def test_prefill_chunks_and_oversized_batches_do_not_apply():
    model = LlamaDecoder(TINY, random_weights(TINY, torch.float32, CPU), PaddedReference())
    graphs = DecodeGraphs(model, torch.zeros(1), None, PAGE, max_seqs=2, max_model_len=64, capture=False)
    decode = StepItem("a", (1,), 5, (0, 1))
    assert graphs.applies([decode, decode]) and not graphs.applies([decode] * 3)
    assert not graphs.applies([decode, StepItem("b", (1, 2), 0, (2,))]) and not graphs.applies([])
    assert not graphs.applies([StepItem("c", (1,), 64, tuple(range(17)))])


def test_the_triton_backend_through_padded_decode_buffers_matches_the_reference():
    """The triton backend (kvserve/kernels/triton_paged.py, another branch) honouring the padding rules itself; under
    the triton interpreter on CPU. Skipped only where that module is not in this build."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    triton_paged = pytest.importorskip("kvserve.kernels.triton_paged")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    weights = random_weights(TINY, torch.float32, device, seed=5, std=0.1)
    model = LlamaDecoder(TINY, weights, triton_paged.TritonBackend())
    reference = LlamaDecoder(TINY, random_weights(TINY, torch.float32, device, seed=5, std=0.1), ReferenceBackend())
    tables = [(0, 1, 2), (3, 4, 5)]
    cache = torch.zeros(TINY.num_layers, 2, 8, PAGE, TINY.num_kv_heads, TINY.head_dim, device=device)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    meta = build_metadata([0, 0], [5, 3], [list(t) for t in tables], PAGE, device)
    reference.forward(torch.tensor(prompts[0] + prompts[1], device=device), meta, cache)
    items = [StepItem("a", (7,), 5, tables[0]), StepItem("b", (8,), 3, tables[1])]
    ref_cache = cache.clone()
    rmeta = build_metadata([5, 3], [1, 1], [list(t) for t in tables], PAGE, device)
    expected = reference.forward(torch.tensor([7, 8], device=device), rmeta, ref_cache)
    got = DecodeGraphs(model, cache, None, PAGE, max_seqs=4, max_model_len=4096, capture=False).run(items)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cache, ref_cache, rtol=1e-4, atol=1e-4)


def test_worker_cuda_graph_flags_and_their_env_defaults(monkeypatch):
    from kvserve.services.cli import build_parser

    args = build_parser().parse_args(["worker"])
    assert args.cuda_graphs is True and int(args.cuda_graph_max_seqs) == 64
    args = build_parser().parse_args(["worker", "--no-cuda-graphs", "--cuda-graph-max-seqs", "128"])
    assert args.cuda_graphs is False and args.cuda_graph_max_seqs == 128
    monkeypatch.setenv("KVSERVE_CUDA_GRAPHS", "off")
    monkeypatch.setenv("KVSERVE_CUDA_GRAPH_MAX_SEQS", "32")
    args = build_parser().parse_args(["worker"])
    assert args.cuda_graphs is False and args.cuda_graph_max_seqs == 32
    assert build_parser().parse_args(["worker", "--cuda-graphs"]).cuda_graphs is True
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--cuda-graph-max-seqs", "0"])


def test_mla_and_mixed_layer_models_decode_without_graphs_and_say_why():
    """A graph cannot capture MLA's attention (it reads each sequence's span on the host) nor a step that prepares
    one state per window; the others still capture."""
    from kvserve.common.attention_window import FULL_ATTENTION
    from kvserve.worker.cuda_step import graphs_unavailable

    llama = ModelConfig.from_dict({"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                                   "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4})
    mla = ModelConfig.from_dict({"model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 32,
                                 "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                 "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
                                 "q_lora_rank": None, "first_k_dense_replace": 2, "n_routed_experts": 0})
    mixed = ModelConfig.from_dict({"model_type": "mistral", "vocab_size": 64, "hidden_size": 32,
                                   "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                   "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]})
    assert graphs_unavailable(True, "triton", FULL_ATTENTION, llama) is None
    assert "MLA" in graphs_unavailable(True, "triton", FULL_ATTENTION, mla)
    assert "mixed" in graphs_unavailable(True, "triton", FULL_ATTENTION, mixed)
