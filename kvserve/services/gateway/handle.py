"""A front-end's side of one request: the deltas the engine loop produces for it, in order, and its cancel.

A front-end iterates a handle until the delta that carries finish_reason, from a thread (the gRPC servicer:
``for``) or from an asyncio loop (the HTTP one: ``async for``, woken by the engine's thread, never blocking the
loop); a request that ends with FinishReason.ERROR carries the error to report.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from kvserve.common.wire.worker import SampledToken
from kvserve.services.gateway.request import FinishReason, Request


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of a finished request."""

    prompt_tokens: int
    num_cached_tokens: int  # of the prompt, served from the prefix cache (a multiple of the page size)
    completion_tokens: int
    num_pinned_tokens: int = 0  # of the prompt, under a soft pin this request took or refreshed


@dataclass(slots=True)
class OutputDelta:
    """What one step produced for one request."""

    text: str = ""  # never half a UTF-8 character; text that may still become a stop string is held back
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampledToken] = field(default_factory=list)  # when the request asked for logprobs
    finish_reason: FinishReason | None = None  # on the last delta only
    usage: Usage | None = None  # on the last delta only
    error: Exception | None = None  # finish_reason ERROR: why


class RequestHandle:
    """Deltas arrive on a queue that the engine loop fills; ``cancel`` asks the loop to end the request (its
    pages are freed within one step, and the last delta then says CANCELLED)."""

    def __init__(self, req: Request, worker_id: str, cancel: Callable[[str], None]):
        self.req, self.worker_id = req, worker_id
        self.deltas: queue.SimpleQueue[OutputDelta] = queue.SimpleQueue()
        self._cancel = cancel
        self.cancelled = False  # the client cancelled: an engine adopting it (handed over) ends it at once
        self._wake: Callable[[], None] | None = None  # set by an asyncio consumer: called after each put

    def __iter__(self) -> Iterator[OutputDelta]:
        while True:
            delta = self.deltas.get()
            yield delta
            if delta.finish_reason is not None:
                return

    async def __aiter__(self) -> AsyncIterator[OutputDelta]:
        loop, ready = asyncio.get_running_loop(), asyncio.Event()

        def wake() -> None:  # on the engine's thread
            try:
                loop.call_soon_threadsafe(ready.set)
            except RuntimeError:  # the loop is closed: no consumer is left to wake
                pass

        self._wake = wake  # set before the first look at the queue: no put is missed
        while True:
            try:
                delta = self.deltas.get_nowait()
            except queue.Empty:
                await ready.wait()
                ready.clear()
                continue
            yield delta
            if delta.finish_reason is not None:
                return

    def cancel(self) -> None:
        """Client cancel, deadline or disconnect: safe to call at any time, also after the request ended."""
        self.cancelled = True  # first: a hand-over that rebinds it after this still sees it
        self._cancel(self.req.req_id)

    def rebind(self, worker_id: str, cancel: Callable[[str], None]) -> None:
        """The request was handed over to another worker's engine: cancels go there from now on."""
        self.worker_id, self._cancel = worker_id, cancel

    def put(self, delta: OutputDelta) -> None:
        self.deltas.put(delta)
        if self._wake is not None:
            self._wake()

    def finish(self, text: str = "") -> None:
        """Queues the last delta (the engine calls it once the request's pages are freed, or it held none)."""
        req = self.req
        usage = Usage(len(req.prompt_token_ids), req.num_cached_tokens or 0, len(req.output_token_ids),
                      req.num_pinned_tokens)
        self.put(OutputDelta(text=text, finish_reason=req.finish_reason, usage=usage, error=req.error))
