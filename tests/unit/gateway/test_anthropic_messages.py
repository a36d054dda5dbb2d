"""Anthropic's Messages API without the model: the request body's parsing and refusals, cache_control breakpoints
as pins (over the real tokenizer and chat template), usage arithmetic, stop sequences, the error table, the
x-api-key, and the stream's event sequence over a request handle fed by hand."""

from __future__ import annotations

import json

import anyio
import pytest

from kvserve.common.errors import Unauthenticated
from kvserve.common.wire.pages import PinPoint
from kvserve.services.gateway.auth import ApiKeys
from kvserve.services.gateway.errors import GatewayBusy, OutOfCapacity, ShuttingDown
from kvserve.services.gateway.handle import OutputDelta, RequestHandle, Usage
from kvserve.services.gateway.http import anthropic_responses as anthropic
from kvserve.services.gateway.http.anthropic_protocol import MessagesRequest
from kvserve.services.gateway.http.errors import BodyTooLarge, ModelNotFound
from kvserve.services.gateway.http.protocol import ParamError, parse
from kvserve.services.gateway.request import FinishReason, Request, RequestParams

USER = [{"role": "user", "content": "Hi"}]


def body(**fields) -> dict:
    return {"max_tokens": 8, "messages": USER, **fields}


def cached(text: str, ttl: str | None = None) -> dict:
    control = {"type": "ephemeral"} if ttl is None else {"type": "ephemeral", "ttl": ttl}
    return {"type": "text", "text": text, "cache_control": control}


def test_body_to_input_joins_blocks_and_leads_with_the_system_turn(tokenizer):
    req = parse(MessagesRequest, {
        "model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "you"}]},
                     {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Bye"}],
        "stop_sequences": ["\n\n"], "top_k": 3, "metadata": {"user_id": "u1"}})
    inp = req.to_input(tokenizer)
    assert inp.messages == (("system", "Be brief."), ("user", "Hello you"), ("assistant", "Hi."), ("user", "Bye"))
    assert (inp.max_tokens, inp.stop, inp.pins, inp.prompt) == (5, ("\n\n",), (), None)
    assert (inp.sampling.temperature, inp.sampling.top_k, inp.sampling.top_p) == (1.0, 3, 1.0)  # Anthropic's default
    assert parse(MessagesRequest, body(system="Be brief.", temperature=0)).to_input(tokenizer).messages == (
        ("system", "Be brief."), ("user", "Hi"))
    assert parse(MessagesRequest, body(temperature=0)).to_input(tokenizer).sampling.greedy


BAD = [  # (body, what the message says)
    (body(tools=[{"name": "f", "input_schema": {}}]), "tools are not supported"),
    (body(tool_choice={"type": "auto"}), "tool_choice is not supported"),
    (body(thinking={"type": "enabled", "budget_tokens": 1024}), "extended thinking is not supported"),
    (body(output_config={"format": {"type": "json_schema", "schema": {}}}), "structured outputs"),
    (body(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type":
                                                                              "image/png", "data": "AA=="}}]}]),
     "messages.0.content.0: image blocks are not supported"),
    (body(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "document"}]}]),
     "messages.0.content.1: document blocks are not supported"),
    (body(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]),
     "tool_result blocks are not supported"),
    (body(system=[{"type": "image"}]), "system.0: image blocks are not supported"),
    (body(system=5), "system must be a string or a list of text blocks"),
    (body(messages=[{"role": "user", "content": 5}]), "messages.0.content must be a string or a list of text"),
    (body(system=[cached("s", ttl="10m")]), "cache_control.ttl must be one of 5m, 1h"),
    (body(messages=[{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {
        "type": "persistent"}}]}]), "cache_control.type must be 'ephemeral'"),
    (body(system=[cached("a"), cached("b"), cached("c")], messages=[{"role": "user", "content": [
        cached("d"), cached("e")]}]), "5 blocks have cache_control; at most 4"),
    (body(system=[cached("a"), cached("b"), cached("c"), cached("d")], cache_control={"type": "ephemeral"}),
     "5 blocks have cache_control; at most 4"),
    ({"messages": USER}, "max_tokens: Field required"),
    (body(max_tokens=0), "max_tokens"),
    (body(temperature=1.5), "temperature"),
    (body(messages=[{"role": "system", "content": "x"}]), "messages.0.role"),
    (body(messages=[]), "at least one message"),
    (body(messages=[*USER, {"role": "assistant", "content": "Sure,"}]), "prefill"),
]


