"""The worker's gRPC servicer: protobuf <-> dataclasses, and the one table of domain errors to status codes."""

from __future__ import annotations

import grpc

from kvserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from kvserve.worker.batch import InvalidRequest, SamplingParams, StaleEpoch, StepBatch, StepItem, StepOutput
from kvserve.worker.runner import ModelRunner, WorkerInfo

ERROR_STATUS: dict[type[Exception], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    StaleEpoch: grpc.StatusCode.FAILED_PRECONDITION,
}


def status_for(error: Exception) -> grpc.StatusCode:
    return next(code for kind, code in ERROR_STATUS.items() if isinstance(error, kind))


def sampling_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        seed=p.seed if p.HasField("seed") else None,
        top_logprobs=p.top_logprobs,
    )


def batch_from_proto(req: worker_pb2.StepRequest) -> StepBatch:
    items = tuple(
        StepItem(
            req_id=i.req_id,
            token_ids=tuple(i.token_ids),
            start_pos=i.start_pos,
            page_table=tuple(i.page_table),
            sample=i.sample,
            sampling=sampling_from_proto(i.sampling),
        )
        for i in req.items
    )
    return StepBatch(items=items, epoch=req.epoch)


def output_to_proto(out: StepOutput) -> worker_pb2.StepResponse:
    results = [
        worker_pb2.StepResult(
            req_id=s.req_id,
            token_id=s.token_id,
            logprob=s.logprob,
            top_logprobs=[common_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in s.top_logprobs],
        )
        for s in out.sampled
    ]
    return worker_pb2.StepResponse(results=results, num_tokens=out.num_tokens, compute_ms=out.compute_ms)


def info_to_proto(info: WorkerInfo) -> worker_pb2.InfoResponse:
    fields = {k: getattr(info, k) for k in info.__slots__}
    fields["eos_token_ids"] = list(info.eos_token_ids)
    return worker_pb2.InfoResponse(**fields)


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
