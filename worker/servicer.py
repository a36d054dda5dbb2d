"""The worker's gRPC servicer: protobuf <-> dataclasses, and the one table of domain errors to status codes."""

from __future__ import annotations

import grpc

from kvserve.v1 import worker_pb2_grpc
from kvserve.worker.batch import InvalidRequest, StaleEpoch
from kvserve.worker.convert import batch_from_proto, info_to_proto, output_to_proto
from kvserve.worker.runner import ModelRunner

ERROR_STATUS: dict[type[Exception], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    StaleEpoch: grpc.StatusCode.FAILED_PRECONDITION,
}


def status_for(error: Exception) -> grpc.StatusCode:
    return next(code for kind, code in ERROR_STATUS.items() if isinstance(error, kind))


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """Thin: convert, call the runner, convert back, map errors."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def Step(self, request, context):
        try:
            return output_to_proto(self.runner.step(batch_from_proto(request)))
        except tuple(ERROR_STATUS) as e:
            context.abort(status_for(e), str(e))

    def Info(self, request, context):
        return info_to_proto(self.runner.info)
