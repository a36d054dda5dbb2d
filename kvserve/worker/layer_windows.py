"""Per-layer attention windows for models that mix full-attention and sliding-window layers (Gemma 3, Qwen2's
``max_window_layers``, a ``layer_types`` list).

Such a model keeps every page of a request (its worker reports full attention, so nothing is released): the
sliding layers only mask. Each distinct window gets one copy of the step's metadata with that ``window`` and one
backend ``prepare`` state, shared by the layers that attend with it::

    layer_windows (512, 512, 0, 512, 512, 0)  ->  steps [S, S, F, S, S, F]
    F = (meta, prepare(meta)), S = (meta with window 512, prepare(that))
"""

from __future__ import annotations

from dataclasses import replace

from kvserve.common.attention_window import AttentionWindow
from kvserve.kernels.paged_attention import AttentionMetadata
from kvserve.worker.config import ModelConfig


def layer_steps(cfg: ModelConfig, meta: AttentionMetadata, prepare) -> list[tuple[AttentionMetadata, object]]:
    """Per layer, the metadata and backend state (``prepare(meta)``) its attention runs with. One pair for every
    layer unless ``cfg.layer_windows`` mixes windows; then ``meta`` must be full attention (a mixed model
    never slides as a whole, and has no sinks)."""
    if not cfg.layer_windows:
        return [(meta, prepare(meta))] * cfg.num_layers
    assert not meta.window.slides, "a mixed-layer model's step metadata must be full attention"
    by_window = {}
    for window in sorted(set(cfg.layer_windows)):
        layer_meta = replace(meta, window=AttentionWindow(window)) if window else meta
        by_window[window] = (layer_meta, prepare(layer_meta))
    return [by_window[w] for w in cfg.layer_windows]
