"""Worker membership in the kvmanager (membership.py, KVService's membership calls, the reaper, the servicer):
leases on a hand-moved clock, what joining and dying do to pools, index entries and requests, the member table
in the call log (join, drain and leave records) in a real Redis across a new KVService, and the RPCs over real
gRPC on port 0."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from kvserve.common.embedded_redis import EmbeddedRedis
from kvserve.common.errors import InvalidRequest, StaleEpoch
from kvserve.common.redis_client import connect, fresh_client
from kvserve.common.wire.membership import WorkerMember
from kvserve.common.wire.pages import PageAllocation, PageCommit, PageExtension, PageFree, PoolSpec, StepOps
from kvserve.kvmanager import admin
from kvserve.kvmanager.call_log import CallLog
from kvserve.kvmanager.errors import StoreUnavailable, UnknownRequest, UnknownWorker
from kvserve.kvmanager.invariants import check_invariants
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.reaper import MemberReaper
from kvserve.kvmanager.server import start_kvmanager_server
from kvserve.kvmanager.service import KVService

PS = 4
LEASE_S = 1.0
P1 = tuple(range(100, 112))  # 3 full pages


class Clock:
    """A monotonic clock moved by hand."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def spec(worker="w0", epoch=1, num_pages=8) -> PoolSpec:
    return PoolSpec(worker, epoch, num_pages, PS, "fp", "float32", 100)


def service(clock: Clock, store=None) -> KVService:
    return KVService(KVManager(), store, worker_timeout_s=LEASE_S, clock=clock)


def run_request(svc: KVService, req_id="r", worker="w0", step_id=1) -> None:
    """A request on ``worker`` with its 3 full prompt pages committed to the index."""
    svc.step(StepOps(step_id=step_id, allocations=(PageAllocation(req_id, "A", P1 + (1,), worker),)))
    svc.step(StepOps(step_id=step_id + 1, commits=(PageCommit(req_id, 0, P1, 12),)))


def listed(svc: KVService) -> list[tuple[str, int, str, bool, int]]:
    return [(m.worker_id, m.epoch, m.address, m.draining, m.num_requests) for m in svc.list_workers()]


# -- leases on the fake clock --------------------------------------------------------------------------------
def test_join_registers_the_pool_and_lists_the_member():
    clock = Clock()
    svc = service(clock)
    result = svc.join_worker(spec(), "10.0.0.1:50061")
    assert result.lease_ms == 1000 and result.registered.previous_epoch == 0
    assert svc.manager.pools["w0"].spec == spec()
    assert svc.list_workers() == [WorkerMember("w0", 1, "10.0.0.1:50061", False, 0)]
    again = svc.join_worker(spec(), "10.0.0.1:50061")  # the same incarnation again: idempotent
    assert again.registered.previous_epoch == 1 and not again.registered.dropped_req_ids


def test_heartbeats_renew_the_lease_and_count_the_live_requests():
    clock = Clock()
    svc = service(clock)
    svc.join_worker(spec(), "a:1")
    run_request(svc)
    for _ in range(3):  # 2.4 s in all, each heartbeat 0.8 s after the last: never lapsed
        clock.t += 0.8
        beat = svc.heartbeat("w0", 1)
        assert (beat.known, beat.num_requests, beat.lease_ms) == (True, 1, 1000)
        assert svc.expire_members(clock.t) == []
    assert listed(svc) == [("w0", 1, "a:1", False, 1)]


def test_a_lapsed_lease_drops_the_pool_its_index_entries_and_its_requests():
    clock = Clock()
    svc = service(clock)
    svc.join_worker(spec("w0"), "a:1")
    svc.join_worker(spec("w1"), "b:1")
    run_request(svc, "r0", "w0", step_id=1)
    run_request(svc, "r1", "w1", step_id=3)
    clock.t = 0.9
    svc.heartbeat("w1", 1)
    clock.t = 1.5  # w0's lease (to 1.0) lapsed, w1's runs to 1.9
    dead = svc.expire_members(clock.t)
    assert [(d.worker_id, d.epoch, d.address, d.dropped_req_ids, d.reason) for d in dead] == [
        ("w0", 1, "a:1", ("r0",), "its lease lapsed")]
    mgr = svc.manager
    assert "w0" not in mgr.pools and "r0" not in mgr.requests and "r0" not in mgr.stale
    assert [p.worker_id for p in svc.read(admin.stats).pools] == ["w1"]
    assert sum(t.num_blocks for t in svc.read(admin.list_tenants)) == 3  # w1's three blocks only
    assert listed(svc) == [("w1", 1, "b:1", False, 1)]
    with pytest.raises(UnknownRequest):  # the dropped request is gone, not stale
        svc.step(StepOps(step_id=9, extensions=(PageExtension("r0", 20),)))
    assert svc.heartbeat("w0", 1).known is False
    check_invariants(mgr)


