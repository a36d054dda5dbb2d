"""The client SDK (kvserve.services.client) against a real gRPC server on port 0 that runs a scripted gateway."""

from __future__ import annotations

import asyncio
import random
import re
import threading
import time
from concurrent import futures

import grpc
import pytest
from free_ports import free_port

from kvserve.services.client import (
    AsyncClient,
    Client,
    Completion,
    DeadlineExceeded,
    Delta,
    InvalidArgument,
    KVServeError,
    Logprob,
    RetryPolicy,
    Unavailable,
    Usage,
    build_request,
    errors,
    from_rpc_error,
)
from kvserve.services.client.retry import fits_before, retry_wait_s
from kvserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff_s=0.001, max_backoff_s=0.005)
WAIT_S = 5.0  # the most any Event wait in these tests may take (a hang, not a synchronisation delay)

RESPONSES = (
    gateway_pb2.GenerateResponse(
        req_id="r-1", text="Hel", token_ids=[10, 11],
        logprobs=[gateway_pb2.GeneratedLogprob(token_id=10, logprob=-0.5,
                                               top_logprobs=[common_pb2.TokenLogprob(token_id=10, logprob=-0.5),
                                                             common_pb2.TokenLogprob(token_id=12, logprob=-1.25)]),
                  gateway_pb2.GeneratedLogprob(token_id=11, logprob=-0.25)]),
    gateway_pb2.GenerateResponse(req_id="r-1"),
    gateway_pb2.GenerateResponse(req_id="r-1", text="lo ✓", token_ids=[12],
                                 finish_reason=gateway_pb2.FINISH_REASON_STOP,
                                 usage=gateway_pb2.Usage(prompt_tokens=20, cached_tokens=16, completion_tokens=3)),
)
EXPECTED_DELTAS = [
    Delta(req_id="r-1", text="Hel", token_ids=(10, 11),
          logprobs=(Logprob(token_id=10, logprob=-0.5, top_logprobs=((10, -0.5), (12, -1.25))),
                    Logprob(token_id=11, logprob=-0.25, top_logprobs=())),
          finish_reason=None, usage=None),
    Delta(req_id="r-1", text="", token_ids=(), logprobs=(), finish_reason=None, usage=None),
    Delta(req_id="r-1", text="lo ✓", token_ids=(12,), logprobs=(), finish_reason="stop",
          usage=Usage(prompt_tokens=20, cached_tokens=16, completion_tokens=3)),
]
COMPLETE_RESPONSE = gateway_pb2.GenerateResponse(
    req_id="r-2", text="Hello", token_ids=[10, 11, 12], finish_reason=gateway_pb2.FINISH_REASON_LENGTH,
    usage=gateway_pb2.Usage(prompt_tokens=4, cached_tokens=0, completion_tokens=3))
EXPECTED_COMPLETION = Completion(req_id="r-2", text="Hello", token_ids=(10, 11, 12), logprobs=(),
                                 finish_reason="length",
                                 usage=Usage(prompt_tokens=4, cached_tokens=0, completion_tokens=3))


