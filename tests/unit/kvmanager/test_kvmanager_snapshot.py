"""Call-log snapshots written by a forked child: calls made meanwhile are kept, a child outliving a restart
cannot switch generations, a killed child leaves nothing a reload reads, and forking inside a gRPC handler
leaves the server serving."""

from __future__ import annotations

import os
import signal

import grpc
import pytest
from kvmanager_histories import alloc, build_history, history, spec
from test_kvmanager_call_log import exact, live_keys, reload
from test_kvmanager_properties import snapshot as exact_state

from kvserve.common.embedded_redis import EmbeddedRedis
from kvserve.common.redis_client import connect
from kvserve.common.tokens import le_uint32
from kvserve.common.wire.pages import PageCommit, PageFree, StepOps
from kvserve.kvmanager import admin
from kvserve.kvmanager import snapshot as snapshots
from kvserve.kvmanager.call_log import CallLog
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.server import start_kvmanager_server
from kvserve.kvmanager.service import KVService
from kvserve.v1 import kvmanager_pb2 as pb
from kvserve.v1 import kvmanager_pb2_grpc


@pytest.fixture
def redis_url(tmp_path):
    with EmbeddedRedis(tmp_path / "redis") as server:
        yield server.url


def history_with_a_stopped_child(redis_url: str) -> tuple[KVService, CallLog, snapshots.Child]:
    """build_history with a snapshot due every 4 calls. The 4th call forks a child, which writes the state as
    generation 1 and stops itself before it switches to it; the later calls go to generation 1's log."""
    client = connect(redis_url)
    store = CallLog(client, snapshot_every=4)
    store.stop_child_before_switch = True
    svc = KVService(KVManager(), store)
    build_history(svc)
    child = store.child
    assert child is not None and child.num_records == 4
    _, status = os.waitpid(child.pid, os.WUNTRACED)  # returns once the child has stopped itself
    assert os.WIFSTOPPED(status)
    assert store.log_gens == [0, child.gen] and client.get("kvserve:gen") is None  # not switched yet
    assert client.exists(f"kvserve:snap:{child.gen}") and client.llen(f"kvserve:log:{child.gen}") > 0
    return svc, store, child


def test_calls_made_while_a_child_writes_the_snapshot_are_kept(redis_url):
    svc, store, child = history_with_a_stopped_child(redis_url)
    client = store.client
    after_fork = client.llen(store.log_key)
    os.kill(child.pid, signal.SIGCONT)
    assert store.wait_snapshot() == snapshots.SWITCHED
    assert int(client.get("kvserve:gen")) == child.gen == store.gen and store.log_gens == [child.gen]
    assert store.num_logged == after_fork  # what a restart replays: only the calls after the fork
    live = live_keys(client, store)
    assert live["snap"] == [child.gen] and live["log"] == [child.gen]  # generation 0 and its log are gone
    assert client.exists("kvserve:log:0") == 0 and client.exists("kvserve:snap:0") == 0
    loaded, _ = reload(redis_url)
    assert exact(loaded) == exact(svc.manager)


def test_a_child_outliving_a_restart_cannot_switch_generations(redis_url):
    svc, store, child = history_with_a_stopped_child(redis_url)
    loaded, _ = reload(redis_url)  # a restarted kvmanager claims the prefix: snapshot 0, logs 0 and 1
    assert exact(loaded) == exact(svc.manager)
    os.kill(child.pid, signal.SIGCONT)
    assert store.wait_snapshot() == snapshots.SUPERSEDED
    assert store.client.get("kvserve:gen") is None and store.client.llen("kvserve:log:0") == 4  # untouched
    loaded, _ = reload(redis_url)
    assert exact(loaded) == exact(svc.manager)


