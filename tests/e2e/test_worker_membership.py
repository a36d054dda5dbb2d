"""A real `kvserve worker --kvmanager` process keeping its lease in a real `kvserve kvmanager` process: it joins
and is listed, drains on SIGTERM while requests run and then leaves, rejoins under a new epoch when the
kvmanager lost its lease, and, killed for good, is declared dead with its pool.

Each test starts one worker (the real model on CPU, a 32-page pool). The kvmanager's --worker-timeout is 2 s:
short, with room for a worker on two busy cores to heartbeat in time.
"""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path

import grpc
import pytest
from kvmanager_processes import kvmanager_process
from kvmanager_rpc import Admin
from polling import wait_for
from test_cli_process import cli_env, info_of, worker_process

from kvserve.common.tokens import le_uint32
from kvserve.v1 import kvmanager_pb2 as pb
from kvserve.v1 import kvmanager_pb2_grpc, worker_pb2, worker_pb2_grpc

LEASE_S = 2.0
WAIT_S = 30.0  # for what follows a lease (a few of them) or a model load on two busy cores
WORKER = "w-m"
PROMPT = [1, 2, 3]


def poll(condition, what: str):
    return wait_for(condition, what, WAIT_S)


@contextlib.contextmanager
def kvmanager(folder: Path, port: int = 0):
    """`kvserve kvmanager --no-persistence` on ``port``; yields (process, port, KVManagerService stub, admin)."""
    folder.mkdir(parents=True, exist_ok=True)
    with kvmanager_process(folder, "--port", str(port), "--no-persistence", "--admin-token", "T",
                           "--worker-timeout", str(LEASE_S)) as (proc, match):
        bound = int(match.group(1))
        with grpc.insecure_channel(f"127.0.0.1:{bound}") as channel:
            yield proc, bound, kvmanager_pb2_grpc.KVManagerServiceStub(channel), Admin(channel, "T")


@contextlib.contextmanager
def member_worker(tmp_path: Path, kvmanager_port: int):
    with worker_process(tmp_path, "--port", "0", "--num-pages", "32", "--worker-id", WORKER, "--kvmanager",
                        f"127.0.0.1:{kvmanager_port}", worker_id=WORKER, env=cli_env()) as running:
        yield running


def members(stub) -> list[pb.WorkerMember]:
    return list(stub.ListWorkers(pb.ListWorkersRequest(), timeout=10).workers)


def listed_epoch(stub, other_than: int = 0) -> int:
    """The worker's epoch once it is listed under an epoch other than ``other_than``, else 0."""
    found = [m.epoch for m in members(stub) if m.worker_id == WORKER and m.epoch != other_than]
    return found[0] if found else 0


def allocate(stub, req_id: str) -> list[int]:
    """Allocates in the test's first StepPages call (step_id 1) to this kvmanager."""
    op = pb.PageAllocation(req_id=req_id, tenant="A", worker_id=WORKER, packed_token_ids=le_uint32(PROMPT))
    result = stub.StepPages(pb.StepOps(step_id=1, allocations=[op]), timeout=10).allocation_results[0]
    assert result.status == pb.PAGE_OP_STATUS_OK
    return list(result.page_table)


def step(port: int, epoch: int, page_table: list[int]) -> worker_pb2.StepOutput:
    item = worker_pb2.StepItem(req_id="r", token_ids=PROMPT, start_pos=0, page_table=page_table, sample=True)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return worker_pb2_grpc.WorkerServiceStub(channel).Step(worker_pb2.StepBatch(items=[item], epoch=epoch),
                                                              timeout=30)


def pool_ids(admin) -> list[str]:
    return [p.worker_id for p in admin.Stats(pb.StatsRequest()).pools]


def test_a_worker_joins_drains_on_sigterm_while_requests_run_then_leaves(tmp_path):
    with kvmanager(tmp_path / "kvm") as (_, kv_port, stub, admin), \
            member_worker(tmp_path, kv_port) as (worker, port):
        epoch = poll(lambda: listed_epoch(stub), "the worker is listed")
        (member,) = members(stub)
        assert (member.address, member.epoch, member.draining) == (f"127.0.0.1:{port}", info_of(port).epoch, False)
        assert pool_ids(admin) == [WORKER]
        page_table = allocate(stub, "r")

        worker.send_signal(signal.SIGTERM)
        poll(lambda: members(stub)[0].draining, "the worker drains")
        assert members(stub)[0].num_requests == 1
        assert len(step(port, epoch, page_table).results) == 1  # still serving its running request
        assert worker.poll() is None
        stub.StepPages(pb.StepOps(step_id=2, frees=[pb.PageFree(req_id="r")]), timeout=10)

        assert worker.wait(timeout=WAIT_S) == 0
        assert members(stub) == [] and pool_ids(admin) == []  # it left: pool and member forgotten


def test_the_worker_rejoins_under_a_new_epoch_when_the_kvmanager_lost_its_lease(tmp_path):
    with contextlib.ExitStack() as stack:
        first, kv_port, stub, _ = stack.enter_context(kvmanager(tmp_path / "kvm1"))
        worker, port = stack.enter_context(member_worker(tmp_path, kv_port))
        e1 = poll(lambda: listed_epoch(stub), "the worker is listed")

        first.send_signal(signal.SIGTERM)  # a restart without persistence: the new kvmanager knows nobody
        assert first.wait(timeout=WAIT_S) == 0
        _, _, stub, admin = stack.enter_context(kvmanager(tmp_path / "kvm2", kv_port))
        e2 = poll(lambda: listed_epoch(stub, other_than=e1), "the worker rejoins the restarted kvmanager")
        assert e2 > e1 and info_of(port).epoch == e2 and pool_ids(admin) == [WORKER]

        worker.send_signal(signal.SIGSTOP)  # no heartbeat for longer than its lease
        try:
            poll(lambda: not members(stub) and not pool_ids(admin), "the lapsed worker is declared dead")
        finally:
            worker.send_signal(signal.SIGCONT)
        e3 = poll(lambda: listed_epoch(stub, other_than=e2), "the worker rejoins after its lease lapsed")
        assert e3 > e2 and info_of(port).epoch == e3
        page_table = allocate(stub, "r")
        with pytest.raises(grpc.RpcError) as err:  # the forgotten epoch's steps are refused
            step(port, e2, page_table)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and f"epoch {e2}" in err.value.details()
        assert len(step(port, e3, page_table).results) == 1


def test_a_worker_killed_for_good_is_declared_dead_with_its_pool(tmp_path):
    with kvmanager(tmp_path / "kvm") as (kvm, kv_port, stub, admin), \
            member_worker(tmp_path, kv_port) as (worker, _):
        poll(lambda: listed_epoch(stub), "the worker is listed")
        allocate(stub, "r")
        worker.kill()
        worker.wait(timeout=WAIT_S)
        killed = time.monotonic()
        poll(lambda: not members(stub) and not pool_ids(admin), "the dead worker and its pool are gone")
        assert time.monotonic() - killed >= LEASE_S * 0.5  # it was its lease lapsing, not the kill itself
        stub.StepPages(pb.StepOps(step_id=2, frees=[pb.PageFree(req_id="r")]), timeout=10)  # a free of it is OK
    stderr = (tmp_path / "kvm" / "kvmanager.stderr").read_text()
    assert f"worker {WORKER} epoch" in stderr and "declared dead: its lease lapsed" in stderr