def test_a_heartbeat_after_the_lease_lapsed_is_not_known_even_before_the_reaper_ran():
    clock = Clock()
    svc = service(clock)
    svc.join_worker(spec(), "a:1")
    run_request(svc)
    clock.t = 1.01
    assert svc.list_workers() == []  # lapsed: not live, though nobody dropped it yet
    beat = svc.heartbeat("w0", 1)
    assert (beat.known, beat.num_requests) == (False, 0)
    assert "w0" not in svc.manager.pools and not svc.manager.requests
    assert svc.expire_members(clock.t) == []  # dropped already


def test_rejoining_under_a_new_epoch_gets_a_fresh_pool():
    clock = Clock()
    svc = service(clock)
    svc.join_worker(spec(), "a:1")
    run_request(svc)
    clock.t = 2.0
    svc.expire_members(clock.t)
    result = svc.join_worker(spec(epoch=2), "a:2")
    assert result.registered.previous_epoch == 0  # the old pool was forgotten with its lease
    pool = svc.manager.pools["w0"]
    assert pool.spec.epoch == 2 and pool.num_free == 8 and not pool.index
    assert listed(svc) == [("w0", 2, "a:2", False, 0)]
    assert svc.heartbeat("w0", 1).known is False and svc.heartbeat("w0", 2).known is True


def test_a_new_epoch_joining_while_the_old_one_holds_its_lease_replaces_pool_and_member():
    clock = Clock()
    svc = service(clock)
    svc.join_worker(spec(), "a:1")
    run_request(svc)
    svc.heartbeat("w0", 1, draining=True)
    result = svc.join_worker(spec(epoch=2), "a:2")  # the worker restarted within its lease
    assert result.registered.previous_epoch == 1 and result.registered.dropped_req_ids == ("r",)
    assert svc.manager.pools["w0"].spec.epoch == 2 and "r" in svc.manager.stale  # answers STALE_EPOCH
    assert listed(svc) == [("w0", 2, "a:2", False, 0)]  # draining was the old incarnation's
    with pytest.raises(StaleEpoch):  # the old incarnation cannot come back
        svc.join_worker(spec(epoch=1), "a:1")
    assert listed(svc) == [("w0", 2, "a:2", False, 0)]


def test_draining_is_listed_and_excluded_from_placement():
    clock = Clock()
    svc = service(clock)
    svc.join_worker(spec("w0"), "a:1")
    svc.join_worker(spec("w1"), "b:1")
    run_request(svc, "r", "w0")
    svc.step(StepOps(step_id=3, frees=(PageFree("r"),)))  # its blocks stay cached: w0 has the hit
    assert svc.place("A", P1 + (7,), {}).worker_id == "w0"
    assert svc.heartbeat("w0", 1, draining=True).known
    assert listed(svc) == [("w0", 1, "a:1", True, 0), ("w1", 1, "b:1", False, 0)]
    assert svc.place("A", P1 + (7,), {}).worker_id == "w1"
    svc.heartbeat("w1", 1, draining=True)
    with pytest.raises(UnknownWorker, match="draining"):
        svc.place("A", P1 + (7,), {})


def test_leave_forgets_pool_and_member_and_a_second_leave_is_a_no_op():
    clock = Clock()
    svc = service(clock)
    svc.join_worker(spec(), "a:1")
    run_request(svc)
    assert svc.leave_worker("w0", 1) == ("r",)
    assert svc.list_workers() == [] and not svc.manager.pools and not svc.manager.requests
    assert svc.leave_worker("w0", 1) == ()
    assert svc.heartbeat("w0", 1).known is False


