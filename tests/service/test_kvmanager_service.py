"""The kvmanager over real gRPC (port 0, no persistence): page ops, epoch fencing, bad input, admin RPCs, auth."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvmanager_rpc import TOKEN, WORDS, Admin, write_word_tokenizer
from step_ids import step_id_for

from kvserve.common.tokens import le_uint32
from kvserve.kvmanager import admin
from kvserve.kvmanager.hashing import chain_hashes
from kvserve.kvmanager.invariants import check_invariants
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.server import start_kvmanager_server
from kvserve.kvmanager.service import KVService
from kvserve.v1 import kvmanager_pb2 as pb
from kvserve.v1 import kvmanager_pb2_grpc

PS = 4  # page size
BYTES_PER_TOKEN = 100
OK, OOP, STALE = pb.PAGE_OP_STATUS_OK, pb.PAGE_OP_STATUS_OUT_OF_PAGES, pb.PAGE_OP_STATUS_STALE_EPOCH
P1 = list(range(100, 112))  # 3 full pages


@dataclass
class KV:
    service: KVService
    mgr: KVManager
    stub: kvmanager_pb2_grpc.KVManagerServiceStub
    admin: Admin
    channel: grpc.Channel

    def register(self, worker="w0", epoch=1, num_pages=8):
        return self.stub.RegisterWorker(pb.PoolSpec(
            worker_id=worker, epoch=epoch, num_pages=num_pages, page_size=PS, model_fingerprint="fp",
            kv_dtype="float32", bytes_per_token=BYTES_PER_TOKEN), timeout=10)

    def step(self, step_id=None, allocations=(), extensions=(), commits=(), frees=()):
        """One StepPages call: with ``step_id`` as given, else a new call's (newer than every one sent)."""
        return self.stub.StepPages(pb.StepOps(step_id=step_id_for(self.mgr, step_id), allocations=allocations,
                                              extensions=extensions, commits=commits, frees=frees),
                                   timeout=10)

    def alloc(self, req_id, tokens, tenant="A", worker="w0", step_id=None):
        op = pb.PageAllocation(req_id=req_id, tenant=tenant, packed_token_ids=le_uint32(tokens), worker_id=worker)
        return self.step(step_id, allocations=[op]).allocation_results[0]

    def commit(self, req_id, start, tokens, step_id=None):
        op = pb.PageCommit(req_id=req_id, start_pos=start, packed_token_ids=le_uint32(tokens),
                           num_computed_tokens=start + len(tokens))
        return self.step(step_id, commits=[op]).commit_results[0]

    def free(self, req_id, step_id=None):
        return self.step(step_id, frees=[pb.PageFree(req_id=req_id)]).free_results[0]

    def stats(self):
        return self.admin.Stats(pb.StatsRequest())


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return write_word_tokenizer(tmp_path_factory.mktemp("tok"))


@contextlib.contextmanager
def serving(service: KVService, tokenizer=None):
    """A real server on a free port over ``service``, and stubs; the manager's invariants hold afterwards."""
    server = start_kvmanager_server(service, "127.0.0.1", 0, admin_token=TOKEN, tokenizer=tokenizer)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield KV(service, service.manager, kvmanager_pb2_grpc.KVManagerServiceStub(channel), Admin(channel), channel)
    server.stop(0)
    check_invariants(service.manager)


@pytest.fixture
def kv(tokenizer_dir):
    from kvserve.common.tokenizer import Tokenizer

    with serving(KVService(), Tokenizer(tokenizer_dir)) as kv:
        yield kv


def rpc_error(call, *args) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(*args)
    return err.value


