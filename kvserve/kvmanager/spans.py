"""The kvmanager's part of each request's trace: one span per page op of a traced request (the op carries the
request's traceparent), a child of the gateway's request span, timed by the StepPages call that applied it.
Glue, like the servicer: the domain never sees a span."""

from __future__ import annotations

from kvserve.common.telemetry import context_of
from kvserve.common.wire.pages import StepResults


def _allocate_attrs(op, res) -> dict:  # op: the PageAllocation message (token ids packed, 4 bytes each)
    return {"kvserve.tenant": op.tenant, "kvserve.prompt_tokens": len(op.packed_token_ids) // 4,
            "kvserve.worker_id": res.worker_id, "kvserve.num_cached_tokens": res.num_cached_tokens,
            "kvserve.num_pages": len(res.page_table), "kvserve.num_pages_short": res.num_pages_short}


def _extend_attrs(op, res) -> dict:
    return {"kvserve.num_tokens": op.num_tokens, "kvserve.num_new_pages": len(res.new_page_ids),
            "kvserve.num_pages": res.num_pages, "kvserve.num_pages_short": res.num_pages_short}


def _commit_attrs(op, res) -> dict:
    return {"kvserve.num_new_tokens": len(op.packed_token_ids) // 4,
            "kvserve.num_committed_tokens": res.num_committed_tokens}


def _free_attrs(op, res) -> dict:
    return {}


def _release_attrs(op, res) -> dict:
    return {"kvserve.num_page_indices": len(op.page_indices), "kvserve.num_released": res.num_released}


# (span kind, the field of the request's ops, which is also the field of their results in StepResults)
KINDS = (("allocate", "allocations", _allocate_attrs), ("extend", "extensions", _extend_attrs),
         ("commit", "commits", _commit_attrs), ("free", "frees", _free_attrs),
         ("release", "releases", _release_attrs))


def record_op_spans(tracer, request, results: StepResults, start_ns: int, end_ns: int, num_evicted: int) -> None:
    """``request``: the StepOps proto; spans only for ops that carry a traceparent. ``num_evicted``:
    blocks the call evicted, as an event on the spans of the ops that took pages (allocate, extend)."""
    for kind, field, attrs in KINDS:
        for op, res in zip(getattr(request, field), getattr(results, field), strict=True):
            if not op.traceparent:
                continue
            attributes = {"kvserve.req_id": op.req_id, "kvserve.status": res.status.value,
                          "kvserve.step_id": request.step_id, **attrs(op, res)}
            span = tracer.start_span(f"kvmanager.{kind}", context=context_of(op.traceparent), start_time=start_ns,
                                     attributes=attributes)
            if num_evicted and kind in ("allocate", "extend"):
                span.add_event("evicted", {"kvserve.evicted_blocks_in_step": num_evicted}, timestamp=start_ns)
            span.end(end_time=end_ns)
