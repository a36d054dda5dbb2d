"""The worker's part of each request's trace. A prefill chunk is a child span of its request's span; a batched
decode step is one span linked to every request it served (a span per token would be too many). Glue: the
runner never sees a span."""

from __future__ import annotations

from kvserve.common.telemetry import context_of, link_of


def record_step_spans(tracer, items, start_ns: int, end_ns: int) -> None:
    """``items``: the StepBatch's StepItems; only those with a traceparent are recorded."""
    links = []
    for item in items:
        if not item.traceparent:
            continue
        if len(item.token_ids) == 1 and item.sample:  # one token fed, one sampled: a decode
            link = link_of(item.traceparent)
            if link is not None:
                links.append(link)
            continue
        span = tracer.start_span("worker.prefill_chunk", context=context_of(item.traceparent), start_time=start_ns,
                                 attributes={"kvserve.req_id": item.req_id, "kvserve.start_pos": item.start_pos,
                                             "kvserve.num_tokens": len(item.token_ids),
                                             "kvserve.batch_size": len(items)})
        span.end(end_time=end_ns)
    if links:
        span = tracer.start_span("worker.decode_step", links=links, start_time=start_ns,
                                 attributes={"kvserve.num_decodes": len(links), "kvserve.batch_size": len(items)})
        span.end(end_time=end_ns)