def test_leave_of_a_stale_epoch_is_a_no_op():
    """The gateway's word for a worker it declared dead names the epoch whose steps failed; a worker that
    rejoined since under a new one stays."""
    clock = Clock()
    svc = service(clock)
    svc.join_worker(spec(), "a:1")
    svc.join_worker(spec(epoch=2), "a:2")
    run_request(svc)
    assert svc.leave_worker("w0", 1) == ()
    assert listed(svc) == [("w0", 2, "a:2", False, 1)] and "r" in svc.manager.requests
    assert svc.leave_worker("w0", 2) == ("r",)
    assert svc.list_workers() == [] and not svc.manager.pools


def test_leave_also_drops_a_pool_registered_without_a_lease():
    """A static --workers gateway registers pools itself (RegisterWorker); it may give up on one too."""
    svc = service(Clock())
    svc.register_worker(spec())
    assert svc.list_workers() == []  # registered, but not a member
    assert svc.expire_members(100.0) == []  # no lease: the reaper never drops it
    assert svc.leave_worker("w0", 1) == () and not svc.manager.pools


def test_a_member_whose_pool_an_operator_forgot_is_dropped():
    clock = Clock()
    svc = service(clock)
    svc.join_worker(spec(), "a:1")
    svc.mutate(admin.forget_worker, "w0", True)
    assert svc.list_workers() == []
    assert [d.reason for d in svc.expire_members(clock.t)] == ["its pool is gone"]


def test_bad_input_is_refused_with_nothing_left_behind():
    svc = service(Clock())
    with pytest.raises(InvalidRequest, match="address"):
        svc.join_worker(spec(), "")
    with pytest.raises(InvalidRequest, match="num_pages"):
        svc.join_worker(spec(num_pages=0), "a:1")
    assert not svc.manager.pools and svc.list_workers() == []
    for worker_id, epoch in (("", 1), ("w0", 0)):
        for call in (svc.heartbeat, svc.leave_worker):
            with pytest.raises(InvalidRequest):
                call(worker_id, epoch)
    svc.join_worker(spec(), "a:1")
    with pytest.raises(StaleEpoch):  # the same epoch with another pool
        svc.join_worker(spec(num_pages=9), "a:1")
    assert listed(svc) == [("w0", 1, "a:1", False, 0)] and svc.manager.pools["w0"].spec == spec()


def test_the_reaper_declares_lapsed_members_dead(caplog):
    clock = Clock()
    svc = service(clock)
    svc.join_worker(spec(), "a:1")
    reaper = MemberReaper(svc)
    assert reaper.interval_s == pytest.approx(LEASE_S / 10)
    assert reaper.run_once() == []
    clock.t = 1.5
    with caplog.at_level("WARNING", logger="kvserve.kvmanager"):
        assert [d.worker_id for d in reaper.run_once()] == ["w0"]
    assert "worker w0 epoch 1 (a:1) declared dead: its lease lapsed" in caplog.text


def test_the_reaper_thread_runs_on_its_own():
    svc = KVService(KVManager(), worker_timeout_s=0.2)  # the real monotonic clock
    svc.join_worker(spec(), "a:1")
    reaper = MemberReaper(svc).start()
    try:
        deadline = time.monotonic() + 10
        while svc.manager.pools and time.monotonic() < deadline:
            time.sleep(0.02)  # polling a condition under a deadline
        assert not svc.manager.pools and svc.list_workers() == []
    finally:
        reaper.stop()


# -- the member table in the call log --------------------------------------------------------------------------
@pytest.fixture()
def redis_server(tmp_path):
    with EmbeddedRedis(tmp_path / "redis") as server:
        yield server


def redis_service(url: str, clock: Clock) -> KVService:
    return service(clock, CallLog(connect(url), "m"))


def member_records(url: str) -> list[tuple]:
    """The join, drain and leave records of the call log, in order."""
    raw = fresh_client(connect(url), decode_responses=False).lrange("m:log:0", 0, -1)
    headers = [json.loads(r.partition(b"\n")[0]) for r in raw]
    return [(h["k"], h["spec"]["worker_id"] if "spec" in h else h["args"][0]) for h in headers
            if h["k"] in ("join", "drain", "leave")]


