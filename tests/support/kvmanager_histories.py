"""One history of kvmanager calls shared by the persistence tests: two pools, three tenants, prefix hits, commits,
an extension, frees, evictions, a pinned block and a stale request."""

from __future__ import annotations

from kvserve.common.wire.pages import OpStatus, PageAllocation, PageCommit, PageExtension, PageFree, PoolSpec, StepOps
from kvserve.kvmanager import admin
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.service import KVService

PS = 4
P = list(range(100, 112))  # a 3-page prefix shared by tenant A's requests


def spec(worker: str, epoch: int = 1, num_pages: int = 12) -> PoolSpec:
    return PoolSpec(worker, epoch, num_pages, PS, "fp", "float32", 100)


def alloc(req_id, tenant, tokens, worker="w0"):
    return PageAllocation(req_id, tenant, tuple(tokens), worker)


def build_history(svc: KVService) -> None:
    """Two pools, three tenants, prefix hits, commits, an extension, frees, evictions, a pinned block, and a
    stale request after w1 re-registers. Every call goes through the service (and its store)."""
    svc.register_worker(spec("w0"))
    svc.register_worker(spec("w1"))
    r = svc.step(StepOps(1, allocations=(alloc("a", "A", P + [1], "w0"), alloc("b", "B", range(9), "w1"))))
    assert [x.page_table for x in r.allocations] == [[0, 1, 2, 3], [0, 1, 2]]
    svc.step(StepOps(2, commits=(PageCommit("a", 0, tuple(P), 13), PageCommit("b", 0, tuple(range(8)), 9))))
    r = svc.step(StepOps(3, allocations=(alloc("c", "A", P + [2], "w0"),), extensions=(PageExtension("a", 17),)))
    assert r.allocations[0].num_cached_tokens == 12 and r.allocations[0].page_table == [0, 1, 2, 5]
    assert r.extensions[0].new_page_ids == [4]
    svc.step(StepOps(4, frees=(PageFree("b"),), commits=(PageCommit("a", 12, (1, 7, 7, 7), 16),)))
    # w1: b's 2 cached blocks + 10 free pages; 11 pages for d evict one cached block (the chain's end)
    r = svc.step(StepOps(5, allocations=(alloc("d", "C", range(500, 544), "w1"),)))
    assert r.allocations[0].status == OpStatus.OK and svc.manager.pools["w1"].num_evicted == 1
    svc.step(StepOps(6, frees=(PageFree("c"),)))  # c's tail page 5 is free again; its hit pages stay held by a
    assert svc.mutate(admin.pin, "A", tuple(P[:8]), "w0").num_pinned_blocks == 2  # pages 0 and 1, held by a
    svc.register_worker(spec("w1", epoch=2))  # d becomes stale, w1's blocks are dropped
    r = svc.step(StepOps(7, allocations=(alloc("e", "B", range(9), "w1"),), extensions=(PageExtension("d", 48),)))
    assert r.allocations[0].epoch == 2 and r.extensions[0].status == OpStatus.STALE_EPOCH
    svc.step(StepOps(8, frees=(PageFree("a"),), allocations=(alloc("f", "A", P + [3], "w0"),)))


def history() -> KVManager:
    svc = KVService()  # NullStore: the snapshot is written by the test
    build_history(svc)
    return svc.manager