class ScriptedGateway(gateway_pb2_grpc.GatewayServiceServicer):
    """Fails the first ``fail_first`` calls with ``fail_code``, then behaves as ``mode`` says:
    "ok" answers RESPONSES / COMPLETE_RESPONSE; "hang" answers nothing until the call ends; "break" streams the
    first response and fails with UNAVAILABLE; "hold" streams the first response and waits for the call to end."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls = 0
        self.metadata: list[dict[str, str]] = []
        self.requests: list[gateway_pb2.GenerateRequest] = []
        self.fail_first = 0
        self.fail_code = grpc.StatusCode.UNAVAILABLE
        self.mode = "ok"
        self.first_sent = threading.Event()
        self.ended = threading.Event()  # set when a "hang"/"hold" call ends (cancel, deadline or server stop)
        self.active_at_end: bool | None = None

    def _admit(self, request, context) -> threading.Event:
        """Records the call, fails it when scripted to; returns an event set when the call ends."""
        terminated = threading.Event()
        context.add_callback(lambda: self._on_end(context, terminated))
        with self.lock:
            self.calls += 1
            calls = self.calls
            self.metadata.append(dict(context.invocation_metadata()))
            self.requests.append(request)
        if calls <= self.fail_first:
            context.abort(self.fail_code, "scripted failure")
        return terminated

    def _on_end(self, context, terminated: threading.Event) -> None:
        if self.mode in ("hang", "hold"):
            self.active_at_end = context.is_active()
            self.ended.set()
        terminated.set()

    def Generate(self, request, context):
        terminated = self._admit(request, context)
        if self.mode == "hang":
            terminated.wait(WAIT_S)
            return
        if self.mode in ("break", "hold"):
            yield RESPONSES[0]
            self.first_sent.set()
            if self.mode == "break":
                context.abort(grpc.StatusCode.UNAVAILABLE, "going away")
            terminated.wait(WAIT_S)  # cancelled while waiting here, or while the first response was sent
            return
        yield from RESPONSES

    def Complete(self, request, context):
        terminated = self._admit(request, context)
        if self.mode == "hang":
            terminated.wait(WAIT_S)
            return gateway_pb2.GenerateResponse()
        return COMPLETE_RESPONSE


@pytest.fixture
def gateway():
    servicer = ScriptedGateway()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0).wait()


def closed_port_address() -> str:
    return f"127.0.0.1:{free_port()}"  # nothing listens there


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__()
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class HighRng(random.Random):
    def random(self) -> float:
        return 0.999


# --- types -----------------------------------------------------------------------------------------------------

def test_build_request_needs_exactly_one_input():
    chat = [{"role": "user", "content": "y"}]
    for args, kwargs in (((), {}), (("x", chat), {}), (("x",), {"prompt_token_ids": [1]}),
                         ((), {"messages": chat, "prompt_token_ids": [1]}),
                         (("x", chat), {"prompt_token_ids": [1]})):
        with pytest.raises(ValueError, match="give exactly one of prompt, messages and prompt_token_ids"):
            build_request(*args, **kwargs)
    with pytest.raises(ValueError):
        build_request(messages=[{"role": "user"}])
    with pytest.raises(TypeError):
        build_request("x", temprature=1.0)


def test_build_request_fields():
    request = build_request("hi", max_tokens=7, temperature=0.5, top_k=3, seed=0, stop=["\n", "END"], logprobs=True,
                            top_logprobs=2, ignore_eos=True)
    assert request.WhichOneof("input") == "prompt" and request.prompt == "hi"
    assert (request.max_tokens, request.sampling.temperature, request.sampling.top_k) == (7, 0.5, 3)
    assert request.sampling.HasField("seed") and request.sampling.seed == 0
    assert not request.sampling.HasField("top_p")
    assert list(request.stop) == ["\n", "END"]
    assert (request.logprobs, request.sampling.top_logprobs, request.ignore_eos) == (True, 2, True)
    chat = build_request(messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                         top_p=0.5)
    assert [(m.role, m.content) for m in chat.messages.messages] == [("system", "be brief"), ("user", "hi")]
    assert chat.sampling.HasField("top_p") and chat.sampling.top_p == 0.5
    assert not chat.sampling.HasField("seed")


def test_build_request_sends_token_ids_as_given_and_refuses_what_is_not_a_uint32():
    request = build_request(prompt_token_ids=(1, 0, 2**32 - 1), max_tokens=2)
    assert request.WhichOneof("input") == "prompt_token_ids"
    assert list(request.prompt_token_ids.token_ids) == [1, 0, 2**32 - 1] and request.max_tokens == 2
    empty = build_request(prompt_token_ids=[])  # sent (the oneof set, the list empty): the gateway refuses it
    assert empty.WhichOneof("input") == "prompt_token_ids" and not empty.prompt_token_ids.token_ids
    for bad in ([-1], [2**32], [1.5], ["7"], 7):
        with pytest.raises(ValueError, match=re.escape("prompt_token_ids: give a sequence of ints from 0 to")):
            build_request(prompt_token_ids=bad)


def test_build_request_takes_one_stop_string_and_names_a_value_that_does_not_fit():
    assert list(build_request("hi", stop="today").stop) == ["today"]  # one string, not five characters
    for kwargs, message in (({"seed": -1}, "seed=-1 does not fit"),
                            ({"max_tokens": 2**40}, f"max_tokens={2**40} does not fit"),
                            ({"temperature": "hot"}, "temperature='hot' does not fit"),
                            ({"stop": [1]}, "stop=[1]: give a string or a list of strings")):
        with pytest.raises(ValueError, match=re.escape(message)):
            build_request("hi", **kwargs)


# --- errors ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("code, cls", [
    (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgument),
    (grpc.StatusCode.UNAUTHENTICATED, errors.Unauthenticated),
    (grpc.StatusCode.PERMISSION_DENIED, errors.PermissionDenied),
    (grpc.StatusCode.NOT_FOUND, errors.NotFound),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhausted),
    (grpc.StatusCode.FAILED_PRECONDITION, errors.FailedPrecondition),
    (grpc.StatusCode.UNAVAILABLE, errors.Unavailable),
    (grpc.StatusCode.DEADLINE_EXCEEDED, errors.DeadlineExceeded),
    (grpc.StatusCode.CANCELLED, errors.Cancelled),
    (grpc.StatusCode.INTERNAL, errors.InternalError),
    (grpc.StatusCode.ABORTED, KVServeError),
])
def test_from_rpc_error_maps_codes(code, cls):
    error = from_rpc_error(FakeRpcError(code, "why"))
    assert type(error) is cls and isinstance(error, KVServeError)
    assert (error.code, error.details) == (code, "why")


# --- retry policy ----------------------------------------------------------------------------------------------

def test_backoff_grows_and_is_capped():
    policy = RetryPolicy()
    assert [policy.ceiling_s(a) for a in range(1, 9)] == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0])
    assert policy.ceiling_s(10**6) == 2.0
    high = [policy.backoff_s(a, HighRng()) for a in range(1, 12)]
    assert high == sorted(high) and high[0] < high[3] and max(high) <= 2.0
    rng = random.Random(0)
    for attempt in range(1, 12):
        assert all(0.0 <= policy.backoff_s(attempt, rng) <= policy.ceiling_s(attempt) for _ in range(200))
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError):
        RetryPolicy(initial_backoff_s=3.0, max_backoff_s=2.0)


def test_retry_wait_only_unavailable_within_attempts_and_deadline():
    policy = RetryPolicy(max_attempts=3, initial_backoff_s=1.0, max_backoff_s=1.0)
    unavailable = grpc.StatusCode.UNAVAILABLE
    assert retry_wait_s(policy, 1, unavailable, deadline=10.0, rng=HighRng(), now=0.0) == pytest.approx(0.999)
    assert retry_wait_s(policy, 2, unavailable, deadline=10.0, rng=HighRng(), now=0.0) is not None
    assert retry_wait_s(policy, 3, unavailable, deadline=10.0, rng=HighRng(), now=0.0) is None
    assert retry_wait_s(policy, 1, unavailable, deadline=0.5, rng=HighRng(), now=0.0) is None
    for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL):
        assert retry_wait_s(policy, 1, code, deadline=10.0, rng=HighRng(), now=0.0) is None
    assert fits_before(1.0, 0.5, now=0.4) and not fits_before(1.0, 0.5, now=0.5)


# --- Client ----------------------------------------------------------------------------------------------------

def test_stream_converts_deltas_and_sends_api_key(gateway):
    gw, address = gateway
    with Client(address, api_key="K") as client:
        stream = client.generate("hi", max_tokens=3, seed=7, stop=["x"])
        assert stream.req_id is None
        assert list(stream) == EXPECTED_DELTAS
        assert stream.req_id == "r-1" and stream.finished
        assert client.complete(messages=[{"role": "user", "content": "hi"}]) == EXPECTED_COMPLETION
    assert [m.get("authorization") for m in gw.metadata] == ["Bearer K", "Bearer K"]
    assert gw.requests[0] == build_request("hi", max_tokens=3, seed=7, stop=["x"])


def test_token_ids_reach_the_gateway_and_two_inputs_are_refused_before_any_call(gateway):
    gw, address = gateway
    with Client(address) as client:
        assert list(client.generate(prompt_token_ids=[5, 6], max_tokens=3)) == EXPECTED_DELTAS
        assert client.complete(prompt_token_ids=[7]) == EXPECTED_COMPLETION
        with pytest.raises(ValueError, match="exactly one of prompt, messages and prompt_token_ids"):
            client.generate("hi", prompt_token_ids=[5])
        with pytest.raises(ValueError, match="exactly one of prompt, messages and prompt_token_ids"):
            client.complete(messages=[{"role": "user", "content": "hi"}], prompt_token_ids=[5])
    assert gw.requests == [build_request(prompt_token_ids=[5, 6], max_tokens=3), build_request(prompt_token_ids=[7])]


def test_no_api_key_sends_no_authorization(gateway):
    gw, address = gateway
    with Client(address) as client:
        client.complete("hi")
    assert "authorization" not in gw.metadata[0]


@pytest.mark.parametrize("kind", ["stream", "unary"])
def test_unavailable_is_retried_until_success(gateway, kind):
    gw, address = gateway
    gw.fail_first = FAST_RETRY.max_attempts - 1
    with Client(address, retry=FAST_RETRY) as client:
        if kind == "stream":
            assert list(client.generate("hi")) == EXPECTED_DELTAS
        else:
            assert client.complete("hi") == EXPECTED_COMPLETION
    assert gw.calls == FAST_RETRY.max_attempts


@pytest.mark.parametrize("kind", ["stream", "unary"])
def test_unavailable_always_raises_after_max_attempts(gateway, kind):
    gw, address = gateway
    gw.fail_first = 100
    with Client(address, retry=FAST_RETRY) as client, pytest.raises(Unavailable) as info:
        list(client.generate("hi")) if kind == "stream" else client.complete("hi")
    assert gw.calls == FAST_RETRY.max_attempts
    assert isinstance(info.value.__cause__, grpc.RpcError)


@pytest.mark.parametrize("kind", ["stream", "unary"])
def test_invalid_argument_is_not_retried(gateway, kind):
    gw, address = gateway
    gw.fail_first, gw.fail_code = 100, grpc.StatusCode.INVALID_ARGUMENT
    with Client(address, retry=FAST_RETRY) as client, pytest.raises(InvalidArgument) as info:
        list(client.generate("hi")) if kind == "stream" else client.complete("hi")
    assert gw.calls == 1
    assert (info.value.code, info.value.details) == (grpc.StatusCode.INVALID_ARGUMENT, "scripted failure")
    assert isinstance(info.value.__cause__, grpc.RpcError)


def test_stream_failing_after_first_delta_is_not_retried(gateway):
    gw, address = gateway
    gw.mode = "break"
    with Client(address, retry=FAST_RETRY) as client:
        stream = client.generate("hi")
        assert next(stream) == EXPECTED_DELTAS[0]
        with pytest.raises(Unavailable):
            next(stream)
    assert gw.calls == 1


def test_retries_stop_at_the_deadline(gateway):
    """A retry starts only when its backoff ends before the deadline, and runs with the time that is left; if that
    last attempt is still in flight at the deadline (a loaded machine), the call ends DEADLINE_EXCEEDED instead of
    UNAVAILABLE. Either way it ends at the deadline, having retried."""
    gw, address = gateway
    gw.fail_first = 10**6
    policy = RetryPolicy(max_attempts=10**6, initial_backoff_s=0.02, max_backoff_s=0.02)
    with Client(address, retry=policy) as client:
        start = time.monotonic()
        with pytest.raises((Unavailable, DeadlineExceeded)):
            client.complete("hi", timeout_s=0.3)
        assert time.monotonic() - start < 0.3 + 0.2
    assert 1 < gw.calls < 10**6


def test_cancel_reaches_the_server(gateway):
    gw, address = gateway
    gw.mode = "hold"
    with Client(address) as client:
        stream = client.generate("hi")
        assert next(stream) == EXPECTED_DELTAS[0] and stream.req_id == "r-1"
        stream.cancel()
        assert gw.ended.wait(WAIT_S)
        assert list(stream) == [] and stream.finished
    assert gw.active_at_end is False


def test_cancel_from_another_thread_and_on_exit(gateway):
    gw, address = gateway
    gw.mode = "hold"
    with Client(address) as client:
        stream = client.generate("hi")
        canceller = threading.Thread(target=lambda: gw.first_sent.wait(WAIT_S) and stream.cancel())
        canceller.start()
        assert list(stream) in ([], EXPECTED_DELTAS[:1])  # ends quietly once cancelled, first delta read or not
        canceller.join(WAIT_S)
        assert gw.ended.wait(WAIT_S)
        gw.ended.clear()
        with client.generate("hi") as stream:
            next(stream)
        assert gw.ended.wait(WAIT_S)


@pytest.mark.parametrize("kind", ["stream", "unary"])
def test_deadline_is_respected(gateway, kind):
    gw, address = gateway
    gw.mode = "hang"
    with Client(address, timeout_s=0.3) as client:
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            list(client.generate("hi")) if kind == "stream" else client.complete("hi")
        assert 0.25 < time.monotonic() - start < 0.3 + 0.5
    assert gw.ended.wait(WAIT_S)


@pytest.mark.parametrize("kind", ["stream", "unary"])
def test_closed_port_fails_within_the_deadline(kind):
    with Client(closed_port_address(), timeout_s=0.5) as client:
        start = time.monotonic()
        with pytest.raises((Unavailable, DeadlineExceeded)):
            list(client.generate("hi")) if kind == "stream" else client.complete("hi")
        assert time.monotonic() - start < 0.5 + 0.25


# --- AsyncClient -----------------------------------------------------------------------------------------------

async def _collect(client: AsyncClient, **kwargs) -> list[Delta]:
    return [delta async for delta in await client.generate("hi", **kwargs)]


def test_async_stream_converts_deltas_and_sends_api_key(gateway):
    gw, address = gateway

    async def main():
        async with AsyncClient(address, api_key="K") as client:
            stream = await client.generate("hi")
            deltas = [delta async for delta in stream]
            return deltas, stream.req_id, await client.complete("hi")

    assert asyncio.run(main()) == (EXPECTED_DELTAS, "r-1", EXPECTED_COMPLETION)
    assert [m.get("authorization") for m in gw.metadata] == ["Bearer K", "Bearer K"]


def test_async_token_ids_reach_the_gateway_and_two_inputs_are_refused_before_any_call(gateway):
    gw, address = gateway

    async def main():
        async with AsyncClient(address) as client:
            deltas = [delta async for delta in await client.generate(prompt_token_ids=[5, 6])]
            completion = await client.complete(prompt_token_ids=[7], max_tokens=2)
            for call in (client.generate, client.complete):
                with pytest.raises(ValueError, match="exactly one of prompt, messages and prompt_token_ids"):
                    await call("hi", prompt_token_ids=[5])
            return deltas, completion

    assert asyncio.run(main()) == (EXPECTED_DELTAS, EXPECTED_COMPLETION)
    assert gw.requests == [build_request(prompt_token_ids=[5, 6]), build_request(prompt_token_ids=[7], max_tokens=2)]


@pytest.mark.parametrize("kind", ["stream", "unary"])
def test_async_retries_only_unavailable(gateway, kind):
    gw, address = gateway

    async def call(client: AsyncClient):
        return await _collect(client) if kind == "stream" else await client.complete("hi")

    async def main():
        async with AsyncClient(address, retry=FAST_RETRY) as client:
            gw.fail_first = FAST_RETRY.max_attempts - 1
            assert await call(client) == (EXPECTED_DELTAS if kind == "stream" else EXPECTED_COMPLETION)
            assert gw.calls == FAST_RETRY.max_attempts
            gw.calls, gw.fail_first = 0, 100
            with pytest.raises(Unavailable):
                await call(client)
            assert gw.calls == FAST_RETRY.max_attempts
            gw.calls, gw.fail_code = 0, grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(InvalidArgument) as info:
                await call(client)
            assert gw.calls == 1 and isinstance(info.value.__cause__, grpc.RpcError)

    asyncio.run(main())


def test_async_stream_failing_after_first_delta_is_not_retried(gateway):
    gw, address = gateway
    gw.mode = "break"

    async def main():
        async with AsyncClient(address, retry=FAST_RETRY) as client:
            stream = await client.generate("hi")
            assert await anext(stream) == EXPECTED_DELTAS[0]
            with pytest.raises(Unavailable):
                await anext(stream)

    asyncio.run(main())
    assert gw.calls == 1


def test_async_cancel_reaches_the_server(gateway):
    gw, address = gateway
    gw.mode = "hold"

    async def main():
        async with AsyncClient(address) as client:
            stream = await client.generate("hi")
            assert await anext(stream) == EXPECTED_DELTAS[0]
            stream.cancel()
            assert [delta async for delta in stream] == [] and stream.finished
            assert await asyncio.to_thread(gw.ended.wait, WAIT_S)

    asyncio.run(main())
    assert gw.active_at_end is False


@pytest.mark.parametrize("kind", ["stream", "unary"])
def test_async_deadline_is_respected(gateway, kind):
    gw, address = gateway
    gw.mode = "hang"

    async def main():
        async with AsyncClient(address, timeout_s=0.3) as client:
            start = time.monotonic()
            with pytest.raises(DeadlineExceeded):
                await _collect(client) if kind == "stream" else await client.complete("hi")
            assert 0.25 < time.monotonic() - start < 0.3 + 0.5

    asyncio.run(main())
    assert gw.ended.wait(WAIT_S)


def test_async_closed_port_fails_within_the_deadline():
    async def main():
        async with AsyncClient(closed_port_address(), timeout_s=0.5) as client:
            start = time.monotonic()
            with pytest.raises((Unavailable, DeadlineExceeded)):
                await client.complete("hi")
            assert time.monotonic() - start < 0.5 + 0.25

    asyncio.run(main())