def test_a_child_killed_mid_snapshot_leaves_garbage_the_next_snapshot_deletes(redis_url):
    svc, store, child = history_with_a_stopped_child(redis_url)
    store.stop_child_before_switch = False
    os.kill(child.pid, signal.SIGKILL)
    assert store.wait_snapshot() == -signal.SIGKILL
    # the killed child's snapshot is there, unread: generation 0 (no state keys) is still the one loaded
    assert live_keys(store.client, store)["snap"] == [child.gen] and store.client.get("kvserve:gen") is None
    # (no reload here: it would claim the prefix, and this store could then no longer switch generations)
    # The next attempt comes once snapshot_every more calls are logged.
    for step_id in range(100, 104):
        assert store.child is None
        svc.step(StepOps(step_id, allocations=(alloc(f"n{step_id}", "C", range(step_id, step_id + 5), "w0"),)))
    next_child = store.child
    assert next_child is not None and next_child.gen > child.gen
    assert store.wait_snapshot() == snapshots.SWITCHED
    live = live_keys(store.client, store)
    assert live["snap"] == [next_child.gen] and set(live["log"]) <= {next_child.gen}
    loaded, _ = reload(redis_url)
    assert exact(loaded) == exact(svc.manager)


def test_a_snapshot_forked_inside_a_grpc_handler_leaves_the_server_serving(redis_url):
    store = CallLog(connect(redis_url), snapshot_every=2)
    service = KVService(KVManager(), store)
    server = start_kvmanager_server(service, "127.0.0.1", 0, admin_token="t")
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        stub = kvmanager_pb2_grpc.KVManagerServiceStub(channel)
        s = spec("w0", num_pages=64)
        stub.RegisterWorker(pb.PoolSpec(worker_id=s.worker_id, epoch=s.epoch, num_pages=s.num_pages,
                                        page_size=s.page_size, model_fingerprint=s.model_fingerprint,
                                        kv_dtype=s.kv_dtype, bytes_per_token=s.bytes_per_token),
                            timeout=10)
        for step_id in range(1, 6):
            op = pb.PageAllocation(req_id=f"r{step_id}", tenant="A", worker_id="w0",
                                   packed_token_ids=le_uint32(range(9)))
            reply = stub.StepPages(pb.StepOps(step_id=step_id, allocations=[op]), timeout=10)
            assert reply.allocation_results[0].status == pb.PAGE_OP_STATUS_OK
            if store.child is not None:
                assert store.wait_snapshot() == snapshots.SWITCHED  # the child closed its copies of the sockets
        assert store.gen > 0
        service.step(StepOps(6, commits=(PageCommit("r1", 0, tuple(range(8)), 9),), frees=(PageFree("r2"),)))
        loaded, _ = reload(redis_url)
        assert exact(loaded) == exact(service.manager)
    finally:
        channel.close()
        server.stop(0)


def test_cleanup_never_deletes_the_loaded_generation_a_live_log_or_a_newer_generation(redis_url):
    """A child deletes before it writes (keeping the loaded generation and every log a restart replays) and
    after it switched; neither touches a generation newer than its own, which can only be a restarted
    kvmanager's child writing its snapshot."""
    client = connect(redis_url)
    keys = snapshots.GenerationKeys("kvserve")
    for g in (2, 3, 5, 7):
        client.rpush(f"kvserve:snap:{g}", "{}")
    client.rpush("kvserve:log:0", "r")
    for g in (1, 2, 5, 7):
        client.rpush(f"kvserve:log:{g}", "r")

    def left():
        kinds = [keys.classify(k) for k in client.scan_iter(match="kvserve:*")]
        return sorted({k for k in kinds if k[0] == "snap"}), sorted(k[1] for k in kinds if k[0] == "log")

    # child of generation 5, before writing; generation 2 is loaded: 3 is a dead snapshot, log 0 and 1 are
    # covered by snapshot 2
    assert snapshots.delete_stale(client, keys, loaded=2, below=5) == 3
    assert left() == ([("snap", 2), ("snap", 5), ("snap", 7)], [2, 5, 7])
    assert snapshots.delete_stale(client, keys, loaded=5) == 2  # after its switch to 5
    assert left() == ([("snap", 5), ("snap", 7)], [5, 7])


