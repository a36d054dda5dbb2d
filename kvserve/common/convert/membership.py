"""Protobuf <-> the membership dataclasses (kvserve/common/wire/membership.py): the kvmanager's servicer decodes
requests and encodes answers, the worker's lease keeper and the gateway's client the other way round. No logic beyond
renaming and copying."""

from __future__ import annotations

from kvserve.common.convert.fields import to_message
from kvserve.common.convert.pages import register_from_proto, register_to_proto, spec_from_proto, spec_to_proto
from kvserve.common.wire.membership import HeartbeatResult, JoinResult, WorkerMember
from kvserve.common.wire.pages import PoolSpec
from kvserve.v1 import kvmanager_pb2 as pb


# -- the kvmanager's side: requests in, answers out -----------------------------------------------------------
def join_from_proto(r: pb.JoinWorkerRequest) -> tuple[PoolSpec, str]:
    """(the pool, the address) of a JoinWorker."""
    return spec_from_proto(r.pool), r.address


def join_to_proto(r: JoinResult) -> pb.JoinResult:
    return pb.JoinResult(registered=register_to_proto(r.registered), lease_ms=r.lease_ms)


def heartbeat_to_proto(r: HeartbeatResult) -> pb.HeartbeatResult:
    return to_message(r, pb.HeartbeatResult)


def workers_to_proto(members: list[WorkerMember]) -> pb.ListWorkersResponse:
    return pb.ListWorkersResponse(workers=[to_message(m, pb.WorkerMember) for m in members])


# -- the callers' side: requests out, answers in --------------------------------------------------------------
def join_to_request_proto(spec: PoolSpec, address: str) -> pb.JoinWorkerRequest:
    return pb.JoinWorkerRequest(pool=spec_to_proto(spec), address=address)


def join_result_from_proto(r: pb.JoinResult) -> JoinResult:
    return JoinResult(registered=register_from_proto(r.registered), lease_ms=r.lease_ms)


def heartbeat_result_from_proto(r: pb.HeartbeatResult) -> HeartbeatResult:
    return HeartbeatResult(known=r.known, num_requests=r.num_requests, lease_ms=r.lease_ms)


def member_from_proto(m: pb.WorkerMember) -> WorkerMember:
    return WorkerMember(m.worker_id, m.epoch, m.address, m.draining, m.num_requests)


def workers_from_proto(r: pb.ListWorkersResponse) -> list[WorkerMember]:
    return [member_from_proto(m) for m in r.workers]
