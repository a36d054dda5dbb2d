"""Token positions -> pages: the one place that rounds a token count up to whole pages.

    page_size = 4:   tokens 0 1 2 3 | 4 5 6 7 | 8 9      num_pages_for(10, 4) == 3

Which pages a request keeps under a sliding window, and which it may release, is the policy of
``kvserve/common/attention_window.py``.
"""

from __future__ import annotations


def num_pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` tokens (positions [0, num_tokens)): the ceiling of the quotient."""
    return -(-num_tokens // page_size)


# A page-table entry that holds no page: a page a sliding window has left behind, released during the request
# (vLLM's null page). Positions in it are never read again.
HOLE = -1
