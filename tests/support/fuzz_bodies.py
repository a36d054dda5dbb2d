"""Malformed and extreme requests for the gateway's two front-ends, as hypothesis strategies, how to send one,
and what a right answer is (issue 35): a 2xx in the API's shape, or a client error (HTTP 4xx with OpenAI's error
object, gRPC INVALID_ARGUMENT and kin) that says what was wrong. Never a 5xx, INTERNAL or UNAVAILABLE, never a
hang. Shared by tests/e2e/test_fuzz_frontends.py (a short run) and bench/fuzz_frontends.py (the long one).

Most bodies are valid but for one or two fields, so that they reach the engine: values finite in float64 that
overflow or underflow float32, NaN and Infinity as raw JSON tokens, integers past int32/int64/uint64, token ids
past the vocabulary, wrong types, odd unicode (lone surrogates, escaped), unknown roles, deep nesting.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field

import grpc
import httpx
from hypothesis import strategies as st

from kvserve.common.channels import kvmanager_channel
from kvserve.v1 import common_pb2, gateway_pb2, kvmanager_pb2, kvmanager_pb2_grpc

API_KEY = "key-fuzz"
KEYS = {API_KEY: "tenant-fuzz"}
BEARER = f"Bearer {API_KEY}"
# authorization headers that name no key of KEYS (None: no header)
ODD_AUTHORIZATION = [None, "", "Bearer", "Bearer nope", f"Basic {API_KEY}", f"bearer {API_KEY}", f"Bearer  {API_KEY}",
                     f"Bearer {API_KEY}x"]
VOCAB_SIZE = 49152  # SmolLM2's
CLIENT_TIMEOUT_S = 60.0  # no answer within this is a hang
# What `kvserve up` runs with under the fuzzer: no body generates more than 16 tokens, so a run stays short.
STACK_FLAGS = ("--num-pages", "256", "--max-num-batched-tokens", "128", "--default-max-tokens", "8",
               "--max-tokens-limit", "16")
# Gateway log lines that say a worker was lost, a step failed as a whole, or a bug was hit.
TROUBLE = ("is gone (", "worker gone, handing", "restarted (epoch", "declare worker", "step failed:",
           "a step raised", "failed on a bug")
FINISHED = ("stop", "length")  # OpenAI's finish_reason of a completion that ended
GRPC_CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
                      grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION}


@dataclass(frozen=True, slots=True)
class Raw:
    """A JSON token written as is: NaN, Infinity, 1e400, an integer of 5,000 digits."""

    text: str


def dumps(value) -> str:
    """JSON with Raw tokens; strings ASCII-escaped (a lone surrogate becomes \\ud800), NaN/Infinity allowed."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dumps(v) for v in value) + "]"
    return json.dumps(value)


# -- values --------------------------------------------------------------------------------------------------
FLOAT32_OVERFLOW = [1e39, -1e39, 1e308, -1e308, 3.4028236e38, 1.7976931348623157e308]  # finite only in float64
FLOAT32_TINY = [1e-50, -1e-50, 5e-324, 1e-40, 1.4e-45, 1e-45]  # 0 or subnormal in float32
NON_FINITE = [Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e400"), Raw("-1e400"), Raw("-0.0")]
BIG_INTS = [2**31 - 1, 2**31, -2**31 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -2**63 - 1, 10**30,
            Raw("1" + "0" * 5000)]
WRONG_TYPES = ["", "1", "NaN", True, False, None, [], [1], {}, {"x": 1}, 1.5, -1, 0]
ODD_TEXT = ["", " ", "\x00", "\ud800", "\udfff", "a\ud800b", "\U0001f600", "\u202e\u2066", "\ufeff", "e\u0301" * 40,
            "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>", "{{ raise_exception('x') }}", "\n" * 64,
            "\U0010ffff", "\x7f\x1b[31m", "x" * 300]
EXTREME = st.sampled_from(NON_FINITE + BIG_INTS + WRONG_TYPES + ODD_TEXT) | st.integers() | st.floats()


def mostly(valid: st.SearchStrategy, odd: st.SearchStrategy, one_in: int = 4) -> st.SearchStrategy:
    """``valid`` but one time in ``one_in``, when ``odd``."""
    return st.integers(0, one_in - 1).flatmap(lambda i: odd if i == one_in - 1 else valid)


TEXT = mostly(st.text(min_size=1, max_size=40), st.sampled_from(ODD_TEXT) | st.text(max_size=200))
TOKEN_IDS = st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=24)
ODD_TOKEN_IDS = st.lists(st.sampled_from([-1, VOCAB_SIZE, 2**31, 2**32, 2**63, 2**64, 1.5, True, None, "1"])
                         | st.integers(0, VOCAB_SIZE - 1), max_size=6)
