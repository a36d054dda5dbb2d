"""Checks a step before anything touches the pool. A step malformed as a whole computes nothing and writes
nothing; an item malformed alone is rejected alone (its request fails at the gateway) and the step computes the
others: one bad request never costs the others their step."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.common.attention_window import FULL_ATTENTION, AttentionWindow
from kvserve.common.errors import InvalidRequest
from kvserve.common.pages import HOLE, num_pages_for
from kvserve.common.request_checks import check_sampling
from kvserve.common.tokens import check_token_ids
from kvserve.common.wire.tier import StoreLoad, StoreWrite
from kvserve.common.wire.worker import StepBatch, StepItem

HASH_BYTES = 16  # block hashes and namespaces (xxh3_128)


@dataclass(frozen=True, slots=True)
class SlidingGroupPages:
    """A worker with page groups (kvserve/worker/page_groups.py): its sliding layers' pool, which each item's
    group_page_table addresses."""

    num_pages: int
    window: AttentionWindow  # the sliding layers' window: pages before it may be holes


def validate_batch(batch: StepBatch, *, vocab_size: int, num_pages: int, page_size: int,
                   max_model_len: int, max_step_tokens: int,
                   window: AttentionWindow = FULL_ATTENTION,
                   sliding_group: SlidingGroupPages | None = None) -> dict[str, str]:
    """Raises InvalidRequest for a step malformed as a whole: no item (and no store write), an empty or repeated
    req_id, more tokens than the worker takes, two items writing one page (a page an item fills from the store
    counts as written by it), a malformed store write. Returns the items rejected alone, req_id -> what is
    wrong (a position, token id, page table, store load or sampling parameter); the step computes the others.
    With a sliding window (kvserve/kernels/window.py) a page table may hold HOLEs where no position of the item is read
    or written.

    With ``sliding_group`` (page groups) every item carries a group_page_table covering its positions, of page
    ids in [0, sliding_group.num_pages), holes only before the window of its start_pos, and no two items write
    one page of it either; without, an item with a group_page_table is rejected."""
    if not batch.items and not batch.store_writes:
        raise InvalidRequest("empty batch: a step needs at least one item or store write")
    for write in batch.store_writes:
        _check_store_page(f"store write of page {write.page_id}", write, num_pages)
    seen: set[str] = set()
    for item in batch.items:
        if not item.req_id:
            raise InvalidRequest("an item has an empty req_id")
        if item.req_id in seen:
            raise InvalidRequest(f"duplicate req_id {item.req_id!r} in one step")
        seen.add(item.req_id)
    num_tokens = sum(len(i.token_ids) for i in batch.items)
    if num_tokens > max_step_tokens:
        raise InvalidRequest(f"step has {num_tokens} tokens; this worker takes at most {max_step_tokens}")
    rejected: dict[str, str] = {}
    for item in batch.items:
        try:
            _check_item(item, vocab_size, num_pages, page_size, max_model_len, window)
            _check_group_table(item, sliding_group, page_size)
        except InvalidRequest as e:
            rejected[item.req_id] = str(e)
    kept = tuple(i for i in batch.items if i.req_id not in rejected)
    _check_no_shared_slots(kept, page_size)
    if sliding_group is not None:
        _check_no_shared_slots(kept, page_size, group=True)
    return rejected


def _check_item(item: StepItem, vocab_size: int, num_pages: int, page_size: int, max_model_len: int,
                window: AttentionWindow) -> None:
    where = f"item {item.req_id!r}"
    if item.start_pos < 0:
        raise InvalidRequest(f"{where}: start_pos {item.start_pos} is negative")
    if item.end_pos > max_model_len:
        raise InvalidRequest(f"{where}: positions up to {item.end_pos} exceed max_model_len {max_model_len}")
    check_token_ids(where, item.token_ids, vocab_size)
    pages_needed = num_pages_for(item.end_pos, page_size)
    if len(item.page_table) < pages_needed:
        raise InvalidRequest(
            f"{where}: page_table has {len(item.page_table)} pages but positions [0, {item.end_pos}) "
            f"need {pages_needed} of {page_size} tokens"
        )
    pages = [p for p in item.page_table if p != HOLE] if window.slides else item.page_table
    bad = [p for p in pages if not 0 <= p < num_pages]
    if bad:
        raise InvalidRequest(f"{where}: page id {bad[0]} is out of range [0, {num_pages})")
    if len(pages) != len(item.page_table):
        _check_holes(where, item, window, page_size)
    _check_once(where, pages, "page_table")
    if item.sample:
        check_sampling(where, item.sampling)
    _check_store_loads(where, item, num_pages)


def _check_once(where: str, pages: list[int] | tuple[int, ...], field: str) -> None:
    """No page twice in a table (which also bounds a table's length by the pool's)."""
    if len(set(pages)) != len(pages):
        seen: set[int] = set()
        twice = next(p for p in pages if p in seen or seen.add(p))
        raise InvalidRequest(f"{where}: page {twice} appears twice in its {field}")


def _check_group_table(item: StepItem, group: SlidingGroupPages | None, page_size: int) -> None:
    """The sliding layers' page table of a grouped worker's item; none on another worker."""
    where, table = f"item {item.req_id!r}", item.group_page_table
    if group is None:
        if table:
            raise InvalidRequest(f"{where}: it has a group_page_table, but this worker keeps no page groups "
                                 "(its sliding_group_pages is 0)")
        return
    pages_needed = num_pages_for(item.end_pos, page_size)
    if len(table) < pages_needed:
        raise InvalidRequest(f"{where}: group_page_table has {len(table)} pages but positions [0, {item.end_pos}) "
                             f"need {pages_needed} of {page_size} tokens (this worker keeps page groups)")
    pages = [p for p in table if p != HOLE]
    bad = [p for p in pages if not 0 <= p < group.num_pages]
    if bad:
        raise InvalidRequest(f"{where}: group_page_table page id {bad[0]} is out of range [0, {group.num_pages})")
    first_read = group.window.first_page_read(item.start_pos, page_size)
    late = next((k for k in range(first_read, len(table)) if table[k] == HOLE), None)
    if late is not None:
        raise InvalidRequest(f"{where}: group_page_table[{late}] is a hole, but only pages before "
                             f"{first_read} (older than the window {group.window.window} of position "
                             f"{item.start_pos}) may be")
    _check_once(where, pages, "group_page_table")


def _check_store_loads(where: str, item: StepItem, num_pages: int) -> None:
    """Each page filled from the store is the item's own, once."""
    seen: set[int] = set()
    for load in item.store_loads:
        _check_store_page(f"{where}: store load of page {load.page_id}", load, num_pages)
        if load.page_id not in item.page_table:
            raise InvalidRequest(f"{where}: store load of page {load.page_id}, which is not in its page_table")
        if load.page_id in seen:
            raise InvalidRequest(f"{where}: page {load.page_id} is loaded from the store twice")
        seen.add(load.page_id)


