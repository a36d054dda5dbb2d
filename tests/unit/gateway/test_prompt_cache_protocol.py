"""OpenAI's prompt caching fields on the HTTP front-end: prompt_cache_key (placement affinity within the tenant)
and prompt_cache_retention ("24h": a day's soft pin of the whole prompt), parsed into GenerateInput, validated,
and over HTTP to a gateway on two rule workers (tests/support/engine_fakes.py) whose kvmanager records the pins
its allocations carry."""

from __future__ import annotations

import pytest
from engine_fakes import PagedRuleWorker, PinRecordingKV
from starlette.testclient import TestClient

from kvserve.common.errors import InvalidRequest
from kvserve.common.wire.pages import PinPoint
from kvserve.services.gateway.app import Gateway, GatewayConfig
from kvserve.services.gateway.auth import ApiKeys
from kvserve.services.gateway.http.app import HttpFrontEnd
from kvserve.services.gateway.http.protocol import ChatCompletionRequest, CompletionRequest, ParamError, parse
from kvserve.services.gateway.validate import MAX_CACHE_KEY_CHARS, Limits, validate_request

DAY_S = 24 * 3600
CHAT = {"messages": [{"role": "user", "content": "Hello there"}]}
COMPLETION = {"prompt": "Hello there"}


@pytest.mark.parametrize("body", [CHAT, COMPLETION], ids=["chat", "completion"])
def test_retention_24h_pins_the_whole_prompt_for_a_day_and_the_key_is_passed_on(body):
    model = ChatCompletionRequest if "messages" in body else CompletionRequest
    inp = parse(model, body | {"prompt_cache_key": "doc-7", "prompt_cache_retention": "24h"}).to_input()
    assert inp.pins == (PinPoint(num_tokens=0, ttl_s=DAY_S),) and inp.cache_key == "doc-7"
    for retention in ({"prompt_cache_retention": "in_memory"}, {"prompt_cache_retention": None}, {}):
        inp = parse(model, body | retention).to_input()
        assert inp.pins == () and inp.cache_key == ""


@pytest.mark.parametrize("value", ["1h", "24H", "in-memory", "", 24, ["24h"]])
def test_a_retention_other_than_in_memory_or_24h_names_the_field(value):
    with pytest.raises(ParamError, match="prompt_cache_retention") as e:
        parse(CompletionRequest, COMPLETION | {"prompt_cache_retention": value})
    assert e.value.param == "prompt_cache_retention"


def test_a_key_that_is_not_a_string_names_the_field():
    with pytest.raises(ParamError) as e:
        parse(ChatCompletionRequest, CHAT | {"prompt_cache_key": 7})
    assert e.value.param == "prompt_cache_key"


def test_validation_bounds_the_key_and_cuts_the_pin_to_the_prompt(tokenizer):
    limits = Limits(max_model_len=256, max_pool_tokens=1024)
    body = COMPLETION | {"prompt_cache_retention": "24h"}
    longest = parse(CompletionRequest, body | {"prompt_cache_key": "k" * MAX_CACHE_KEY_CHARS}).to_input()
    req = validate_request(longest, "a", tokenizer, limits)
    assert req.cache_key == "k" * MAX_CACHE_KEY_CHARS
    assert req.pins == (PinPoint(len(req.prompt_token_ids), DAY_S),)  # 0 = the whole prompt
    too_long = parse(CompletionRequest, body | {"prompt_cache_key": "k" * (MAX_CACHE_KEY_CHARS + 1)}).to_input()
    with pytest.raises(InvalidRequest, match="prompt_cache_key") as e:
        validate_request(too_long, "a", tokenizer, limits)
    assert e.value.param == "prompt_cache_key"


@pytest.fixture
def http(model_dir):
    """(an HTTP client of the front-end, its gateway over w0 and w1, the kvmanager); keys key-a and key-b."""
    kv = PinRecordingKV()
    gateway = Gateway(GatewayConfig(model_dir), ApiKeys((("key-a", "a"), ("key-b", "b"))), kv,
                      [PagedRuleWorker(f"w{i}", num_pages=64) for i in range(2)])
    try:
        with TestClient(HttpFrontEnd(gateway, "m").app) as client:
            yield client, gateway, kv
    finally:
        gateway.close(drain_s=1.0)


def post(client, path: str, body: dict, key: str = "key-a"):
    return client.post(path, json=body | {"max_tokens": 3, "ignore_eos": True},
                       headers={"authorization": f"Bearer {key}"})


def test_over_http_24h_retention_reaches_the_kvmanager_as_a_pin_of_the_whole_prompt(http):
    client, gateway, kv = http
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        reply = post(client, path, body | {"prompt_cache_key": "doc", "prompt_cache_retention": "24h"})
        assert reply.status_code == 200, reply.text
        usage = reply.json()["usage"]
        assert usage["completion_tokens"] == 3 and "cached_tokens" in usage["prompt_tokens_details"]
        assert kv.pins[reply.json()["id"].split("-", 1)[1]] == (PinPoint(usage["prompt_tokens"], DAY_S),)
        unpinned = post(client, path, body)
        assert unpinned.status_code == 200 and kv.pins[unpinned.json()["id"].split("-", 1)[1]] == ()
    idle = {e.info.worker_id: 0 for e in gateway.engines}
    assert gateway.affinity.worker_for("a", "doc", idle) is not None  # the key was remembered, for a alone
    assert gateway.affinity.worker_for("b", "doc", idle) is None


def test_over_http_a_bad_retention_or_key_is_400_naming_the_field(http):
    client, _, kv = http
    reply = post(client, "/v1/chat/completions", CHAT | {"prompt_cache_retention": "7d"})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "prompt_cache_retention" and "7d" in reply.json()["error"]["message"]
    reply = post(client, "/v1/completions", COMPLETION | {"prompt_cache_key": "k" * (MAX_CACHE_KEY_CHARS + 1)})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt_cache_key"
    assert kv.pins == {}  # neither was admitted
