"""Protobuf <-> the page-op dataclasses (kvserve/common/wire/pages.py): the kvmanager's servicer decodes requests and
encodes answers, the gateway's client the other way round. No logic beyond renaming and copying."""

from __future__ import annotations

from collections.abc import Mapping

from kvserve.common.convert.fields import as_kwargs, to_message
from kvserve.common.errors import InvalidRequest
from kvserve.common.telemetry import NO_TRACES
from kvserve.common.tokens import le_uint32, unpack_uint32
from kvserve.common.wire import pages as wire
from kvserve.common.wire.tier import StoreLoad, StoreWrite
from kvserve.common.wire.transfer import PeerLoad, TransferDone
from kvserve.v1 import kvmanager_pb2 as pb

OP_STATUS = {
    wire.OpStatus.OK: pb.PAGE_OP_STATUS_OK,
    wire.OpStatus.OUT_OF_PAGES: pb.PAGE_OP_STATUS_OUT_OF_PAGES,
    wire.OpStatus.STALE_EPOCH: pb.PAGE_OP_STATUS_STALE_EPOCH,
}
STATUS_OF = {v: k for k, v in OP_STATUS.items()}
OK = pb.PAGE_OP_STATUS_OK


# -- the kvmanager's side: requests in, answers out -----------------------------------------------------------
def spec_from_proto(r: pb.PoolSpec) -> wire.PoolSpec:
    return wire.PoolSpec(r.worker_id, r.epoch, r.num_pages, r.page_size, r.model_fingerprint, r.kv_dtype,
                         r.bytes_per_token, r.kv_scales, r.sliding_window, r.attention_sinks, r.kv_store,
                         r.role or "both", r.sliding_group_pages, r.sliding_group_window,
                         r.sliding_group_bytes_per_token)


def register_to_proto(r: wire.RegisterResult) -> pb.RegisterResult:
    return pb.RegisterResult(ok=True, previous_epoch=r.previous_epoch, dropped_req_ids=r.dropped_req_ids,
                             released_req_ids=r.released_req_ids)


def unpack_token_ids(where: str, packed: bytes):
    """A ``packed_token_ids`` field as a sequence of ints (an array of uint32); InvalidRequest when torn."""
    try:
        return unpack_uint32(packed)
    except ValueError as e:
        raise InvalidRequest(f"{where}: packed_token_ids: {e}") from None


def _allocation(a: pb.PageAllocation) -> wire.PageAllocation:
    token_ids = unpack_token_ids(f"allocation {a.req_id!r}", a.packed_token_ids)
    return wire.PageAllocation(a.req_id, a.tenant, token_ids, a.worker_id, a.skip_prefix_cache, a.chunk_tokens,
                               a.skip_store, a.load_s_per_page, a.prefill_s_per_token,
                               tuple(wire.PinPoint(p.num_tokens, p.ttl_s) for p in a.pins), a.pull_peers,
                               a.pull_s_per_page, a.moved_from)


def _commit(c: pb.PageCommit) -> wire.PageCommit:
    token_ids = unpack_token_ids(f"commit {c.req_id!r}", c.packed_token_ids)
    return wire.PageCommit(c.req_id, c.start_pos, token_ids, c.num_computed_tokens)


def step_from_proto(r: pb.StepOps) -> wire.StepOps:
    return wire.StepOps(step_id=r.step_id, allocations=tuple(map(_allocation, r.allocations)),
                        extensions=tuple(wire.PageExtension(e.req_id, e.num_tokens) for e in r.extensions),
                        commits=tuple(map(_commit, r.commits)),
                        frees=tuple(wire.PageFree(f.req_id) for f in r.frees),
                        releases=tuple(wire.PageRelease(x.req_id, tuple(x.page_indices)) for x in r.releases),
                        transfers=tuple(TransferDone(t.req_id, t.ok, t.num_bytes, t.seconds) for t in r.transfers))


def peer_load_to_proto(add, p: PeerLoad) -> None:
    add(page_id=p.page_id, src_page_id=p.src_page_id, block_hash=p.block_hash, namespace=p.namespace)


