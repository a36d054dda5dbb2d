"""Per-layer attention windows for models that mix full-attention and sliding-window layers (Gemma 3, Qwen2's
``max_window_layers``, a ``layer_types`` list), and where each layer's K/V lives.

A worker with page groups (kvserve/worker/page_groups.py) keeps the sliding layers' K/V in a pool of their own,
each request with a page table there (``StepItem.group_page_table``) whose pages older than the window are
released (HOLE). Each layer then attends with its group's metadata, backend state and pool::

    layer_windows (24, 24, 0, 24, 24, 0)  ->  full group:    layers 2, 5        (full pool [2, ...])
                                              sliding group: layers 0, 1, 3, 4  (sliding pool [4, ...])
    steps [S0, S1, F0, S2, S3, F1]  F<j> = (full pool[j], page_table meta (window 0), its prepare)
                                    S<k> = (sliding pool[k], group_page_table meta (window 24), its prepare)

Without page groups every page of a request stays in one pool and the sliding layers only mask: each distinct
window gets one copy of the step's metadata with that ``window`` and one backend ``prepare`` state, shared by the
layers that attend with it (F = (meta, prepare(meta)), S = (meta with window 24, prepare(that))).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from kvserve.common.attention_window import AttentionWindow
from kvserve.kernels.paged_attention import AttentionMetadata
from kvserve.worker.config import ModelConfig


@dataclass(frozen=True, slots=True)
class LayerGroups:
    """Which pool each layer of a grouped model writes and reads, and at which index of it."""

    window: int  # the sliding layers' window
    full_layers: tuple[int, ...]  # the model's layer indices in the full layers' pool, in order
    sliding_layers: tuple[int, ...]  # ... in the sliding layers' pool

    @classmethod
    def of(cls, layer_windows: tuple[int, ...]) -> LayerGroups:
        """The groups of a model whose layers mix full attention (0) with exactly one window."""
        windows = set(layer_windows) - {0}
        assert len(windows) == 1 and 0 in layer_windows, f"not one window mixed with full layers: {layer_windows}"
        return cls(windows.pop(), tuple(i for i, w in enumerate(layer_windows) if not w),
                   tuple(i for i, w in enumerate(layer_windows) if w))

    def place(self, layer: int) -> tuple[bool, int]:
        """(whether ``layer`` is a sliding one, its index in its group's pool)."""
        if layer in self.sliding_layers:
            return True, self.sliding_layers.index(layer)
        return False, self.full_layers.index(layer)


@dataclass(frozen=True, slots=True)
class SlidingGroup:
    """A grouped worker's step over the sliding layers' pool: the metadata built from the items'
    group_page_tables (with the sliding window), and that pool."""

    meta: AttentionMetadata
    kv_cache: torch.Tensor  # [num_sliding_layers, 2, num_group_pages, page_size, num_kv_heads, head_dim]
    kv_scales: torch.Tensor | None  # [num_sliding_layers, 2, num_group_pages, page_size, num_kv_heads] or None


class LayerStep(NamedTuple):
    """What one layer's attention runs with (the order of the decoders' ``_attention`` arguments)."""

    kv_cache: torch.Tensor  # [2, num_pages, page_size, num_kv_heads, head_dim] of this layer
    kv_scales: torch.Tensor | None
    meta: AttentionMetadata
    state: object  # the backend's prepare(meta)


def layer_steps(cfg: ModelConfig, meta: AttentionMetadata, prepare, kv_cache: torch.Tensor,
                kv_scales: torch.Tensor | None, sliding: SlidingGroup | None = None) -> list[LayerStep]:
    """Per layer, its cache, scales, metadata and backend state (``prepare`` runs once per distinct metadata).
    One metadata for every layer unless ``cfg.layer_windows`` mixes windows; then ``meta`` must be full attention
    (a mixed model never slides as a whole, and has no sinks). With ``sliding`` (a grouped worker) ``kv_cache``
    and ``kv_scales`` are the full layers' pool and the sliding layers use ``sliding``'s."""
    def at(pool, i):
        return None if pool is None else pool[i]

    if cfg.logits_soft_cap:  # a model constant every layer's kernels apply (Gemma 2)
        meta = replace(meta, logits_soft_cap=cfg.logits_soft_cap)
        if sliding is not None:
            sliding = replace(sliding, meta=replace(sliding.meta, logits_soft_cap=cfg.logits_soft_cap))
    if not cfg.layer_windows:
        assert sliding is None, "page groups need a model that mixes sliding and full layers"
        state = prepare(meta)
        return [LayerStep(kv_cache[i], at(kv_scales, i), meta, state) for i in range(cfg.num_layers)]
    assert not meta.window.slides, "a mixed-layer model's step metadata must be full attention"
    if sliding is None:
        by_window = {}
        for window in sorted(set(cfg.layer_windows)):
            layer_meta = replace(meta, window=AttentionWindow(window)) if window else meta
            by_window[window] = (layer_meta, prepare(layer_meta))
        return [LayerStep(kv_cache[i], at(kv_scales, i), *by_window[w]) for i, w in enumerate(cfg.layer_windows)]
    groups = LayerGroups.of(cfg.layer_windows)
    assert sliding.meta.window == AttentionWindow(groups.window), (sliding.meta.window, groups.window)
    assert kv_cache.shape[0] == len(groups.full_layers) and sliding.kv_cache.shape[0] == len(groups.sliding_layers)
    full_state, sliding_state = prepare(meta), prepare(sliding.meta)
    steps = []
    for i in range(cfg.num_layers):
        slides, j = groups.place(i)
        steps.append(LayerStep(sliding.kv_cache[j], at(sliding.kv_scales, j), sliding.meta, sliding_state) if slides
                     else LayerStep(kv_cache[j], at(kv_scales, j), meta, full_state))
    return steps
