"""The gateway's gRPC servicer: thin. Protobuf -> GenerateInput, the tenant from the API key, Gateway.submit,
deltas -> protobuf, and the one table of errors to status codes."""

from __future__ import annotations

import grpc

from kvserve.common.convert.worker import sampling_from_proto
from kvserve.common.telemetry import context_from_metadata
from kvserve.services.gateway.app import Gateway
from kvserve.services.gateway.engine import Delta
from kvserve.services.gateway.errors import (
    BackendFailure,
    InvalidRequest,
    OutOfCapacity,
    ShuttingDown,
    Unauthenticated,
)
from kvserve.services.gateway.request import FinishReason
from kvserve.services.gateway.validate import GenerateInput
from kvserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

ERROR_STATUS: dict[type[Exception], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    ShuttingDown: grpc.StatusCode.UNAVAILABLE,
    OutOfCapacity: grpc.StatusCode.RESOURCE_EXHAUSTED,
    BackendFailure: grpc.StatusCode.UNAVAILABLE,
}
FINISH = {FinishReason.EOS: gateway_pb2.FINISH_REASON_EOS, FinishReason.STOP: gateway_pb2.FINISH_REASON_STOP,
          FinishReason.LENGTH: gateway_pb2.FINISH_REASON_LENGTH}


def input_from_proto(r: gateway_pb2.GenerateRequest) -> GenerateInput:
    which = r.WhichOneof("input")
    messages = tuple((m.role, m.content) for m in r.messages.messages) if which == "messages" else None
    return GenerateInput(prompt=r.prompt if which == "prompt" else None, messages=messages,
                         sampling=sampling_from_proto(r.sampling), max_tokens=r.max_tokens, stop=tuple(r.stop),
                         logprobs=r.logprobs, ignore_eos=r.ignore_eos)


def _logprobs(delta: Delta) -> list[gateway_pb2.GeneratedLogprob]:
    return [gateway_pb2.GeneratedLogprob(
        token_id=s.token_id, logprob=s.logprob,
        top_logprobs=[common_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in s.top_logprobs])
        for s in delta.logprobs]


def _usage(delta: Delta) -> gateway_pb2.Usage | None:
    if delta.usage is None:
        return None
    prompt, cached, completion = delta.usage
    return gateway_pb2.Usage(prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion)


def delta_to_proto(req_id: str, delta: Delta) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(req_id=req_id, text=delta.text, token_ids=delta.token_ids,
                                        logprobs=_logprobs(delta), finish_reason=FINISH.get(delta.finish_reason, 0),
                                        usage=_usage(delta))


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    def _deltas(self, request, context):
        """(req_id, deltas) of an admitted request; aborts the call on bad input, auth or shutdown."""
        try:
            metadata = context.invocation_metadata()
            tenant = self.gateway.keys.tenant_for(dict(metadata))
            handle, engine = self.gateway.submit(input_from_proto(request), tenant, context_from_metadata(metadata))
        except tuple(ERROR_STATUS) as e:
            context.abort(_status(e), str(e))
        req_id = handle.req.req_id
        context.add_callback(lambda: engine.abort(req_id))  # cancel, deadline, disconnect: free its pages
        return req_id, self._checked(handle, context)

    def _checked(self, handle, context):
        for delta in handle:
            if delta.finish_reason is FinishReason.ERROR:
                context.abort(_status(delta.error), str(delta.error))
            if delta.finish_reason is FinishReason.CANCELLED:
                context.abort(grpc.StatusCode.UNAVAILABLE if context.is_active() else grpc.StatusCode.CANCELLED,
                              "the request was cancelled (client cancel, deadline or gateway shutdown)")
            yield delta

    def Generate(self, request, context):
        req_id, deltas = self._deltas(request, context)
        for delta in deltas:
            yield delta_to_proto(req_id, delta)

    def Complete(self, request, context):
        req_id, deltas = self._deltas(request, context)
        reply = gateway_pb2.CompleteResponse(req_id=req_id)
        text = []
        for delta in deltas:
            text.append(delta.text)
            reply.token_ids.extend(delta.token_ids)
            reply.logprobs.extend(_logprobs(delta))
            if delta.finish_reason is not None:
                reply.finish_reason = FINISH[delta.finish_reason]
                reply.usage.CopyFrom(_usage(delta))
        reply.text = "".join(text)
        return reply


def _status(error: Exception) -> grpc.StatusCode:
    return next(code for kind, code in ERROR_STATUS.items() if isinstance(error, kind))
