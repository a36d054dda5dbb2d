"""Checks a whole step call before anything is applied: one bad op rejects the call and changes nothing."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from kvserve.common.errors import DomainError, InvalidRequest
from kvserve.common.pages import HOLE, num_pages_for
from kvserve.common.tokens import check_token_ids
from kvserve.common.wire.pages import (
    MAX_PIN_TTL_S,
    MAX_PINS,
    PageAllocation,
    PageCommit,
    PageExtension,
    PageRelease,
    StepOps,
)
from kvserve.kvmanager.errors import StaleStep, UnknownRequest
from kvserve.kvmanager.pool import PagePool, releasing
from kvserve.kvmanager.state import RequestPages

if TYPE_CHECKING:
    from kvserve.kvmanager.manager import KVManager



def check_tenant(tenant: str) -> None:
    if not tenant:
        raise InvalidRequest("tenant must not be empty")


@contextmanager
def _about(req_id: str) -> Iterator[None]:
    """An op's refusal names its request (DomainError.req_id), so that the gateway fails that one alone."""
    try:
        yield
    except DomainError as e:
        if e.req_id is None and req_id:
            e.req_id = req_id
        raise


def validate_step(mgr: KVManager, ops: StepOps) -> None:
    """Raises the typed error of the first bad op, naming its request (req_id) where an op is at fault."""
    if ops.step_id < 1:
        raise InvalidRequest(f"step_id must be >= 1, got {ops.step_id}")
    _check_unique(ops)
    for f in ops.frees:
        if not f.req_id:
            raise InvalidRequest("a free has an empty req_id")
        with _about(f.req_id):
            _check_not_stale(mgr, f.req_id, "free", ops.step_id)
    for c in ops.commits:
        with _about(c.req_id):
            _check_commit(mgr, c, ops.step_id)
    for r in ops.releases:
        with _about(r.req_id):
            _check_release(mgr, r, ops.step_id)
    releasing = {r.req_id: r.page_indices for r in ops.releases}
    for e in ops.extensions:
        with _about(e.req_id):
            _check_extend(mgr, e, ops.step_id, releasing.get(e.req_id, ()))
    for a in ops.allocations:
        with _about(a.req_id):
            _check_allocate(mgr, a, ops.step_id)


def _check_unique(ops: StepOps) -> None:
    lists = {"allocations": [a.req_id for a in ops.allocations], "extensions": [e.req_id for e in ops.extensions],
             "commits": [c.req_id for c in ops.commits], "frees": [f.req_id for f in ops.frees],
             "releases": [r.req_id for r in ops.releases]}
    for name, ids in lists.items():
        if len(set(ids)) != len(ids):
            seen: set[str] = set()
            dup = next(i for i in ids if i in seen or seen.add(i))  # linear: a call may carry thousands
            raise InvalidRequest(f"req_id {dup!r} appears twice in {name}", req_id=dup)
    # A request may commit its last full pages in the call that frees it (applied commit first); an extension
    # or a release of a request being freed, or an allocation sharing a req_id with any other op, makes no sense.
    running = set(lists["extensions"]) | set(lists["commits"]) | set(lists["releases"])
    for a, b in (("allocations", running), ("frees", set(lists["extensions"]) | set(lists["releases"])),
                 ("allocations", set(lists["frees"]))):
        both = set(lists[a]) & b
        if both:
            raise InvalidRequest(f"req_id {sorted(both)[0]!r} appears in {a} and in another list of the same call",
                                 req_id=sorted(both)[0])


def _live_or_stale(mgr: KVManager, req_id: str) -> RequestPages:
    req = mgr.requests.get(req_id) or mgr.stale.get(req_id)
    if req is None:
        raise UnknownRequest(f"request {req_id!r} is not live (never allocated, freed, or reset)")
    return req


def _check_not_stale(mgr: KVManager, req_id: str, kind: str, step_id: int, req: RequestPages | None = None) -> None:
    req = req or mgr.requests.get(req_id) or mgr.stale.get(req_id)
    if req is not None and step_id < req.last_step_id:
        raise StaleStep(f"request {req_id!r}: step_id {step_id} is older than step {req.last_step_id} already "
                        f"applied")


