"""Page groups (issue 42): a model that mixes full-attention and sliding-window layers keeps the sliding layers'
K/V in a pool of its own, so that only their pages fall out of the window while the full layers keep all of theirs.

Each request then has a page table per group: ``StepItem.page_table`` in the full layers' pool (every page held)
and ``StepItem.group_page_table`` in the sliding layers' pool, covering the same positions, where the kvmanager
turns the pages older than the window into HOLEs::

    page_size 16, window 24, a decode at position 100:    pages  0   1   2   3   4   5   6
    page_table        (full layers:    every page)              [7,  3,  9,  1, 12,  4,  8]
    group_page_table  (sliding layers: pages of 77 .. 100)      [-1, -1, -1, -1,  2,  0,  5]

The worker decides here whether it groups (``plan``), how many pages each pool gets (``size_groups``) and a
step's metadata over the sliding layers' tables (``sliding_step``); the decoders run each layer on its group's
pool (kvserve/worker/layer_windows.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from kvserve.common.attention_window import AttentionWindow
from kvserve.common.wire.worker import StepItem
from kvserve.kernels.kv_quant import KVFormat
from kvserve.kernels.paged_attention import build_metadata
from kvserve.worker.config import ModelConfig
from kvserve.worker.kv_pool import PoolSize, size_pool
from kvserve.worker.layer_windows import LayerGroups, SlidingGroup

# The default sliding layers' pool holds the windows of this many requests: the gateway's --max-num-seqs default,
# the most it runs on a worker at once. More would only split the budget towards equal page counts, where the
# full pool (which bounds how many tokens fit) gains nothing over one pool for every layer.
GROUP_REQUESTS = 64


def plan(cfg: ModelConfig, *, enabled: bool, kv_store: bool, role: str, sinks: int, page_size: int
         ) -> tuple[LayerGroups | None, str]:
    """The page groups a worker of these settings keeps (None: one pool for every layer, the sliding layers only
    masking), and why not ("" when it groups, or for a model that does not mix sliding and full layers).

    A mixed model is grouped unless: ``enabled`` is False (--no-page-groups), the worker reads and writes the
    shared KV tier (its store values hold every layer of a page), its role is not "both" (pages move between
    prefill and decode workers whole), it has attention sinks, its layers have more than one window, or the
    window is smaller than a page (pages are released whole)."""
    if not cfg.layer_windows:
        return None, ""
    windows = sorted(set(cfg.layer_windows) - {0})
    why_not = ("--no-page-groups" if not enabled else
               "the shared KV tier (--kv-store-url) stores every layer of a page" if kv_store else
               f"role {role}: pages move between workers with every layer" if role != "both" else
               "attention sinks" if sinks else
               f"{len(windows)} sliding windows ({', '.join(map(str, windows))})" if len(windows) != 1 else
               f"window {windows[0]} is smaller than a page ({page_size} tokens)" if windows[0] < page_size else
               "")
    return (None, why_not) if why_not else (LayerGroups.of(cfg.layer_windows), "")


def describe(groups: LayerGroups | None, why_not: str, sliding: PoolSize | None) -> str:
    """The worker's choice for its ready line ("" for a model that does not mix sliding and full layers)."""
    if groups is None:
        return f"one pool for every layer, the sliding ones masking (no page groups: {why_not})" if why_not else ""
    return (f"page groups: {len(groups.full_layers)} full layers in the pool above, {len(groups.sliding_layers)} "
            f"sliding layers (window {groups.window}) in {sliding.num_pages} pages x {sliding.page_size} tokens x "
            f"{sliding.bytes_per_token} B/token = {sliding.pool_bytes} B")


def sliding_step(items: Sequence[StepItem], groups: LayerGroups, page_size: int, kv_cache: torch.Tensor,
                 kv_scales: torch.Tensor | None, device: torch.device) -> SlidingGroup:
    """The sliding layers' side of a step: the metadata over the items' group_page_tables (HOLEs where
    released), with their window, and their pool."""
    meta = build_metadata([i.start_pos for i in items], [len(i.token_ids) for i in items],
                          [list(i.group_page_table) for i in items], page_size, device,
                          AttentionWindow(groups.window))
    return SlidingGroup(meta, kv_cache, kv_scales)


def window_pages(window: int, max_model_len: int, page_size: int) -> int:
    """Pages of the sliding layers' pool one request holds at most while a step computes up to a page of its
    tokens: its window's pages, not page-aligned, and the page being written."""
    return AttentionWindow(window).max_pages_held(max_model_len, page_size, chunk=page_size)


def size_groups(cfg: ModelConfig, groups: LayerGroups, fmt: KVFormat, page_size: int, *, kv_scales: str,
                kv_cache_bytes: int | None, num_pages: int | None, sliding_group_pages: int | None,
                max_model_len: int) -> tuple[PoolSize, PoolSize]:
    """The full layers' pool and the sliding layers' pool, from a byte budget for both or an explicit page count.

    The sliding pool gets ``sliding_group_pages`` pages if given, else by default enough for GROUP_REQUESTS
    requests' windows (GROUP_REQUESTS x window_pages: a request holds no more sliding pages than that however
    long it runs), but never more pages than the full layers' pool (a request holds no more sliding pages than
    full ones, so more could never be used):

    - ``num_pages`` P: the full pool has P pages, the sliding pool min(P, cap).
    - ``kv_cache_bytes`` B, full pages of f bytes and sliding pages of s: the two pools together fit B. Both get
      P = B // (f + s) pages when that is at most the cap; otherwise the sliding pool gets the cap's pages and the
      full pool the rest, (B - cap * s) // f pages. With an explicit sliding_group_pages N the full pool gets
      (B - N * s) // f.

    Raises ValueError when the budget holds no page of the full pool, or an explicit sliding_group_pages is less
    than 1 or more than the full pool's pages.
    """
    def pool(layers: tuple[int, ...], pages: int) -> PoolSize:
        return size_pool(cfg, fmt, page_size, kv_scales=kv_scales, num_pages=pages, num_layers=len(layers))

    if sliding_group_pages is not None and sliding_group_pages < 1:
        raise ValueError(f"--sliding-group-pages must be at least 1, got {sliding_group_pages}")
    full, sliding = pool(groups.full_layers, 1), pool(groups.sliding_layers, 1)
    cap = sliding_group_pages or GROUP_REQUESTS * window_pages(groups.window, max_model_len, page_size)
    if num_pages is not None:
        full_pages = num_pages
        sliding_pages = sliding_group_pages or min(num_pages, cap)
    else:
        f, s = full.page_bytes, sliding.page_bytes
        both = kv_cache_bytes // (f + s)
        if sliding_group_pages is None and both <= cap:
            full_pages = sliding_pages = both
        else:
            full_pages, sliding_pages = max(0, kv_cache_bytes - cap * s) // f, cap
        if full_pages <= 0:
            raise ValueError(f"the KV budget of {kv_cache_bytes} bytes holds no page of the full layers' pool "
                             f"({f} bytes a page of {page_size} tokens) beside the sliding layers' (pages of {s} "
                             f"bytes, {max(1, sliding_pages)} of them at least)")
    if sliding_pages > full_pages:
        raise ValueError(f"--sliding-group-pages {sliding_pages} is more than the full layers' {full_pages} pages: "
                         "a request never holds more sliding pages than full ones")
    return dataclasses.replace(full, num_pages=full_pages), dataclasses.replace(sliding, num_pages=sliding_pages)
