"""A CUDA worker's forward pass: one CUDA stream for all of the worker's GPU work, step inputs staged in pinned
memory (staging.py), and CUDA graphs for pure-decode steps (cuda_graphs.py) where the backend allows them.

Within a step nothing waits for the GPU except the sampler reading the sampled tokens: inputs are copied
``non_blocking`` in stream order, graphs are replayed, and the rows to sample are picked on the device. (The
reference backend's prepare reads lengths on the host; it runs eagerly and syncs there: only the triton backend
is captured.) CPU workers never build this: their runner path is unchanged.
"""

from __future__ import annotations

import logging

import torch

from kvserve.common.attention_window import AttentionWindow
from kvserve.kernels.paged_attention import build_metadata
from kvserve.worker.cuda_graphs import DecodeGraphs
from kvserve.worker.staging import stage, stage_metadata

log = logging.getLogger(__name__)
GRAPH_BACKENDS = ("triton",)  # backends whose prepare/forward are capture-safe and honour padding rows


class CudaStep:
    """Runs a step's forward pass on the GPU; ``forward`` returns the hidden states of the rows to sample."""

    def __init__(self, model, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, page_size: int,
                 window: AttentionWindow, graphs: bool, max_graph_seqs: int, max_model_len: int):
        self.model, self.kv_cache, self.kv_scales = model, kv_cache, kv_scales
        self.page_size, self.window = page_size, window
        self.device = kv_cache.device
        self.stream = torch.cuda.Stream(self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the weights and pool, made before
        torch.cuda.set_stream(self.stream)  # on the compute thread: every later op of the worker runs on it
        why_not = graphs_unavailable(graphs, model.backend.name, window, model.cfg)
        self.graphs = None if why_not else DecodeGraphs(model, kv_cache, kv_scales, page_size, max_graph_seqs,
                                                        max_model_len, capture=True)
        log.info("cuda path: one stream, pinned staging; decode CUDA graphs %s",
                 f"off ({why_not})" if why_not else f"on, buckets {self.graphs.buckets}, captured lazily")

    def forward(self, items, rows: list[int]) -> torch.Tensor | None:
        """Hidden states [len(rows), hidden] of the last token of each item in ``rows`` (None when none)."""
        if self.graphs is not None and self.graphs.applies(items):
            hidden = self.graphs.run(items)
            if len(rows) == len(items):
                return hidden
            return hidden.index_select(0, stage([torch.tensor(rows, dtype=torch.int64)], self.device)[0])
        meta = build_metadata([i.start_pos for i in items], [len(i.token_ids) for i in items],
                              [list(i.page_table) for i in items], self.page_size, torch.device("cpu"),
                              self.window)
        tokens = torch.tensor([t for i in items for t in i.token_ids], dtype=torch.int64)
        last = meta.cu_q_lens[1:][torch.tensor(rows, dtype=torch.int64)] - 1
        meta, (tokens, last) = stage_metadata(meta, [tokens, last], self.device)
        hidden = self.model.forward(tokens, meta, self.kv_cache, self.kv_scales)
        return hidden.index_select(0, last) if rows else None


def graphs_unavailable(enabled: bool, backend: str, window: AttentionWindow, model_cfg) -> str | None:
    """Why decode steps run without CUDA graphs, or None when they use them. ``model_cfg`` (a ModelConfig): the
    families a graph cannot capture (MLA reads its sequences' spans on the host; mixed layers prepare per window)."""
    if not enabled:
        return "--no-cuda-graphs"
    if backend not in GRAPH_BACKENDS:
        return f"the {backend} backend runs eagerly; graphs need {', '.join(GRAPH_BACKENDS)}"
    if window.slides:
        return "sliding-window steps run eagerly"
    if model_cfg.mla is not None:
        return "MLA attention reads each sequence's span on the host (no capture)"
    if model_cfg.layer_windows:
        return "sliding and full layers mixed run eagerly"
    return None