def test_members_are_logged_on_changes_only_and_reloaded_with_fresh_leases(redis_server):
    clock = Clock()
    first = redis_service(redis_server.url, clock)
    first.join_worker(spec("w0"), "a:1")
    first.join_worker(spec("w1"), "b:1")
    first.join_worker(spec("w2"), "c:1")
    first.join_worker(spec("w2"), "c:1")  # a retried join changes nothing
    run_request(first, "r", "w0")
    for _ in range(5):
        first.heartbeat("w0", 1)
    first.heartbeat("w1", 1, draining=True)
    first.heartbeat("w1", 1, draining=True)
    first.leave_worker("w2", 1)
    assert member_records(redis_server.url) == [("join", "w0"), ("join", "w1"), ("join", "w2"), ("drain", "w1"),
                                                ("leave", "w2")]  # plain heartbeats write nothing

    clock2 = Clock(1000.0)  # another process's monotonic clock: leases start fresh on it
    second = redis_service(redis_server.url, clock2)
    second.load()
    assert listed(second) == [("w0", 1, "a:1", False, 1), ("w1", 1, "b:1", True, 0)]
    assert "w2" not in second.manager.pools  # the leave was logged and replayed
    clock2.t = 1000.9
    assert second.expire_members(clock2.t) == []
    second.heartbeat("w0", 1)
    clock2.t = 1001.5  # w1 did not heartbeat within its fresh lease
    assert [d.worker_id for d in second.expire_members(clock2.t)] == ["w1"]

    third = redis_service(redis_server.url, Clock())
    third.load()
    assert listed(third) == [("w0", 1, "a:1", False, 1)] and set(third.manager.pools) == {"w0"}


def test_a_reloaded_member_whose_pool_an_operator_forgot_is_declared_dead(redis_server):
    svc = redis_service(redis_server.url, Clock())
    svc.join_worker(spec(), "a:1")
    svc.mutate(admin.forget_worker, "w0", False)  # an admin record: the member stays, without its pool
    again = redis_service(redis_server.url, Clock())
    again.load()
    assert again.list_workers() == [] and again.members.get("w0", 1) is not None
    assert [(d.worker_id, d.reason) for d in again.expire_members(0.0)] == [("w0", "its pool is gone")]
    assert member_records(redis_server.url)[-1] == ("leave", "w0")


def test_a_member_change_redis_refused_is_written_by_a_later_call(redis_server):
    clock = Clock()
    svc = redis_service(redis_server.url, clock)
    svc.join_worker(spec(), "a:1")
    redis_server.stop()
    with pytest.raises(StoreUnavailable):
        svc.heartbeat("w0", 1, draining=True)
    assert listed(svc) == [("w0", 1, "a:1", True, 0)] and not svc.store_ok  # memory holds it
    redis_server.start()
    assert svc.heartbeat("w0", 1, draining=True).known  # no change now, but the one kept is written
    assert svc.store_ok and member_records(redis_server.url)[-1] == ("drain", "w0")
    again = redis_service(redis_server.url, Clock())
    again.load()
    assert listed(again) == [("w0", 1, "a:1", True, 0)]


def test_without_persistence_the_table_is_in_memory_only():
    svc = KVService(KVManager())
    svc.join_worker(spec(), "a:1")
    fresh = KVService(KVManager())
    fresh.load()
    assert fresh.list_workers() == []


# -- the RPCs over gRPC, and the gateway's client -------------------------------------------------------------
@pytest.fixture()
def kv_server():
    svc = service(Clock())
    server = start_kvmanager_server(svc, "127.0.0.1", 0, admin_token="t")
    yield svc, f"127.0.0.1:{server.port}"
    server.stop(0)


