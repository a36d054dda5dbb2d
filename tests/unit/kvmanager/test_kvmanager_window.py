"""Sliding-window KV and attention sinks in the kvmanager: a windowed pool's spec on the wire, window releases
(holes in a request's page table) with exact pages, ref_cnts, LRU and free-list order, their validation, and
their persistence (call log replay, snapshots, recovery).

    sliding_window = 8, attention_sinks = 4, page_size = 4: page 0 holds the sinks and is never released
    page_table  [ 0 | 1 | 2 | 3 | 4 ]   -- release (1, 2) -->   [ 0 | HOLE | HOLE | 3 | 4 ]
"""

from __future__ import annotations

import json
import re

import grpc
import pytest
from kvmanager_soak import snapshot  # noqa: E402
from kvmanager_steps import checked_step as step
from kvmanager_steps import manager_with
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import generate_latest

from kvserve.common.convert import pages as page_cv
from kvserve.common.convert import worker as worker_cv
from kvserve.common.embedded_redis import EmbeddedRedis
from kvserve.common.errors import InvalidRequest
from kvserve.common.metrics import KVManagerMetrics
from kvserve.common.pages import HOLE
from kvserve.common.redis_client import connect, fresh_client
from kvserve.common.wire.pages import (
    OpStatus,
    PageAllocation,
    PageCommit,
    PageExtension,
    PageFree,
    PageRelease,
    PageReleaseResult,
    PoolSpec,
    StepOps,
    StepResults,
)
from kvserve.common.wire.worker import WorkerInfo
from kvserve.kvmanager import admin
from kvserve.kvmanager import snapshot as snapshot_format
from kvserve.kvmanager.call_log import CallLog
from kvserve.kvmanager.errors import StaleStep, UnknownRequest
from kvserve.kvmanager.hashing import chain_hashes
from kvserve.kvmanager.invariants import check_invariants
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.server import start_kvmanager_server
from kvserve.kvmanager.service import KVService
from kvserve.kvmanager.spans import record_op_spans
from kvserve.services.cli import main as cli_main
from kvserve.services.gateway.errors import KVManagerFailed
from kvserve.services.gateway.rpc.clients import KVManagerClient
from kvserve.v1 import kvmanager_pb2_grpc

PS = 4  # page size


def raw_records(client, key: str) -> list[bytes]:
    """The records of a log, as bytes (the store's client decodes replies as text)."""
    return fresh_client(client, decode_responses=False).lrange(key, 0, -1)


def test_a_windowed_pools_spec_crosses_the_wire_from_worker_info_to_registration():
    info = WorkerInfo("w0", 3, "mistral", "fp", PS, 16, "float32", 100, 100 * PS * 16, 2, 2, 4, 8, 1000, 4096,
                      (2,), "cpu", "reference", "", 1024, 4)
    back = worker_cv.info_from_proto(worker_cv.info_to_proto(info))
    assert back == info and (back.sliding_window, back.attention_sinks) == (1024, 4)
    spec = PoolSpec.of(back)
    assert spec == PoolSpec("w0", 3, 16, PS, "fp", "float32", 100, "", 1024, 4)
    msg = page_cv.spec_to_proto(spec)
    assert (msg.sliding_window, msg.attention_sinks) == (1024, 4)
    assert page_cv.spec_from_proto(msg) == spec
    # a dense worker's Info (the fields unset) is a pool without a window
    dense = WorkerInfo("w1", 1, "llama", "fp", PS, 16, "float32", 100, 100 * PS * 16, 2, 2, 4, 8, 1000, 4096,
                       (2,), "cpu", "reference")
    assert page_cv.spec_from_proto(page_cv.spec_to_proto(PoolSpec.of(dense))).sliding_window == 0


# -- releases in the domain -------------------------------------------------------------------------------------
def wspec(worker="w0", epoch=1, num_pages=12, window=8, sinks=4) -> PoolSpec:
    return PoolSpec(worker, epoch, num_pages, PS, "fp", "float32", 100, "", window, sinks)


def mgr_with(*specs) -> KVManager:
    return manager_with(*(specs or (wspec(),)))



