"""A CUDA worker's forward pass: one CUDA stream for all of the worker's GPU work, step inputs staged in pinned
memory (staging.py), and CUDA graphs for pure-decode steps (cuda_graphs.py) where the backend allows them.

Within a step nothing waits for the GPU except the sampler reading the sampled tokens: inputs are copied
``non_blocking`` in stream order, graphs are replayed, and the rows to sample are picked on the device. (The
reference backend's prepare reads lengths on the host; it runs eagerly and syncs there: only the triton backend
is captured.) CPU workers never build this: their runner path is unchanged.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

import torch

from kvserve.common.attention_window import AttentionWindow
from kvserve.kernels.paged_attention import build_metadata
from kvserve.worker.cuda_graphs import DecodeGraphs
from kvserve.worker.layer_windows import SlidingGroup
from kvserve.worker.staging import stage, stage_metadata

log = logging.getLogger(__name__)
GRAPH_BACKENDS = ("triton",)  # backends whose prepare/forward are capture-safe and honour padding rows


class CudaStep:
    """Runs a step's forward pass on the GPU; ``forward`` returns the hidden states of the rows to sample."""

    def __init__(self, model, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, page_size: int,
                 window: AttentionWindow, graphs: bool, max_graph_seqs: int, max_model_len: int,
                 sliding: Callable[[Sequence, torch.device], SlidingGroup] | None = None):
        """``sliding``: with page groups, the sliding layers' side of a step over its items (metadata built on
        the given device; ModelRunner._sliding); ``kv_cache`` and ``kv_scales`` are then the full layers'."""
        self.model, self.kv_cache, self.kv_scales, self.sliding = model, kv_cache, kv_scales, sliding
        self.page_size, self.window = page_size, window
        self.device = kv_cache.device
        self.stream = torch.cuda.Stream(self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the weights and pool, made before
        torch.cuda.set_stream(self.stream)  # on the compute thread: every later op of the worker runs on it
        why_not = graphs_unavailable(graphs, model.backend.name, window, model.cfg)
        self.graphs = None if why_not else DecodeGraphs(model, kv_cache, kv_scales, page_size, max_graph_seqs,
                                                        max_model_len, capture=True)
        assert sliding is None or self.graphs is None, "page groups' steps run eagerly (mixed layers)"
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
        groups = []  # page groups: the sliding layers' metadata, staged too (a second copy)
        if self.sliding is not None:
            sliding = self.sliding(items, torch.device("cpu"))
            groups = [dataclasses.replace(sliding, meta=stage_metadata(sliding.meta, [], self.device)[0])]
        hidden = self.model.forward(tokens, meta, self.kv_cache, self.kv_scales, *groups)
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