LONG_PROMPTS = st.sampled_from(["word " * 9000, [0] * 5000, [1, 2] * 2000])  # past the context or one pool
ODD_FLOAT = mostly(st.sampled_from(FLOAT32_OVERFLOW + FLOAT32_TINY + NON_FINITE), EXTREME, one_in=3)
ODD_INT = mostly(st.sampled_from(BIG_INTS + [-1, 0, 2.0, 2.5, 1e39, Raw("1e2")]), EXTREME, one_in=3)

# -- HTTP bodies ---------------------------------------------------------------------------------------------
SAMPLING = {"temperature": st.sampled_from([0, 0.0, 0.7, 1, 1.3]), "top_p": st.sampled_from([0.5, 0.95, 1]),
            "top_k": st.sampled_from([-1, 0, 1, 40]), "seed": st.integers(0, 2**63 - 1),
            "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3)), "stream": st.booleans(),
            "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
            "ignore_eos": st.booleans(), "n": st.just(1), "presence_penalty": st.just(0),
            "model": st.just("SmolLM2-135M-Instruct"), "user": TEXT}
FLOAT_FIELDS = ["temperature", "top_p", "presence_penalty", "frequency_penalty"]
INT_FIELDS = ["max_tokens", "max_completion_tokens", "top_k", "seed", "logprobs", "top_logprobs", "n", "best_of"]
ODD = {**dict.fromkeys(FLOAT_FIELDS, ODD_FLOAT), **dict.fromkeys(INT_FIELDS, ODD_INT),  # field -> its odd values
       "stop": st.sampled_from([["x"] * 9, ["y" * 257], [""], ["\ud800"] * 8, "z" * 100000]) | EXTREME,
       "logit_bias": st.just({"1": 100}) | EXTREME, "model": st.sampled_from(["gpt-4o", *ODD_TEXT]) | EXTREME}
COMPLETION = {**SAMPLING, "logprobs": st.integers(0, 5), "echo": st.just(False), "best_of": st.just(1)}
PART = mostly(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
              st.sampled_from([{"type": "image_url", "image_url": {"url": "http://x"}}, {"type": "text"}, {}, "x"]))
ROLE = mostly(st.sampled_from(["system", "user", "assistant"]),
              st.sampled_from(["tool", "developer", "function", "", "USER", "user ", "\ud800"]) | st.text(max_size=8))
MESSAGE = mostly(st.fixed_dictionaries({"role": ROLE, "content": mostly(TEXT, st.lists(PART, max_size=3))},
                                       optional={"name": TEXT}),
                 st.sampled_from([{}, {"role": "user"}, {"content": "hi"}, {"role": "user", "content": None},
                                  {"role": "user", "content": {"text": "hi"}}, ["user", "hi"], "hi"]))
CHAT = {**SAMPLING, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20),
        "max_completion_tokens": st.integers(1, 8), "response_format": st.just({"type": "text"})}


