"""Token positions -> pages: the one place that rounds a token count up to whole pages.

    page_size = 4:   tokens 0 1 2 3 | 4 5 6 7 | 8 9      num_pages_for(10, 4) == 3
"""

from __future__ import annotations


def num_pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` tokens (positions [0, num_tokens)): the ceiling of the quotient."""
    return -(-num_tokens // page_size)


# A page-table entry that holds no page: a page a sliding window has left behind, released during the request
# (vLLM's null page). Positions in it are never read again.
HOLE = -1


def num_sink_pages(sinks: int, page_size: int) -> int:
    """Leading pages that hold the first ``sinks`` tokens (attention sinks): pinned to the request."""
    return num_pages_for(sinks, page_size)


def first_window_page(pos: int, window: int, page_size: int) -> int:
    """The first page a query at position ``pos`` reads inside a window of ``window`` tokens (itself and the
    ``window - 1`` before it)."""
    return max(0, pos - window + 1) // page_size


def pages_read(start_pos: int, end_pos: int, window: int, sinks: int, page_size: int) -> list[int]:
    """The page indices that queries at ``start_pos .. end_pos - 1`` read, in order: the sink pages, then the
    first one's window through the last position."""
    lo = first_window_page(start_pos, window, page_size)
    return [*range(min(num_sink_pages(sinks, page_size), lo)), *range(lo, num_pages_for(end_pos, page_size))]


def releasable_pages(next_pos: int, window: int, sinks: int, page_size: int) -> range:
    """Pages no query from ``next_pos`` on reads: after the sink pages, those wholly before the window of the
    query at ``next_pos``::

        page_size 4, window 6, sinks 0, next_pos 13: the query at 13 reads 8..13 -> pages 0 and 1 releasable
    """
    return range(num_sink_pages(sinks, page_size), first_window_page(next_pos, window, page_size))


def window_pages_held(num_tokens: int, window: int, sinks: int, page_size: int) -> int:
    """Pages a windowed request holds while the step that computes its token at position ``num_tokens - 1``
    runs, its earlier pages released (``releasable_pages``): its sink pages and the pages of that token's
    window, ``kvserve kv-mem --page-size --sliding-window --sinks``'s pages per sequence::

        page_size 4, window 6, sinks 2, num_tokens 14: pages 0 (sinks) and 2, 3 (positions 8 .. 13): 3 pages
    """
    pages = num_pages_for(num_tokens, page_size)
    sink_pages = min(num_sink_pages(sinks, page_size), pages)
    return sink_pages + pages - max(sink_pages, first_window_page(num_tokens - 1, window, page_size))


def max_window_pages(window: int, sinks: int, page_size: int, chunk: int = 1) -> int:
    """The most pages a windowed request holds while a step computes ``chunk`` new tokens (1: a decode): the
    sink pages, and the window of the chunk's first token through its last, not page-aligned."""
    return num_sink_pages(sinks, page_size) + num_pages_for(window - 1 + chunk, page_size) + 1