def alloc(m, req_id, tokens, tenant="t", worker="w0", step_id=None):
    return step(m, step_id, allocations=[PageAllocation(req_id, tenant, tuple(tokens), worker)]).allocations[0]


def commit(m, req_id, start, tokens, computed=None, step_id=None):
    op = PageCommit(req_id, start, tuple(tokens), computed if computed is not None else start + len(tokens))
    return step(m, step_id, commits=[op]).commits[0]


def release(m, req_id, *indices, step_id=None):
    return step(m, step_id, releases=[PageRelease(req_id, indices)]).releases[0]


PROMPT = tuple(range(100, 118))  # 18 tokens: 4 full pages and 2 tokens of a fifth


def test_a_release_makes_holes_its_committed_pages_join_the_lru_still_indexed_and_they_still_hit():
    m = mgr_with()
    pool = m.pools["w0"]
    assert alloc(m, "a", PROMPT).page_table == [0, 1, 2, 3, 4]
    commit(m, "a", 0, PROMPT[:16], computed=18)  # blocks in pages 0..3
    r = release(m, "a", 1, 2)
    assert (r.status, r.num_released) == (OpStatus.OK, 2)
    assert m.requests["a"].page_table == [0, HOLE, HOLE, 3, 4]
    assert pool.ref_cnt[:5] == [1, 0, 0, 1, 1] and list(pool.evictable) == [1, 2]  # in the order given
    assert list(pool.free) == list(range(5, 12)) and pool.num_window_released == 2
    assert pool.block_of[1] is not None and pool.block_of[1].block_index == 1  # still indexed
    assert (pool.num_used, pool.num_cached, pool.num_free) == (3, 2, 7)
    # an uncommitted page goes to the free list's end
    assert alloc(m, "b", range(500, 513)).page_table == [5, 6, 7, 8]
    assert release(m, "b", 1).num_released == 1 and list(pool.free)[-1] == 6
    # the same prompt hits all 4 blocks; its first chunk (16, 17) reads the sinks' page 0 and its window 9..17
    # (pages 2 to 4): it holds pages 0 and 3 with a, takes 2 back from the LRU, and page 1 stays a hole, cached
    c = alloc(m, "c", PROMPT)
    assert c.num_cached_tokens == 16 and c.page_table == [0, HOLE, 2, 3, 9]
    assert pool.ref_cnt[:4] == [2, 0, 1, 2] and list(pool.evictable) == [1] and pool.num_window_released == 3


def test_a_retried_release_returns_the_remembered_answer_and_a_hole_released_again_releases_nothing():
    m = mgr_with()
    alloc(m, "a", PROMPT, step_id=1)
    first = release(m, "a", 1, 2, step_id=2)
    before = (list(m.pools["w0"].ref_cnt), list(m.pools["w0"].free), list(m.pools["w0"].evictable))
    assert release(m, "a", 1, 2, step_id=2) == first  # the retry: answered from memory
    assert (list(m.pools["w0"].ref_cnt), list(m.pools["w0"].free), list(m.pools["w0"].evictable)) == before
    assert m.requests["a"].last_ops["release"] == (2, first)
    again = release(m, "a", 1, 2, step_id=3)  # a new call naming holes: idempotent, nothing released
    assert (again.status, again.num_released) == (OpStatus.OK, 0) and m.pools["w0"].num_window_released == 2
    with pytest.raises(StaleStep, match="older than step 3"):
        release(m, "a", 3, step_id=2)


def test_a_free_of_a_request_with_holes_releases_only_the_pages_it_still_holds_tail_first():
    m = mgr_with()
    alloc(m, "a", PROMPT)
    commit(m, "a", 0, PROMPT[:16], computed=18)
    release(m, "a", 1, 2)
    step(m, frees=[PageFree("a")])  # pool.release would assert on a page released twice
    pool = m.pools["w0"]
    assert list(pool.evictable) == [1, 2, 3, 0] and list(pool.free)[-1] == 4 and not any(pool.ref_cnt)
    assert pool.num_requests == 0 and "a" not in m.requests