# -- KVManagerService -----------------------------------------------------------------------------------------
def test_register_and_step_round_trip_with_exact_pages(kv):
    reg = kv.register()
    assert reg.ok and reg.previous_epoch == 0 and list(reg.dropped_req_ids) == []
    a = kv.alloc("a", P1 + [7])  # 13 tokens -> 4 pages
    assert (a.status, list(a.page_table), a.num_cached_tokens, a.worker_id, a.epoch) == (OK, [0, 1, 2, 3], 0, "w0", 1)
    assert kv.commit("a", 0, P1).num_committed_tokens == 12
    out = kv.step(allocations=[pb.PageAllocation(req_id="b", tenant="A", worker_id="w0",
                                                 packed_token_ids=le_uint32(P1))],
                  extensions=[pb.PageExtension(req_id="a", num_tokens=17)])
    b, ext = out.allocation_results[0], out.extension_results[0]
    assert list(b.page_table) == [0, 1, 5] and b.num_cached_tokens == 8  # capped: the last token is computed
    assert list(ext.new_page_ids) == [4] and ext.num_pages == 5
    assert [(p.worker_id, p.num_free_pages, p.num_evictable_pages) for p in out.pools] == [("w0", 2, 0)]
    assert out.handle_ms > 0
    assert kv.free("a").status == OK and kv.free("a").status == OK  # a second free is harmless
    assert list(kv.mgr.pools["w0"].evictable) == [2]  # blocks 0, 1 are still held by b
    c = kv.alloc("c", [1] * 24)  # 6 pages; 4 free + 1 evictable
    assert (c.status, c.num_pages_short, list(c.page_table)) == (OOP, 1, [])


def test_retried_step_with_the_same_step_id_does_not_allocate_twice(kv):
    kv.register()
    first = kv.alloc("a", range(6), step_id=7)
    again = kv.alloc("a", range(6), step_id=7)
    assert again == first and list(first.page_table) == [0, 1]
    assert kv.stats().pools[0].num_used_pages == 2
    ext = [pb.PageExtension(req_id="a", num_tokens=12)]
    e1, e2 = kv.step(8, extensions=ext).extension_results[0], kv.step(8, extensions=ext).extension_results[0]
    assert list(e1.new_page_ids) == list(e2.new_page_ids) == [2] and kv.stats().pools[0].num_used_pages == 3
    err = rpc_error(kv.step, 7, (), [pb.PageExtension(req_id="a", num_tokens=16)])
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "older than step 8" in err.details()


def test_epoch_fencing(kv):
    kv.register()
    kv.alloc("a", P1 + [1])
    kv.commit("a", 0, P1)
    reg = kv.register(epoch=2)
    assert reg.previous_epoch == 1 and list(reg.dropped_req_ids) == ["a"]
    out = kv.step(extensions=[pb.PageExtension(req_id="a", num_tokens=20)],
                  commits=[pb.PageCommit(req_id="a", start_pos=12, packed_token_ids=le_uint32([1, 2, 3, 4]),
                                         num_computed_tokens=16)])
    assert out.extension_results[0].status == STALE and out.commit_results[0].status == STALE
    err = rpc_error(kv.admin.GetPageTable, pb.GetPageTableRequest(req_id="a"))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "dropped with epoch 1" in err.details()
    b = kv.alloc("b", P1 + [1])  # the old epoch's blocks are gone: no hit, fresh pages of the new pool
    assert (b.epoch, b.num_cached_tokens, list(b.page_table)) == (2, 0, [0, 1, 2, 3])
    assert kv.free("a").status == STALE and kv.free("a").status == OK  # forgotten after the stale free
    for epoch, num_pages, message in ((1, 8, "older than the registered epoch 2"), (2, 9, "different pool")):
        err = rpc_error(kv.register, "w0", epoch, num_pages)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and message in err.details()
    assert kv.register(epoch=2).previous_epoch == 2  # the same registration again is idempotent


def _alloc(req_id, tokens, tenant="A", worker="w0"):
    return pb.PageAllocation(req_id=req_id, tenant=tenant, packed_token_ids=le_uint32(tokens), worker_id=worker)


