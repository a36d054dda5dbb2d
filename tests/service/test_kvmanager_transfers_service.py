"""Transfers over the kvmanager's real gRPC server (port 0): roles refused at join, and pulls in admin stats, in
`kvserve admin stats` and in the kvmanager's metrics."""

from __future__ import annotations

import json

import grpc
import pytest
from kvmanager_rpc import TOKEN, Admin
from prometheus_client import generate_latest
from test_kvmanager_service import KV, rpc_error

from kvserve.common.metrics import KVManagerMetrics
from kvserve.common.tokens import le_uint32
from kvserve.kvmanager import admin
from kvserve.kvmanager.invariants import check_invariants
from kvserve.kvmanager.server import start_kvmanager_server
from kvserve.kvmanager.service import KVService
from kvserve.services.cli import main as cli_main
from kvserve.v1 import kvmanager_pb2 as pb
from kvserve.v1 import kvmanager_pb2_grpc

PS = 4
P = list(range(100, 113))  # 13 tokens: 3 full pages can hit
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def pool(worker, role, kv_dtype="float32", epoch=1) -> pb.PoolSpec:
    return pb.PoolSpec(worker_id=worker, epoch=epoch, num_pages=8, page_size=PS, model_fingerprint="fp",
                       kv_dtype=kv_dtype, bytes_per_token=100, role=role)


@pytest.fixture
def served():
    """(stubs, port) of a real server over a fresh service; the manager's invariants hold afterwards."""
    service = KVService()
    server = start_kvmanager_server(service, "127.0.0.1", 0, admin_token=TOKEN)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield KV(service, service.manager, kvmanager_pb2_grpc.KVManagerServiceStub(channel), Admin(channel),
                 channel), server.port
    server.stop(0)
    check_invariants(service.manager)


@pytest.fixture
def kv(served):
    return served[0]


def join(kv, spec: pb.PoolSpec):
    return kv.stub.JoinWorker(pb.JoinWorkerRequest(pool=spec, address=f"{spec.worker_id}:1"), timeout=10)


def test_join_refuses_an_unknown_role_and_a_decode_pool_unlike_the_prefill_ones(kv):
    err = rpc_error(join, kv, pool("p0", "prefil"))
    assert err.code() == INVALID and "role 'prefil' is not one of both, prefill, decode" in err.details()
    join(kv, pool("p0", "prefill"))
    join(kv, pool("b0", "", kv_dtype="int8"))  # no role is "both": never constrained
    err = rpc_error(join, kv, pool("d0", "decode", kv_dtype="bfloat16"))
    assert err.code() == INVALID
    assert ("prefill and decode workers must share" in err.details() and "'d0' (decode)" in err.details()
            and "'p0' (prefill)" in err.details() and "kv_dtype 'bfloat16' on 'd0', 'float32' on 'p0'" in err.details())
    err = rpc_error(kv.stub.RegisterWorker, pool("d0", "decode", kv_dtype="bfloat16"))  # the same rule
    assert err.code() == INVALID and "prefill and decode workers must share" in err.details()
    assert sorted(kv.mgr.pools) == ["b0", "p0"] and sorted(kv.service.members.members) == ["b0", "p0"]
    assert kv.mgr.pools["b0"].spec.role == "both"
    join(kv, pool("d0", "decode"))
    assert [m.worker_id for m in kv.service.list_workers()] == ["b0", "d0", "p0"]


def handed_over(kv) -> None:
    """A prefill on p0 taken over by its decode worker d0, which reports its pull; a second pull left held."""
    join(kv, pool("p0", "prefill"))
    join(kv, pool("d0", "decode"))
    kv.step(1, allocations=[pb.PageAllocation(req_id="r", tenant="A", packed_token_ids=le_uint32(P), worker_id="p0")])
    kv.step(2, commits=[pb.PageCommit(req_id="r", start_pos=0, packed_token_ids=le_uint32(P[:12]),
                                      num_computed_tokens=13)])
    moved = kv.step(3, allocations=[pb.PageAllocation(req_id="r", tenant="A", packed_token_ids=le_uint32(P),
                                                      worker_id="d0", pull_peers=True, moved_from="p0"),
                                    pb.PageAllocation(req_id="s", tenant="A", packed_token_ids=le_uint32(P),
                                                      worker_id="d0", pull_peers=True)])
    r = moved.allocation_results[0]
    assert (r.peer_worker_id, len(r.peer_loads), r.num_cached_tokens) == ("p0", 3, 12)
    kv.stub.StepPages(pb.StepOps(step_id=4, transfers=[pb.TransferDone(req_id="r", ok=True, num_bytes=3_000_000,
                                                                       seconds=0.5)]), timeout=10)


def test_admin_stats_show_the_pulls_and_each_pools_role(served, capsys):
    kv, port = served
    handed_over(kv)
    s = kv.stats()
    t = s.transfers
    assert (t.num_pulls, t.num_pages, t.num_ok, t.num_failed, t.num_expired, t.num_moved, t.num_holds) == (
        2, 6, 1, 0, 0, 1, 1)
    assert (t.num_bytes, t.seconds) == (3_000_000, 0.5)
    assert [(p.worker_id, p.role) for p in s.pools] == [("d0", "decode"), ("p0", "prefill")]

    admin_args = ["--kvmanager", f"127.0.0.1:{port}", "--admin-token", TOKEN]
    assert cli_main(["admin", "stats", "--json", *admin_args]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["transfers"]["num_ok"] == 1 and stats["transfers"]["num_bytes"] == 3_000_000
    assert cli_main(["admin", "stats", *admin_args]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("transfers")
    assert lines[at + 1].split() == ["PULLS", "OK", "FAILED", "EXPIRED", "MOVED", "PAGES", "MB", "MB/S", "HOLDS"]
    assert lines[at + 2].split() == ["2", "1", "0", "0", "1", "6", "3.0", "6.0", "1"]
    pools = [line.split() for line in lines[1:4]]
    assert pools[0][:3] == ["WORKER", "EPOCH", "ROLE"] and [p[2] for p in pools[1:]] == ["decode", "prefill"]

    text = generate_latest(KVManagerMetrics(lambda: kv.service.read(admin.stats)).registry).decode()
    for sample in ('kvserve:transfer_pulls_total{result="ok"} 1.0', 'kvserve:transfer_pulls_total{result="failed"} 0.0',
                   'kvserve:transfer_pulls_total{result="expired"} 0.0', "kvserve:transfer_orders_total 2.0",
                   "kvserve:transfer_pages_total 6.0", "kvserve:transfer_bytes_total 3e+06",
                   "kvserve:transfer_seconds_total 0.5", "kvserve:transfer_moved_requests_total 1.0",
                   "kvserve:transfer_holds 1.0"):
        assert sample in text
