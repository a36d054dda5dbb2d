"""The synchronous client of the gateway's public gRPC API (kvserve.v1.GatewayService).

Every call has a deadline. A call that fails with UNAVAILABLE is sent again with backoff while attempts remain
and the wait ends before the deadline; a stream is only retried while it has received nothing, so output is
never duplicated. Every other failure raises the typed error of ``kvserve.services.client.errors``.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import grpc
from opentelemetry import propagate

from kvserve.common.tls import channel_credentials, load_tls
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
from kvserve.v1 import gateway_pb2_grpc

DEFAULT_GATEWAY_ADDRESS = "127.0.0.1:50050"
DEFAULT_TIMEOUT_S = 300.0
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Reconnect quickly after the gateway went away, so that the retries' backoff, not the channel's, sets the pace.
DEFAULT_CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
)

Metadata = tuple[tuple[str, str], ...]


def call_metadata(metadata: Metadata) -> Metadata:
    """``metadata`` plus the caller's current trace context (W3C ``traceparent``), when the application runs
    an OpenTelemetry SDK: the gateway's request span then joins the caller's trace."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return (*metadata, *carrier.items()) if carrier else metadata


def auth_metadata(api_key: str | None) -> Metadata:
    """The call metadata carrying ``api_key`` as ``authorization: Bearer <key>``; empty for no (or an empty) key."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def check_timeout(timeout_s: float) -> float:
    """Returns ``timeout_s``; raises ValueError unless it is a positive number of seconds."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    return timeout_s


def call_deadline(timeout_s: float | None, default_s: float) -> float:
    """The ``time.monotonic()`` deadline of a call started now with ``timeout_s`` (None: ``default_s``)."""
    return time.monotonic() + check_timeout(default_s if timeout_s is None else timeout_s)


def remaining_s(deadline: float) -> float:
    """Seconds left until ``deadline``, never negative."""
    return max(deadline - time.monotonic(), 0.0)


class GenerateStream:
    """The deltas of one Generate call, in order. Iterate it; ``cancel()`` or leave its ``with`` block to stop.

    The RPC starts when the stream is created. UNAVAILABLE before the first delta is retried (see the module);
    any later failure raises. After ``cancel()`` iteration ends quietly (no error).

    Raises (while iterating):
        KVServeError: the typed error of a failure that is not retried, chained from the grpc.RpcError.
    """

    def __init__(self, start: Callable[[float], Any], policy: RetryPolicy, deadline: float,
                 rng: random.Random) -> None:
        self._start = start
        self._policy = policy
        self._deadline = deadline
        self._rng = rng
        self._lock = threading.Lock()
        self._cancelled = threading.Event()
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
        """Cancels the RPC, so the gateway frees the request. Safe from any thread, and more than once."""
        with self._lock:
            self._cancelled.set()
            call = self._call
        call.cancel()

    def __iter__(self) -> Iterator[Delta]:
        return self

    def __next__(self) -> Delta:
        while not (self._finished or self._cancelled.is_set()):
            try:
                response = next(self._call)
            except StopIteration:
                break
            except grpc.RpcError as e:
                self._retry_or_raise(e)
                continue
            self._received = True
            delta = delta_from_response(response)
            self._req_id = delta.req_id
            self._finished = delta.finish_reason is not None
            return delta
        self._finished = True
        raise StopIteration

    def _retry_or_raise(self, e: grpc.RpcError) -> None:
        """Starts the call again after the backoff when allowed; returns at once when cancelled; else raises."""
        if self._cancelled.is_set():
            return
        code = rpc_error_code(e)
        wait_s = None if self._received else retry_wait_s(self._policy, self._attempts, code, self._deadline,
                                                          self._rng)
        if wait_s is None:
            self._finished = True
            raise from_rpc_error(e) from e
        if self._cancelled.wait(wait_s):
            return
        with self._lock:
            if not self._cancelled.is_set():
                self._attempts += 1
                self._call = self._start(remaining_s(self._deadline))

    def __enter__(self) -> GenerateStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self._finished:
            self.cancel()


def tls_credentials(ca: str | None = None, cert: str | None = None, key: str | None = None) -> grpc.ChannelCredentials:
    """TLS channel credentials for ``Client(credentials=...)`` from PEM files: ``ca`` verifies the gateway
    (None: the system's roots), ``cert`` and ``key`` are the client certificate for a gateway that requires one
    (mutual TLS). Raises ValueError (kvserve.common.tls.TlsError) naming a file that is missing or wrong."""
    tls = load_tls(cert, key, ca, server=False)
    return channel_credentials(tls) if tls is not None else grpc.ssl_channel_credentials()


class ClientBase:
    """What Client and AsyncClient share: settings, call metadata and a channel from ``_channels`` (the grpc
    module for the sync client, grpc.aio for the asyncio one)."""

    _channels: Any = grpc

    def __init__(self, address: str = DEFAULT_GATEWAY_ADDRESS, api_key: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, retry: RetryPolicy = RetryPolicy(),  # noqa: B008
                 channel_options: Sequence[tuple[str, Any]] = DEFAULT_CHANNEL_OPTIONS,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self._timeout_s = check_timeout(timeout_s)
        self._retry = retry
        self._metadata = auth_metadata(api_key)
        self._rng = random.Random()
        options = list(channel_options)
        self._channel = (self._channels.insecure_channel(address, options=options) if credentials is None
                         else self._channels.secure_channel(address, credentials, options=options))
        self._stub = gateway_pb2_grpc.GatewayServiceStub(self._channel)


class Client(ClientBase):
    """A synchronous client of the gateway. Thread-safe; use it as a context manager or call ``close()``.

    Args:
        address: the gateway's ``host:port``.
        api_key: sent as ``authorization: Bearer <api_key>`` on every call; None sends no authorization.
        timeout_s: the default deadline of every call, in seconds (a whole stream included).
        retry: the backoff policy for UNAVAILABLE.
        channel_options: gRPC channel arguments.
        credentials: TLS channel credentials (``tls_credentials(ca, cert, key)``); None uses an insecure
            channel.

    Raises:
        ValueError: timeout_s is not positive.
    """

    def generate(self, prompt: str | None = None, *, messages: Sequence[Mapping[str, str]] | None = None,
                 prompt_token_ids: Sequence[int] | None = None, cache_pins: Iterable[CachePin | tuple[int, int]] = (),
                 cache_key: str = "", timeout_s: float | None = None, **sampling: Any) -> GenerateStream:
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
            The stream of deltas; the last one carries finish_reason and usage.

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

        return GenerateStream(start, self._retry, deadline, self._rng)

    def complete(self, prompt: str | None = None, *, messages: Sequence[Mapping[str, str]] | None = None,
                 prompt_token_ids: Sequence[int] | None = None, cache_pins: Iterable[CachePin | tuple[int, int]] = (),
                 cache_key: str = "", timeout_s: float | None = None, **sampling: Any) -> Completion:
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
                response = self._stub.Complete(request, timeout=remaining_s(deadline),
                                               metadata=call_metadata(self._metadata))
            except grpc.RpcError as e:
                wait_s = retry_wait_s(self._retry, attempt, rpc_error_code(e), deadline, self._rng)
                if wait_s is None:
                    raise from_rpc_error(e) from e
            else:
                return completion_from_response(response)
            time.sleep(wait_s)  # the backoff
            attempt += 1

    def close(self) -> None:
        """Closes the channel; calls still in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
