"""What the gateway tells operators about each request and step: the request's span (one per request, the
root of its trace unless the client sent a traceparent) and the Prometheus metrics. The engine calls these
hooks at the moments they name; with tracing off and no metrics they do nothing."""

from __future__ import annotations

import time

from opentelemetry.trace import SpanKind, Status, StatusCode

from kvserve.common.metrics import GatewayMetrics
from kvserve.common.telemetry import traceparent_of, tracer
from kvserve.services.gateway.request import FinishReason, Request


class Observer:
    def __init__(self, metrics: GatewayMetrics | None = None):
        self.metrics = metrics
        self.tracer = tracer("kvserve.gateway")

    def started(self, req: Request, parent) -> None:
        """A validated request: opens its span (child of the client's context when it sent one)."""
        span = self.tracer.start_span("gateway.request", context=parent, kind=SpanKind.SERVER, attributes={
            "kvserve.req_id": req.req_id, "kvserve.tenant": req.tenant,
            "kvserve.prompt_tokens": len(req.prompt_token_ids), "kvserve.max_tokens": req.params.max_tokens})
        if span.is_recording():
            req.span, req.traceparent = span, traceparent_of(span)

    def admitted(self, req: Request, worker_id: str) -> None:
        """Just allocated: its computed tokens are the prefix cache's hit."""
        if req.span is not None:
            req.span.add_event("admitted", {"kvserve.worker_id": worker_id,
                                            "kvserve.num_cached_tokens": req.num_computed_tokens,
                                            "kvserve.queue_wait_s": time.monotonic() - req.arrival_s,
                                            "kvserve.num_preemptions": req.num_preemptions})

    def preempted(self, req: Request) -> None:
        if req.span is not None:
            req.span.add_event("preempted", {"kvserve.num_computed_tokens": req.num_tokens})
        if self.metrics:
            self.metrics.preemptions.inc()

    def first_token(self, req: Request) -> None:
        ttft_s = req.first_token_s - req.arrival_s
        if req.span is not None:
            req.span.set_attribute("kvserve.time_to_first_token_s", ttft_s)
        if self.metrics:
            self.metrics.ttft.observe(ttft_s)

    def finished(self, req: Request) -> None:
        """The last delta is out (after the pages were freed): closes the span, counts the request."""
        now = time.monotonic()
        reason = req.finish_reason.value if req.finish_reason else "unknown"
        num_out = len(req.output_token_ids)
        if self.metrics:
            m = self.metrics
            m.e2e.observe(now - req.arrival_s)
            if num_out > 1 and req.first_token_s is not None:
                m.tpot.observe((req.last_token_s - req.first_token_s) / (num_out - 1))
            m.prompt_tokens.labels(req.tenant).inc(len(req.prompt_token_ids))
            m.generation_tokens.labels(req.tenant).inc(num_out)
            m.finished.labels(reason).inc()
        if req.span is not None:
            span = req.span
            span.set_attributes({"kvserve.finish_reason": reason, "kvserve.completion_tokens": num_out,
                                 "kvserve.num_cached_tokens": req.num_cached_tokens or 0,
                                 "kvserve.num_preemptions": req.num_preemptions})
            if req.finish_reason is FinishReason.ERROR:
                span.set_status(Status(StatusCode.ERROR, str(req.error)))
            span.end()
            req.span = None

    def pulled(self, req: Request, worker_id: str, result) -> None:
        """A pull of its pages ended (a PullResult): an event on its span, and the transfer metrics."""
        if req.span is not None:
            req.span.add_event("pulled", {"kvserve.worker_id": worker_id, "kvserve.num_pages": result.num_pages,
                                          "kvserve.num_bytes": result.num_bytes, "kvserve.pull_s": result.seconds,
                                          "kvserve.error": result.error})
        if self.metrics:
            m = self.metrics
            m.pulls.labels("ok" if result.ok else "failed").inc()
            m.pull_bytes.inc(result.num_bytes)
            m.pull_seconds.observe(result.seconds)

    def handed_off(self, req: Request, prefill_worker_id: str) -> None:
        """Its prefill is done on a prefill worker: it goes to a decode worker."""
        if req.span is not None:
            req.span.add_event("prefilled", {"kvserve.worker_id": prefill_worker_id})
        if self.metrics:
            self.metrics.handoffs.inc()

    def step(self, worker_id: str, step_s: float, kv_wait_share: float, num_running: int,
             num_waiting: int) -> None:
        if self.metrics:
            m = self.metrics
            m.step.labels(worker_id).observe(step_s)
            m.kv_wait_fraction.labels(worker_id).set(kv_wait_share)
            m.running.labels(worker_id).set(num_running)
            m.waiting.labels(worker_id).set(num_waiting)