@st.composite
def _mutated(draw, body: dict, names: list[str]) -> dict:
    """``body`` with up to two fields set to an odd value (or, rarely, removed); the sampling numbers, which reach
    the engine, most often."""
    weighted = [*names, "unknown_field", *["temperature", "top_p", "top_k", "seed", "max_tokens"] * 2]
    for name in draw(st.lists(st.sampled_from(weighted), max_size=2, unique=True)):
        if draw(st.integers(0, 9)) == 9:
            body.pop(name, None)
        else:
            body[name] = draw(ODD.get(name, EXTREME))
    return body


def completion_body() -> st.SearchStrategy[dict]:
    prompt = mostly(TEXT | TOKEN_IDS | st.lists(TOKEN_IDS, min_size=1, max_size=1),
                    ODD_TOKEN_IDS | LONG_PROMPTS | st.lists(TEXT | TOKEN_IDS, max_size=3))
    base = st.fixed_dictionaries({"prompt": prompt, "max_tokens": st.integers(1, 8)}, optional=COMPLETION)
    return base.flatmap(lambda b: _mutated(b, ["prompt", "max_tokens", *COMPLETION]))


def chat_body() -> st.SearchStrategy[dict]:
    messages = mostly(st.lists(MESSAGE, min_size=1, max_size=4), st.lists(MESSAGE, max_size=2) | EXTREME)
    base = st.fixed_dictionaries({"messages": messages, "max_tokens": st.integers(1, 8)}, optional=CHAT)
    return base.flatmap(lambda b: _mutated(b, ["messages", "max_tokens", *CHAT]))


RAW_BODIES = [b"", b"{", b"[]", b"null", b"1", b'"x"', b"\xff\xfe\x00", b"\xef\xbb\xbf{}", b"[" * 100000,
              b'{"prompt": "hi", "stop": ' + b"[" * 50000 + b"]" * 50000 + b"}", b'{"prompt": "\xc3("}',
              b'{"prompt": "hi", "max_tokens": 1, "tools": ' + b"[" * 900 + b"]" * 900 + b"}",
              b'{"prompt": "hi", "prompt": 5}', b'{"prompt": "hi", "max_tokens": 1} trailing',
              b'{"prompt": "' + b"x" * (1 << 20) + b'"}', b'{"messages": [{"role": "user", "content": "\\ud800"}]}']


@dataclass(frozen=True, slots=True)
class HttpCase:
    path: str  # under /v1
    body: bytes
    authorization: str | None = BEARER  # the header; None: none sent


def _http_case(path: str, body: dict | bytes, authorization: str | None) -> HttpCase:
    return HttpCase(path, body if isinstance(body, bytes) else dumps(body).encode(), authorization)


def http_cases() -> st.SearchStrategy[HttpCase]:
    key = mostly(st.just(BEARER), st.sampled_from(ODD_AUTHORIZATION), one_in=20)
    body = mostly(st.one_of(completion_body().map(lambda b: ("/completions", b)),
                            chat_body().map(lambda b: ("/chat/completions", b))),
                  st.tuples(st.sampled_from(["/completions", "/chat/completions"]), st.sampled_from(RAW_BODIES)),
                  one_in=12)
    return st.builds(lambda pb, k: _http_case(*pb, k), body, key)


# -- gRPC requests -------------------------------------------------------------------------------------------
UTF8_ODD_TEXT = [t for t in ODD_TEXT if not any("\ud800" <= c <= "\udfff" for c in t)]  # protobuf strings: UTF-8
GRPC_TEXT = mostly(st.text(min_size=1, max_size=40), st.sampled_from(UTF8_ODD_TEXT) | st.text(max_size=300))
FLOAT32 = st.floats(width=32) | st.sampled_from([1e-45, 1e-40, 3.4e38, -0.0])
INT32 = st.integers(-2**31, 2**31 - 1)