def _check_allocate(mgr: KVManager, a: PageAllocation, step_id: int) -> None:
    where = f"allocation {a.req_id!r}"
    if not a.req_id:
        raise InvalidRequest("an allocation has an empty req_id")
    if not a.tenant:
        raise InvalidRequest(f"{where}: tenant must not be empty")
    check_token_ids(where, a.token_ids)
    live = mgr.requests.get(a.req_id)
    if a.moved_from:
        record = live or mgr.stale.get(a.req_id)
        if record is not None and record.worker_id not in (a.moved_from, a.worker_id):
            raise InvalidRequest(f"{where}: moved_from {a.moved_from!r}, but the request is on worker "
                                 f"{record.worker_id!r}")
        if live is not None and live.worker_id == a.moved_from:
            return _check_moved(mgr, a, where, live)  # its prefill's incarnation, under another caller's step_ids
        if live is None and record is not None and record.worker_id == a.moved_from != a.worker_id:
            return _check_moved(mgr, a, where, record)  # dropped with its prefill's pool: it recomputes
    _check_not_stale(mgr, a.req_id, "allocate", step_id)
    freed = mgr.recent.get(("free", a.req_id))
    if freed is not None and step_id < freed[0]:  # a late attempt of a call the caller gave up on
        raise StaleStep(f"request {a.req_id!r}: step_id {step_id} is older than step {freed[0]}, which freed it")
    if live is not None and not live.is_replay("allocate", step_id):
        raise InvalidRequest(f"{where}: req_id is already live")
    _check_placed(mgr, a, where)


def _check_moved(mgr: KVManager, a: PageAllocation, where: str, prefill: RequestPages) -> None:
    if prefill.tenant != a.tenant:
        raise InvalidRequest(f"{where}: moved_from {a.moved_from!r} holds this req_id for another tenant")
    _check_placed(mgr, a, where)


def _check_placed(mgr: KVManager, a: PageAllocation, where: str) -> None:
    if not a.worker_id:
        raise InvalidRequest(f"{where}: worker_id must name the worker to allocate on (Place chooses it)")
    pool = mgr.pool(a.worker_id)
    if a.chunk_tokens < 0:
        raise InvalidRequest(f"{where}: chunk_tokens must be >= 0 (0 = the whole prompt), got {a.chunk_tokens}")
    _check_pins(where, a)
    for p, what in ((pool, "pool"), (pool.group, "the sliding group of pool")):
        if p is None or (p.window.slides and a.chunk_tokens):  # a window's pages at a time: it may outgrow p
            continue
        if num_pages_for(len(a.token_ids), p.spec.page_size) > p.spec.num_pages:
            raise InvalidRequest(f"{where}: {len(a.token_ids)} tokens need more pages than {what} "
                                 f"{a.worker_id!r} has")


def _check_pins(where: str, a: PageAllocation) -> None:
    if len(a.pins) > MAX_PINS:
        raise InvalidRequest(f"{where}: {len(a.pins)} pins; at most {MAX_PINS} per allocation")
    for i, p in enumerate(a.pins):
        if not 0 <= p.num_tokens <= len(a.token_ids):
            raise InvalidRequest(f"{where}: pins[{i}].num_tokens must be 0 (the whole prompt) to the prompt's "
                                 f"{len(a.token_ids)} tokens, got {p.num_tokens}")
        if not 0 < p.ttl_s <= MAX_PIN_TTL_S:
            raise InvalidRequest(f"{where}: pins[{i}].ttl_s must be 1 to {MAX_PIN_TTL_S} seconds, got {p.ttl_s}")


def _check_extend(mgr: KVManager, e: PageExtension, step_id: int, releasing: tuple[int, ...]) -> None:
    """``releasing``: the page indices the same call releases before it extends (validated already)."""
    req = _live_or_stale(mgr, e.req_id)
    _check_not_stale(mgr, e.req_id, "extend", step_id, req)
    if e.num_tokens <= 0:
        raise InvalidRequest(f"extension {e.req_id!r}: num_tokens must be > 0, got {e.num_tokens}")
    if req.req_id not in mgr.requests:
        return
    pool = mgr.pools[req.worker_id]
    if req.group is None:
        _check_room(e, pool, req.page_table, releasing, "the pool's")
    else:  # a grouped pool's releases are of the sliding group's table
        _check_room(e, pool, req.page_table, (), "the pool's")
        _check_room(e, pool.group, req.group.page_table, releasing, "the sliding group's")