def test_a_late_commit_of_released_pages_extends_the_chain_without_caching_their_blocks():
    m = mgr_with()
    pool = m.pools["w0"]
    alloc(m, "a", PROMPT)
    commit(m, "a", 0, PROMPT[:4], computed=18)
    release(m, "a", 1, 2)  # uncommitted: to the free list
    assert list(pool.free)[-2:] == [1, 2]
    r = commit(m, "a", 4, PROMPT[4:16], computed=18)
    assert r.num_committed_tokens == 16
    hashes = chain_hashes(pool.seed_for("t"), PROMPT[:16], PS)
    assert m.requests["a"].block_hashes == hashes  # the whole chain: block 3's hash depends on blocks 1 and 2
    assert {b.page_id: b.block_index for b in pool.index.values()} == {0: 0, 3: 3}
    assert pool.index[hashes[3]].parent_hash == hashes[2]
    assert pool.block_of[1] is None and pool.block_of[2] is None  # pages 1 and 2 may hold anything by now
    # the chain walk stops at the first block not cached: only page 0 hits, though block 3 is indexed
    assert alloc(m, "b", PROMPT).num_cached_tokens == 4


def test_a_hit_never_uses_an_evicted_middle_block_of_a_released_request():
    m = mgr_with()
    pool = m.pools["w0"]
    alloc(m, "a", PROMPT)
    commit(m, "a", 0, PROMPT[:16], computed=18)
    release(m, "a", 1, 2)  # LRU [1, 2]
    # 8 pages: the 7 free ones, then the LRU head, page 1: block 1 is evicted, block 2 stays cached
    c = alloc(m, "c", range(700, 732))
    assert c.page_table == [5, 6, 7, 8, 9, 10, 11, 1] and pool.num_evicted == 1
    hashes = chain_hashes(pool.seed_for("t"), PROMPT[:16], PS)
    assert hashes[1] not in pool.index and pool.index[hashes[2]].page_id == 2
    step(m, frees=[PageFree("c")])
    d = alloc(m, "d", PROMPT)
    assert d.num_cached_tokens == 4 and d.page_table[0] == 0 and 2 not in d.page_table  # block 0 only
    assert pool.ref_cnt[2] == 0 and 2 in pool.evictable


def test_in_one_step_a_page_committed_then_released_lands_in_the_lru_indexed():
    m = mgr_with()
    pool = m.pools["w0"]
    alloc(m, "a", PROMPT)
    out = step(m, commits=[PageCommit("a", 0, PROMPT[:16], 18)], releases=[PageRelease("a", (1, 2))],
               extensions=[PageExtension("a", 21)])
    assert out.commits[0].num_committed_tokens == 16 and out.releases[0].num_released == 2
    assert out.extensions[0].new_page_ids == [5]  # the free list first
    assert list(pool.evictable) == [1, 2] and [pool.block_of[p].block_index for p in (1, 2)] == [1, 2]
    assert m.requests["a"].page_table == [0, HOLE, HOLE, 3, 4, 5]


def test_pages_released_in_a_step_serve_its_extensions_and_allocations():
    m = mgr_with(wspec(num_pages=6))
    prompt = tuple(range(100, 121))  # 21 tokens: all 6 pages
    assert alloc(m, "a", prompt).page_table == [0, 1, 2, 3, 4, 5]
    out = step(m, commits=[PageCommit("a", 0, prompt[:20], 21)], releases=[PageRelease("a", (1, 2))],
               extensions=[PageExtension("a", 25)], allocations=[PageAllocation("b", "t", (1, 2, 3), "w0")])
    # released before the extension and the allocation take pages: the LRU head (page 1), then page 2
    assert (out.extensions[0].status, out.extensions[0].new_page_ids) == (OpStatus.OK, [1])
    assert (out.allocations[0].status, out.allocations[0].page_table) == (OpStatus.OK, [2])
    assert m.pools["w0"].num_evicted == 2 and m.requests["a"].page_table == [0, HOLE, HOLE, 3, 4, 5, 1]


