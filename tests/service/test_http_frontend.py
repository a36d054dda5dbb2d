"""The HTTP front-end in-process, over a real gateway core (a real worker and kvmanager on port 0): the request
bodies' parsing, the 503s of a draining gateway, the metrics by endpoint and status, and an asyncio consumer
of a request handle."""

from __future__ import annotations

import contextlib

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.common.metrics import GatewayMetrics
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.server import start_kvmanager_server
from kvserve.kvmanager.service import KVService, NullStore
from kvserve.services.gateway.app import GatewayConfig
from kvserve.services.gateway.auth import ApiKeys
from kvserve.services.gateway.http.app import HttpFrontEnd
from kvserve.services.gateway.http.protocol import ChatCompletionRequest, CompletionRequest, ParamError, parse
from kvserve.services.gateway.http.server import HttpServer
from kvserve.services.gateway.rpc.connect import connect_gateway


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"prompt": 5}, "prompt", "prompt must be a string or a list of token ids"),
    ({"prompt": [1, -2]}, "prompt", "prompt must be"),
    ({"prompt": "x", "stop": ["a", 3]}, "stop", "stop must be a string or a list of strings"),
    ({"prompt": "x", "temperature": "hot"}, "temperature", "valid number"),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens", "valid integer"),
    ({"prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty", "not supported"),
    ({"prompt": "x", "logit_bias": {"1": 2}}, "logit_bias", "not supported"),
    ({}, "prompt", "Field required"),
])
def test_completion_bodies_that_are_wrong_name_their_field(body, param, message):
    with pytest.raises(ParamError, match=message) as e:
        parse(CompletionRequest, body)
    assert e.value.param == param


def test_completion_body_to_input():
    inp = parse(CompletionRequest, {"prompt": [[3, 4, 5]], "max_tokens": 7, "stop": "\n", "logprobs": 2,
                                    "top_k": -1, "seed": 9, "ignore_eos": True}).to_input()
    assert inp.prompt_token_ids == (3, 4, 5) and inp.prompt is None and inp.messages is None
    assert (inp.max_tokens, inp.stop, inp.logprobs, inp.ignore_eos) == (7, ("\n",), True, True)
    assert (inp.sampling.top_k, inp.sampling.top_logprobs, inp.sampling.seed) == (0, 2, 9)
    assert inp.sampling.temperature == 1.0  # OpenAI's default, not gRPC's greedy


def test_chat_body_to_input():
    req = parse(ChatCompletionRequest, {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}],
        "max_tokens": 3, "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 4, "temperature": 0})
    inp = req.to_input()
    assert inp.messages == (("system", "Be brief."), ("user", "Hello there"))
    assert inp.max_tokens == 5 and inp.logprobs and inp.sampling.top_logprobs == 4 and inp.sampling.greedy
    with pytest.raises(ParamError, match="messages.0.content must be a string or a list of text parts"):
        parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})


@contextlib.contextmanager
def serving(model_dir, worker_server, cfg: GatewayConfig, keys: ApiKeys, metrics: GatewayMetrics | None = None):
    """A gateway core (a real kvmanager on port 0, the session's worker) and its HTTP front-end on a free port."""
    service = KVService(KVManager(), NullStore())
    kv_server = start_kvmanager_server(service, "127.0.0.1", 0, admin_token="t")
    gateway = connect_gateway(f"127.0.0.1:{kv_server.port}", (f"127.0.0.1:{worker_server.port}",), cfg, keys)
    http = HttpServer(HttpFrontEnd(gateway, "m", metrics).app)
    try:
        yield http, gateway
    finally:
        http.stop()
        if not gateway.closing:  # a test may have closed it
            gateway.close(drain_s=1.0)
        kv_server.stop(0)


@pytest.fixture
def served(model_dir, worker_server):
    """The gateway of one key, with metrics."""
    metrics = GatewayMetrics()
    with serving(model_dir, worker_server, GatewayConfig(model_dir), ApiKeys((("key-a", "tenant-a"),)),
                 metrics) as (http, gateway):
        yield http, gateway, metrics


