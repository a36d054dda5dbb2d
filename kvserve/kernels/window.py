"""Sliding-window attention and attention sinks over the page pool, for the reference backend (the cpu
backend's C++ kernels, kvserve/kernels/paged_decode.cpp and paged_prefill.cpp, and the triton backend walk the same
keys in place).

A query at position p sees key j when ``p - window < j <= p`` (Mistral's sliding window: itself and the
``window - 1`` keys before it), or when ``j < sinks`` (StreamingLLM's attention sinks: the first tokens stay
visible). Which keys a query reads, and so which pages a request keeps, is the policy ``AttentionWindow``
(kvserve/common/attention_window.py). Pages that hold only keys older than every window still to come are released
during the request (``releasable_pages``; their page-table entries become ``HOLE``), so a sequence gathers
only the pages its rows read: its sink pages, then the pages from its first row's window on::

    page_size 4, window 6, sinks 2, a decode at p = 13:    pages  [0] [1] [2] [3]
                                                            keys   0 1 . . | . . . . | 8 9 10 11 | 12 13
    gathered: page 0 (sinks 0, 1) and pages 2, 3 (keys 8 .. 13); page 1 may be a hole

Positions with sinks (StreamingLLM): a token's rotary position is its index inside the kept cache, so the
distances the model sees never exceed ``sinks + window - 1`` however long the request runs. Keys are stored
rotated at their absolute positions, as without sinks (a page's contents then depend only on its tokens, so
prefix caching stays as it is). RoPE's score depends only on the distance between query and key, so for the
window's keys the absolute positions give exactly the in-cache distances; only the sink keys need the query
at its in-cache position, ``min(p, sinks + window - 1)`` (``sink_positions``): each query is rotated twice,
and a sink key is scored against the second rotation. No stored key is ever rotated again.
"""

from __future__ import annotations

import torch

from kvserve.common.attention_window import AttentionWindow

FAR = 1 << 40  # the key position of a padding slot: after every query, so masked


def sink_positions(positions: torch.Tensor, window: AttentionWindow) -> torch.Tensor:
    """Each query's in-cache position, at which it scores the sink keys: its own until the window has moved
    past the sinks, then ``sinks + window - 1``."""
    return positions.clamp(max=window.max_cache_position)


def window_keys(start_pos: list[int], seq_lens: list[int], tables: torch.Tensor, window: AttentionWindow,
                page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence, the pages to gather (page ids, padded with page 0) and the position of every gathered key
    (padding at FAR): ``[num_seqs * num_pages]`` and ``[num_seqs, num_pages * page_size]``."""
    reads = [window.pages_read(s, n, page_size) for s, n in zip(start_pos, seq_lens, strict=True)]
    width = max(len(r) for r in reads)
    logical = torch.full((len(reads), width), -1, dtype=torch.long)
    for b, r in enumerate(reads):
        logical[b, :len(r)] = torch.tensor(r, dtype=torch.long)
    pad = logical < 0
    page_ids = torch.gather(tables.cpu(), 1, logical.clamp(min=0)).masked_fill_(pad, 0)
    if bool((page_ids < 0).any()):
        raise ValueError("a page a query reads is a hole in its page table (released by the window too early)")
    key_pos = (logical[:, :, None] * page_size + torch.arange(page_size)).masked_fill_(pad[:, :, None], FAR)
    return page_ids.reshape(-1).to(tables.device), key_pos.reshape(len(reads), -1).to(tables.device)


def scored_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                     logits_soft_cap: float = 0.0, q_sink: torch.Tensor | None = None,
                     sink_keys: torch.Tensor | None = None) -> torch.Tensor:
    """Dense attention with its scores written out, for what SDPA does not compute: a soft cap on the scores
    (``cap * tanh(s / cap)`` after the scale, as HF's eager Gemma 2 attention) and attention sinks (sink keys
    scored against q_sink, the others against q).

    q, q_sink [seqs, heads, q_len, d]; k, v [seqs, kv_heads, keys, d]; mask additive [seqs, 1, q_len, keys];
    sink_keys bool [seqs, 1, 1, keys]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2)
    if sink_keys is not None:
        scores = torch.where(sink_keys, q_sink @ k.transpose(-1, -2), scores)
    scores = scores * scale
    if logits_soft_cap:
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    return torch.softmax(scores + mask, dim=-1) @ v
