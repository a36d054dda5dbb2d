"""A request handle as an Anthropic Messages API response: whole (one ``message`` body) or streamed (Server-Sent
Events, each named: message_start, content_block_start, ping, content_block_delta with text_delta,
content_block_stop, message_delta with stop_reason and usage, message_stop; ``error`` if the request fails
midway). Errors, from the same typed errors as the OpenAI API's, in Anthropic's shape
``{"type": "error", "error": {"type", "message"}}``.

Usage, as Anthropic counts the prompt: three disjoint parts that add up to the prompt's tokens.

    prompt:  |<- cache_read_input_tokens ->|<- cache_creation_input_tokens ->|<- input_tokens ->|
             |  served from the prefix     |  newly pinned by this request's  |  the rest        |
             |  cache (num_cached_tokens)  |  cache_control breakpoints       |                  |
                                           num_cached_tokens          num_pinned_tokens
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from starlette.responses import JSONResponse
from starlette.types import Send

from kvserve.common.errors import DomainError
from kvserve.common.wire.pages import PinPoint
from kvserve.services.gateway.errors import GatewayBusy
from kvserve.services.gateway.handle import RequestHandle, Usage
from kvserve.services.gateway.http.errors import RETRY_AFTER_S, status_of
from kvserve.services.gateway.http.responses import _HandleResponse, _headers, dumps, failure_of
from kvserve.services.gateway.request import FinishReason

log = logging.getLogger("kvserve.gateway.http")

STOP_REASON = {FinishReason.EOS: "end_turn", FinishReason.LENGTH: "max_tokens", FinishReason.STOP: "stop_sequence"}

# status -> Anthropic's error type. The status is errors.py's (one table for both APIs), but for a full gateway
# queue (GatewayBusy): 529, Anthropic's "overloaded" (its 429 means the caller's own rate limit).
OVERLOADED_STATUS = 529
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
              404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
              503: "overloaded_error", OVERLOADED_STATUS: "overloaded_error"}


def error_status(error: Exception) -> int:
    return OVERLOADED_STATUS if isinstance(error, GatewayBusy) else status_of(error)[0]


def error_body(error: Exception) -> dict:
    """Anthropic's error object for ``error``; its message is the typed error's own."""
    message = str(error) if isinstance(error, DomainError) else "internal error (a bug): see the gateway's log"
    return {"type": "error", "error": {"type": ERROR_TYPE.get(error_status(error), "api_error"), "message": message}}


def error_headers(error: Exception) -> dict[str, str]:
    return {"retry-after": str(RETRY_AFTER_S)} if error_status(error) in (429, 503, OVERLOADED_STATUS) else {}


def usage_body(usage: Usage, pins: tuple[PinPoint, ...]) -> dict:
    """Anthropic's usage (the diagram above). Tokens count as created only when the request asked for pins: a
    hit on another request's pin is a read, and a prefix pinned before this request is not created again."""
    read = usage.num_cached_tokens
    created = max(0, usage.num_pinned_tokens - read) if pins else 0
    # Of the created tokens, those under a 1h pin (Anthropic puts longer TTLs first); the rest are 5m's.
    hour_end = max((p.num_tokens for p in pins if p.ttl_s >= 3600), default=0)
    created_1h = max(0, min(usage.num_pinned_tokens, hour_end) - read) if created else 0
    return {"input_tokens": usage.prompt_tokens - read - created, "cache_creation_input_tokens": created,
            "cache_read_input_tokens": read, "output_tokens": usage.completion_tokens,
            "cache_creation": {"ephemeral_5m_input_tokens": created - created_1h,
                               "ephemeral_1h_input_tokens": created_1h}}


