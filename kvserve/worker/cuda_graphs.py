"""CUDA graphs for pure-decode steps: one graph per (batch bucket, length bucket), captured lazily, the first
time a step of that shape arrives, then replayed (one launch for the whole forward pass instead of hundreds).

A step of n decodes (every item one new token) runs in the smallest batch bucket ``rows >= n``
(1, 2, 4, 8, 16, 32, then every 16 up to max_seqs) and the smallest length bucket ``bound >= max seq_len``
(powers of two from MIN_GRAPH_SEQ_LEN, the last one max_model_len). A graph reads its inputs from static device
buffers, one int64 block per graph (staging.py's packing)::

    rows = 4, n = 3:   token_ids     [t0 t1 t2  0]
                       positions     [p0 p1 p2  0]
                       slot_mapping  [s0 s1 s2 -1]     padding rows: slot -1 (nothing written),
                       seq_lens      [l0 l1 l2  0]     seq_len 0 (attention output zeros)
                       page_tables   [rows, pages of `bound` tokens], padded with 0

and ``meta.max_seq_len`` is the length bucket's bound, so the kernels' grid depends on the bucket only; each
sequence's real length is read on the device. Only a backend that honours these padding rules and launches no
host synchronisation in prepare/forward may be captured: the triton backend (kvserve/kernels/triton_paged.py). Steps
with prefill chunks, more decodes than max_seqs, or longer than max_model_len run eagerly, as do windowed or
sink steps (their page tables hold holes and their metadata more fields).

With ``capture=False`` the same padded buffers run eagerly: the bucketing and padding, on CPU, in tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.common.pages import num_pages_for
from kvserve.kernels.paged_attention import AttentionMetadata
from kvserve.worker.staging import pack, unpack

MIN_GRAPH_SEQ_LEN = 2048  # the smallest length bucket: shorter contexts cost the same to launch


def batch_buckets(max_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, 32, 48, 64, ... (every 16 past 32), the last one max_seqs."""
    sizes = [s for s in (1, 2, 4, 8, 16) if s < max_seqs] + list(range(32, max_seqs, 16))
    return (*sizes, max_seqs)


def length_bucket(max_seq_len: int, max_model_len: int) -> int:
    """The smallest power of two >= max_seq_len (at least MIN_GRAPH_SEQ_LEN), capped at max_model_len."""
    bound = MIN_GRAPH_SEQ_LEN
    while bound < max_seq_len:
        bound *= 2
    return min(bound, max_model_len)


@dataclass(slots=True)
class DecodeInputs:
    """One graph's static device inputs: views of ``block``, and constants (one query per row)."""

    block: torch.Tensor  # [rows * (5 + width)] int64
    layout: list
    token_ids: torch.Tensor  # [rows]
    meta: AttentionMetadata


def host_inputs(token_ids: list[int], positions: list[int], page_tables: list[list[int]], rows: int,
                width: int, page_size: int, pin: bool) -> tuple[torch.Tensor, list]:
    """The block a graph of ``rows`` rows and ``width`` pages per table reads, for these decodes (padded), and
    its layout: token_ids, positions, slot_mapping, seq_lens, start_pos, page_tables."""
    n = len(token_ids)
    tables = torch.zeros((rows, width), dtype=torch.int64)
    for b, table in enumerate(page_tables):
        pages = table[:width]
        tables[b, :len(pages)] = torch.tensor(pages, dtype=torch.int64)
    pos = torch.tensor(positions, dtype=torch.int64)
    slots = torch.full((rows,), -1, dtype=torch.int64)
    slots[:n] = tables[torch.arange(n), pos // page_size] * page_size + pos % page_size
    padded = [torch.zeros(rows, dtype=torch.int64) for _ in range(3)]  # token_ids, positions, seq_lens
    padded[0][:n] = torch.tensor(token_ids, dtype=torch.int64)
    padded[1][:n] = pos
    padded[2][:n] = pos + 1
    return pack([padded[0], padded[1], slots, padded[2], padded[1], tables], pin)  # start_pos = position


def decode_inputs(rows: int, width: int, page_size: int, bound: int, device: torch.device) -> DecodeInputs:
    """Static buffers for one graph, holding only padding rows (a capture with them writes nothing)."""
    block, layout = host_inputs([], [], [], rows, width, page_size, pin=False)
    block = block.to(device)
    token_ids, positions, slots, seq_lens, start_pos, tables = unpack(block, layout)
    arange = torch.arange(rows + 1, dtype=torch.int64, device=device)
    meta = AttentionMetadata(page_size=page_size, q_lens=torch.ones(rows, dtype=torch.int64, device=device),
                             start_pos=start_pos, seq_lens=seq_lens, cu_q_lens=arange, positions=positions,
                             token_seq=arange[:rows], slot_mapping=slots, page_tables=tables, max_q_len=1,
                             max_seq_len=bound)
    return DecodeInputs(block, layout, token_ids, meta)


@dataclass(slots=True)
class GraphEntry:
    inputs: DecodeInputs
    graph: object | None  # torch.cuda.CUDAGraph, or None when run eagerly (capture=False)
    hidden: torch.Tensor | None  # the graph's output [rows, hidden]


class DecodeGraphs:
    """Pure-decode steps through bucketed, padded static inputs: replayed CUDA graphs (``capture``), or the
    same buffers run eagerly."""

    def __init__(self, model, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, page_size: int,
                 max_seqs: int, max_model_len: int, capture: bool):
        self.model, self.kv_cache, self.kv_scales = model, kv_cache, kv_scales
        self.page_size, self.max_model_len, self.capture = page_size, max_model_len, capture
        self.buckets = batch_buckets(max_seqs)
        self.entries: dict[tuple[int, int], GraphEntry] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None  # one memory pool for every graph

    def applies(self, items) -> bool:
        """Whether this step is pure decode and fits a bucket."""
        return (0 < len(items) <= self.buckets[-1] and all(len(i.token_ids) == 1 for i in items)
                and max(i.start_pos for i in items) < self.max_model_len)

    def run(self, items) -> torch.Tensor:
        """Hidden states [n, hidden] of the n decodes (one row each), through their bucket's graph."""
        n = len(items)
        rows = next(b for b in self.buckets if b >= n)
        bound = length_bucket(max(i.start_pos for i in items) + 1, self.max_model_len)
        entry = self.entries.get((rows, bound)) or self._new_entry(rows, bound)
        width = entry.inputs.meta.page_tables.shape[1]
        host, _ = host_inputs([i.token_ids[0] for i in items], [i.start_pos for i in items],
                              [list(i.page_table) for i in items], rows, width, self.page_size,
                              pin=self.kv_cache.is_cuda)
        entry.inputs.block.copy_(host, non_blocking=True)
        if entry.graph is None:
            return self._forward(entry.inputs)[:n]
        entry.graph.replay()
        return entry.hidden[:n]

    def _forward(self, inputs: DecodeInputs) -> torch.Tensor:
        return self.model.forward(inputs.token_ids, inputs.meta, self.kv_cache, self.kv_scales)

    def _new_entry(self, rows: int, bound: int) -> GraphEntry:
        """Static inputs for (rows, bound) and, with ``capture``, their graph: one eager warm-up (it compiles the
        kernels; its padding rows write nothing), then the capture, both over padding only."""
        inputs = decode_inputs(rows, num_pages_for(bound, self.page_size), self.page_size, bound,
                               self.kv_cache.device)
        graph = hidden = None
        if self.capture:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(inputs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                hidden = self._forward(inputs)
        self.entries[(rows, bound)] = entry = GraphEntry(inputs, graph, hidden)
        return entry