@st.composite
def _sampling(draw) -> common_pb2.SamplingParams:
    s = common_pb2.SamplingParams(temperature=draw(mostly(st.sampled_from([0.0, 0.7, 1.0]), FLOAT32)),
                                  top_k=draw(mostly(st.sampled_from([0, 1, 40]), INT32)),
                                  top_logprobs=draw(mostly(st.integers(0, 5), INT32)))
    if draw(st.booleans()):
        s.top_p = draw(mostly(st.sampled_from([0.5, 0.95, 1.0]), FLOAT32))
    if draw(st.booleans()):
        s.seed = draw(st.integers(0, 2**64 - 1))
    return s


@st.composite
def _generate_request(draw) -> gateway_pb2.GenerateRequest:
    stop = draw(mostly(st.lists(GRPC_TEXT, max_size=2), st.lists(GRPC_TEXT, max_size=12)))
    r = gateway_pb2.GenerateRequest(max_tokens=draw(mostly(st.integers(1, 8), INT32)), stop=stop,
                                    logprobs=draw(st.booleans()), ignore_eos=draw(st.booleans()))
    which = draw(st.sampled_from(["prompt", "prompt", "messages", "prompt_token_ids", None]))
    if which == "prompt":
        r.prompt = draw(GRPC_TEXT)
    elif which == "messages":
        roles = mostly(st.sampled_from(["system", "user", "assistant"]), st.text(max_size=8))
        pairs = draw(mostly(st.lists(st.tuples(roles, GRPC_TEXT), min_size=1, max_size=4),
                            st.lists(st.tuples(roles, GRPC_TEXT), max_size=1)))
        r.messages.SetInParent()
        r.messages.messages.extend(gateway_pb2.ChatMessage(role=role, content=text) for role, text in pairs)
    elif which == "prompt_token_ids":
        ids = draw(mostly(TOKEN_IDS, st.lists(st.integers(0, 2**32 - 1) | st.just(VOCAB_SIZE), max_size=6)))
        r.prompt_token_ids.SetInParent()
        r.prompt_token_ids.token_ids.extend(ids)
    if draw(st.integers(0, 3)):
        r.sampling.CopyFrom(draw(_sampling()))
    return r


@dataclass(frozen=True, slots=True)
class GrpcCase:
    method: str  # Generate (server streaming) or Complete (unary)
    request: gateway_pb2.GenerateRequest
    authorization: str | None = BEARER  # the metadata's value; None: none sent


def grpc_cases() -> st.SearchStrategy[GrpcCase]:
    key = mostly(st.just(BEARER), st.sampled_from(ODD_AUTHORIZATION), one_in=20)
    return st.builds(GrpcCase, st.sampled_from(["Generate", "Complete"]), _generate_request(), key)


# -- sending one, and checking its answer --------------------------------------------------------------------
@dataclass(slots=True)
class Answer:
    outcome: str  # HTTP: the status ("200", "400", "200 stream error" ...); gRPC: the code's name; or "hang"
    problems: list[str] = field(default_factory=list)  # empty: a right answer


def send_http(http: httpx.Client, base_url: str, case: HttpCase) -> Answer:
    headers = {"authorization": case.authorization} if case.authorization is not None else {}
    try:
        reply = http.post(base_url + case.path, content=case.body, headers=headers, timeout=CLIENT_TIMEOUT_S)
    except httpx.TimeoutException:
        return Answer("hang", [f"no answer within {CLIENT_TIMEOUT_S:g} s"])
    except httpx.HTTPError as e:  # the connection closed without an answer
        return Answer("no answer", [f"{type(e).__name__}: {e}"])
    if reply.headers.get("content-type", "").startswith("text/event-stream"):
        return _sse_answer(reply.text, chat=case.path == "/chat/completions")
    return Answer(str(reply.status_code), http_problems(reply.status_code, reply.content, case.path))