def test_sink_pages_round_up_to_whole_pages():
    m = mgr_with(wspec(sinks=5))  # 5 sink tokens: pages 0 and 1
    alloc(m, "a", PROMPT)
    assert m.pools["w0"].num_sink_pages == 2
    with pytest.raises(InvalidRequest, match="page index 1 holds a sink and cannot be released"):
        release(m, "a", 1)
    assert release(m, "a", 2).num_released == 1
    m = mgr_with(wspec(sinks=0))  # a window without sinks: page 0 may go
    alloc(m, "a", PROMPT)
    assert release(m, "a", 0).num_released == 1 and m.requests["a"].page_table[0] == HOLE


def test_a_release_of_a_request_whose_epoch_was_replaced_answers_stale_epoch():
    m = mgr_with()
    alloc(m, "a", PROMPT)
    m.register_worker(wspec(epoch=2))
    r = release(m, "a", 1)
    assert r.status is OpStatus.STALE_EPOCH and r.num_released == 0
    assert m.stale["a"].page_table == [0, 1, 2, 3, 4] and m.pools["w0"].num_window_released == 0


BAD = [
    (dict(releases=[PageRelease("live", (5,))]), InvalidRequest, "page index 5 is outside its page table [0, 5)"),
    (dict(releases=[PageRelease("live", (-1,))]), InvalidRequest, "page index -1 is outside"),
    (dict(releases=[PageRelease("live", (0,))]), InvalidRequest, "page index 0 holds a sink and cannot be released"),
    (dict(releases=[PageRelease("live", (4,))]), InvalidRequest, "page index 4 is the last page of its table"),
    (dict(releases=[PageRelease("live", (1, 2, 1))]), InvalidRequest, "a page index appears twice"),
    (dict(releases=[PageRelease("dense", (0,))]), InvalidRequest,
     "pool 'w1' has no sliding window: nothing to release"),
    (dict(releases=[PageRelease("ghost", (1,))]), UnknownRequest, "'ghost' is not live"),
    (dict(releases=[PageRelease("live", (1,)), PageRelease("live", (2,))]), InvalidRequest,
     "'live' appears twice in releases"),
    (dict(releases=[PageRelease("live", (1,))], frees=[PageFree("live")]), InvalidRequest, "another list"),
    (dict(releases=[PageRelease("live", (1,))], allocations=[PageAllocation("live", "t", (1,), "w0")]),
     InvalidRequest, "another list"),
]


@pytest.mark.parametrize("ops,error,message", BAD, ids=[b[2] for b in BAD])
def test_a_bad_release_is_rejected_with_a_clear_message_and_changes_nothing(ops, error, message):
    m = mgr_with(wspec(), PoolSpec("w1", 1, 8, PS, "fp", "float32", 100))
    alloc(m, "live", PROMPT)
    alloc(m, "other", range(300, 310))
    alloc(m, "dense", PROMPT, worker="w1")
    release(m, "live", 1)  # a hole already
    ops = {**ops, "releases": [*ops.get("releases", ()), PageRelease("other", (1,))]}  # a valid op in the call
    before = snapshot(m)
    with pytest.raises(error, match=re.escape(message)):
        m.step(StepOps(7, **{k: tuple(v) for k, v in ops.items()}))
    assert snapshot(m) == before


def test_a_streaming_request_decodes_far_past_the_pool_holding_only_its_sinks_and_window():
    """A 6-page pool (24 token slots), window 8, one sink page: 100 tokens decode, one extension per token, the
    pages wholly older than the window released as they fall out of it."""
    m = mgr_with(wspec(num_pages=6))
    alloc(m, "s", range(1, 6), step_id=1)  # 5 prompt tokens
    pool, window = m.pools["w0"], 8
    for n in range(5, 100):  # n tokens computed; this step computes token n, which attends [n + 1 - window, n]
        table = m.requests["s"].page_table
        old = [j for j in range(pool.num_sink_pages, len(table) - 1)
               if (j + 1) * PS <= n + 1 - window and table[j] != HOLE]
        out = step(m, n, releases=[PageRelease("s", tuple(old))] if old else [],
                   extensions=[PageExtension("s", n + 1)])
        assert out.extensions[0].status is OpStatus.OK
        held = [p for p in m.requests["s"].page_table if p != HOLE]
        assert len(held) <= pool.num_sink_pages + window // PS + 1  # sinks, the window, the next token's page
    table = m.requests["s"].page_table
    # the last step computed token 99 (attending 92..99): pages 1..22 hold only older positions
    assert len(table) == 25 and table[0] != HOLE and table[1:23] == [HOLE] * 22
    assert pool.num_window_released == 22 and pool.num_used == 3


