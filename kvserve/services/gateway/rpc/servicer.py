"""The gateway's gRPC front-end: thin. Protobuf -> GenerateInput, the tenant from the API key, Gateway.submit,
deltas -> protobuf; typed errors become statuses by the one table of kvserve/common/grpc_server.py."""

from __future__ import annotations

import grpc
from google.protobuf import json_format

from kvserve.common.convert.sampling import sampling_from_proto
from kvserve.common.errors import DomainError
from kvserve.common.grpc_server import abort
from kvserve.common.telemetry import context_from_metadata
from kvserve.common.wire.pages import PinPoint
from kvserve.services.gateway.app import Gateway
from kvserve.services.gateway.handle import OutputDelta, RequestHandle, Usage
from kvserve.services.gateway.request import FinishReason
from kvserve.services.gateway.validate import GenerateInput
from kvserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

FINISH = {FinishReason.EOS: gateway_pb2.FINISH_REASON_EOS, FinishReason.STOP: gateway_pb2.FINISH_REASON_STOP,
          FinishReason.LENGTH: gateway_pb2.FINISH_REASON_LENGTH}


def input_from_proto(r: gateway_pb2.GenerateRequest) -> GenerateInput:
    """The request's oneof input becomes the one matching GenerateInput field; none set leaves all three None
    (validation says so). Cache pins and the cache key are taken as sent (validation bounds them)."""
    which = r.WhichOneof("input")
    messages = tuple((m.role, m.content) for m in r.messages.messages) if which == "messages" else None
    token_ids = tuple(r.prompt_token_ids.token_ids) if which == "prompt_token_ids" else None
    kwargs = template_kwargs(r.messages.chat_template_kwargs) if which == "messages" else ()
    return GenerateInput(prompt=r.prompt if which == "prompt" else None, messages=messages,
                         prompt_token_ids=token_ids, sampling=sampling_from_proto(r.sampling),
                         max_tokens=r.max_tokens, stop=tuple(r.stop), logprobs=r.logprobs, ignore_eos=r.ignore_eos,
                         pins=tuple(PinPoint(p.num_tokens, p.ttl_s) for p in r.cache_pins), cache_key=r.cache_key,
                         template_kwargs=kwargs)


def template_kwargs(struct) -> tuple[tuple[str, object], ...]:
    """A Struct's fields as GenerateInput's (name, value) pairs, sorted; a Struct's numbers are doubles, so an
    integral one becomes an int (JSON's 1 is 1.0). Lists and objects pass through for validation to refuse."""
    def plain(value):
        return int(value) if isinstance(value, float) and value.is_integer() else value

    return tuple(sorted((name, plain(value)) for name, value in json_format.MessageToDict(struct).items()))


def _logprobs(delta: OutputDelta) -> list[gateway_pb2.GeneratedLogprob]:
    return [gateway_pb2.GeneratedLogprob(
        token_id=s.token_id, logprob=s.logprob,
        top_logprobs=[common_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in s.top_logprobs])
        for s in delta.logprobs]


def usage_to_proto(usage: Usage | None) -> gateway_pb2.Usage | None:
    """The public Usage keeps OpenAI's name for the prompt tokens served from the cache (cached_tokens), and
    names the pinned ones alike (pinned_tokens)."""
    if usage is None:
        return None
    return gateway_pb2.Usage(prompt_tokens=usage.prompt_tokens, cached_tokens=usage.num_cached_tokens,
                             completion_tokens=usage.completion_tokens, pinned_tokens=usage.num_pinned_tokens)


def delta_to_proto(req_id: str, delta: OutputDelta) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(req_id=req_id, text=delta.text, token_ids=delta.token_ids,
                                        logprobs=_logprobs(delta), finish_reason=FINISH.get(delta.finish_reason, 0),
                                        usage=usage_to_proto(delta.usage))


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    def _submit(self, request, context) -> RequestHandle:
        """The handle of an admitted request; aborts the call on bad input, auth or shutdown."""
        try:
            metadata = context.invocation_metadata()
            tenant = self.gateway.keys.tenant_for(dict(metadata))
            handle = self.gateway.submit(input_from_proto(request), tenant, context_from_metadata(metadata))
        except DomainError as e:
            abort(context, e)
        context.add_callback(handle.cancel)  # cancel, deadline, disconnect: free its pages
        return handle

    def _deltas(self, handle: RequestHandle, context):
        for delta in handle:
            if delta.finish_reason is FinishReason.ERROR:
                abort(context, delta.error)
            if delta.finish_reason is FinishReason.CANCELLED:
                context.abort(grpc.StatusCode.UNAVAILABLE if context.is_active() else grpc.StatusCode.CANCELLED,
                              "the request was cancelled (client cancel, deadline or gateway shutdown)")
            yield delta

    def Generate(self, request, context):
        handle = self._submit(request, context)
        for delta in self._deltas(handle, context):
            yield delta_to_proto(handle.req.req_id, delta)

    def Complete(self, request, context):
        handle = self._submit(request, context)
        reply = gateway_pb2.GenerateResponse(req_id=handle.req.req_id)
        text = []
        for delta in self._deltas(handle, context):
            text.append(delta.text)
            reply.token_ids.extend(delta.token_ids)
            reply.logprobs.extend(_logprobs(delta))
            if delta.finish_reason is not None:
                reply.finish_reason = FINISH[delta.finish_reason]
                reply.usage.CopyFrom(usage_to_proto(delta.usage))
        reply.text = "".join(text)
        return reply
