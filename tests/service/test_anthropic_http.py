"""Anthropic's Messages API, driven by the official `anthropic` client (and httpx for the raw shapes) against the
HTTP front-end on port 0 over a real gateway core: the session's worker on the real model and a real kvmanager
on port 0, whose state tells what a request left behind. Greedy answers are compared with the OpenAI chat path's
over the same core (itself checked token for token against HF in tests/e2e/test_http_e2e.py)."""

from __future__ import annotations

import contextlib

import anthropic
import httpx
import openai
import pytest
from polling import wait_for

from kvserve.kvmanager import admin
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.server import start_kvmanager_server
from kvserve.kvmanager.service import KVService, NullStore
from kvserve.services.gateway.app import GatewayConfig
from kvserve.services.gateway.auth import ApiKeys
from kvserve.services.gateway.http.app import HttpFrontEnd
from kvserve.services.gateway.http.server import HttpServer
from kvserve.services.gateway.rpc.connect import connect_gateway

MODEL = "m"
KEYS = ApiKeys((("key-a", "tenant-a"), ("key-cache", "tenant-cache")))
# Anthropic's default temperature is 1: the tests ask for greedy (the client has no argument for it any more)
GREEDY = dict(extra_body={"temperature": 0})
QUESTION = [{"role": "user", "content": "What is the capital of Italy?"}]
SYSTEM = "You answer in one short sentence."
# A long system prompt: many pages (16 tokens each) of a prefix worth caching.
LONG_SYSTEM = "You are the timetable desk of a railway. " + "The night train from Paris to Vienna leaves at eight " \
              "and stops in Munich and Salzburg. " * 10


@contextlib.contextmanager
def serving(model_dir, worker_server):
    """A gateway core (a real kvmanager on port 0, the session's worker) and its HTTP front-end on a free port."""
    service = KVService(KVManager(), NullStore())
    kv_server = start_kvmanager_server(service, "127.0.0.1", 0, admin_token="t")
    gateway = connect_gateway(f"127.0.0.1:{kv_server.port}", (f"127.0.0.1:{worker_server.port}",),
                              GatewayConfig(model_dir), KEYS)
    http = HttpServer(HttpFrontEnd(gateway, MODEL).app)
    try:
        yield http, service
    finally:
        http.stop()
        gateway.close(drain_s=1.0)
        kv_server.stop(0)


@pytest.fixture(scope="module")
def served(model_dir, worker_server):
    with serving(model_dir, worker_server) as s:
        yield s


@pytest.fixture(scope="module")
def client(served):
    http, _ = served
    with anthropic.Anthropic(base_url=http.base_url.removesuffix("/v1"), api_key="key-a", max_retries=0,
                             timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def openai_client(served):
    http, _ = served
    with openai.OpenAI(base_url=http.base_url, api_key="key-a", max_retries=0, timeout=120) as c:
        yield c


def kv_state(service: KVService) -> tuple:
    """What requests hold in the kvmanager, and how many allocations it saw: used pages, live requests,
    prefix-cache queries (one per allocation)."""
    with service.lock:
        stats = admin.stats(service.manager)
    return (sum(p.num_used_pages for p in stats.pools), sum(p.num_requests for p in stats.pools),
            stats.prefix_cache_queries)


def prompt_ids(tokenizer, system: str | None, messages: list[dict]) -> list[int]:
    head = [{"role": "system", "content": system}] if system else []
    return tokenizer.encode(tokenizer.apply_chat_template(head + messages))


def test_a_message_is_the_chat_paths_greedy_answer_with_anthropics_usage(client, openai_client, tokenizer):
    reply = client.messages.create(model=MODEL, max_tokens=20, system=SYSTEM, messages=QUESTION, **GREEDY)
    chat = openai_client.chat.completions.create(model=MODEL, max_tokens=20, messages=[
        {"role": "system", "content": SYSTEM}, *QUESTION], temperature=0)
    assert reply.type == "message" and reply.role == "assistant" and reply.model == MODEL
    assert reply.id.startswith("msg_") and [b.type for b in reply.content] == ["text"]
    assert reply.content[0].text == chat.choices[0].message.content != ""
    assert reply.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    usage = reply.usage
    assert usage.output_tokens == chat.usage.completion_tokens
    assert usage.cache_creation_input_tokens == 0  # no cache_control
    assert usage.input_tokens + usage.cache_read_input_tokens == len(prompt_ids(tokenizer, SYSTEM, QUESTION))


def test_system_as_blocks_and_content_as_blocks_read_as_their_concatenation(client):
    plain = client.messages.create(model=MODEL, max_tokens=12, system=SYSTEM, messages=QUESTION, **GREEDY)
    half = len(SYSTEM) // 2
    blocks = client.messages.create(
        model=MODEL, max_tokens=12, **GREEDY,
        system=[{"type": "text", "text": SYSTEM[:half]}, {"type": "text", "text": SYSTEM[half:]}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                               {"type": "text", "text": "of Italy?"}]}])
    assert blocks.content[0].text == plain.content[0].text
    assert blocks.usage.input_tokens + blocks.usage.cache_read_input_tokens == \
        plain.usage.input_tokens + plain.usage.cache_read_input_tokens