def test_call_log_metrics_show_what_a_restart_replays_and_how_snapshots_went(redis_url):
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvserve.common.metrics import KVManagerMetrics
    from kvserve.kvmanager import admin

    svc, store, child = history_with_a_stopped_child(redis_url)
    metrics = KVManagerMetrics(lambda: svc.read(admin.stats), call_log=store)

    def scrape() -> dict:
        text = generate_latest(metrics.registry).decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples
                if s.name.startswith("kvserve:call_log")}

    os.kill(child.pid, signal.SIGKILL)
    store.wait_snapshot()
    got = scrape()
    in_redis = sum(store.client.llen(store.keys.log(g)) for g in store.log_gens)
    assert got[("kvserve:call_log_records", ())] == in_redis == 12  # all of build_history's: no snapshot took
    assert got[("kvserve:call_log_snapshots_total", (("result", "failed"),))] == 1
    assert got[("kvserve:call_log_generation", ())] == 0
    svc.mutate(admin.reset, True)  # an inline snapshot (force: requests are live)
    got = scrape()
    assert got[("kvserve:call_log_snapshots_total", (("result", "inline"),))] == 1
    assert got[("kvserve:call_log_generation", ())] == store.gen > child.gen
    assert got[("kvserve:call_log_records", ())] == 0 and got[("kvserve:call_log_last_snapshot_seconds", ())] > 0


@pytest.mark.parametrize(("setting", "forks"), [("0", True), ("false", True), ("1", False), (None, False)])
def test_a_process_with_grpc_forks_only_when_grpcs_fork_handlers_are_off(monkeypatch, setting, forks):
    """grpc is imported here (and the setting was read when it was, so only the decision is tested): with its
    fork handlers on, or not known to be off, the default store snapshots inline."""
    if setting is None:
        monkeypatch.delenv("GRPC_ENABLE_FORK_SUPPORT", raising=False)
    else:
        monkeypatch.setenv("GRPC_ENABLE_FORK_SUPPORT", setting)
    assert snapshots.forking_is_safe() is forks
    assert CallLog(None).background is forks and CallLog(None, background=True).background


def test_a_log_four_times_over_its_bound_is_snapshotted_inline_whatever_the_child_does(redis_url):
    """A child that never finishes (here: stopped before its switch) cannot let the log grow without bound:
    past 4 x snapshot_every calls, a call kills it and writes the snapshot itself."""
    store = CallLog(connect(redis_url), snapshot_every=2)
    store.stop_child_before_switch = True
    svc = KVService(KVManager(), store)
    svc.register_worker(spec("w0", num_pages=64))
    svc.step(StepOps(1, allocations=(alloc("r1", "A", range(9), "w0"),)))  # the 2nd call: forks
    child = store.child
    assert child is not None and os.WIFSTOPPED(os.waitpid(child.pid, os.WUNTRACED)[1])
    step_id = 1
    while store.num_snapshots["inline"] == 0:
        assert store.num_logged <= 4 * 2
        step_id += 1
        svc.step(StepOps(step_id, allocations=(alloc(f"r{step_id}", "A", range(step_id, step_id + 9), "w0"),)))
    assert step_id == 8  # the 9th logged call is over 4 x 2
    assert store.child is None and store.num_snapshots == {"forked": 0, "inline": 1, "failed": 1}
    assert store.num_logged == 0 and store.gen > child.gen
    assert store.client.exists(f"kvserve:snap:{child.gen}") == 0  # the killed child's keys are deleted
    loaded, _ = reload(redis_url)
    assert exact(loaded) == exact(svc.manager)


