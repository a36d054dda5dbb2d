"""The worker's gRPC servicer: protobuf <-> dataclasses around the runner and its page transfers; typed errors
become statuses by the one table of kvserve/common/grpc_server.py."""

from __future__ import annotations

import dataclasses
import time

from kvserve.common.convert.transfer import pull_order_from_proto, pull_result_to_proto, read_order_from_proto
from kvserve.common.convert.worker import batch_from_proto, info_to_proto, output_to_proto
from kvserve.common.errors import DomainError
from kvserve.common.grpc_server import abort
from kvserve.common.metrics import WorkerMetrics
from kvserve.common.telemetry import context_from_metadata, traceparent_of, tracer
from kvserve.v1 import worker_pb2, worker_pb2_grpc
from kvserve.worker.runner import ModelRunner
from kvserve.worker.spans import end_pull_span, record_read_span, record_step_spans, record_tier_spans, start_pull_span
from kvserve.worker.transfer import PeerTransfers


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """Thin: convert, call the runner (or its transfers), convert back, map errors. ``transfers``: the worker's
    page transfers (default: over the runner's pool, with no link to pull over: pulls fail, reads are served)."""

    def __init__(self, runner: ModelRunner, metrics: WorkerMetrics | None = None,
                 transfers: PeerTransfers | None = None):
        self.runner = runner
        self.metrics = metrics
        self.transfers = transfers or PeerTransfers(runner.kv_cache, runner.kv_scales, lambda: runner.epoch,
                                                    unavailable=runner.transfers_off)
        self.tracer = tracer("kvserve.worker")

    def Step(self, request, context):
        start_ns = time.time_ns()
        try:
            output = self.runner.step(batch_from_proto(request))
        except DomainError as e:
            abort(context, e)
        end_ns = time.time_ns()
        record_step_spans(self.tracer, request.items, start_ns, end_ns)
        seen = self.runner.take_tier_step()
        if seen is not None:
            record_tier_spans(self.tracer, request, output.unloaded, seen)
        if self.metrics is not None and request.items:  # a writes-only step computes nothing
            self.metrics.step.observe(output.compute_ms / 1000)
            self.metrics.batch_size.observe(len(request.items))
            self.metrics.batch_tokens.observe(output.num_tokens)
        return output_to_proto(output)

    def Info(self, request, context):
        return info_to_proto(self.runner.info)

    def PullPages(self, request, context):
        order = pull_order_from_proto(request)
        span = start_pull_span(self.tracer, order)
        if span is not None:  # the source's read becomes a child of this pull
            order = dataclasses.replace(order, traceparent=traceparent_of(span) or order.traceparent)
        try:
            result = self.transfers.pull(order, context.is_active)
        except DomainError as e:
            end_pull_span(span, error=str(e))
            abort(context, e)
        end_pull_span(span, result)
        if self.metrics is not None:
            self.metrics.pulls.labels("ok" if result.ok else "failed").inc()
            self.metrics.pulled_bytes.inc(result.num_bytes)
            self.metrics.pull_seconds.observe(result.seconds)
        return pull_result_to_proto(result)

    def ReadPages(self, request, context):
        start_ns, parent = time.time_ns(), context_from_metadata(context.invocation_metadata())
        num_pages = num_bytes = 0
        error = ""
        try:
            for frame in self.transfers.read(read_order_from_proto(request)):
                yield worker_pb2.PageFrame(values=frame)
                num_pages, num_bytes = num_pages + len(frame), num_bytes + sum(map(len, frame))
        except DomainError as e:
            error = str(e)
            abort(context, e)
        finally:  # also when the receiver went away mid-stream
            record_read_span(self.tracer, parent, start_ns, len(request.pages), num_pages, num_bytes, error)
            if self.metrics is not None:
                self.metrics.served_bytes.inc(num_bytes)