def samples(metrics: GatewayMetrics) -> dict:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_requests_are_counted_by_endpoint_and_status(served):
    http, _, metrics = served
    auth = {"authorization": "Bearer key-a"}
    with httpx.Client(base_url=http.base_url, timeout=60) as c:
        assert c.post("/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=auth).status_code == 200
        assert c.post("/completions", json={"prompt": "Hi"}).status_code == 401
        assert c.get("/models/other", headers=auth).status_code == 404
        assert c.get("/no/such/path").status_code == 404
    got = samples(metrics)
    count = "kvserve:http_requests_total"
    assert got[(count, (("endpoint", "/v1/completions"), ("status", "200")))] == 1
    assert got[(count, (("endpoint", "/v1/completions"), ("status", "401")))] == 1
    assert got[(count, (("endpoint", "/v1/models/{model:path}"), ("status", "404")))] == 1
    assert got[(count, (("endpoint", "other"), ("status", "404")))] == 1
    assert got[("kvserve:http_request_duration_seconds_count", (("endpoint", "/v1/completions"),))] == 2


def test_a_draining_gateway_answers_503(served):
    http, gateway, _ = served
    gateway.close(drain_s=0.0)
    with httpx.Client(base_url=http.base_url, timeout=60) as c:
        assert c.get(http.base_url.removesuffix("/v1") + "/health").status_code == 503
        reply = c.post("/completions", json={"prompt": "Hi", "max_tokens": 2},
                       headers={"authorization": "Bearer key-a"})
    assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
    assert reply.json()["error"]["type"] == "service_unavailable"
    assert "shutting down" in reply.json()["error"]["message"]


def test_a_full_queue_is_429_over_http_and_gateway_busy_in_the_core(model_dir, worker_server):
    """One request runs (max_num_seqs 1) and one waits (max_queued_requests 1): a third is refused, by the core
    with GatewayBusy and by the HTTP front-end with 429 and Retry-After."""
    from kvserve.common.wire.worker import SamplingParams
    from kvserve.services.gateway.errors import GatewayBusy
    from kvserve.services.gateway.validate import GenerateInput

    def long():
        return GenerateInput(prompt="Count:", messages=None, sampling=SamplingParams(), max_tokens=300,
                             ignore_eos=True)

    cfg = GatewayConfig(model_dir, max_num_seqs=1, max_queued_requests=1)
    with serving(model_dir, worker_server, cfg, ApiKeys()) as (http, gateway):
        running = gateway.submit(long(), "default")
        deltas = iter(running)
        while not next(deltas).token_ids:
            pass
        queued = gateway.submit(long(), "default")
        with pytest.raises(GatewayBusy, match="--max-queued-requests"):
            gateway.submit(long(), "default")
        refused = httpx.post(http.base_url + "/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=60)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert "--max-queued-requests" in refused.json()["error"]["message"]
        running.cancel()
        queued.cancel()


def test_chat_logprobs_and_usage_in_openai_shapes():
    from kvserve.common.wire.worker import SampledToken
    from kvserve.services.gateway.handle import OutputDelta, Usage
    from kvserve.services.gateway.http.render import Rendering
    from kvserve.services.gateway.request import FinishReason

    texts = {5: "Hi", 6: "é"}
    r = Rendering(chat=True, req_id="req-1", model="m", token_text=texts.__getitem__, created=7)
    sampled = [SampledToken("req-1", 5, -0.5, [(5, -0.5), (6, -1.5)])]
    body = r.response("Hi", sampled, FinishReason.EOS, Usage(prompt_tokens=10, num_cached_tokens=8,
                                                             completion_tokens=1))
    assert body["id"] == "chatcmpl-req-1" and body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hi"} and choice["finish_reason"] == "stop"
    assert choice["logprobs"]["content"] == [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": [
        {"token": "Hi", "logprob": -0.5, "bytes": [72, 105]}, {"token": "é", "logprob": -1.5, "bytes": [195, 169]}]}]
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11,
                             "prompt_tokens_details": {"cached_tokens": 8}}
    first = r.role_chunk(include_usage=False)
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"] == {"content": "",
                                                                                             "role": "assistant"}
    chunk = r.chunk(OutputDelta(text="Hi", token_ids=[5], logprobs=sampled), with_logprobs=False, include_usage=True)
    assert chunk["choices"][0]["delta"] == {"content": "Hi"} and chunk["choices"][0]["logprobs"] is None
    assert chunk["usage"] is None