@pytest.mark.parametrize(("fields", "message"), BAD, ids=[m[:32] for _, m in BAD])
def test_bodies_that_are_wrong_or_not_text_are_refused_naming_why(fields, message):
    with pytest.raises(ParamError, match=message.replace("(", r"\(")):
        parse(MessagesRequest, fields)


def prompt_text(tokenizer, messages) -> str:
    return tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages])


def test_a_breakpoint_pins_the_prompt_tokens_through_its_block(tokenizer):
    """The pin of a block is as many tokens as the prompt's text up to the block's end encodes to: a block's
    text tokenises the same alone as followed by the next (each starts at a word), so the count is exact."""
    req = parse(MessagesRequest, {"max_tokens": 4, "system": [cached("You are terse.", ttl="1h")], "messages": [
        {"role": "user", "content": [cached("Hello there."), {"type": "text", "text": " How are you?"}]}]})
    inp = req.to_input(tokenizer)
    full = prompt_text(tokenizer, inp.messages)
    prompt_ids = tokenizer.encode(full)
    system_end = full.index("You are terse.") + len("You are terse.<|im_end|>\n")
    block_end = full.index("Hello there.") + len("Hello there.")
    assert inp.pins == (PinPoint(len(tokenizer.encode(full[:system_end])), 3600),
                        PinPoint(len(tokenizer.encode(full[:block_end])), 300))
    assert prompt_ids[:inp.pins[1].num_tokens] == tokenizer.encode(full[:block_end])
    assert 0 < inp.pins[0].num_tokens < inp.pins[1].num_tokens < len(prompt_ids)


def test_top_level_cache_control_marks_the_last_block(tokenizer):
    req = parse(MessagesRequest, body(system="Sys.", cache_control={"type": "ephemeral", "ttl": "1h"}))
    inp = req.to_input(tokenizer)
    full = prompt_text(tokenizer, inp.messages)
    turn_end = full.rindex("Hi") + len("Hi<|im_end|>\n")  # the turn's end is the prompt's too: cached with it
    assert inp.pins == (PinPoint(len(tokenizer.encode(full[:turn_end])), 3600),)
    assert inp.pins[0].num_tokens < len(tokenizer.encode(full))  # the generation prompt is not
    # the same block marked twice is one breakpoint
    twice = body(messages=[{"role": "user", "content": [cached("Hi")]}], cache_control={"type": "ephemeral"})
    assert len(parse(MessagesRequest, twice).to_input(tokenizer).pins) == 1


def test_usage_parts_add_up_to_the_prompt():
    pins = (PinPoint(64, 300),)
    created = anthropic.usage_body(Usage(prompt_tokens=100, num_cached_tokens=16, completion_tokens=5,
                                         num_pinned_tokens=64), pins)
    assert created == {"input_tokens": 36, "cache_creation_input_tokens": 48, "cache_read_input_tokens": 16,
                       "output_tokens": 5, "cache_creation": {"ephemeral_5m_input_tokens": 48,
                                                              "ephemeral_1h_input_tokens": 0}}
    read = anthropic.usage_body(Usage(100, 64, 5, 64), pins)  # the same prompt again: read, nothing created
    assert (read["input_tokens"], read["cache_creation_input_tokens"], read["cache_read_input_tokens"]) == (36, 0, 64)
    unpinned = anthropic.usage_body(Usage(100, 32, 5, 64), ())  # no cache_control: a pin hit is a read alone
    assert (unpinned["input_tokens"], unpinned["cache_creation_input_tokens"]) == (68, 0)
    split = anthropic.usage_body(Usage(100, 16, 5, 80), (PinPoint(48, 3600), PinPoint(80, 300)))
    assert split["cache_creation"] == {"ephemeral_5m_input_tokens": 32, "ephemeral_1h_input_tokens": 32}
    assert split["input_tokens"] + split["cache_creation_input_tokens"] + split["cache_read_input_tokens"] == 100


def rendering(stops=(), pins=()) -> anthropic.MessageRendering:
    return anthropic.MessageRendering("req-abc", "m", pins, stops, decode=lambda ids: "".join(chr(i) for i in ids))