# -- persistence: the call log, snapshots, recovery --------------------------------------------------------------
@pytest.fixture
def redis_url(tmp_path):
    with EmbeddedRedis(tmp_path / "redis") as server:
        yield server.url


def windowed_history(svc: KVService) -> None:
    """Releases of committed and uncommitted pages (one in the step that commits them), a retried release, a
    window without sinks, an eviction of a released page, a free of a request with holes, a hit stopped by the
    evicted block, a release answered STALE_EPOCH, and a late commit of a released page. Every call goes through
    the service (and its store)."""
    svc.register_worker(wspec("w0"))  # 12 pages, one sink page
    svc.register_worker(wspec("w1", num_pages=8, sinks=0))
    r = svc.step(StepOps(1, allocations=(PageAllocation("a", "t", PROMPT, "w0"),
                                         PageAllocation("b", "t", tuple(range(500, 513)), "w0"),
                                         PageAllocation("c", "u", tuple(range(900, 910)), "w1"))))
    assert [x.page_table for x in r.allocations] == [[0, 1, 2, 3, 4], [5, 6, 7, 8], [0, 1, 2]]
    ops = StepOps(2, commits=(PageCommit("a", 0, PROMPT[:16], 18),), extensions=(PageExtension("a", 21),),
                  releases=(PageRelease("a", (1, 2)), PageRelease("b", (1,))))
    first = svc.step(ops)
    assert [x.num_released for x in first.releases] == [2, 1] and first.extensions[0].new_page_ids == [9]
    assert svc.step(ops).releases == first.releases  # a retry: answered from memory, applied once
    assert svc.step(StepOps(3, releases=(PageRelease("c", (0,)),))).releases[0].num_released == 1
    # e takes the free pages 10, 11, 6, then evicts the LRU head: a's released page 1 (block 1)
    r = svc.step(StepOps(4, allocations=(PageAllocation("e", "t", tuple(range(700, 716)), "w0"),)))
    assert r.allocations[0].page_table == [10, 11, 6, 1] and svc.manager.pools["w0"].num_evicted == 1
    svc.step(StepOps(5, frees=(PageFree("a"),)))
    r = svc.step(StepOps(6, allocations=(PageAllocation("f", "t", PROMPT, "w0"),)))
    assert r.allocations[0].num_cached_tokens == 4  # block 0 only: block 1 was evicted
    svc.register_worker(wspec("w1", epoch=2, num_pages=8, sinks=0))  # c becomes stale
    assert svc.step(StepOps(7, releases=(PageRelease("c", (1,)),))).releases[0].status is OpStatus.STALE_EPOCH
    r = svc.step(StepOps(8, commits=(PageCommit("b", 0, tuple(range(500, 512)), 13),)))
    assert r.commits[0].num_committed_tokens == 12
    pool = svc.manager.pools["w0"]
    assert svc.manager.requests["b"].page_table == [5, HOLE, 7, 8] and pool.block_of[5] and pool.block_of[7]
    assert pool.num_window_released == 3  # a's pages 1 and 2, b's page 6
    assert svc.manager.pools["w1"].num_window_released == 0  # w1's counter went with its epoch
    # a prompt longer than w1's pool, admitted with its first chunk's pages (the log must carry chunk_tokens)
    r = svc.step(StepOps(9, allocations=(PageAllocation("g", "t", tuple(range(2000, 2040)), "w1", chunk_tokens=8),)))
    assert r.allocations[0].page_table == [0, 1]


def exact(mgr: KVManager) -> tuple:
    """Everything a restart must reproduce: the state, the clock, every remembered answer, the free lists'
    and LRUs' exact order, and the window counters."""
    orders = {w: (list(p.free), list(p.evictable), p.num_window_released) for w, p in mgr.pools.items()}
    return snapshot(mgr, clock=True, last_ops=True), orders, dict(mgr.recent)