def peer_loads_from_proto(loads) -> list[PeerLoad]:
    return [PeerLoad(x.page_id, x.src_page_id, x.block_hash, x.namespace) for x in loads]


# The answers are added in place (``repeated.add``), not built and then copied into the response, and an
# extension's default fields are left unset: both save a copy per op of big calls.
def _add_allocation(add, a: wire.PageAllocationResult) -> None:
    msg = add(req_id=a.req_id, status=OP_STATUS[a.status], worker_id=a.worker_id, epoch=a.epoch,
              page_table=a.page_table, num_cached_tokens=a.num_cached_tokens, num_pages_short=a.num_pages_short,
              num_committed_tokens=a.num_committed_tokens, num_pinned_tokens=a.num_pinned_tokens,
              group_page_table=a.group_page_table)
    for load in a.store_loads:
        msg.store_loads.add(page_id=load.page_id, block_hash=load.block_hash, namespace=load.namespace)
    if a.peer_loads:
        for load in a.peer_loads:
            peer_load_to_proto(msg.peer_loads.add, load)
        msg.peer_worker_id, msg.peer_epoch, msg.lease_expires_ms = a.peer_worker_id, a.peer_epoch, a.lease_expires_ms


def _add_extension(add, e: wire.PageExtensionResult) -> None:
    if e.status is wire.OpStatus.OK and not e.new_page_ids and not e.group_new_page_ids:  # most decode steps
        add(req_id=e.req_id, status=OK, num_pages=e.num_pages)
    else:
        add(req_id=e.req_id, status=OP_STATUS[e.status], new_page_ids=e.new_page_ids, num_pages=e.num_pages,
            num_pages_short=e.num_pages_short, group_new_page_ids=e.group_new_page_ids)


def _add_commit(add, c: wire.PageCommitResult) -> None:
    add(req_id=c.req_id, status=OP_STATUS[c.status], num_committed_tokens=c.num_committed_tokens,
        num_pinned_tokens=c.num_pinned_tokens)


def _add_free(add, f: wire.PageFreeResult) -> None:
    add(req_id=f.req_id, status=OP_STATUS[f.status])


def _add_release(add, r: wire.PageReleaseResult) -> None:
    add(req_id=r.req_id, status=OP_STATUS[r.status], num_released=r.num_released)


def step_to_proto(r: wire.StepResults, handle_ms: float) -> pb.StepResults:
    out = pb.StepResults(handle_ms=handle_ms)
    for results, repeated, add_one in ((r.allocations, out.allocation_results, _add_allocation),
                                       (r.extensions, out.extension_results, _add_extension),
                                       (r.commits, out.commit_results, _add_commit),
                                       (r.frees, out.free_results, _add_free),
                                       (r.releases, out.release_results, _add_release)):
        add = repeated.add
        for result in results:
            add_one(add, result)
    for p in r.pools:
        out.pools.add(**as_kwargs(p))
    for order in r.store_writes:
        w, msg = order.write, out.store_writes.add(worker_id=order.worker_id).write
        msg.page_id, msg.block_hash, msg.namespace, msg.tenant = w.page_id, w.block_hash, w.namespace, w.tenant
    return out


# -- the gateway's side: requests out, answers in -------------------------------------------------------------
def spec_to_proto(s: wire.PoolSpec, release_requests: bool = False) -> pb.PoolSpec:
    msg = to_message(s, pb.PoolSpec)
    msg.release_requests = release_requests
    return msg


def register_from_proto(r: pb.RegisterResult) -> wire.RegisterResult:
    return wire.RegisterResult(previous_epoch=r.previous_epoch, dropped_req_ids=tuple(r.dropped_req_ids),
                               released_req_ids=tuple(r.released_req_ids))