def _check_store_page(where: str, order: StoreLoad | StoreWrite, num_pages: int) -> None:
    if not 0 <= order.page_id < num_pages:
        raise InvalidRequest(f"{where}: page id out of range [0, {num_pages})")
    for name in ("block_hash", "namespace"):
        if len(getattr(order, name)) != HASH_BYTES:
            raise InvalidRequest(f"{where}: {name} is {len(getattr(order, name))} bytes, not {HASH_BYTES}")


def _check_holes(where: str, item: StepItem, window: AttentionWindow, page_size: int) -> None:
    """A hole (a page the window released) only where the item neither reads nor writes."""
    for index in window.pages_read(item.start_pos, item.end_pos, page_size):
        if item.page_table[index] == HOLE:
            raise InvalidRequest(f"{where}: page_table[{index}] is a hole, but positions {item.start_pos}.."
                                 f"{item.end_pos - 1} read it (window {window.window}, sinks {window.sinks})")


def _check_no_shared_slots(items: tuple[StepItem, ...], page_size: int, group: bool = False) -> None:
    """A page one item writes in a step must be nobody else's in it: two writers would corrupt each other's
    K/V, and an item reading it would attend over K/V written in the same step (every layer writes before it
    attends), and would keep the damage in its cached prefix. ``group``: of the sliding layers' pool (the items'
    group_page_tables) rather than the page_tables'."""
    owner: dict[int, str] = {}
    what = "sliding group page" if group else "page"
    for item in items:
        table = item.group_page_table if group else item.page_table
        first, last = item.start_pos // page_size, (item.end_pos - 1) // page_size
        loaded = () if group else (load.page_id for load in item.store_loads)  # pages it fills from the store
        for page_id in (*table[first : last + 1], *loaded):  # no page twice in a table: checked per item
            other = owner.setdefault(page_id, item.req_id)
            if other != item.req_id:
                raise InvalidRequest(f"items {other!r} and {item.req_id!r} both write {what} {page_id} in one step")
    for item in items:
        read = (item.group_page_table if group else item.page_table)[: num_pages_for(item.end_pos, page_size)]
        for page_id in owner.keys() & read:  # C-level: the pages it reads that someone writes (its own, usually)
            if owner[page_id] != item.req_id:
                raise InvalidRequest(f"item {item.req_id!r} reads {what} {page_id}, which item "
                                     f"{owner[page_id]!r} writes in the same step")
