"""The worker's gRPC servicer: protobuf <-> dataclasses around the runner; typed errors become statuses by the one
table of common/grpc_server.py."""

from __future__ import annotations

import time

from kvserve.common.convert.worker import batch_from_proto, info_to_proto, output_to_proto
from kvserve.common.errors import DomainError
from kvserve.common.grpc_server import abort
from kvserve.common.metrics import WorkerMetrics
from kvserve.common.telemetry import tracer
from kvserve.v1 import worker_pb2_grpc
from kvserve.worker.runner import ModelRunner
from kvserve.worker.spans import record_step_spans, record_tier_spans


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """Thin: convert, call the runner, convert back, map errors."""

    def __init__(self, runner: ModelRunner, metrics: WorkerMetrics | None = None):
        self.runner = runner
        self.metrics = metrics
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