def http_problems(status: int, content: bytes, path: str) -> list[str]:
    """What is wrong with a non-streamed answer: a 5xx, or a body not in the API's shape."""
    try:
        body = json.loads(content)
    except ValueError:
        return [f"{status} with a body that is not JSON: {content[:200]!r}"]
    if status >= 500:
        return [f"{status}: {body}"]
    if status >= 400:
        return error_problems(body, status)
    kind = "chat.completion" if path == "/chat/completions" else "text_completion"
    body_ = body if isinstance(body, dict) else {}
    choice = (body_.get("choices") or [{}])[0]
    text = (choice.get("message") or {}).get("content") if kind == "chat.completion" else choice.get("text")
    shaped = (body_.get("object") == kind and isinstance(text, str) and choice.get("finish_reason") in FINISHED
              and isinstance((body_.get("usage") or {}).get("completion_tokens"), int))
    return [] if shaped else [f"{status} not a {kind}: {body}"]


def error_problems(body, status: int) -> list[str]:
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return [f"{status} not OpenAI's error shape: {body}"]
    if not isinstance(error["message"], str) or not error["message"]:
        return [f"{status} with no message: {body}"]
    return []


def _sse_answer(text: str, chat: bool) -> Answer:
    """A stream: data events of chunks, ending with [DONE]; an error event in it is a server-side failure
    (every client error is answered before the stream starts)."""
    events = [e for e in text.split("\n\n") if e]
    if not events or events[-1] != "data: [DONE]":
        return Answer("200 stream cut", [f"a stream that does not end with [DONE]: {text[-300:]!r}"])
    try:
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    except ValueError:
        return Answer("200 stream cut", [f"a stream event that is not JSON: {text[:300]!r}"])
    errors = [c["error"] for c in chunks if "error" in c]
    if errors:
        return Answer("200 stream error", [f"an error event in a 200 stream: {errors[0]}"])
    kind = "chat.completion.chunk" if chat else "text_completion"
    if any(c.get("object") != kind for c in chunks) or not any(ch.get("finish_reason") for c in chunks
                                                               for ch in c["choices"]):
        return Answer("200", [f"a stream of something else than {kind} chunks with a finish_reason: {text[:300]!r}"])
    return Answer("200")


def send_grpc(stub, case: GrpcCase) -> Answer:
    metadata = (("authorization", case.authorization),) if case.authorization is not None else ()
    call = getattr(stub, case.method)
    try:
        replies = call(case.request, timeout=CLIENT_TIMEOUT_S, metadata=metadata)
        replies = [replies] if case.method == "Complete" else list(replies)
    except grpc.RpcError as e:
        code, details = e.code(), e.details()
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return Answer("hang", [f"no answer within {CLIENT_TIMEOUT_S:g} s"])
        ok = code in GRPC_CLIENT_ERRORS and details
        return Answer(code.name, [] if ok else [f"{code.name}: {details}"])
    last = replies[-1] if replies else None
    if last is None or last.finish_reason == gateway_pb2.FINISH_REASON_UNSPECIFIED or not last.HasField("usage"):
        return Answer("OK", [f"OK but no finish_reason and usage at the end: {replies[-1:]}"])
    return Answer("OK")


# -- the stack afterwards ------------------------------------------------------------------------------------
def worker_epochs(kvmanager: str) -> dict[str, int]:
    """worker_id -> epoch, as the kvmanager lists its members."""
    with kvmanager_channel(kvmanager) as channel:
        stub = kvmanager_pb2_grpc.KVManagerServiceStub(channel)
        return {m.worker_id: m.epoch for m in stub.ListWorkers(kvmanager_pb2.ListWorkersRequest(), timeout=10).workers}


def trouble_lines(log: str) -> list[str]:
    """The log lines that say a worker was lost or declared dead, a step failed as a whole, or a bug was hit; for
    a traceback, the exception it ends with."""
    lines, found = log.splitlines(), []
    for i, line in enumerate(lines):
        if line.startswith("Traceback"):
            found.append(next((x for x in itertools.islice(lines, i + 1, None) if x and not x[0].isspace()), line))
        elif any(t in line for t in TROUBLE):
            found.append(line)
    return found