@dataclass(slots=True)
class MessageRendering:
    """The Anthropic shapes of one request."""

    req_id: str
    model: str
    pins: tuple[PinPoint, ...]  # the request's, as validated
    stops: tuple[str, ...]  # its stop_sequences
    decode: Callable[[list[int]], str]  # token ids -> text, as the engine's text stream decodes them

    @property
    def id(self) -> str:
        return f"msg_{self.req_id.removeprefix('req-')}"

    def stop_sequence(self, finish: FinishReason | None, text: str, token_ids: list[int]) -> str | None:
        """The stop sequence that ended the text: the one the decoded output has where the text was cut."""
        if finish is not FinishReason.STOP:
            return None
        generated = self.decode(token_ids)
        return next((s for s in self.stops if generated.startswith(s, len(text))), None)

    def message(self, text: str, finish: FinishReason | None, stop_sequence: str | None, usage: dict) -> dict:
        content = [{"type": "text", "text": text}] if text or finish is not None else []
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": STOP_REASON.get(finish), "stop_sequence": stop_sequence, "usage": usage}

    def start_usage(self, prompt_tokens: int) -> dict:
        """message_start's usage: the prompt as submitted (what the cache served is known once it ends:
        message_delta's usage, cumulative, replaces it)."""
        return usage_body(Usage(prompt_tokens, 0, 0), ())


def event(name: str, obj: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + dumps(obj) + b"\n\n"


class MessageStream(_HandleResponse):
    """``stream: true``: message_start and the text block's start at once, a text_delta per delta with text,
    then the block's stop, message_delta (stop_reason, usage) and message_stop; an ``error`` event instead
    if the request fails."""

    def __init__(self, handle: RequestHandle, rendering: MessageRendering):
        super().__init__(handle, None, with_logprobs=False)
        self.message = rendering

    async def _respond(self, send: Send) -> None:
        async def body(data: bytes, more: bool = True) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": more})

        r = self.message
        await send({"type": "http.response.start", "status": 200, "headers": _headers(
            "text/event-stream; charset=utf-8", self.handle.req.req_id, {"cache-control": "no-cache"})})
        start = r.message("", None, None, r.start_usage(len(self.handle.req.prompt_token_ids)))
        await body(event("message_start", {"type": "message_start", "message": start}))
        await body(event("content_block_start", {"type": "content_block_start", "index": 0,
                                                 "content_block": {"type": "text", "text": ""}}))
        await body(event("ping", {"type": "ping"}))
        texts, token_ids = [], []
        async for delta in self.handle:
            error = failure_of(delta)
            if error is not None:
                await body(event("error", error_body(error)), more=False)
                return
            texts.append(delta.text)
            token_ids.extend(delta.token_ids)
            if delta.text:
                await body(event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                         "delta": {"type": "text_delta", "text": delta.text}}))
            last = delta
        stop_sequence = r.stop_sequence(last.finish_reason, "".join(texts), token_ids)
        await body(event("content_block_stop", {"type": "content_block_stop", "index": 0}))
        await body(event("message_delta", {"type": "message_delta", "delta": {
            "stop_reason": STOP_REASON.get(last.finish_reason), "stop_sequence": stop_sequence},
            "usage": usage_body(last.usage, r.pins)}))
        await body(event("message_stop", {"type": "message_stop"}), more=False)


class WholeMessage(_HandleResponse):
    """``stream: false``: the message in one body, or the request's error with its status."""

    def __init__(self, handle: RequestHandle, rendering: MessageRendering):
        super().__init__(handle, None, with_logprobs=False)
        self.message = rendering

    async def _respond(self, send: Send) -> None:
        texts, token_ids = [], []
        async for delta in self.handle:
            texts.append(delta.text)
            token_ids.extend(delta.token_ids)
            last = delta
        error = failure_of(last)
        if error is not None:
            status, payload, extra = error_status(error), error_body(error), error_headers(error)
        else:
            r, text = self.message, "".join(texts)
            status, extra = 200, {}
            payload = r.message(text, last.finish_reason, r.stop_sequence(last.finish_reason, text, token_ids),
                                usage_body(last.usage, r.pins))
        data = dumps(payload)
        await send({"type": "http.response.start", "status": status, "headers": _headers(
            "application/json", self.handle.req.req_id, {"content-length": str(len(data)), **extra})})
        await send({"type": "http.response.body", "body": data, "more_body": False})


def error_response(error: Exception) -> JSONResponse:
    """A typed error (or a bug: logged) as Anthropic's error body with its status."""
    status = error_status(error)
    if status == 500:
        log.error("HTTP request failed on a bug", exc_info=error)
    return JSONResponse(error_body(error), status, headers=error_headers(error))