@pytest.mark.parametrize("background", [True, False], ids=["forked", "inline"])
@pytest.mark.parametrize("snapshot_every", [1000, 4, 1])
def test_a_restart_reproduces_the_holes_ref_cnts_lru_and_free_list_exactly(redis_url, snapshot_every, background):
    store = CallLog(connect(redis_url), snapshot_every=snapshot_every, background=background)
    svc = KVService(KVManager(), store)
    windowed_history(svc)
    store.wait_snapshot()
    assert (store.gen == 0) == (snapshot_every == 1000)  # the replay alone, or snapshots holding holes
    loaded = KVManager()
    CallLog(connect(redis_url)).load(loaded)  # runs check_invariants
    assert exact(loaded) == exact(svc.manager)
    # page 6, which b's window released, is e's alone now
    assert loaded.requests["b"].page_table == [5, HOLE, 7, 8] and loaded.pools["w0"].ref_cnt[6] == 1
    assert set(loaded.stale["c"].last_ops) == {"allocate", "release"}
    # the reloaded manager carries on: a retried release is answered from memory, a new one applies
    again = KVService(loaded, CallLog(connect(redis_url)))
    assert again.step(StepOps(8, commits=(PageCommit("b", 0, tuple(range(500, 512)), 13),))).commits[0] == \
        svc.manager.requests["b"].last_ops["commit"][1]
    assert again.step(StepOps(9, releases=(PageRelease("b", (2,)),))).releases[0].num_released == 1
    assert loaded.pools["w0"].num_window_released == 4 and 7 in loaded.pools["w0"].evictable


def test_a_snapshot_stores_holes_as_minus_one_and_a_reload_holds_no_page_for_them():
    svc = KVService()  # NullStore: the snapshot is encoded by the test
    windowed_history(svc)
    chunks = snapshot_format.encode(svc.manager, [])
    stored = next(r for r in json.loads(b"".join(chunks))["requests"] if r["req_id"] == "b")
    assert stored["page_table"] == [5, -1, 7, 8] and stored["last_ops"]["release"][1]["num_released"] == 1
    loaded = KVManager()
    snapshot_format.decode(chunks, loaded)  # check_invariants: ref_cnts equal the holders, holes hold nothing
    pool = loaded.pools["w0"]
    assert loaded.requests["b"].page_table == [5, HOLE, 7, 8] and pool.ref_cnt[6] == 1  # e's alone
    assert exact(loaded) == exact(svc.manager) and pool.num_window_released == 3


def test_a_step_record_carries_its_releases_only_when_it_has_some(redis_url):
    client = connect(redis_url)
    svc = KVService(KVManager(), CallLog(client))
    svc.register_worker(wspec())
    svc.step(StepOps(1, allocations=(PageAllocation("a", "t", PROMPT, "w0"),)))
    svc.step(StepOps(2, releases=(PageRelease("a", (2, 1)),)))
    headers = [json.loads(raw.split(b"\n", 1)[0]) for raw in raw_records(client, "kvserve:log:0")]
    assert "r" not in headers[1] and headers[2]["r"] == [["a", [2, 1]]]
    assert list(svc.manager.pools["w0"].evictable) == [] and list(svc.manager.pools["w0"].free)[-2:] == [2, 1]


# -- over gRPC: the gateway's client, the servicer, the converters ----------------------------------------------
ADMIN_TOKEN = "window-admin-token"


@pytest.fixture
def served():
    """A real kvmanager server on a free port, and the gateway's client to it; the invariants hold after."""
    service = KVService()
    server = start_kvmanager_server(service, "127.0.0.1", 0, admin_token=ADMIN_TOKEN)
    client = KVManagerClient(f"127.0.0.1:{server.port}", timeout_s=10, retry_for_s=0)
    try:
        yield service, client, server.port
    finally:
        client.close()
        server.stop(0)
        check_invariants(service.manager)