def _check_room(e: PageExtension, pool: PagePool, table: list[int], releasing: tuple[int, ...], what: str) -> None:
    """An extension past the pool's size is only possible with holes: pages its window released, or releases in
    this call, are not held (counted only here, so that a dense request's extension never scans its table)."""
    if e.num_tokens <= pool.spec.num_pages * pool.spec.page_size:
        return
    holes = table.count(HOLE) + sum(1 for i in releasing if table[i] != HOLE)
    if num_pages_for(e.num_tokens, pool.spec.page_size) - holes > pool.spec.num_pages:
        released = f", {holes} of its pages released" if holes else ""
        raise InvalidRequest(f"extension {e.req_id!r}: num_tokens {e.num_tokens} exceeds {what} "
                             f"{pool.spec.num_pages * pool.spec.page_size} token slots{released}")


def _check_commit(mgr: KVManager, c: PageCommit, step_id: int) -> None:
    where = f"commit {c.req_id!r}"
    if c.req_id not in mgr.requests and c.req_id not in mgr.stale:
        remembered = mgr.recent.get(("commit", c.req_id))
        if remembered is not None and remembered[0] == step_id:
            return  # a retried call whose first attempt committed this request's last pages, then freed it
    req = _live_or_stale(mgr, c.req_id)
    _check_not_stale(mgr, c.req_id, "commit", step_id)
    if c.token_ids:  # an empty commit commits nothing, harmlessly
        check_token_ids(where, c.token_ids)
    if c.req_id in mgr.stale or req.is_replay("commit", step_id):
        return
    page_size = mgr.pools[req.worker_id].spec.page_size
    if len(c.token_ids) % page_size:
        raise InvalidRequest(f"{where}: {len(c.token_ids)} token ids are not a whole number of pages "
                             f"of {page_size}")
    if c.start_pos != req.num_committed_tokens:
        raise InvalidRequest(f"{where}: start_pos {c.start_pos} must equal the {req.num_committed_tokens} tokens "
                             f"committed so far")
    end = c.start_pos + len(c.token_ids)
    num_slots = len(req.page_table) * page_size
    if req.group is not None:  # its sliding group's table may cover fewer positions (chunked prefill)
        num_slots = min(num_slots, len(req.group.page_table) * page_size)
    if not end <= c.num_computed_tokens <= num_slots:
        raise InvalidRequest(f"{where}: need start_pos + len(token_ids) = {end} <= num_computed_tokens = "
                             f"{c.num_computed_tokens} <= {num_slots} slots of its pages")


def _check_release(mgr: KVManager, r: PageRelease, step_id: int) -> None:
    """A release names pages of a live request's table on a windowed pool (on a grouped pool: of its sliding
    group's table): never a sink page, never the last page (the next token goes there), each index once. A stale
    request's release answers STALE_EPOCH."""
    where = f"release {r.req_id!r}"
    req = _live_or_stale(mgr, r.req_id)
    _check_not_stale(mgr, r.req_id, "release", step_id, req)
    if r.req_id in mgr.stale or req.is_replay("release", step_id):
        return
    pool, table = releasing(mgr.pools[req.worker_id], req)
    if not pool.window.slides:
        raise InvalidRequest(f"{where}: pool {req.worker_id!r} has no sliding window: nothing to release")
    num_sinks = pool.num_sink_pages
    if len(set(r.page_indices)) != len(r.page_indices):
        raise InvalidRequest(f"{where}: a page index appears twice in {list(r.page_indices)}")
    for i in r.page_indices:
        if not 0 <= i < len(table):
            raise InvalidRequest(f"{where}: page index {i} is outside its page table [0, {len(table)})")
        if i < num_sinks:
            raise InvalidRequest(f"{where}: page index {i} holds a sink and cannot be released (the first "
                                 f"{num_sinks} pages hold the pool's {pool.window.sinks} attention sinks)")
        if i == len(table) - 1:
            raise InvalidRequest(f"{where}: page index {i} is the last page of its table: the next token goes "
                                 "there")
