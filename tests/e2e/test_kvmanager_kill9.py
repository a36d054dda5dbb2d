"""`kill -9` of a kvmanager process mid-traffic, then a restart on the same Redis: every page table,
ref_cnt and index entry comes back, in-flight requests keep their pages, and traffic carries on. The pool has
a sliding window with attention sinks, and decoding requests release the pages that fall out of it: their holes
come back too.

The Redis here is the test's own (an external Redis from the kvmanager's point of view), so it survives the
kvmanager's SIGKILL as a managed Redis would.
"""

from __future__ import annotations

import grpc
from kvmanager_processes import kvmanager_process, stop_cleanly

from kvserve.common.convert.pages import step_from_proto
from kvserve.common.embedded_redis import EmbeddedRedis
from kvserve.common.pages import HOLE
from kvserve.common.tokens import le_uint32
from kvserve.common.wire.pages import PoolSpec
from kvserve.kvmanager.manager import KVManager
from kvserve.v1 import kvmanager_pb2 as pb
from kvserve.v1 import kvmanager_pb2_grpc

PS, NUM_PAGES, TOKEN = 4, 64, "T"
WINDOW, SINKS = 8, 4  # two pages of window, one sink page
SYSTEM = list(range(1000, 1012))  # a 3-page shared system prompt
REQ_IDS = [f"r{i}" for i in range(8)]


def workload() -> list[pb.StepOps]:
    """Deterministic scheduler-like steps: admissions with shared prefixes, commits, decode growth that releases
    the page its window moved past (page 1, a shared prefix page: position 15 attends 8..15), frees."""
    steps, computed, step_id = [], {}, 0

    def call(**ops):
        nonlocal step_id
        step_id += 1
        steps.append(pb.StepOps(step_id=step_id, **ops))

    for i, req_id in enumerate(REQ_IDS):
        tenant = "A" if i % 2 == 0 else "B"
        prompt = SYSTEM + [i, i + 1, i + 2]
        computed[req_id] = prompt
        call(allocations=[pb.PageAllocation(req_id=req_id, tenant=tenant, worker_id="w0",
                                            packed_token_ids=le_uint32(prompt))])
        call(commits=[pb.PageCommit(req_id=req_id, start_pos=0, packed_token_ids=le_uint32(prompt[:12]),
                                    num_computed_tokens=15)]
             if i < 2 else [])  # the first of each tenant computes the prefix; later ones hit it
        if i >= 3:  # decode: grow the oldest running request past a page boundary
            old = REQ_IDS[i - 3]
            call(extensions=[pb.PageExtension(req_id=old, num_tokens=15 + 4 * (i - 2))],
                 releases=[pb.PageRelease(req_id=old, page_indices=[1])])
        if i >= 5:
            call(frees=[pb.PageFree(req_id=REQ_IDS[i - 5])])
    return steps


def register(stub) -> None:
    stub.RegisterWorker(pb.PoolSpec(worker_id="w0", epoch=7, num_pages=NUM_PAGES, page_size=PS,
                                    model_fingerprint="fp", kv_dtype="float32", bytes_per_token=100,
                                    sliding_window=WINDOW, attention_sinks=SINKS), timeout=10)


def replay(steps: list[pb.StepOps]) -> KVManager:
    mgr = KVManager()
    mgr.register_worker(PoolSpec("w0", 7, NUM_PAGES, PS, "fp", "float32", 100, "", WINDOW, SINKS))
    for s in steps:
        mgr.step(step_from_proto(s))
    return mgr


def expected_view(mgr: KVManager) -> dict:
    pool = mgr.pools["w0"]
    tables = {r: (tuple(q.page_table), tuple(0 if p == HOLE else pool.ref_cnt[p] for p in q.page_table),
                  q.num_committed_tokens) for r, q in mgr.requests.items()}
    return {"tables": tables, "counts": (pool.num_used, pool.num_cached, pool.num_free), "blocks": len(pool.index),
            "released": pool.num_window_released}


def observed_view(admin, metadata) -> dict:
    tables = {}
    for req_id in REQ_IDS:
        try:
            t = admin.GetPageTable(pb.GetPageTableRequest(req_id=req_id), metadata=metadata, timeout=10)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.NOT_FOUND
            continue
        tables[req_id] = (tuple(t.page_table), tuple(p.ref_cnt for p in t.pages), t.num_committed_tokens)
    stats = admin.Stats(pb.StatsRequest(), metadata=metadata, timeout=10)
    pool = stats.pools[0]
    return {"tables": tables, "counts": (pool.num_used_pages, pool.num_cached_pages, pool.num_free_pages),
            "blocks": sum(t.num_blocks for t in stats.tenants), "released": pool.num_window_released_pages}


def test_kill9_mid_traffic_then_restart_recovers_every_page(tmp_path):
    steps = workload()
    cut = len(steps) // 2
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    with EmbeddedRedis(tmp_path / "redis") as redis:
        args = ("--redis-url", redis.url, "--admin-token", TOKEN, "--data-dir", str(tmp_path / "data"))
        with kvmanager_process(tmp_path, *args) as (proc, ready), \
                grpc.insecure_channel(f"127.0.0.1:{ready.group(1)}") as channel:
            stub = kvmanager_pb2_grpc.KVManagerServiceStub(channel)
            register(stub)
            for s in steps[:cut]:
                stub.StepPages(s, timeout=10)
            in_flight = stub.StepPages.future(steps[cut], timeout=10)
            proc.kill()  # SIGKILL while the next call may be in flight
            proc.wait(timeout=10)
            try:
                in_flight.result()
            except grpc.RpcError:
                pass
        candidates = [expected_view(replay(steps[:cut])), expected_view(replay(steps[: cut + 1]))]
        assert candidates[0] != candidates[1], "the cut must fall on a step that changes state"
        assert all(HOLE in c["tables"]["r0"][0] for c in candidates), "the kill must find released pages"
        with kvmanager_process(tmp_path, *args) as (proc, ready), \
                grpc.insecure_channel(f"127.0.0.1:{ready.group(1)}") as channel:
            stub = kvmanager_pb2_grpc.KVManagerServiceStub(channel)
            admin = kvmanager_pb2_grpc.KVAdminServiceStub(channel)
            assert observed_view(admin, metadata) in candidates
            for s in steps[cut:]:  # carry on; the in-flight call is retried with its step_id
                stub.StepPages(s, timeout=10)
            final = observed_view(admin, metadata)
            assert final == expected_view(replay(steps))
            assert {r for r, t in final["tables"].items() if HOLE in t[0]} == {"r3", "r4"} and final["released"] == 5
            late = stub.StepPages(pb.StepOps(step_id=len(steps) + 1, allocations=[
                pb.PageAllocation(req_id="late", tenant="A", worker_id="w0",
                                  packed_token_ids=le_uint32(SYSTEM + [9]))]), timeout=10)
            assert late.allocation_results[0].num_cached_tokens == 12  # the index survived the kill
            live = [r for r in REQ_IDS + ["late"] if r in observed_view(admin, metadata)["tables"]] + ["late"]
            stub.StepPages(pb.StepOps(step_id=len(steps) + 2,
                                      frees=[pb.PageFree(req_id=r) for r in dict.fromkeys(live)]),
                           timeout=10)
            pool = admin.Stats(pb.StatsRequest(), metadata=metadata, timeout=10).pools[0]
            assert pool.num_used_pages == 0 and pool.num_cached_pages + pool.num_free_pages == NUM_PAGES
            stop_cleanly(proc)