def test_releases_cross_the_wire_from_step_ops_to_results_end_to_end(served):
    service, client, _ = served
    assert client.register(wspec()).previous_epoch == 0
    assert service.manager.pools["w0"].spec == wspec()  # the window and the sinks arrived
    r = client.step_pages(StepOps(1, allocations=(PageAllocation("a", "t", PROMPT, "w0"),)))
    assert r.allocations[0].page_table == [0, 1, 2, 3, 4]
    ops = StepOps(2, commits=(PageCommit("a", 0, PROMPT[:16], 18),), releases=(PageRelease("a", (1, 2)),),
                  extensions=(PageExtension("a", 21),))
    r = client.step_pages(ops)
    assert r.releases == [PageReleaseResult("a", OpStatus.OK, 2)] and r.extensions[0].new_page_ids == [5]
    assert r.pools[0].num_evictable_pages == 2  # the released pages, still cached
    assert client.step_pages(ops).releases == r.releases  # a retry over the wire: the remembered answer
    assert service.manager.requests["a"].page_table == [0, HOLE, HOLE, 3, 4, 5]
    with pytest.raises(KVManagerFailed, match="INVALID_ARGUMENT: release 'a': page index 0 holds a sink"):
        client.step_pages(StepOps(3, releases=(PageRelease("a", (0,)),)))
    with pytest.raises(KVManagerFailed, match="NOT_FOUND: request 'ghost' is not live"):
        client.step_pages(StepOps(3, releases=(PageRelease("ghost", (1,)),)))
    assert service.manager.requests["a"].page_table == [0, HOLE, HOLE, 3, 4, 5]  # both refused whole