def step_to_request_proto(ops: wire.StepOps, traceparents: Mapping[str, str] = NO_TRACES) -> pb.StepOps:
    """``traceparents``: req_id -> W3C traceparent of the request's span, for the ops of traced requests."""
    def tp(op) -> dict:
        parent = traceparents.get(op.req_id)
        return {"traceparent": parent} if parent else {}

    return pb.StepOps(
        step_id=ops.step_id,
        allocations=[pb.PageAllocation(req_id=a.req_id, tenant=a.tenant, worker_id=a.worker_id,
                                       packed_token_ids=le_uint32(a.token_ids),
                                       skip_prefix_cache=a.skip_prefix_cache, chunk_tokens=a.chunk_tokens,
                                       skip_store=a.skip_store, load_s_per_page=a.load_s_per_page,
                                       prefill_s_per_token=a.prefill_s_per_token,
                                       pins=[pb.PinPoint(num_tokens=p.num_tokens, ttl_s=p.ttl_s) for p in a.pins],
                                       pull_peers=a.pull_peers, pull_s_per_page=a.pull_s_per_page,
                                       moved_from=a.moved_from, **tp(a))
                     for a in ops.allocations],
        extensions=[pb.PageExtension(**as_kwargs(e), **tp(e)) for e in ops.extensions],
        commits=[pb.PageCommit(req_id=c.req_id, start_pos=c.start_pos, packed_token_ids=le_uint32(c.token_ids),
                               num_computed_tokens=c.num_computed_tokens, **tp(c)) for c in ops.commits],
        frees=[pb.PageFree(**as_kwargs(f), **tp(f)) for f in ops.frees],
        releases=[pb.PageRelease(**as_kwargs(r), **tp(r)) for r in ops.releases],
        transfers=[pb.TransferDone(**as_kwargs(t)) for t in ops.transfers],
    )


def place_to_proto(tenant: str, token_ids, num_queued: dict[str, int],
                   worker_ids: tuple[str, ...] = (), pull_peers: bool = False) -> pb.PlaceRequest:
    return pb.PlaceRequest(tenant=tenant, packed_token_ids=le_uint32(token_ids), num_queued=num_queued,
                           worker_ids=worker_ids, pull_peers=pull_peers)


def _allocation_result(a: pb.PageAllocationResult) -> wire.PageAllocationResult:
    return wire.PageAllocationResult(a.req_id, STATUS_OF[a.status], a.worker_id, a.epoch, list(a.page_table),
                                     a.num_cached_tokens, a.num_pages_short,
                                     [StoreLoad(x.page_id, x.block_hash, x.namespace) for x in a.store_loads],
                                     a.num_committed_tokens, a.num_pinned_tokens, peer_loads_from_proto(a.peer_loads),
                                     a.peer_worker_id, a.peer_epoch, a.lease_expires_ms, list(a.group_page_table))


def _extension_result(e: pb.PageExtensionResult) -> wire.PageExtensionResult:
    return wire.PageExtensionResult(e.req_id, STATUS_OF[e.status], list(e.new_page_ids), e.num_pages,
                                    e.num_pages_short, list(e.group_new_page_ids))


def step_results_from_proto(r: pb.StepResults) -> wire.StepResults:
    return wire.StepResults(
        allocations=list(map(_allocation_result, r.allocation_results)),
        extensions=list(map(_extension_result, r.extension_results)),
        commits=[wire.PageCommitResult(c.req_id, STATUS_OF[c.status], c.num_committed_tokens, c.num_pinned_tokens)
                 for c in r.commit_results],
        frees=[wire.PageFreeResult(f.req_id, STATUS_OF[f.status]) for f in r.free_results],
        releases=[wire.PageReleaseResult(x.req_id, STATUS_OF[x.status], x.num_released) for x in r.release_results],
        pools=[wire.PoolSummary(p.worker_id, p.epoch, p.num_free_pages, p.num_evictable_pages) for p in r.pools],
        store_writes=[wire.StoreWriteOrder(o.worker_id, StoreWrite(o.write.page_id, o.write.block_hash,
                                                                     o.write.namespace, o.write.tenant))
                      for o in r.store_writes],
    )