def test_stop_reasons_and_the_stop_sequence_that_cut_the_text():
    r = rendering(stops=("zz", "END"))
    assert r.stop_sequence(FinishReason.STOP, "ab", [ord(c) for c in "abEND"]) == "END"
    assert r.stop_sequence(FinishReason.EOS, "ab", [97, 98]) is None
    usage = anthropic.usage_body(Usage(10, 0, 2), ())
    message = r.message("ab", FinishReason.STOP, "END", usage)
    assert message == {"id": "msg_abc", "type": "message", "role": "assistant", "model": "m",
                       "content": [{"type": "text", "text": "ab"}], "stop_reason": "stop_sequence",
                       "stop_sequence": "END", "usage": usage}
    assert r.message("", FinishReason.LENGTH, None, usage)["stop_reason"] == "max_tokens"
    assert r.message("", FinishReason.EOS, None, usage)["stop_reason"] == "end_turn"


@pytest.mark.parametrize(("error", "status", "kind"), [
    (ParamError("bad"), 400, "invalid_request_error"), (Unauthenticated("who"), 401, "authentication_error"),
    (ModelNotFound("no"), 404, "not_found_error"), (BodyTooLarge("big"), 413, "request_too_large"),
    (OutOfCapacity("full"), 429, "rate_limit_error"), (GatewayBusy("busy"), 529, "overloaded_error"),
    (ShuttingDown("bye"), 503, "overloaded_error"), (RuntimeError("bug"), 500, "api_error")])
def test_errors_in_anthropic_shape(error, status, kind):
    reply = anthropic.error_response(error)
    assert reply.status_code == status
    assert json.loads(reply.body) == {"type": "error", "error": {"type": kind, "message": anthropic.error_body(
        error)["error"]["message"]}}
    assert ("retry-after" in reply.headers) == (status in (429, 503, 529))


def test_x_api_key_names_the_tenant_as_a_bearer_key_does():
    keys = ApiKeys((("key-a", "tenant-a"),))
    assert keys.tenant_for({"x-api-key": "key-a"}) == keys.tenant_for({"authorization": "Bearer key-a"}) == "tenant-a"
    with pytest.raises(Unauthenticated, match="x-api-key"):
        keys.tenant_for({})
    with pytest.raises(Unauthenticated, match="unknown"):
        keys.tenant_for({"x-api-key": "nope"})


def run_response(response) -> tuple[int, bytes]:
    """An ASGI response run to its end against a client that never disconnects: (status, body)."""
    sent = []

    async def receive():
        await anyio.sleep_forever()

    async def send(message):
        sent.append(message)

    anyio.run(response, {"type": "http"}, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def handle_with(deltas: list[OutputDelta]) -> RequestHandle:
    req = Request("req-abc", "t", [1, 2, 3, 4], RequestParams(max_tokens=8))
    handle = RequestHandle(req, "w", cancel=lambda req_id: None)
    for d in deltas:
        handle.put(d)
    return handle


def events(data: bytes) -> list[tuple[str, dict]]:
    out = []
    for chunk in data.decode().strip().split("\n\n"):
        name, payload = chunk.split("\n")
        out.append((name.removeprefix("event: "), json.loads(payload.removeprefix("data: "))))
    return out


def test_a_stream_is_anthropics_event_sequence():
    usage = Usage(prompt_tokens=4, num_cached_tokens=0, completion_tokens=2)
    handle = handle_with([OutputDelta("Hel", [1]), OutputDelta("", [2]), OutputDelta("lo", [3]),
                          OutputDelta(finish_reason=FinishReason.LENGTH, usage=usage)])
    status, data = run_response(anthropic.MessageStream(handle, rendering()))
    got = events(data)
    assert status == 200 and [name for name, _ in got] == [
        "message_start", "content_block_start", "ping", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    assert all(payload["type"] == name for name, payload in got)
    start = got[0][1]["message"]
    assert (start["id"], start["content"], start["stop_reason"], start["usage"]["input_tokens"]) == (
        "msg_abc", [], None, 4)
    assert [p["delta"] for _, p in got[3:5]] == [{"type": "text_delta", "text": "Hel"},
                                                 {"type": "text_delta", "text": "lo"}]
    delta = got[6][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"] == anthropic.usage_body(usage, ())


def test_a_request_that_fails_midway_ends_its_stream_with_an_error_event():
    failed = OutputDelta(finish_reason=FinishReason.ERROR, error=ShuttingDown("the gateway is shutting down"))
    status, data = run_response(anthropic.MessageStream(handle_with([OutputDelta("a", [1]), failed]), rendering()))
    got = events(data)
    assert status == 200 and got[-1] == ("error", {"type": "error", "error": {
        "type": "overloaded_error", "message": "the gateway is shutting down"}})
    status, data = run_response(anthropic.WholeMessage(handle_with([failed]), rendering()))
    assert status == 503 and json.loads(data)["error"]["type"] == "overloaded_error"
