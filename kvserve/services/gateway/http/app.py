"""The gateway's HTTP front-end, OpenAI's API and Anthropic's Messages API: thin, as the gRPC servicer. A
request body -> the protocol models -> GenerateInput, the tenant from the API key (``authorization: Bearer`` or
``x-api-key``; the same keys as gRPC), Gateway.submit, deltas -> the API's shapes; typed errors become statuses
by the one table of errors.py.

    GET  /health                 200 while serving, 503 once the gateway drains
    GET  /v1/models[/{model}]    the served model
    POST /v1/completions         prompt: text or token ids
    POST /v1/chat/completions    messages, through the model's chat template
    POST /v1/messages            Anthropic's Messages API: text blocks, cache_control breakpoints as soft pins
"""

from __future__ import annotations

import json
import logging
import time

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvserve.common.errors import DomainError
from kvserve.common.metrics import GatewayMetrics
from kvserve.common.telemetry import context_from_metadata
from kvserve.services.gateway.app import Gateway
from kvserve.services.gateway.http import anthropic_responses as anthropic
from kvserve.services.gateway.http.anthropic_protocol import MessagesRequest
from kvserve.services.gateway.http.errors import BodyTooLarge, ModelNotFound, error_body, headers_of, status_of
from kvserve.services.gateway.http.metrics import HttpMetricsMiddleware
from kvserve.services.gateway.http.protocol import ChatCompletionRequest, CompletionRequest, ParamError, parse
from kvserve.services.gateway.http.render import Rendering
from kvserve.services.gateway.http.responses import StreamResponse, WholeResponse

log = logging.getLogger("kvserve.gateway.http")

MAX_BODY_BYTES = 1 << 20  # as the gRPC front-end's MAX_REQUEST_BYTES: a larger body is 413


def error_response(error: Exception) -> JSONResponse:
    status, _ = status_of(error)
    if status == 500:
        log.error("HTTP request failed on a bug", exc_info=error)
    return JSONResponse(error_body(error), status, headers=headers_of(error))


async def read_json(request: Request, max_bytes: int):
    """The body as JSON. Raises BodyTooLarge past ``max_bytes`` (read no further), ParamError if not JSON."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge(f"the request body has {declared} bytes; at most {max_bytes} are accepted")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge(f"the request body is over {max_bytes} bytes")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except ValueError as e:  # also bytes that are not UTF-8
        raise ParamError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # json's decoder recurses per level: [[[[... a few thousand deep
        raise ParamError("the request body nests arrays or objects too deeply to be a request") from None


class HttpFrontEnd:
    def __init__(self, gateway: Gateway, model_name: str, metrics: GatewayMetrics | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES):
        self.gateway, self.model_name, self.max_body_bytes = gateway, model_name, max_body_bytes
        self.created = int(time.time())
        tokenizer = gateway.tokenizer
        self._token_texts: dict[int, str] = {}
        self._decode = lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)
        routes = [Route("/health", self.health), Route("/v1/models", self.models),
                  Route("/v1/models/{model:path}", self.model),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                  Route("/v1/messages", self.messages, methods=["POST"])]
        app = Starlette(routes=routes, exception_handlers={HTTPException: self.http_error})
        self.app = HttpMetricsMiddleware(app, metrics, [r.path for r in routes]) if metrics else app

    async def http_error(self, request: Request, exc: HTTPException) -> Response:
        """Starlette's own answers (an unknown path, a method a path does not take) in OpenAI's error shape."""
        body = {"error": {"message": f"{request.method} {request.url.path}: {exc.detail}", "type":
                          "invalid_request_error", "param": None, "code": None}}
        return JSONResponse(body, exc.status_code, headers=exc.headers)

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self._decode(token_id)
        return text

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "kvserve",
                "max_model_len": self.gateway.limits.max_model_len}

    async def health(self, request: Request) -> Response:
        if self.gateway.closing:
            return JSONResponse({"status": "draining"}, 503)
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        try:
            self.gateway.keys.tenant_for(request.headers)
        except DomainError as e:
            return error_response(e)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        try:
            self.gateway.keys.tenant_for(request.headers)
            self._check_model(request.path_params["model"])
        except DomainError as e:
            return error_response(e)
        return JSONResponse(self._model_card())

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionRequest, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, ChatCompletionRequest, chat=True)

    async def messages(self, request: Request) -> Response:
        """Anthropic's Messages API over the same core; its errors in Anthropic's shape."""
        try:
            tenant = self.gateway.keys.tenant_for(request.headers)
            params = parse(MessagesRequest, await read_json(request, self.max_body_bytes))
            self._check_model(params.model)
            parent = context_from_metadata(request.headers.items())
            # Tokenising the breakpoints and the prompt, and placing it: on a thread, as _generate's submit.
            handle = await anyio.to_thread.run_sync(
                lambda: self.gateway.submit(params.to_input(self.gateway.tokenizer), tenant, parent))
        except DomainError as e:
            return anthropic.error_response(e)
        req = handle.req
        rendering = anthropic.MessageRendering(req.req_id, self.model_name, req.pins, req.params.stop,
                                               self.gateway.tokenizer.decode)
        return (anthropic.MessageStream if params.stream else anthropic.WholeMessage)(handle, rendering)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelNotFound(f"the model {model!r} does not exist here; this gateway serves {self.model_name!r}")

    async def _generate(self, request: Request, body_model, chat: bool) -> Response:
        try:
            tenant = self.gateway.keys.tenant_for(request.headers)
            params = parse(body_model, await read_json(request, self.max_body_bytes))
            self._check_model(params.model)
            inp = params.to_input()
            parent = context_from_metadata(request.headers.items())
            # Tokenising and placing (a kvmanager call) would stall every stream on this loop: a thread does it.
            handle = await anyio.to_thread.run_sync(self.gateway.submit, inp, tenant, parent)
        except DomainError as e:
            return error_response(e)
        rendering = Rendering(chat=chat, req_id=handle.req.req_id, model=self.model_name, token_text=self.token_text)
        if params.stream:
            return StreamResponse(handle, rendering, inp.logprobs, params.include_usage)
        return WholeResponse(handle, rendering, inp.logprobs)
