"""Protobuf <-> the shared KV tier's messages (kvserve/common/wire/tier.py): the kvmanager's orders carried in a
worker's step (StoreLoad, StoreWrite) and the worker's ReportTier. No logic beyond renaming and copying."""

from __future__ import annotations

from kvserve.common.convert.fields import as_kwargs
from kvserve.common.wire.tier import StoredBlock, StoreLoad, StoreWrite, TierCounters, TierReport
from kvserve.v1 import kvmanager_pb2 as pb


def store_load_to_proto(s: StoreLoad) -> pb.StoreLoad:
    return pb.StoreLoad(page_id=s.page_id, block_hash=s.block_hash, namespace=s.namespace)


def store_load_from_proto(r: pb.StoreLoad) -> StoreLoad:
    return StoreLoad(page_id=r.page_id, block_hash=r.block_hash, namespace=r.namespace)


def store_write_to_proto(s: StoreWrite) -> pb.StoreWrite:
    return pb.StoreWrite(page_id=s.page_id, block_hash=s.block_hash, namespace=s.namespace, tenant=s.tenant)


def store_write_from_proto(r: pb.StoreWrite) -> StoreWrite:
    return StoreWrite(page_id=r.page_id, block_hash=r.block_hash, namespace=r.namespace, tenant=r.tenant)


def tier_report_to_proto(r: TierReport) -> pb.TierReport:
    return pb.TierReport(
        worker_id=r.worker_id, epoch=r.epoch,
        written=[pb.StoredBlock(block_hash=b.block_hash, tenant=b.tenant, num_bytes=b.num_bytes) for b in r.written],
        missing=list(r.missing), counters=pb.TierCounters(**as_kwargs(r.counters)))


def tier_report_from_proto(r: pb.TierReport) -> TierReport:
    return TierReport(
        worker_id=r.worker_id, epoch=r.epoch,
        written=tuple(StoredBlock(b.block_hash, b.tenant, b.num_bytes) for b in r.written),
        missing=tuple(r.missing),
        counters=TierCounters(**{name: getattr(r.counters, name) for name in TierCounters.__slots__}))
