"""A request handle as an HTTP response, streamed (Server-Sent Events in OpenAI's chunk format, ending with
``data: [DONE]``) or whole (one JSON body once the request ends).

Both watch the connection while they wait for deltas: a client that disconnects cancels its request at once, so
its pages are freed by the engine's next step, also while the request is still queued or prefilling and no
delta would have revealed the broken connection.
"""

from __future__ import annotations

import json

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvserve.services.gateway.handle import RequestHandle
from kvserve.services.gateway.http.errors import CancelledByServer, error_body, headers_of, status_of
from kvserve.services.gateway.http.render import Rendering
from kvserve.services.gateway.request import FinishReason

CANCELLED = "the gateway ended the request before it finished (shutting down); retry it"


def failure_of(delta) -> Exception | None:
    """Why a request's last delta ended it without its output (its error, or the gateway's cancel); None when
    it finished."""
    if delta.finish_reason is FinishReason.ERROR:
        return delta.error
    if delta.finish_reason is FinishReason.CANCELLED:
        return CancelledByServer(CANCELLED)
    return None


def dumps(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def _event(obj) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def _headers(content_type: str, req_id: str, extra: dict[str, str] | None = None) -> list[tuple[bytes, bytes]]:
    headers = {"content-type": content_type, "x-request-id": req_id, **(extra or {})}
    return [(k.encode(), v.encode()) for k, v in headers.items()]


class _HandleResponse(Response):
    """Runs ``_respond`` while a second task waits for the client's disconnect, which cancels the request."""

    def __init__(self, handle: RequestHandle, rendering: Rendering, with_logprobs: bool):
        self.handle, self.rendering, self.with_logprobs = handle, rendering, with_logprobs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tasks:
            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                tasks.cancel_scope.cancel()

            tasks.start_soon(watch)
            try:
                await self._respond(send)
            finally:  # done, disconnected, or the send failed: a request still running is cancelled
                self.handle.cancel()
                tasks.cancel_scope.cancel()

    async def _respond(self, send: Send) -> None:
        raise NotImplementedError


class StreamResponse(_HandleResponse):
    """``stream: true``: one chunk per delta; the error object as an event if the request fails midway."""

    def __init__(self, handle: RequestHandle, rendering: Rendering, with_logprobs: bool, include_usage: bool):
        super().__init__(handle, rendering, with_logprobs)
        self.include_usage = include_usage

    async def _respond(self, send: Send) -> None:
        async def body(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        await send({"type": "http.response.start", "status": 200, "headers": _headers(
            "text/event-stream; charset=utf-8", self.handle.req.req_id, {"cache-control": "no-cache"})})
        r = self.rendering
        if r.chat:
            await body(_event(r.role_chunk(self.include_usage)))
        async for delta in self.handle:
            error = failure_of(delta)
            if error is not None:
                await body(_event(error_body(error)))
            else:
                await body(_event(r.chunk(delta, self.with_logprobs, self.include_usage)))
                if delta.finish_reason is not None and self.include_usage:
                    await body(_event(r.usage_chunk(delta.usage)))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


class WholeResponse(_HandleResponse):
    """``stream: false``: the completion in one body, or the request's error with its status."""

    async def _respond(self, send: Send) -> None:
        texts, sampled = [], []
        async for delta in self.handle:
            texts.append(delta.text)
            sampled.extend(delta.logprobs)
            last = delta
        error = failure_of(last)
        if error is not None:
            status, payload, extra = status_of(error)[0], error_body(error), headers_of(error)
        else:
            status, extra = 200, {}
            payload = self.rendering.response("".join(texts), sampled if self.with_logprobs else None,
                                              last.finish_reason, last.usage)
        data = dumps(payload)
        await send({"type": "http.response.start", "status": status, "headers": _headers(
            "application/json", self.handle.req.req_id, {"content-length": str(len(data)), **extra})})
        await send({"type": "http.response.body", "body": data, "more_body": False})