BAD_STEPS = [
    ("unknown worker", dict(allocations=[_alloc("x", [1], worker="nope")]), "NOT_FOUND", "no pool is registered"),
    ("unknown request", dict(extensions=[pb.PageExtension(req_id="ghost", num_tokens=4)]), "NOT_FOUND",
     "'ghost' is not live"),
    ("commit of unknown request", dict(commits=[pb.PageCommit(req_id="ghost", packed_token_ids=le_uint32([1, 2, 3, 4]),
                                                              num_computed_tokens=4)]), "NOT_FOUND", "not live"),
    ("negative count", dict(extensions=[pb.PageExtension(req_id="live", num_tokens=-4)]), "INVALID_ARGUMENT",
     "num_tokens must be > 0, got -4"),
    ("oversized extension", dict(extensions=[pb.PageExtension(req_id="live", num_tokens=10**6)]),
     "INVALID_ARGUMENT", "exceeds the pool's 32 token slots"),
    ("oversized allocation", dict(allocations=[_alloc("x", range(40))]), "INVALID_ARGUMENT",
     "40 tokens need more pages than pool 'w0' has"),
    ("commit not whole pages", dict(commits=[pb.PageCommit(req_id="live", packed_token_ids=le_uint32([1, 2, 3]),
                                                           num_computed_tokens=3)]), "INVALID_ARGUMENT",
     "3 token ids are not a whole number of pages of 4"),
    ("empty tenant", dict(allocations=[_alloc("x", [1], tenant="")]), "INVALID_ARGUMENT", "tenant must not be empty"),
    ("torn packed token ids",
     dict(allocations=[pb.PageAllocation(req_id="x", tenant="A", packed_token_ids=b"\x05\0\0")]),
     "INVALID_ARGUMENT", "allocation 'x': packed_token_ids: 3 bytes are not a whole number of 4-byte token ids"),
    ("torn commit", dict(commits=[pb.PageCommit(req_id="live", packed_token_ids=le_uint32([1, 2, 3, 4]) + b"\0",
                                                num_computed_tokens=4)]),
     "INVALID_ARGUMENT", "commit 'live': packed_token_ids: 17 bytes"),
    ("duplicate req_id", dict(frees=[pb.PageFree(req_id="x"), pb.PageFree(req_id="x")]), "INVALID_ARGUMENT",
     "appears twice in frees"),
    ("no step_id", dict(step_id=0), "INVALID_ARGUMENT", "step_id must be >= 1, got 0"),
]


@pytest.mark.parametrize("ops,code,message", [c[1:] for c in BAD_STEPS], ids=[c[0] for c in BAD_STEPS])
def test_bad_step_is_rejected_with_a_clear_message_and_changes_nothing(kv, ops, code, message):
    kv.register()
    kv.alloc("live", range(6))
    ops = dict(ops)
    ops["frees"] = [*ops.get("frees", []), pb.PageFree(req_id="other")]  # a valid op in the call: not applied
    ops["allocations"] = [*ops.get("allocations", []), _alloc("fresh", [9, 9])]
    before = (kv.stats(), kv.admin.GetPageTable(pb.GetPageTableRequest(req_id="live")))
    err = rpc_error(lambda: kv.step(**ops))
    assert err.code().name == code and message in err.details()
    assert (kv.stats(), kv.admin.GetPageTable(pb.GetPageTableRequest(req_id="live"))) == before
    assert set(kv.mgr.requests) == {"live"}


@pytest.mark.parametrize(("payload", "reason"), [(b"\x0a\x02\xff\xfe", "String field had bad UTF-8"),
                                                 (b"\xff\xff\xff", "Wire format was corrupt")])
def test_a_request_that_is_not_a_valid_message_is_invalid_argument(kv, payload, reason):
    before = kv.stats()
    err = rpc_error(kv.channel.unary_unary("/kvserve.v1.KVManagerService/RegisterWorker"), payload)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and reason in err.details()
    assert kv.stats() == before


