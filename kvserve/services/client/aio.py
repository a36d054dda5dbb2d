"""The asyncio client of the gateway's public gRPC API, on grpc.aio: the surface and retry rules of ``Client``.

Create it inside the event loop that uses it (``async with AsyncClient(...) as client:``).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any

import grpc

from kvserve.services.client.client import (
    ClientBase,
    call_deadline,
    call_metadata,
    remaining_s,
)
from kvserve.services.client.errors import from_rpc_error, rpc_error_code
from kvserve.services.client.retry import RetryPolicy, retry_wait_s
from kvserve.services.client.types import (
    CachePin,
    Completion,
    Delta,
    build_request,
    completion_from_response,
    delta_from_response,
)


class AsyncGenerateStream:
    """The deltas of one Generate call, in order. ``async for`` over it; ``cancel()`` or leave its ``async with``
    block to stop.

    The RPC starts when the stream is created. UNAVAILABLE before the first delta is retried; any later failure
    raises. After ``cancel()`` iteration ends quietly (no error). Use it from its event loop's thread only.

    Raises (while iterating):
        KVServeError: the typed error of a failure that is not retried, chained from the grpc.RpcError.
    """

    def __init__(self, start: Callable[[float], Any], policy: RetryPolicy, deadline: float,
                 rng: random.Random) -> None:
        self._start = start
        self._policy = policy
        self._deadline = deadline
        self._rng = rng
        self._cancelled = False
        self._wake = asyncio.Event()
        self._attempts = 1
        self._received = False
        self._finished = False
        self._req_id: str | None = None
        self._call = start(remaining_s(deadline))

    @property
    def req_id(self) -> str | None:
        """The server-assigned request id; None until the first delta arrived."""
        return self._req_id

    @property
    def finished(self) -> bool:
        """Whether the stream is over: the last delta arrived, it failed, or it was cancelled."""
        return self._finished

    def cancel(self) -> None:
        """Cancels the RPC, so the gateway frees the request. Idempotent."""
        self._cancelled = True
        self._wake.set()
        self._call.cancel()

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self

    async def __anext__(self) -> Delta:
        while not (self._finished or self._cancelled):
            try:
                response = await self._call.read()
            except grpc.RpcError as e:
                await self._retry_or_raise(e)
                continue
            except asyncio.CancelledError:
                if self._cancelled and not _task_cancelling():
                    break  # our cancel() ended the read, not a cancellation of the awaiting task
                self._call.cancel()
                raise
            if response is grpc.aio.EOF:
                break
            self._received = True
            delta = delta_from_response(response)
            self._req_id = delta.req_id
            self._finished = delta.finish_reason is not None
            return delta
        self._finished = True
        raise StopAsyncIteration

    async def _retry_or_raise(self, e: grpc.RpcError) -> None:
        """Starts the call again after the backoff when allowed; returns at once when cancelled; else raises."""
        if self._cancelled:
            return
        code = rpc_error_code(e)
        wait_s = None if self._received else retry_wait_s(self._policy, self._attempts, code, self._deadline,
                                                          self._rng)
        if wait_s is None:
            self._finished = True
            raise from_rpc_error(e) from e
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=wait_s)  # the backoff, cut short by cancel()
        except TimeoutError:
            pass
        if not self._cancelled:
            self._attempts += 1
            self._call = self._start(remaining_s(self._deadline))

    async def __aenter__(self) -> AsyncGenerateStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if not self._finished:
            self.cancel()


def _task_cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class AsyncClient(ClientBase):
    """An asyncio client of the gateway. Use it as an async context manager or call ``await close()``.

    Args:
        address: the gateway's ``host:port``.
        api_key: sent as ``authorization: Bearer <api_key>`` on every call; None sends no authorization.
        timeout_s: the default deadline of every call, in seconds (a whole stream included).
        retry: the backoff policy for UNAVAILABLE.
        channel_options: gRPC channel arguments.
        credentials: TLS channel credentials; None uses an insecure channel.

    Raises:
        ValueError: timeout_s is not positive.
    """

    _channels = grpc.aio

    async def generate(self, prompt: str | None = None, *, messages: Sequence[Mapping[str, str]] | None = None,
                       prompt_token_ids: Sequence[int] | None = None,
                       cache_pins: Iterable[CachePin | tuple[int, int]] = (), cache_key: str = "",
                       timeout_s: float | None = None, **sampling: Any) -> AsyncGenerateStream:
        """Starts a streamed completion.

        Args:
            prompt: raw text to complete, tokenised as is (exactly one of prompt, messages and
                prompt_token_ids).
            messages: chat messages, each ``{"role": ..., "content": ...}``, oldest first, rendered with the
                model's chat template.
            prompt_token_ids: the prompt as token ids of the model's vocabulary, fed as they are.
            cache_pins: soft pins of prompt prefixes, each a ``CachePin`` or ``(num_tokens, ttl_s)`` (num_tokens 0
                = the whole prompt): their pages stay cached for ttl_s seconds after the last hit, within the
                tenant's pin budget; ``usage.pinned_tokens`` says what was pinned.
            cache_key: placement affinity within the tenant: requests with the same key go to the same worker
                while it has room; empty for none.
            timeout_s: the deadline of the whole stream in seconds; None uses the client's.
            **sampling: max_tokens, temperature, top_p, top_k, seed, stop, logprobs, top_logprobs, ignore_eos,
                chat_template_kwargs (see ``types.build_request``).

        Returns:
            The stream of deltas (``async for``); the last one carries finish_reason and usage.

        Raises:
            ValueError: not exactly one of prompt, messages and prompt_token_ids, a malformed message, a
                token id outside 0 to 2**32 - 1, a malformed cache pin, or a non-positive timeout.
            TypeError: an unknown sampling keyword.
        """
        request = build_request(prompt, messages, prompt_token_ids=prompt_token_ids, cache_pins=cache_pins,
                                cache_key=cache_key, **sampling)
        deadline = call_deadline(timeout_s, self._timeout_s)

        def start(timeout: float) -> Any:
            return self._stub.Generate(request, timeout=timeout, metadata=call_metadata(self._metadata))

        return AsyncGenerateStream(start, self._retry, deadline, self._rng)

    async def complete(self, prompt: str | None = None, *, messages: Sequence[Mapping[str, str]] | None = None,
                       prompt_token_ids: Sequence[int] | None = None,
                       cache_pins: Iterable[CachePin | tuple[int, int]] = (), cache_key: str = "",
                       timeout_s: float | None = None, **sampling: Any) -> Completion:
        """Runs a completion and returns it once finished (the unary Complete call).

        Args:
            prompt, messages, prompt_token_ids, cache_pins, cache_key, timeout_s, **sampling: as for
                ``generate``.

        Returns:
            The finished completion.

        Raises:
            KVServeError: the typed error of the failure (Unavailable once retries are spent, InvalidArgument,
                Unauthenticated, DeadlineExceeded, ...), chained from the grpc.RpcError.
            ValueError, TypeError: as for ``generate``.
        """
        request = build_request(prompt, messages, prompt_token_ids=prompt_token_ids, cache_pins=cache_pins,
                                cache_key=cache_key, **sampling)
        deadline = call_deadline(timeout_s, self._timeout_s)
        attempt = 1
        while True:
            try:
                response = await self._stub.Complete(request, timeout=remaining_s(deadline),
                                                     metadata=call_metadata(self._metadata))
            except grpc.RpcError as e:
                wait_s = retry_wait_s(self._retry, attempt, rpc_error_code(e), deadline, self._rng)
                if wait_s is None:
                    raise from_rpc_error(e) from e
            else:
                return completion_from_response(response)
            await asyncio.sleep(wait_s)  # the backoff
            attempt += 1

    async def close(self) -> None:
        """Closes the channel; calls still in flight are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