@pytest.mark.parametrize("background", [True, False], ids=["forked", "inline"])
def test_a_restart_replays_allocations_onto_the_free_list_and_lru_in_their_live_order(redis_url, background):
    """Recovery derives the free list ascending and the LRU by last use; the live ones drift from that (a freed
    page goes to the free list's end). A replayed allocation takes the free list's first pages, so a snapshot
    stores both orders: without them the reload gave a request pages [4, 5] where the live kvmanager had
    answered [7, 8], pages a worker then writes for two requests."""
    store = CallLog(connect(redis_url), background=background)
    svc = KVService(KVManager(), store)
    build_history(svc)
    live = svc.manager.pools["w0"]
    assert list(live.free) != sorted(live.free)  # not the order recovery derives
    store.snapshot_every = store.num_logged + 1  # this call makes a snapshot due; the next one is replayed
    svc.step(StepOps(9, allocations=(alloc("y", "C", range(800, 805), "w0"),)))
    store.snapshot_every = 1 << 30
    assert store.wait_snapshot() in (None, snapshots.SWITCHED) and store.gen > 0
    z = svc.step(StepOps(10, allocations=(alloc("z", "C", range(900, 905), "w0"),))).allocations[0].page_table
    loaded, _ = reload(redis_url)
    assert loaded.requests["z"].page_table == z
    for worker_id, pool in svc.manager.pools.items():
        assert list(loaded.pools[worker_id].free) == list(pool.free)
        assert list(loaded.pools[worker_id].evictable) == list(pool.evictable)
    assert exact(loaded) == exact(svc.manager)


def test_a_replayed_tenant_eviction_frees_pages_in_the_live_order(redis_url):
    """evict_tenant frees pages in an order that a later allocation sees. Walking the index in insertion order
    (commit order live, page order after a reload) freed them differently after a restart."""
    store = CallLog(connect(redis_url), background=False)
    svc = KVService(KVManager(), store)
    build_history(svc)
    assert list(svc.manager.pools["w0"].free) == [7, 8, 9, 10, 11, 5, 4]
    d = tuple(range(1000, 1025))  # 6 full pages and a token: the 7 free pages, in the order above
    assert svc.step(StepOps(9, allocations=(alloc("d", "D", d, "w0"),))).allocations[0].page_table == [
        7, 8, 9, 10, 11, 5, 4]
    svc.step(StepOps(10, commits=(PageCommit("d", 0, d[:24], 25),)))  # blocks indexed on pages 7..11, then 5
    svc.step(StepOps(11, frees=(PageFree("d"),)))
    store.snapshot(svc.manager, svc.members)  # a reload indexes them by page: 5 first
    svc.mutate(admin.evict_tenant, "D", "", False)
    z = svc.step(StepOps(12, allocations=(alloc("z", "C", range(900, 909), "w0"),))).allocations[0].page_table
    loaded, _ = reload(redis_url)
    assert loaded.requests["z"].page_table == z
    assert list(loaded.pools["w0"].free) == list(svc.manager.pools["w0"].free)


@pytest.mark.parametrize("background", [True, False], ids=["forked", "inline"])
def test_a_retry_answered_from_memory_across_a_snapshot_replays_after_a_restart(redis_url, background):
    """A call that commits a request's last pages and frees it, retried after other calls: the retry is
    validated and answered from the manager's remembered answers (KVManager.recent), and logged again. With a
    snapshot between the two attempts, the replay needs those answers too: without them the reload raised
    UnknownRequest, and the kvmanager could not start."""
    store = CallLog(connect(redis_url), background=background)
    svc = KVService(KVManager(), store)
    svc.register_worker(spec("w0"))
    svc.step(StepOps(1, allocations=(alloc("a", "A", range(9), "w0"),)))
    last = StepOps(2, commits=(PageCommit("a", 0, tuple(range(8)), 9),), frees=(PageFree("a"),))
    store.snapshot_every = store.num_logged + 1  # the first attempt makes a snapshot due
    first = svc.step(last)
    store.snapshot_every = 1 << 30
    assert store.wait_snapshot() in (None, snapshots.SWITCHED) and store.gen > 0
    svc.step(StepOps(3, allocations=(alloc("b", "B", range(5), "w0"),)))
    again = svc.step(last)
    assert (again.commits, again.frees) == (first.commits, first.frees)
    assert store.num_logged == 2  # step 3, then the retry: logged again
    loaded, _ = reload(redis_url)
    assert exact(loaded) == exact(svc.manager) and loaded.recent == svc.manager.recent