def test_bad_registration_is_invalid_argument(kv):
    for num_pages, message in ((0, "num_pages must be > 0, got 0"), (-3, "num_pages must be > 0, got -3")):
        err = rpc_error(kv.register, "w0", 1, num_pages)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.details()
    err = rpc_error(kv.register, "", 1, 8)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "worker_id must not be empty" in err.details()
    err = rpc_error(kv.register, "w0", 1, 2**31 - 1)  # would take ~100 GB of bookkeeping, under the lock
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "past what the kvmanager tracks" in err.details()
    huge = pb.PoolSpec(worker_id="w0", epoch=1, num_pages=8, page_size=PS, model_fingerprint="fp",
                       kv_dtype="float32", bytes_per_token=2**61)  # Stats could not say its bytes
    err = rpc_error(kv.stub.RegisterWorker, huge)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not fit in an int64" in err.details()
    assert list(kv.stats().pools) == []
    kv.register("w0")
    err = rpc_error(kv.stub.Place, pb.PlaceRequest(tenant="A", packed_token_ids=le_uint32(P1),
                                                   num_queued={"w0": -1000}))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_queued['w0'] is -1000" in err.details()


# -- KVAdminService ---------------------------------------------------------------------------------------------
def cached_prompt(kv, req_id="a", tenant="A", tokens=P1, worker="w0"):
    """Allocates, commits every full page, frees: the prompt's blocks stay cached with ref_cnt 0."""
    start = kv.alloc(req_id, tokens + [1], tenant, worker).num_cached_tokens  # a hit counts as committed
    kv.commit(req_id, start, tokens[start:])
    kv.free(req_id)


def test_stats_counts_pages_bytes_and_tenants_exactly(kv):
    kv.register()
    cached_prompt(kv)  # pages 0 1 2 cached (ref 0), page 3 back to the free list
    kv.alloc("b", range(5), tenant="B")  # pages 4 5
    kv.alloc("c", P1 + [99])  # 12-token hit on pages 0 1 2, fresh page 6
    s = kv.stats()
    (pool,) = s.pools
    assert (pool.worker_id, pool.epoch, pool.num_pages, pool.page_size, pool.kv_dtype) == ("w0", 1, 8, PS, "float32")
    assert (pool.num_used_pages, pool.num_cached_pages, pool.num_free_pages, pool.num_pinned_pages) == (6, 0, 2, 0)
    assert (pool.pool_bytes, pool.used_bytes, pool.cached_bytes) == (3200, 2400, 0) and pool.num_requests == 2
    tenants = {t.tenant: (t.num_blocks, t.num_pinned_blocks, t.num_requests, t.prefix_cache_queries,
                          t.prefix_cache_hits) for t in s.tenants}
    assert tenants == {"A": (3, 0, 1, 26, 12), "B": (0, 0, 1, 5, 0)}
    assert (s.prefix_cache_queries, s.prefix_cache_hits, s.num_evicted_blocks, s.store_ok) == (31, 12, 0, True)
    kv.free("c")
    pool = kv.stats().pools[0]
    assert (pool.num_used_pages, pool.num_cached_pages, pool.num_free_pages, pool.cached_bytes) == (2, 3, 3, 1200)
    assert [t.tenant for t in kv.admin.ListTenants(pb.ListTenantsRequest()).tenants] == ["A", "B"]


