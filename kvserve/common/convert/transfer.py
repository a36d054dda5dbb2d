"""Protobuf <-> the transfer messages between workers (kvserve/common/wire/transfer.py). No logic beyond renaming and
copying."""

from __future__ import annotations

from kvserve.common.convert.pages import peer_load_to_proto, peer_loads_from_proto
from kvserve.common.wire.transfer import PeerLoad, PullOrder, PullResult, ReadOrder
from kvserve.v1 import worker_pb2 as pb


def pull_order_to_proto(o: PullOrder) -> pb.PullOrder:
    msg = pb.PullOrder(req_id=o.req_id, epoch=o.epoch, source_worker_id=o.source_worker_id,
                       source_epoch=o.source_epoch, source_address=o.source_address,
                       lease_expires_ms=o.lease_expires_ms, traceparent=o.traceparent)
    for load in o.loads:
        peer_load_to_proto(msg.loads.add, load)
    return msg


def pull_order_from_proto(r: pb.PullOrder) -> PullOrder:
    return PullOrder(r.req_id, r.epoch, r.source_worker_id, r.source_epoch, r.source_address, r.lease_expires_ms,
                     tuple(peer_loads_from_proto(r.loads)), r.traceparent)


def pull_result_to_proto(r: PullResult) -> pb.PullResult:
    return pb.PullResult(num_pages=r.num_pages, num_bytes=r.num_bytes, seconds=r.seconds, error=r.error)


def pull_result_from_proto(r: pb.PullResult) -> PullResult:
    return PullResult(r.num_pages, r.num_bytes, r.seconds, r.error)


def read_order_to_proto(o: ReadOrder) -> pb.ReadOrder:
    msg = pb.ReadOrder(epoch=o.epoch, lease_expires_ms=o.lease_expires_ms)
    for src_page_id, block_hash, namespace in o.pages:
        peer_load_to_proto(msg.pages.add, PeerLoad(0, src_page_id, block_hash, namespace))
    return msg


def read_order_from_proto(r: pb.ReadOrder) -> ReadOrder:
    return ReadOrder(r.epoch, r.lease_expires_ms, tuple((p.src_page_id, p.block_hash, p.namespace) for p in r.pages))