def test_a_stream_is_anthropics_events_with_the_same_greedy_text(client):
    args = dict(model=MODEL, max_tokens=24, system=SYSTEM, messages=QUESTION, **GREEDY)
    whole = client.messages.create(**args)
    events = list(client.messages.create(stream=True, **args))  # the raw events (the client drops pings)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"} and len(kinds) > 5
    assert "".join(e.delta.text for e in events[2:-3]) == whole.content[0].text
    assert events[-2].delta.stop_reason == whole.stop_reason
    with client.messages.stream(**args) as stream:  # the client's own accumulation of the same events
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_max_tokens_and_stop_sequences_are_the_stop_reasons(client):
    short = client.messages.create(model=MODEL, max_tokens=3, messages=QUESTION, **GREEDY)
    assert (short.stop_reason, short.usage.output_tokens) == ("max_tokens", 3)
    free = client.messages.create(model=MODEL, max_tokens=24, messages=QUESTION, **GREEDY).content[0].text
    word = free.split()[2]
    cut = client.messages.create(model=MODEL, max_tokens=24, messages=QUESTION, stop_sequences=["zzz", word],
                                 **GREEDY)
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", word)
    assert cut.content[0].text == free[:free.index(word)]


BAD = [  # (body fields over a valid request, what the message says)
    ({"system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]},
     "cache_control.ttl must be one of 5m, 1h"),
    ({"tools": [{"name": "weather", "input_schema": {"type": "object"}}]}, "tools are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}, "image blocks are not supported"),
    ({"system": [{"type": "text", "text": f"part {i}. ", "cache_control": {"type": "ephemeral"}} for i in range(5)]},
     "5 blocks have cache_control; at most 4"),
    ({"model": "claude-sonnet-4-5"}, "claude-sonnet-4-5"),
    ({"max_tokens": 100000}, "above this gateway's limit"),
]


@pytest.mark.parametrize(("fields", "message"), BAD, ids=[m[:24] for _, m in BAD])
def test_bad_input_is_anthropics_error_and_leaves_nothing_behind(served, fields, message):
    http, service = served
    before = wait_for(lambda: (state := kv_state(service))[:2] == (0, 0) and state, "no request holding pages")
    body = {"model": MODEL, "max_tokens": 8, "messages": QUESTION, **fields}
    reply = httpx.post(http.base_url + "/messages", json=body, headers={"x-api-key": "key-a"}, timeout=60)
    status, kind = (404, "not_found_error") if "model" in fields else (400, "invalid_request_error")
    assert reply.status_code == status, reply.text
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and set(error["error"]) == {"type", "message"}
    assert message in error["error"]["message"]
    assert kv_state(service) == before  # no page held, no request live, no allocation ever asked for


def test_a_missing_or_unknown_key_is_401_in_anthropics_shape(served, client):
    http, service = served
    before = wait_for(lambda: (state := kv_state(service))[:2] == (0, 0) and state, "no request holding pages")
    body = {"model": MODEL, "max_tokens": 8, "messages": QUESTION}
    missing = httpx.post(http.base_url + "/messages", json=body, timeout=60)
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    assert "x-api-key" in missing.json()["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError) as e:  # the official client's own view of the 401
        with anthropic.Anthropic(base_url=http.base_url.removesuffix("/v1"), api_key="nope", max_retries=0) as c:
            c.messages.create(model=MODEL, max_tokens=8, messages=QUESTION)
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError, match="tools are not supported"):
        client.messages.create(model=MODEL, max_tokens=8, messages=QUESTION, tools=[
            {"name": "weather", "input_schema": {"type": "object"}}])
    # a bearer key is the same tenant's key
    bearer = httpx.post(http.base_url + "/messages", json=body, headers={"authorization": "Bearer key-a"},
                        timeout=60)
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"
    assert wait_for(lambda: kv_state(service)[:2] == before[:2], "the bearer request's pages freed")


def flood_text(i: int) -> str:
    """~2,000 tokens no other prompt shares: three of them pass 1.5x the test worker's pool (256 pages of 16)."""
    return f"Flood {i}. " + " ".join(f"item{i}-{j}" for j in range(480))


def test_cache_control_creates_then_reads_the_pinned_prefix_after_a_flood(served, tokenizer):
    """The first request pins its long system prompt (cache_creation_input_tokens); the same tenant then floods
    the pool with 1.5x its pages of unique prompts, which evicts an unpinned prefix sent beside it; the pinned one
    is read back (cache_read_input_tokens). A tenant of its own, so no earlier test's cache counts."""
    http, _ = served
    system = [{"type": "text", "text": LONG_SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    control = "You are the timetable desk of a ferry. " + "The ferry to the island leaves at noon. " * 20
    num_prompt = len(prompt_ids(tokenizer, LONG_SYSTEM, QUESTION))
    assert len(tokenizer.encode(LONG_SYSTEM)) >= 8 * 16  # several pages of the worker's 16-token pages
    assert sum(len(tokenizer.encode(flood_text(i))) for i in range(3)) >= 1.5 * 256 * 16
    with anthropic.Anthropic(base_url=http.base_url.removesuffix("/v1"), api_key="key-cache", max_retries=0,
                             timeout=120) as c:
        first = c.messages.create(model=MODEL, max_tokens=4, system=system, messages=QUESTION, **GREEDY)
        c.messages.create(model=MODEL, max_tokens=1, system=control, messages=QUESTION, **GREEDY)
        for i in range(3):
            c.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": flood_text(i)}],
                              **GREEDY)
        unpinned = c.messages.create(model=MODEL, max_tokens=1, system=control, messages=QUESTION, **GREEDY)
        second = c.messages.create(model=MODEL, max_tokens=4, system=system, messages=QUESTION, **GREEDY)
    assert unpinned.usage.cache_read_input_tokens == 0  # the flood evicted what no pin held
    assert first.usage.cache_read_input_tokens == 0
    assert first.usage.cache_creation_input_tokens >= 8 * 16
    assert first.usage.cache_creation.ephemeral_1h_input_tokens == first.usage.cache_creation_input_tokens
    assert second.usage.cache_read_input_tokens >= first.usage.cache_creation_input_tokens
    assert second.usage.cache_creation_input_tokens == 0
    for u in (first.usage, second.usage):
        assert u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens == num_prompt
    assert second.content[0].text == first.content[0].text
