"""Protobuf <-> the worker's step and Info (kvserve/common/wire/worker.py): the worker's servicer uses one direction,
the gateway's worker client the other. No logic beyond renaming and copying."""

from __future__ import annotations

from collections.abc import Mapping

from kvserve.common.convert.sampling import sampling_from_proto, sampling_to_proto
from kvserve.common.convert.tier import (
    store_load_from_proto,
    store_load_to_proto,
    store_write_from_proto,
    store_write_to_proto,
)
from kvserve.common.telemetry import NO_TRACES
from kvserve.common.wire.worker import RejectedItem, SampledToken, StepBatch, StepItem, StepOutput, WorkerInfo
from kvserve.v1 import common_pb2, worker_pb2


def batch_from_proto(req: worker_pb2.StepBatch) -> StepBatch:
    items = tuple(
        StepItem(
            req_id=i.req_id,
            token_ids=tuple(i.token_ids),
            start_pos=i.start_pos,
            page_table=tuple(i.page_table),
            group_page_table=tuple(i.group_page_table),
            sample=i.sample,
            sampling=sampling_from_proto(i.sampling),
            store_loads=tuple(store_load_from_proto(s) for s in i.store_loads),
        )
        for i in req.items
    )
    return StepBatch(items=items, epoch=req.epoch,
                     store_writes=tuple(store_write_from_proto(w) for w in req.store_writes))


def batch_to_proto(batch: StepBatch, traceparents: Mapping[str, str] = NO_TRACES) -> worker_pb2.StepBatch:
    """``traceparents``: req_id -> W3C traceparent of the request's span, for traced requests."""
    items = [worker_pb2.StepItem(req_id=i.req_id, token_ids=i.token_ids, start_pos=i.start_pos,
                                 page_table=i.page_table, sample=i.sample, sampling=sampling_to_proto(i.sampling),
                                 traceparent=traceparents.get(i.req_id, ""),
                                 store_loads=[store_load_to_proto(s) for s in i.store_loads],
                                 group_page_table=i.group_page_table)
             for i in batch.items]
    return worker_pb2.StepBatch(items=items, epoch=batch.epoch,
                                store_writes=[store_write_to_proto(w) for w in batch.store_writes])


def output_to_proto(out: StepOutput) -> worker_pb2.StepOutput:
    results = [
        worker_pb2.SampledToken(
            req_id=s.req_id,
            token_id=s.token_id,
            logprob=s.logprob,
            top_logprobs=[common_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in s.top_logprobs],
        )
        for s in out.sampled
    ]
    rejected = [worker_pb2.RejectedItem(req_id=r.req_id, message=r.message, invalid=r.invalid) for r in out.rejected]
    return worker_pb2.StepOutput(results=results, num_tokens=out.num_tokens, compute_ms=out.compute_ms,
                                 rejected=rejected, unloaded=out.unloaded, num_loaded_pages=out.num_loaded_pages,
                                 load_ms=out.load_ms)


def output_from_proto(r: worker_pb2.StepOutput) -> StepOutput:
    sampled = [SampledToken(s.req_id, s.token_id, s.logprob, [(t.token_id, t.logprob) for t in s.top_logprobs])
               for s in r.results]
    rejected = [RejectedItem(x.req_id, x.message, x.invalid) for x in r.rejected]
    return StepOutput(sampled=sampled, num_tokens=r.num_tokens, compute_ms=r.compute_ms, rejected=rejected,
                      unloaded=list(r.unloaded), num_loaded_pages=r.num_loaded_pages, load_ms=r.load_ms)


def info_to_proto(info: WorkerInfo) -> worker_pb2.WorkerInfo:
    fields = {k: getattr(info, k) for k in info.__slots__}
    fields["eos_token_ids"] = list(info.eos_token_ids)
    return worker_pb2.WorkerInfo(**fields)


def info_from_proto(r: worker_pb2.WorkerInfo) -> WorkerInfo:
    fields = {k: getattr(r, k) for k in WorkerInfo.__slots__}
    fields["eos_token_ids"] = tuple(r.eos_token_ids)
    fields["role"] = r.role or "both"
    return WorkerInfo(**fields)