# -- the format: encode and decode the whole state ------------------------------------------------------------
MEMBERS = [("w0", 1, "a:1", False), ("w1", 2, "b:1", True)]


@pytest.mark.parametrize("chunk_bytes", [snapshots.CHUNK_BYTES, 97])
def test_a_snapshot_decodes_to_exactly_the_state_it_encoded(monkeypatch, chunk_bytes):
    """Everything, orders included (free lists, LRUs, the index, requests, remembered answers), whatever the
    chunking: nothing is derived on load."""
    monkeypatch.setattr(snapshots, "CHUNK_BYTES", chunk_bytes)
    mgr = history()
    mgr.pools["w0"].free.rotate(3)  # orders no derivation would give
    oldest = next(iter(mgr.pools["w0"].evictable))
    mgr.pools["w0"].evictable.add(oldest, mgr.pools["w0"].block_of[oldest].tenant)  # now the most recent
    chunks = snapshots.encode(mgr, MEMBERS)
    assert len(chunks) > 1 if chunk_bytes < 1000 else len(chunks) == 1
    loaded = KVManager()
    assert snapshots.decode(chunks, loaded) == MEMBERS
    assert exact_state(loaded) == exact_state(mgr) and (loaded.recent, loaded.clock) == (mgr.recent, mgr.clock)
    assert list(loaded.pools["w0"].index) == list(mgr.pools["w0"].index)


def test_a_reloaded_manager_answers_like_the_original():
    mgr, loaded = history(), KVManager()
    snapshots.decode(snapshots.encode(mgr, []), loaded)
    ops = StepOps(20, allocations=(alloc("n", "A", tuple(range(1, 17)), "w0"), alloc("m", "B", tuple(range(40)), "w1")))
    first, again = mgr.step(ops), loaded.step(ops)
    assert again.allocations == first.allocations and exact_state(loaded) == exact_state(mgr)


@pytest.mark.parametrize("corrupt", ["a page held twice", "a ref_cnt off by one", "a free page also in the LRU"])
def test_an_inconsistent_snapshot_is_refused_on_load(corrupt):
    """Never serve from a state that could hand out a page twice: decode raises AssertionError."""
    import json

    state = json.loads(b"".join(snapshots.encode(history(), [])))
    pool = state["pools"][0]
    if corrupt == "a page held twice":
        req = next(r for r in state["requests"] if r["worker_id"] == pool["spec"]["worker_id"])
        req["page_table"] = [req["page_table"][0]] * 2
    elif corrupt == "a ref_cnt off by one":
        pool["ref_cnt"][0] += 1
    else:
        pool["lru"].append(pool["free"][0])
    with pytest.raises(AssertionError):
        snapshots.decode([json.dumps(state).encode()], KVManager())


@pytest.mark.parametrize("left", ["a generation without its snapshot", "generation 0's log of the old layout"])
def test_state_in_a_layout_this_kvmanager_cannot_read_is_refused_not_replayed(redis_url, left):
    """A log replayed onto an empty state would hand out pages its requests hold: the load refuses, says what
    to do, and loads nothing."""
    from kvserve.kvmanager.errors import StateLayoutError

    client = connect(redis_url)
    if left == "a generation without its snapshot":
        client.set("kvserve:gen", 3)
    else:
        client.rpush("kvserve:log", b'{"k": "register"}')
    mgr = KVManager()
    with pytest.raises(StateLayoutError, match=r"another --redis-prefix, or delete the keys kvserve:\*"):
        CallLog(client).load(mgr)
    assert not (mgr.pools or mgr.requests) and CallLog(connect(redis_url), prefix="other").load(KVManager()) is None
