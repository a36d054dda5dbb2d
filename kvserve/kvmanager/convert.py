"""The kvmanager's admin answers -> protobuf, in one place (the page ops' converters are common's:
kvserve/common/convert/pages.py). No logic beyond renaming and copying."""

from __future__ import annotations

from kvserve.common.convert.fields import as_kwargs, to_message
from kvserve.common.convert.tier import tier_report_from_proto
from kvserve.common.errors import InvalidRequest
from kvserve.common.wire.tier import TierReport
from kvserve.kvmanager import admin
from kvserve.v1 import kvmanager_pb2 as pb

HASH_BYTES = 16


# -- KVManagerService ---------------------------------------------------------------------------------------
def checked_tier_report(r: pb.TierReport) -> TierReport:
    """A ReportTier's report. Raises InvalidRequest for an empty worker_id, a block hash that is not 16 bytes,
    a negative count or size."""
    report = tier_report_from_proto(r)
    if not report.worker_id:
        raise InvalidRequest("worker_id must not be empty")
    bad = next((h for h in [b.block_hash for b in report.written] + list(report.missing) if len(h) != HASH_BYTES),
               None)
    if bad is not None:
        raise InvalidRequest(f"a block hash is {HASH_BYTES} bytes, got {len(bad)}")
    negative = [b.num_bytes for b in report.written if b.num_bytes < 0] + [
        v for v in report.counters.as_tuple() if v < 0]
    if negative:
        raise InvalidRequest(f"counts and byte sizes must be >= 0, got {negative[0]}")
    return report


# -- KVAdminService -----------------------------------------------------------------------------------------
def tenant_to_proto(t: admin.TenantStats) -> pb.TenantStats:
    return to_message(t, pb.TenantStats)


def pool_stats_to_proto(p: admin.PoolStats) -> pb.PoolStats:
    fields = as_kwargs(p)
    group = fields.pop("sliding_group")
    return pb.PoolStats(**fields, sliding_group=pool_stats_to_proto(group) if group is not None else None)


def stats_to_proto(s: admin.ClusterStats, store_ok: bool) -> pb.ClusterStats:
    return pb.ClusterStats(pools=[pool_stats_to_proto(p) for p in s.pools],
                           tenants=[tenant_to_proto(t) for t in s.tenants],
                           prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
                           num_evicted_blocks=s.num_evicted_blocks, store_ok=store_ok,
                           kv_store=to_message(s.store, pb.StoreStats) if s.store is not None else None,
                           transfers=to_message(s.transfers, pb.TransferStats) if s.transfers is not None else None)


def inspect_to_proto(r: admin.TenantReport) -> pb.TenantReport:
    return pb.TenantReport(stats=tenant_to_proto(r.stats),
                           blocks=[to_message(b, pb.CachedBlock) for b in r.blocks],
                           prefixes=[to_message(p, pb.CachedPrefix) for p in r.prefixes])


def probe_to_proto(r: admin.ProbeResult) -> pb.ProbeResult:
    return pb.ProbeResult(num_query_tokens=r.num_query_tokens, num_cached_tokens=r.num_cached_tokens,
                          worker_id=r.worker_id, hits=[to_message(h, pb.ProbeHit) for h in r.hits])


def page_table_to_proto(t: admin.PageTable) -> pb.PageTable:
    return pb.PageTable(
        req_id=t.req_id, tenant=t.tenant, worker_id=t.worker_id, epoch=t.epoch, page_table=t.page_table,
        pages=[to_message(p, pb.PageInfo) for p in t.pages], num_committed_tokens=t.num_committed_tokens,
        num_prompt_tokens=t.num_prompt_tokens, last_step_id=t.last_step_id, page_size=t.page_size,
        group_page_table=t.group_page_table, group_pages=[to_message(p, pb.PageInfo) for p in t.group_pages])


def input_of(request) -> tuple[tuple[int, ...] | None, str | None]:
    """(token_ids, None) or (None, text) from a PrefixRequest's ``input`` oneof;
    (None, None) when neither is set."""
    which = request.WhichOneof("input")
    if which == "token_ids":
        return tuple(request.token_ids.token_ids), None
    if which == "text":
        return None, request.text
    return None, None