def test_membership_rpcs_and_their_statuses(kv_server):
    from kvserve.common.channels import kvmanager_channel
    from kvserve.common.convert import membership as cv
    from kvserve.v1 import kvmanager_pb2 as pb
    from kvserve.v1 import kvmanager_pb2_grpc

    svc, address = kv_server
    with kvmanager_channel(address) as channel:
        stub = kvmanager_pb2_grpc.KVManagerServiceStub(channel)
        joined = cv.join_result_from_proto(stub.JoinWorker(cv.join_to_request_proto(spec(), "a:1"), timeout=10))
        assert joined.lease_ms == 1000 and joined.registered.previous_epoch == 0
        beat = stub.Heartbeat(pb.HeartbeatRequest(worker_id="w0", epoch=1, draining=True), timeout=10)
        assert (beat.known, beat.num_requests, beat.lease_ms) == (True, 0, 1000)
        listed_ = cv.workers_from_proto(stub.ListWorkers(pb.ListWorkersRequest(), timeout=10))
        assert listed_ == [WorkerMember("w0", 1, "a:1", True, 0)]
        assert not stub.Heartbeat(pb.HeartbeatRequest(worker_id="w0", epoch=5), timeout=10).known
        bad = [(stub.JoinWorker, cv.join_to_request_proto(spec(), ""), grpc.StatusCode.INVALID_ARGUMENT),
               (stub.JoinWorker, cv.join_to_request_proto(spec(num_pages=3), "a:1"),
                grpc.StatusCode.FAILED_PRECONDITION),
               (stub.Heartbeat, pb.HeartbeatRequest(worker_id="", epoch=1), grpc.StatusCode.INVALID_ARGUMENT),
               (stub.LeaveWorker, pb.LeaveWorkerRequest(worker_id="w0"), grpc.StatusCode.INVALID_ARGUMENT),
               (stub.LeaveWorker, pb.LeaveWorkerRequest(epoch=1), grpc.StatusCode.INVALID_ARGUMENT)]
        for method, request, code in bad:
            with pytest.raises(grpc.RpcError) as err:
                method(request, timeout=10)
            assert err.value.code() == code, err.value.details()
        assert svc.list_workers() == [WorkerMember("w0", 1, "a:1", True, 0)]
        left = stub.LeaveWorker(pb.LeaveWorkerRequest(worker_id="w0", epoch=1), timeout=10)
        assert list(left.dropped_req_ids) == [] and not svc.manager.pools


def test_the_gateway_client_lists_workers_and_has_one_it_declared_dead_leave(kv_server):
    from kvserve.services.gateway.errors import KVManagerUnavailable
    from kvserve.services.gateway.rpc.clients import KVManagerClient

    svc, address = kv_server
    svc.join_worker(spec("w0"), "a:1")
    svc.join_worker(spec("w1"), "b:1")
    run_request(svc, "r", "w1")
    client = KVManagerClient(address)
    try:
        assert client.list_workers() == [WorkerMember("w0", 1, "a:1", False, 0),
                                         WorkerMember("w1", 1, "b:1", False, 1)]
        assert client.leave_worker("w1", 2) == ()  # not its epoch
        assert client.leave_worker("w1", 1) == ("r",)
        assert [m.worker_id for m in client.list_workers()] == ["w0"]
    finally:
        client.close()
    gone = KVManagerClient("127.0.0.1:1")  # nothing listens there
    try:
        with pytest.raises(KVManagerUnavailable):
            gone.list_workers()
    finally:
        gone.close()


def test_a_refused_page_op_names_its_request_to_the_gateway_client(kv_server):
    """A StepPages refused over one op carries that op's req_id (trailing metadata), so the gateway fails that
    request alone; nothing of the call is applied."""
    from kvserve.common.wire.pages import PageAllocation, PageExtension, StepOps
    from kvserve.services.gateway.errors import KVManagerFailed, KVManagerUnavailable
    from kvserve.services.gateway.rpc.clients import KVManagerClient

    svc, address = kv_server
    svc.join_worker(spec("w0"), "a:1")
    run_request(svc, "r", "w0")
    client = KVManagerClient(address)
    try:
        fine = PageAllocation("new", "t", (1, 2, 3), "w0")
        for ops, blamed, message in [
                (StepOps(5, (fine,), (PageExtension("ghost", 4),)), "ghost", "'ghost' is not live"),
                (StepOps(6, (fine, PageAllocation("r", "t", (1,), "w0"))), "r", "req_id is already live")]:
            with pytest.raises(KVManagerFailed) as err:
                client.step_pages(ops)
            assert not isinstance(err.value, KVManagerUnavailable)
            assert err.value.req_id == blamed and message in str(err.value)
            assert "new" not in svc.manager.requests  # nothing of the call applied
    finally:
        client.close()
