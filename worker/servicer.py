"""The worker's gRPC servicer: protobuf <-> dataclasses, and the one table of domain errors to status codes."""

from __future__ import annotations

import time

import grpc

from kvserve.services.metrics import WorkerMetrics
from kvserve.services.telemetry import tracer
from kvserve.v1 import worker_pb2_grpc
from kvserve.worker.batch import InvalidRequest, StaleEpoch
from kvserve.worker.convert import batch_from_proto, info_to_proto, output_to_proto
from kvserve.worker.runner import ModelRunner
from kvserve.worker.spans import record_step_spans

ERROR_STATUS: dict[type[Exception], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    StaleEpoch: grpc.StatusCode.FAILED_PRECONDITION,
}


def status_for(error: Exception) -> grpc.StatusCode:
    return next(code for kind, code in ERROR_STATUS.items() if isinstance(error, kind))


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
        except tuple(ERROR_STATUS) as e:
            context.abort(status_for(e), str(e))
        end_ns = time.time_ns()
        record_step_spans(self.tracer, request.items, start_ns, end_ns)
        if self.metrics is not None:
            self.metrics.step.observe(output.compute_ms / 1000)
            self.metrics.batch_size.observe(len(request.items))
            self.metrics.batch_tokens.observe(output.num_tokens)
        return output_to_proto(output)

    def Info(self, request, context):
        return info_to_proto(self.runner.info)