def test_inspect_tenant_lists_blocks_most_recent_first_and_longest_prefixes(kv):
    kv.register(num_pages=16)
    cached_prompt(kv)  # chain of 3 blocks
    cached_prompt(kv, "b", tokens=P1[:4] + [7, 7, 7, 7])  # shares block 0, then its own block 1
    cached_prompt(kv, "z", tenant="Z")  # another tenant's blocks are not listed
    r = kv.admin.InspectTenant(pb.InspectTenantRequest(tenant="A"))
    assert (r.stats.tenant, r.stats.num_blocks, r.stats.num_requests) == ("A", 4, 0)
    # b was freed last, tail first: its block 1 (page 4), then the shared block 0 (page 0) joined the LRU's end
    assert [(b.block_index, b.page_id) for b in r.blocks][:2] == [(0, 0), (1, 4)]
    assert [b.last_used for b in r.blocks] == sorted((b.last_used for b in r.blocks), reverse=True)
    by_hash = {b.block_hash: b for b in r.blocks}
    assert all(len(h) == 32 for h in by_hash) and {b.parent_block_hash for b in r.blocks if b.block_index == 0} == {""}
    assert all(b.parent_block_hash in by_hash for b in r.blocks if b.block_index > 0)
    assert [(p.num_blocks, p.num_tokens) for p in r.prefixes] == [(3, 12), (2, 8)]
    assert r.prefixes[0].last_block_hash == next(b.block_hash for b in r.blocks if b.block_index == 2)
    limited = kv.admin.InspectTenant(pb.InspectTenantRequest(tenant="A", max_blocks=1, max_prefixes=1))
    assert len(limited.blocks) == 1 and len(limited.prefixes) == 1
    err = rpc_error(kv.admin.InspectTenant, pb.InspectTenantRequest(tenant="nobody"))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "'nobody'" in err.details()


def _snapshot(mgr: KVManager):
    pools = {w: (list(p.ref_cnt), list(p.free), list(p.evictable), [(b.last_used, b.pinned) for b in
             p.index.values()]) for w, p in mgr.pools.items()}
    counters = {t: (c.prefix_cache_queries, c.prefix_cache_hits) for t, c in mgr.tenants.items()}
    return pools, counters, mgr.clock, mgr.changes.empty()


def test_probe_reports_hits_per_worker_with_no_side_effect(kv):
    kv.register("w0")
    kv.register("w1")
    cached_prompt(kv, worker="w0")
    cached_prompt(kv, "b", tokens=P1[:4] + [5, 5, 5, 5], worker="w1")
    kv.alloc("held", P1[:8] + [3], worker="w0")  # hits and holds 2 of the blocks
    before, stats_before = _snapshot(kv.mgr), kv.stats()
    r = kv.admin.Probe(pb.PrefixRequest(tenant="A", token_ids=pb.TokenIds(token_ids=P1)))
    assert (r.num_query_tokens, r.num_cached_tokens, r.worker_id) == (12, 12, "w0")  # uncapped
    assert [(h.worker_id, h.epoch, h.num_cached_tokens) for h in r.hits] == [("w0", 1, 12), ("w1", 1, 4)]
    one = kv.admin.Probe(pb.PrefixRequest(tenant="A", token_ids=pb.TokenIds(token_ids=P1), worker_id="w1"))
    assert (one.num_cached_tokens, one.worker_id, len(one.hits)) == (4, "w1", 1)
    miss = kv.admin.Probe(pb.PrefixRequest(tenant="B", token_ids=pb.TokenIds(token_ids=P1)))
    assert (miss.num_cached_tokens, miss.worker_id) == (0, "")  # another tenant never hits
    assert _snapshot(kv.mgr) == before and kv.stats() == stats_before


def test_probe_text_uses_the_tokenizer_and_needs_one(kv):
    kv.register()
    words = [WORDS.index(w) + 1 for w in "the cat sat on a mat".split()]
    cached_prompt(kv, tokens=words[:4])
    r = kv.admin.Probe(pb.PrefixRequest(tenant="A", text="the cat sat on a mat"))
    assert (r.num_query_tokens, r.num_cached_tokens) == (6, 4)
    bare = KVService()
    server = start_kvmanager_server(bare, admin_token=TOKEN)  # no tokenizer
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        err = rpc_error(Admin(channel).Probe, pb.PrefixRequest(tenant="A", text="the cat"))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "--model" in err.details()
        err = rpc_error(Admin(channel).Probe, pb.PrefixRequest(tenant="A"))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids or text" in err.details()
    server.stop(0)