def test_a_bad_window_at_registration_is_invalid_argument_over_grpc(served):
    service, _, port = served
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = kvmanager_pb2_grpc.KVManagerServiceStub(channel)
        for window, sinks, message in ((0, 4, "needs sliding_window"), (2, 0, "smaller than a page"),
                                       (-8, 0, "sliding_window must be >= 0")):
            with pytest.raises(grpc.RpcError) as err:
                stub.RegisterWorker(page_cv.spec_to_proto(wspec(window=window, sinks=sinks)), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()
    assert service.manager.pools == {}


def test_a_traced_release_gets_a_span_of_its_own():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    request = page_cv.step_to_request_proto(StepOps(4, releases=(PageRelease("a", (1, 2)), PageRelease("b", (3,)))),
                                            {"a": parent})
    results = StepResults(releases=[PageReleaseResult("a", OpStatus.OK, 2), PageReleaseResult("b", OpStatus.OK, 0)])
    record_op_spans(provider.get_tracer("test"), request, results, 1, 2, 0)
    (span,) = exporter.get_finished_spans()
    assert span.name == "kvmanager.release" and span.context.trace_id == int(parent.split("-")[1], 16)
    assert dict(span.attributes) == {"kvserve.req_id": "a", "kvserve.status": "ok", "kvserve.step_id": 4,
                                     "kvserve.num_page_indices": 2, "kvserve.num_released": 2}


# -- admin: stats, page tables, metrics ------------------------------------------------------------------------
def admin_cli(capsys, port: int, *args: str):
    """``kvserve admin ARGS`` in this process against the served kvmanager: (exit code, stdout)."""
    code = cli_main(["admin", *args, "--kvmanager", f"127.0.0.1:{port}", "--admin-token", ADMIN_TOKEN])
    return code, capsys.readouterr().out


def released_request(client: KVManagerClient) -> None:
    """Request a on the windowed pool: a sink page, two pages released by its window, two held."""
    client.register(wspec())
    client.register(PoolSpec("w1", 1, 8, PS, "fp", "float32", 100))  # a dense pool beside it
    client.step_pages(StepOps(1, allocations=(PageAllocation("a", "t", PROMPT, "w0"),)))
    client.step_pages(StepOps(2, commits=(PageCommit("a", 0, PROMPT[:16], 18),),
                              releases=(PageRelease("a", (1, 2)),)))


def test_admin_stats_show_each_pools_window_and_its_released_pages(served, capsys):
    service, client, port = served
    released_request(client)
    code, out = admin_cli(capsys, port, "stats", "--json")
    pools = {p["worker_id"]: p for p in json.loads(out)["pools"]}
    assert code == 0
    assert [(pools[w]["sliding_window"], pools[w]["attention_sinks"], pools[w]["num_window_released_pages"])
            for w in ("w0", "w1")] == [(8, 4, 2), (0, 0, 0)]
    assert (pools["w0"]["num_used_pages"], pools["w0"]["num_cached_pages"]) == (3, 2)  # the released, cached
    code, out = admin_cli(capsys, port, "stats")
    rows = [line.split() for line in out.splitlines()]
    assert rows[1][-3:] == ["WINDOW", "SINKS", "WINDOW_RELEASED"]
    assert rows[2][0] == "w0" and rows[2][-3:] == ["8", "4", "2"] and rows[3][-3:] == ["-", "-", "0"]
    # the metric, read from the same stats
    text = generate_latest(KVManagerMetrics(lambda: service.read(admin.stats)).registry).decode()
    assert 'kvserve:window_released_pages_total{kv_dtype="float32",worker_id="w0"} 2.0' in text
    assert 'kvserve:window_released_pages_total{kv_dtype="float32",worker_id="w1"} 0.0' in text


def test_admin_page_table_shows_holes_as_released_and_sink_pages_as_sinks(served, capsys):
    service, client, port = served
    released_request(client)
    hashes = [h.hex() for h in chain_hashes(service.manager.pools["w0"].seed_for("t"), PROMPT[:16], PS)]
    code, out = admin_cli(capsys, port, "page-table", "a", "--json")
    t = json.loads(out)
    assert code == 0 and t["page_table"] == [0, -1, -1, 3, 4]
    assert [(p["page_id"], p["kind"], p["ref_cnt"], p["block_hash"]) for p in t["pages"]] == [
        (0, "sink", 1, hashes[0]), (-1, "released", 0, ""), (-1, "released", 0, ""), (3, "held", 1, hashes[3]),
        (4, "held", 1, "")]
    code, out = admin_cli(capsys, port, "page-table", "a")
    lines = out.splitlines()
    assert "5 pages of 4 tokens (2 released by its window)" in lines[0]
    assert lines[1].split() == ["INDEX", "PAGE", "KIND", "REF_CNT", "PINNED", "BLOCK_HASH"]
    assert [line.split()[:5] for line in lines[2:]] == [
        ["0", "0", "sink", "1", "no"], ["1", "-", "released", "0", "no"], ["2", "-", "released", "0", "no"],
        ["3", "3", "held", "1", "no"], ["4", "4", "held", "1", "no"]]
    # a dense pool's request: every page held, nothing released, no sinks
    client.step_pages(StepOps(3, allocations=(PageAllocation("d", "t", PROMPT[:9], "w1"),)))
    code, out = admin_cli(capsys, port, "page-table", "d", "--json")
    assert [p["kind"] for p in json.loads(out)["pages"]] == ["held"] * 3


def test_a_windowed_allocation_holds_only_its_first_chunks_pages_so_a_prompt_may_outgrow_the_pool():
    """chunk_tokens: the table covers the hit and the first chunk; a prompt of 100 tokens (25 pages) on a pool
    of 12 pages is admitted with the pages of its first 8 tokens, and nothing past them."""
    m = mgr_with()
    pool = m.pools["w0"]
    long_prompt = tuple(range(1000, 1100))
    a = step(m, allocations=[PageAllocation("long", "t", long_prompt, "w0", chunk_tokens=8)]).allocations[0]
    assert a.status is OpStatus.OK and a.page_table == [0, 1] and pool.num_used == 2
    with pytest.raises(InvalidRequest, match="more pages than pool"):  # without chunk_tokens: the whole prompt
        step(m, allocations=[PageAllocation("whole", "t", long_prompt, "w0")])
    with pytest.raises(InvalidRequest, match="chunk_tokens must be >= 0"):
        step(m, allocations=[PageAllocation("neg", "t", long_prompt, "w0", chunk_tokens=-1)])
    assert set(m.requests) == {"long"} and pool.num_used == 2  # the refused ones left nothing
