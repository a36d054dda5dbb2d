"""The attention-window policy (kvserve/common/attention_window.py): exact pages and positions on tiny cases, the seam
between sinks and window and page boundaries, and its arithmetic against a brute force over every position."""

import pytest

from kvserve.common.attention_window import FLAG_NAMES, FULL_ATTENTION, AttentionWindow
from kvserve.common.errors import InvalidRequest
from kvserve.common.pages import num_pages_for

W6 = AttentionWindow(6, 0)
W6S2 = AttentionWindow(6, 2)


def test_a_query_sees_itself_its_window_and_the_sinks_and_nothing_after_it():
    assert [j for j in range(20) if W6S2.sees(13, j)] == [0, 1, 8, 9, 10, 11, 12, 13]
    assert [j for j in range(20) if W6.sees(13, j)] == [8, 9, 10, 11, 12, 13]
    assert [j for j in range(20) if FULL_ATTENTION.sees(5, j)] == [0, 1, 2, 3, 4, 5]
    assert [j for j in range(8) if W6S2.sees(3, j)] == [0, 1, 2, 3]  # the window still holds the sinks


def test_pages_read_are_the_sink_pages_then_the_window_through_the_last_position():
    assert W6S2.pages_read(13, 14, 4) == [0, 2, 3]  # the module docstring's picture: page 1 is not read
    assert W6.pages_read(13, 14, 4) == [2, 3]
    assert W6S2.pages_read(5, 14, 4) == [0, 1, 2, 3]  # a chunk: its first row's window starts on page 0
    assert AttentionWindow(8, 5).pages_read(20, 21, 4) == [0, 1, 3, 4, 5]  # 5 sinks: two sink pages
    assert FULL_ATTENTION.pages_read(13, 14, 4) == [0, 1, 2, 3]


def test_releasable_pages_stop_at_the_window_of_the_next_query_and_never_take_sink_pages():
    assert W6.releasable_pages(13, 4) == range(0, 2)  # the query at 13 reads 8 .. 13
    assert W6.releasable_pages(12, 4) == range(0, 1)  # the query at 12 reads 7: page 1 stays
    assert W6S2.releasable_pages(13, 4) == range(1, 2)
    assert AttentionWindow(8, 5).releasable_pages(13, 4) == range(2, 1)  # empty: the window reaches page 1
    assert list(AttentionWindow(8, 5).releasable_pages(20, 4)) == [2]
    assert list(FULL_ATTENTION.releasable_pages(10_000, 4)) == []


def test_a_hole_is_allowed_only_past_the_sink_pages_before_the_last_page_and_only_with_a_window():
    assert [i for i in range(5) if W6S2.may_release(i, 5, 4)] == [1, 2, 3]
    assert [i for i in range(5) if W6.may_release(i, 5, 4)] == [0, 1, 2, 3]
    assert [i for i in range(5) if AttentionWindow(8, 5).may_release(i, 5, 4)] == [2, 3]
    assert not any(FULL_ATTENTION.may_release(i, 5, 4) for i in range(5))
    assert not W6.may_release(0, 1, 4)  # a one-page table: its only page is the next token's


def test_pages_held_and_the_most_held_at_the_page_seams():
    assert W6S2.pages_held(14, 4) == 3  # pages 0 (sinks), 2, 3
    assert W6S2.pages_held(13, 4) == 4  # the query at 12 reads 7: pages 0, 1, 2, 3
    assert W6S2.pages_held(3, 4) == 1 and W6S2.pages_held(4, 4) == 1 and W6S2.pages_held(5, 4) == 2
    assert FULL_ATTENTION.pages_held(14, 4) == 4
    assert W6S2.max_pages_held(10_000, 4) == 1 + num_pages_for(6, 4) + 1 == 4
    assert W6S2.max_pages_held(10_000, 4, chunk=8) == 1 + num_pages_for(13, 4) + 1 == 6
    assert W6S2.max_pages_held(5, 4, chunk=8) == 2  # never more than the request's own pages
    assert FULL_ATTENTION.max_pages_held(14, 4, chunk=8) == 4


def test_tokens_kept_and_the_largest_in_cache_position():
    assert W6S2.tokens_kept(100) == 8 and W6S2.tokens_kept(5) == 5
    assert FULL_ATTENTION.tokens_kept(100) == 100
    assert W6S2.max_cache_position == 7  # a query past the window scores the sinks from position 2 + 6 - 1


def test_a_request_is_bounded_by_the_pool_only_without_a_window():
    assert W6.max_request_tokens(4096, 64) == 4096
    assert FULL_ATTENTION.max_request_tokens(4096, 64) == 64


@pytest.mark.parametrize("window,sinks,page_size", [(6, 0, 4), (6, 2, 4), (8, 5, 4), (4, 4, 4), (16, 1, 16),
                                                    (5, 3, 1), (7, 0, 3)])
def test_the_page_arithmetic_agrees_with_a_brute_force_over_positions(window, sinks, page_size):
    """Every query position and chunk, against what sees() says: the pages a chunk reads are exactly those
    holding a key some row sees; releasable pages hold no key any later query sees; pages held count them."""
    w = AttentionWindow(window, sinks)
    for start in range(40):
        for end in range(start + 1, start + 12):
            seen = {j // page_size for p in range(start, end) for j in range(p + 1) if w.sees(p, j)}
            want = sorted(seen | set(range(start // page_size, num_pages_for(end, page_size))))  # writes too
            assert w.pages_read(start, end, page_size) == want, (start, end)
        later = {j // page_size for p in range(start, start + window + 4 * page_size) for j in range(p + 1)
                 if w.sees(p, j)}
        releasable = set(w.releasable_pages(start, page_size))
        assert not releasable & later, start
        assert releasable == set(range(start // page_size + 1)) - later - set(range(w.num_sink_pages(page_size)))
        n = start + 1
        held = set(range(num_pages_for(n, page_size))) - set(w.releasable_pages(n - 1, page_size))
        assert w.pages_held(n, page_size) == len(held), n
        assert w.max_pages_held(10_000, page_size) >= len(held)


@pytest.mark.parametrize("window,sinks,message", [
    (-1, 0, "sliding_window must be >= 0 (0 = none), got -1"),
    (8, -2, "attention_sinks must be >= 0 (0 = none), got -2"),
    (0, 4, "attention_sinks needs sliding_window (the window kept beside the sinks)"),
    (3, 0, "a sliding window of 3 tokens is smaller than a page (4 tokens)"),
])
def test_bad_settings_are_refused_in_the_edges_names(window, sinks, message):
    with pytest.raises(InvalidRequest) as err:
        AttentionWindow.checked(window, sinks, 4)
    assert str(err.value) == message
    with pytest.raises(ValueError) as err:  # the worker's flags
        AttentionWindow.checked(window, sinks, 4, FLAG_NAMES)
    assert str(err.value) == message.replace("sliding_window", "--sliding-window").replace(
        "attention_sinks", "--attention-sinks")


def test_good_settings_make_the_policy_and_no_window_is_full_attention():
    assert AttentionWindow.checked(4, 2, 4) == AttentionWindow(4, 2) and AttentionWindow(4, 2).slides
    assert AttentionWindow.checked(0, 0, 4) == FULL_ATTENTION
    assert not FULL_ATTENTION.slides
    with pytest.raises(AssertionError):
        AttentionWindow(0, 2)  # sinks without a window is never a policy