def test_evict_tenant_evicts_only_unheld_blocks(kv):
    kv.register()
    cached_prompt(kv)
    cached_prompt(kv, "z", tenant="Z", tokens=[9] * 4)
    kv.alloc("held", P1[:4] + [1])  # holds block 0
    r = kv.admin.EvictTenant(pb.EvictTenantRequest(tenant="A"))
    assert (r.num_evicted_blocks, r.num_kept_blocks) == (2, 1)
    s = kv.stats()
    assert s.num_evicted_blocks == 2 and {t.tenant: t.num_blocks for t in s.tenants} == {"A": 1, "Z": 1}
    assert (s.pools[0].num_cached_pages, s.pools[0].num_used_pages) == (1, 2)  # Z's block; held's 2 pages
    assert kv.mgr.changes.empty()  # persisted: the service clears the mark once the store has the call


def test_pin_prevents_eviction_under_memory_pressure_until_unpinned(kv):
    kv.register()
    cached_prompt(kv)  # 3 cached blocks in pages 0 1 2
    tokens = pb.TokenIds(token_ids=P1 + [1, 2])
    pin = kv.admin.Pin(pb.PrefixRequest(tenant="A", token_ids=tokens))
    assert (pin.num_pinned_blocks, pin.num_pinned_tokens) == (3, 12)
    assert kv.stats().pools[0].num_pinned_pages == 3
    assert kv.alloc("big", list(range(500, 520))).status == OK  # 5 pages: every unpinned page
    short = kv.alloc("more", [1, 2])
    assert (short.status, short.num_pages_short) == (OOP, 1)  # pinned blocks are not evictable
    assert kv.admin.EvictTenant(pb.EvictTenantRequest(tenant="A")).num_kept_blocks == 3
    assert kv.admin.Probe(pb.PrefixRequest(tenant="A", token_ids=tokens)).num_cached_tokens == 12
    assert kv.admin.Unpin(pb.PrefixRequest(tenant="A", token_ids=tokens)).num_unpinned_blocks == 3
    assert kv.admin.Unpin(pb.PrefixRequest(tenant="A", token_ids=tokens)).num_unpinned_blocks == 0
    more = kv.alloc("more", [1, 2])
    assert (more.status, list(more.page_table)) == (OK, [2])  # the LRU head: the chain's end
    assert kv.stats().num_evicted_blocks == 1


def test_page_table_dumps_pages_with_ref_cnt_and_block_hash(kv):
    kv.register()
    cached_prompt(kv)
    kv.alloc("r", P1[:8] + [1, 2], step_id=3)  # hits pages 0 1, fresh page 4 (free list: 4 5 6 7 3)
    kv.admin.Pin(pb.PrefixRequest(tenant="A", token_ids=pb.TokenIds(token_ids=P1[:4])))
    t = kv.admin.GetPageTable(pb.GetPageTableRequest(req_id="r"))
    hashes = [h.hex() for h in chain_hashes(kv.mgr.pools["w0"].seed_for("A"), P1, PS)]
    assert (t.req_id, t.tenant, t.worker_id, t.epoch, list(t.page_table)) == ("r", "A", "w0", 1, [0, 1, 4])
    assert [(p.page_id, p.ref_cnt, p.block_hash, p.pinned) for p in t.pages] == [
        (0, 1, hashes[0], True), (1, 1, hashes[1], False), (4, 1, "", False)]
    assert (t.num_committed_tokens, t.num_prompt_tokens, t.last_step_id, t.page_size) == (8, 10, 3, PS)
    err = rpc_error(kv.admin.GetPageTable, pb.GetPageTableRequest(req_id="nope"))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "'nope' is not live" in err.details()


