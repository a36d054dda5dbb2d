"""Sliding-window attention and attention sinks as one policy: which keys a query reads, and from that which
pages a request keeps and which it may release. The scheduler, the kvmanager, the worker and the kernels ask an
``AttentionWindow``; only the edges (config parsing, wire conversion, CLI flags) see the two settings.

A query at position p reads key j when ``p - window < j <= p`` (Mistral's sliding window: itself and the
``window - 1`` keys before it), or when ``j < sinks`` (StreamingLLM's attention sinks: the first tokens stay
visible). Without a window (``FULL_ATTENTION``) it reads every ``j <= p``. Pages that hold only keys older than
every window still to come are released during the request; their page-table entries become ``HOLE``::

    page_size 4, window 6, sinks 2, a query at p = 13:   pages  [0]       [1]       [2]         [3]
                                                          keys   0 1 . . | . . . . | 8 9 10 11 | 12 13
    reads page 0 (the sinks 0, 1) and pages 2, 3 (keys 8 .. 13); page 1 is releasable (a hole)

With sinks a query's rotary position for the sink keys is its position inside the kept cache, at most
``max_cache_position`` (kvserve/kernels/window.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.common.errors import InvalidRequest
from kvserve.common.pages import num_pages_for


@dataclass(frozen=True, slots=True)
class SettingNames:
    """How an edge names the two settings in its error messages."""

    window: str
    sinks: str


WIRE_NAMES = SettingNames("sliding_window", "attention_sinks")  # PoolSpec / WorkerInfo fields
FLAG_NAMES = SettingNames("--sliding-window", "--attention-sinks")  # kvserve worker / up flags


@dataclass(frozen=True, slots=True)
class AttentionWindow:
    """Which positions a request's queries read (and so which pages it keeps); ``FULL_ATTENTION``: all."""

    window: int = 0  # a query at p reads the keys p - window < j <= p; 0 = full attention, every j <= p
    sinks: int = 0  # and the keys j < sinks (StreamingLLM), with a window only

    def __post_init__(self) -> None:
        assert self.window >= 0 and self.sinks >= 0 and (self.window or not self.sinks), self

    @classmethod
    def checked(cls, window: int, sinks: int, page_size: int, names: SettingNames = WIRE_NAMES) -> AttentionWindow:
        """The policy for these settings. Raises InvalidRequest (a ValueError), in the edge's ``names``, for a
        negative setting, sinks without a window, or a window smaller than a page (pages are released whole)."""
        for name, value in ((names.window, window), (names.sinks, sinks)):
            if value < 0:
                raise InvalidRequest(f"{name} must be >= 0 (0 = none), got {value}")
        if sinks and not window:  # without a window every token is kept anyway
            raise InvalidRequest(f"{names.sinks} needs {names.window} (the window kept beside the sinks)")
        if window and window < page_size:  # pages are released whole: the window must span at least one
            raise InvalidRequest(f"a sliding window of {window} tokens is smaller than a page ({page_size} tokens)")
        return cls(window, sinks)

    @property
    def slides(self) -> bool:
        """Whether queries read only a window (and pages fall out of it); False for full attention."""
        return self.window > 0

    @property
    def max_cache_position(self) -> int:
        """With sinks, the largest position a query has inside the kept cache (``sinks + window - 1``)."""
        return self.sinks + self.window - 1

    def sees(self, query_pos, key_pos):
        """Whether a query at query_pos reads a key at key_pos: ints, or tensors that broadcast."""
        causal = key_pos <= query_pos
        return causal & ((key_pos > query_pos - self.window) | (key_pos < self.sinks)) if self.slides else causal

    def tokens_kept(self, num_tokens: int) -> int:
        """Keys the last query of a ``num_tokens`` sequence reads: its sinks and its window, or all of them."""
        return min(num_tokens, self.window + self.sinks) if self.slides else num_tokens

    def max_request_tokens(self, max_model_len: int, pool_tokens: int) -> int:
        """The most tokens one request may hold on a pool of ``pool_tokens`` slots: with a window any number the
        model takes (it holds only its window's pages), else the pool's."""
        return max_model_len if self.slides else pool_tokens

    # Pages. ``page_size`` is the pool's; page index i holds positions [i * page_size, (i + 1) * page_size).

    def num_sink_pages(self, page_size: int) -> int:
        """Leading pages that hold the sinks: pinned to the request, never released."""
        return num_pages_for(self.sinks, page_size)

    def first_page_read(self, pos: int, page_size: int) -> int:
        """The first page of the window of a query at ``pos`` (0 with full attention)."""
        return max(0, pos - self.window + 1) // page_size if self.slides else 0

    def pages_read(self, start_pos: int, end_pos: int, page_size: int) -> list[int]:
        """The page indices that queries at ``start_pos .. end_pos - 1`` read, in order: the sink pages, then the
        first one's window through the last position."""
        lo = self.first_page_read(start_pos, page_size)
        return [*range(min(self.num_sink_pages(page_size), lo)), *range(lo, num_pages_for(end_pos, page_size))]

    def releasable_pages(self, next_pos: int, page_size: int) -> range:
        """Pages no query from ``next_pos`` on reads: after the sink pages, those wholly before the window of the
        query at ``next_pos`` (none with full attention)::

            page_size 4, window 6, sinks 0, next_pos 13: the query at 13 reads 8..13 -> pages 0 and 1
        """
        return range(self.num_sink_pages(page_size), self.first_page_read(next_pos, page_size))

    def may_release(self, page_index: int, num_pages: int, page_size: int) -> bool:
        """Whether page ``page_index`` of a ``num_pages``-page table may be a hole: with a window, after the
        sink pages and before the last page (the next token's)."""
        return self.slides and self.num_sink_pages(page_size) <= page_index < num_pages - 1

    def pages_held(self, num_tokens: int, page_size: int) -> int:
        """Pages a request holds while the step that computes its token at ``num_tokens - 1`` runs, its earlier
        pages released: its sink pages and that token's window (``kvserve kv-mem``'s pages per sequence)::

            page_size 4, window 6, sinks 2, num_tokens 14: pages 0 (sinks) and 2, 3 (positions 8 .. 13): 3
        """
        pages = num_pages_for(num_tokens, page_size)
        if not self.slides:
            return pages
        sink_pages = min(self.num_sink_pages(page_size), pages)
        return sink_pages + pages - max(sink_pages, self.first_page_read(num_tokens - 1, page_size))

    def max_pages_held(self, num_tokens: int, page_size: int, chunk: int = 1) -> int:
        """The most pages a ``num_tokens`` request holds while a step computes ``chunk`` new tokens (1: a
        decode): all of its pages, or with a window at most its sink pages and the window of the chunk's first
        token through its last, not page-aligned."""
        pages = num_pages_for(num_tokens, page_size)
        if not self.slides:
            return pages
        return min(pages, self.num_sink_pages(page_size) + num_pages_for(self.window - 1 + chunk, page_size) + 1)


FULL_ATTENTION = AttentionWindow()
