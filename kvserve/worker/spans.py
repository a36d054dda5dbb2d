"""The worker's part of each request's trace. A prefill chunk is a child span of its request's span; a batched
decode step is one span linked to every request it served (a span per token would be too many). A request's
loads from the shared KV tier are a child span of it; a step's write snapshot is one span linked to the step's
requests. Glue: the runner never sees a span, it fills a TierStep."""

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


def record_tier_spans(tracer, request, unloaded, seen) -> None:
    """The spans of a step's shared KV tier traffic, from ``seen`` (runner.TierStep), for the traced items of
    ``request`` (the StepBatch as received: items with their traceparents, and store_writes).

    ``worker.store_load``: a child span of each traced request that had store loads, over the step's loads
    (one call for all its items): its own pages and whether they all loaded (``unloaded``: StepOutput.unloaded,
    the req_ids recomputed instead), and the step's pages, bytes, failed requests and verification failures.
    ``worker.store_snapshot``: the step's copy of the pages it writes, linked to every traced request of the
    step (the pages are of earlier requests' commits): pages queued for the writer, pages dropped (a snapshot
    is queued or dropped whole: the queue full, the store down, or no kvmanager)."""
    if seen.load is not None:
        _record_loads(tracer, request.items, set(unloaded), seen.load)
    if seen.snapshot is not None:
        _record_snapshot(tracer, request, seen.snapshot)


def _record_loads(tracer, items, unloaded: set[str], part) -> None:
    b, a = part.before, part.after
    step = {"kvserve.step_num_loaded_pages": a.num_loaded_pages - b.num_loaded_pages,
            "kvserve.step_num_loaded_bytes": a.num_loaded_bytes - b.num_loaded_bytes,
            "kvserve.step_num_failed_requests": a.num_failed_loads - b.num_failed_loads,
            "kvserve.step_num_verify_failures": a.num_verify_failures - b.num_verify_failures}
    for item in items:
        if not item.traceparent or not item.store_loads:
            continue
        span = tracer.start_span("worker.store_load", context=context_of(item.traceparent), start_time=part.start_ns,
                                 attributes={"kvserve.req_id": item.req_id, "kvserve.num_pages": len(item.store_loads),
                                             "kvserve.loaded": item.req_id not in unloaded, **step})
        span.end(end_time=part.end_ns)


def _record_snapshot(tracer, request, part) -> None:
    links = [link for link in (link_of(i.traceparent) for i in request.items if i.traceparent) if link is not None]
    if not links:
        return
    num_pages = len(request.store_writes)
    dropped = num_pages if part.after.num_dropped_writes - part.before.num_dropped_writes >= num_pages else 0
    span = tracer.start_span("worker.store_snapshot", links=links, start_time=part.start_ns,
                             attributes={"kvserve.num_pages": num_pages, "kvserve.num_queued": num_pages - dropped,
                                         "kvserve.num_dropped": dropped, "kvserve.batch_size": len(request.items)})
    span.end(end_time=part.end_ns)


def start_pull_span(tracer, order):
    """``worker.pull``: a child span of the request's (``order.traceparent``), or None when it is not traced."""
    if not order.traceparent:
        return None
    return tracer.start_span("worker.pull", context=context_of(order.traceparent),
                             attributes={"kvserve.req_id": order.req_id,
                                         "kvserve.source_worker_id": order.source_worker_id,
                                         "kvserve.source_address": order.source_address,
                                         "kvserve.num_pages": len(order.loads)})


def end_pull_span(span, result=None, error: str = "") -> None:
    """Ends a pull's span with what it moved (``result``: a PullResult), or the refusal's ``error``."""
    if span is None:
        return
    if result is not None:
        mb_per_s = result.num_bytes / result.seconds / 1e6 if result.seconds > 0 else 0.0
        span.set_attributes({"kvserve.num_filled_pages": result.num_pages, "kvserve.num_bytes": result.num_bytes,
                             "kvserve.mb_per_s": round(mb_per_s, 1), "kvserve.ok": result.ok})
        error = result.error
    if error:
        span.set_attribute("kvserve.error", error)
    span.end()


def record_read_span(tracer, parent, start_ns: int, num_asked: int, num_pages: int, num_bytes: int,
                     error: str) -> None:
    """``worker.read_pages`` on the source: a child of the pulling worker's ``worker.pull`` (``parent``: the
    context its call's metadata carried; nothing is recorded without one)."""
    if parent is None:
        return
    attributes = {"kvserve.num_pages": num_asked, "kvserve.num_sent_pages": num_pages, "kvserve.num_bytes": num_bytes}
    if error:
        attributes["kvserve.error"] = error
    span = tracer.start_span("worker.read_pages", context=parent, start_time=start_ns, attributes=attributes)
    span.end()