def test_reset_refuses_while_requests_run_unless_forced_then_drops_everything_but_the_pools(kv):
    kv.register()
    cached_prompt(kv)
    kv.alloc("r", range(6))
    err = rpc_error(kv.admin.Reset, pb.ResetRequest())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "--yes" in err.details()
    before = kv.stats()
    err = rpc_error(kv.admin.Reset, pb.ResetRequest(confirm=True))  # r's pages would go to new requests
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "1 requests are running (on w0)" in err.details() and "--force" in err.details()
    assert kv.stats() == before
    r = kv.admin.Reset(pb.ResetRequest(confirm=True, force=True))
    assert (r.num_dropped_requests, r.num_dropped_blocks) == (1, 3)
    s = kv.stats()
    assert [(p.num_free_pages, p.num_used_pages, p.num_requests) for p in s.pools] == [(8, 0, 0)]
    assert list(s.tenants) == [] and (s.prefix_cache_queries, s.num_evicted_blocks) == (0, 0)
    err = rpc_error(kv.step, None, (), [pb.PageExtension(req_id="r", num_tokens=9)])
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert kv.free("r").status == OK
    assert list(kv.alloc("s", P1).page_table) == [0, 1, 2] and kv.alloc("s2", P1).num_cached_tokens == 0
    for req_id in ("s", "s2"):
        kv.free(req_id)
    assert kv.admin.Reset(pb.ResetRequest(confirm=True)).num_dropped_blocks == 0  # nothing running: no force


# -- auth, health ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("metadata,code", [
    ([], grpc.StatusCode.UNAUTHENTICATED),
    ([("authorization", "Basic " + TOKEN)], grpc.StatusCode.UNAUTHENTICATED),
    ([("authorization", "Bearer wrong")], grpc.StatusCode.PERMISSION_DENIED),
    ([("authorization", "Bearer " + TOKEN + "x")], grpc.StatusCode.PERMISSION_DENIED),
], ids=["missing", "not bearer", "wrong", "longer"])
def test_admin_calls_need_the_admin_token(kv, metadata, code):
    kv.register()
    stub = kvmanager_pb2_grpc.KVAdminServiceStub(kv.channel)
    for call, request in ((stub.Stats, pb.StatsRequest()), (stub.Reset, pb.ResetRequest(confirm=True))):
        err = rpc_error(lambda: call(request, metadata=metadata, timeout=10))  # noqa: B023
        assert err.code() == code
    assert len(kv.stats().pools) == 1  # the reset was refused


def test_manager_service_and_health_need_no_token(kv):
    assert kv.register().ok  # kv.stub sends no metadata
    health = health_pb2_grpc.HealthStub(kv.channel)
    for name in ("", "kvserve.v1.KVManagerService", "kvserve.v1.KVAdminService"):
        status = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    from kvserve.common.embedded_redis import EmbeddedRedis

    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server.url


def _redis_service(url: str, prefix: str) -> KVService:
    from kvserve.common.redis_client import connect
    from kvserve.kvmanager.call_log import CallLog

    service = KVService(KVManager(), CallLog(connect(url), prefix))
    service.load()
    return service


def _durable_view(mgr: KVManager):
    pools = {w: (list(p.free), list(p.evictable), list(p.ref_cnt)) for w, p in mgr.pools.items()}
    return admin.stats(mgr), admin.inspect_tenant(mgr, "A"), pools


