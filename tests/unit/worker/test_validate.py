"""kvserve/worker/validate.py on the shared KV tier's fields: a step of store writes and no item is valid, an empty one
is not; a malformed store write refuses the step; a malformed store load rejects its item alone; a page filled from
the store counts as written by its item, so no other item of the step may read or write it."""

from __future__ import annotations

import pytest

from kvserve.common.errors import InvalidRequest
from kvserve.common.wire.tier import StoreLoad, StoreWrite
from kvserve.common.wire.worker import StepBatch, StepItem
from kvserve.worker.validate import validate_batch

NUM_PAGES, PAGE_SIZE = 8, 4
H = bytes(range(16))
NS = bytes(range(16, 32))


def validate(items=(), store_writes=()) -> dict[str, str]:
    return validate_batch(StepBatch(tuple(items), store_writes=tuple(store_writes)), vocab_size=100,
                          num_pages=NUM_PAGES, page_size=PAGE_SIZE, max_model_len=64, max_step_tokens=64)


def item(req_id="r", start_pos=8, page_table=(0, 1, 2), loads=()) -> StepItem:
    """A first chunk after an 8-token cached prefix (pages 0 and 1), as store loads fill it."""
    return StepItem(req_id, (5, 6), start_pos, page_table, store_loads=tuple(loads))


def test_a_step_of_store_writes_and_no_item_is_valid():
    assert validate(store_writes=[StoreWrite(3, H, NS, "t")]) == {}


def test_a_step_with_neither_item_nor_store_write_is_invalid():
    with pytest.raises(InvalidRequest, match="empty batch"):
        validate()


@pytest.mark.parametrize("write,message", [
    (StoreWrite(NUM_PAGES, H, NS, "t"), "page id out of range [0, 8)"),
    (StoreWrite(-1, H, NS, "t"), "page id out of range"),
    (StoreWrite(2, H[:8], NS, "t"), "block_hash is 8 bytes, not 16"),
    (StoreWrite(2, H, NS + b"x", "t"), "namespace is 17 bytes, not 16"),
])
def test_a_malformed_store_write_refuses_the_whole_step(write, message):
    with pytest.raises(InvalidRequest) as err:
        validate([item()], [StoreWrite(1, H, NS, "t"), write])
    assert message in str(err.value) and f"store write of page {write.page_id}" in str(err.value)


@pytest.mark.parametrize("loads,message", [
    ([StoreLoad(NUM_PAGES, H, NS)], "store load of page 8: page id out of range [0, 8)"),
    ([StoreLoad(5, H, NS)], "store load of page 5, which is not in its page_table"),
    ([StoreLoad(0, H, NS), StoreLoad(0, H, NS)], "page 0 is loaded from the store twice"),
    ([StoreLoad(1, b"", NS)], "block_hash is 0 bytes, not 16"),
    ([StoreLoad(1, H, NS[:15])], "namespace is 15 bytes, not 16"),
])
def test_a_malformed_store_load_rejects_its_item_alone(loads, message):
    rejected = validate([item("bad", loads=loads), item("good", page_table=(3, 4, 5), loads=[StoreLoad(3, H, NS)])])
    assert list(rejected) == ["bad"] and message in rejected["bad"]


def test_a_page_filled_from_the_store_is_its_item_s_alone_in_the_step():
    with pytest.raises(InvalidRequest, match="items 'a' and 'b' both write page 0"):
        validate([item("a", loads=[StoreLoad(0, H, NS)]), item("b", page_table=(0, 6, 7), loads=[StoreLoad(0, H, NS)])])
    with pytest.raises(InvalidRequest, match="item 'b' reads page 0, which item 'a' writes in the same step"):
        validate([item("a", loads=[StoreLoad(0, H, NS)]), item("b", page_table=(0, 6, 7))])
    assert validate([item("a", loads=[StoreLoad(0, H, NS), StoreLoad(1, H, NS)]), item("b", page_table=(3, 4, 5))]) \
        == {}