def test_forget_worker_removes_a_gone_workers_pool_refusing_while_it_runs_requests(kv):
    kv.register("w0")
    kv.register("w1")
    cached_prompt(kv, worker="w1")
    kv.alloc("live", [7] * 5, worker="w1", step_id=3)
    err = rpc_error(kv.admin.ForgetWorker, pb.ForgetWorkerRequest(worker_id="w1"))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "1 requests are running on worker 'w1'" in (
        err.details())
    assert [p.worker_id for p in kv.stats().pools] == ["w0", "w1"]  # nothing changed
    err = rpc_error(kv.admin.ForgetWorker, pb.ForgetWorkerRequest(worker_id="nobody"))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    r = kv.admin.ForgetWorker(pb.ForgetWorkerRequest(worker_id="w1", force=True))
    assert (r.num_dropped_requests, r.num_dropped_blocks) == (1, 3)
    assert [p.worker_id for p in kv.stats().pools] == ["w0"]
    probe = kv.admin.Probe(pb.PrefixRequest(tenant="A", token_ids=pb.TokenIds(token_ids=P1 + [1])))
    assert probe.num_cached_tokens == 0 and [h.worker_id for h in probe.hits] == ["w0"]  # no hit on a gone pool
    assert kv.free("live", step_id=4).status == OK  # forgotten with its pool: a free finds nothing
    err = rpc_error(kv.step, 5, (), [pb.PageExtension(req_id="live", num_tokens=9)])
    assert err.code() == grpc.StatusCode.NOT_FOUND
    kv.register("w1")  # back again, even under the same epoch: a fresh pool, and no record of the old one
    assert [(p.worker_id, p.num_free_pages) for p in kv.stats().pools] == [("w0", 8), ("w1", 8)]
    assert not kv.mgr.requests and not kv.mgr.stale


def test_admin_changes_are_logged_and_survive_a_restart(redis_url):
    with serving(_redis_service(redis_url, "admin-restart")) as kv:
        kv.register()
        cached_prompt(kv)
        cached_prompt(kv, "b", tokens=[5] * 8)
        cached_prompt(kv, "z", tenant="Z", tokens=[6] * 4)
        kv.alloc("held", P1[:4] + [1])
        kv.admin.Pin(pb.PrefixRequest(tenant="A", token_ids=pb.TokenIds(token_ids=P1)))
        kv.admin.Unpin(pb.PrefixRequest(tenant="A", token_ids=pb.TokenIds(token_ids=P1[:8])))
        assert kv.admin.EvictTenant(pb.EvictTenantRequest(tenant="Z")).num_evicted_blocks == 1
        view = _durable_view(kv.mgr)
    reloaded = _redis_service(redis_url, "admin-restart")
    assert _durable_view(reloaded.manager) == view
    assert [b.pinned for b in view[1].blocks if b.block_index == 2] == [True]
    with serving(reloaded) as kv:
        assert kv.admin.Reset(pb.ResetRequest(confirm=True, force=True)).num_dropped_blocks == 5
        kv.register("gone")
        cached_prompt(kv, "g", worker="gone")
        kv.alloc("held-on-gone", [8] * 5, worker="gone", step_id=9)
        assert kv.admin.ForgetWorker(pb.ForgetWorkerRequest(worker_id="gone", force=True)).num_dropped_blocks == 3
        kv.register("gone")  # the same epoch again: nothing of the forgotten pool may conflict with it
    again = _redis_service(redis_url, "admin-restart").manager
    assert (again.requests, again.stale, again.tenants.keys()) == ({}, {}, {"A"})  # the restart loads, too
    assert [(w, len(p.index), p.num_free) for w, p in sorted(again.pools.items())] == [("gone", 0, 8), ("w0", 0, 8)]
    assert list(again.pools["w0"].free) == list(range(8))


def test_a_serving_process_freezes_its_loaded_state_and_collects_rarely():
    """tune_gc_for_serving changes process-wide settings: checked in a child process, not this one."""
    code = ("import gc\n"
            "from kvserve.kvmanager.server import SERVING_GC_THRESHOLDS, tune_gc_for_serving\n"
            "state = [[i] for i in range(1000)]\n"
            "tune_gc_for_serving()\n"
            "assert gc.get_threshold() == SERVING_GC_THRESHOLDS, gc.get_threshold()\n"
            "assert gc.get_freeze_count() >= len(state), gc.get_freeze_count()\n"
            "assert SERVING_GC_THRESHOLDS[0] > 700\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
