"""The gRPC API's cache pins and cache key, through the client SDK: its keyword arguments -> GenerateRequest ->
the servicer's GenerateInput, usage.pinned_tokens back; and a real gateway server on port 0 (over rule workers,
tests/support/engine_fakes.py), whose kvmanager records the pins each allocation carries, served by the sync and
the asyncio client."""

from __future__ import annotations

import asyncio

import pytest
from engine_fakes import PagedRuleWorker, PinRecordingKV

from kvserve.common.wire.pages import PinPoint
from kvserve.services.client import AsyncClient, CachePin, Client, InvalidArgument, build_request
from kvserve.services.client.types import completion_from_response, delta_from_response
from kvserve.services.gateway.app import Gateway, GatewayConfig
from kvserve.services.gateway.auth import ApiKeys
from kvserve.services.gateway.handle import Usage
from kvserve.services.gateway.rpc.server import start_gateway_server
from kvserve.services.gateway.rpc.servicer import input_from_proto, usage_to_proto
from kvserve.v1 import gateway_pb2

PAGE_SIZE = 4  # the rule workers'

def test_pins_and_key_reach_the_gateways_input_as_sent():
    request = build_request("Hello", cache_pins=[(0, 86400), CachePin(num_tokens=32, ttl_s=300)], cache_key="doc")
    inp = input_from_proto(gateway_pb2.GenerateRequest.FromString(request.SerializeToString()))
    assert inp.pins == (PinPoint(0, 86400), PinPoint(32, 300)) and inp.cache_key == "doc"
    plain = input_from_proto(build_request("Hello"))
    assert plain.pins == () and plain.cache_key == ""
    negative = input_from_proto(build_request("Hello", cache_pins=[(-1, 60)]))
    assert negative.pins == (PinPoint(-1, 60),)  # sent as is: the gateway's validation refuses it


@pytest.mark.parametrize("pins", [[(1,)], [("all", 60)], [5], [(1, 2**40)]])
def test_a_malformed_pin_is_a_value_error_naming_it(pins):
    with pytest.raises(ValueError, match=r"cache_pins\[0\]"):
        build_request("Hello", cache_pins=pins)


def test_pinned_tokens_come_back_in_usage():
    usage = usage_to_proto(Usage(prompt_tokens=40, num_cached_tokens=16, completion_tokens=5, num_pinned_tokens=32))
    response = gateway_pb2.GenerateResponse(req_id="r", usage=usage, finish_reason=gateway_pb2.FINISH_REASON_LENGTH)
    wire = gateway_pb2.GenerateResponse.FromString(response.SerializeToString())
    for got in (completion_from_response(wire).usage, delta_from_response(wire).usage):
        assert (got.prompt_tokens, got.cached_tokens, got.completion_tokens, got.pinned_tokens) == (40, 16, 5, 32)


@pytest.fixture
def served(model_dir):
    """(the gateway's address, the gateway, its kvmanager); key-a is tenant a."""
    kv = PinRecordingKV()
    gateway = Gateway(GatewayConfig(model_dir), ApiKeys((("key-a", "a"),)), kv,
                      [PagedRuleWorker(f"w{i}", num_pages=64, page_size=PAGE_SIZE) for i in range(2)])
    server = start_gateway_server(gateway, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.port}", gateway, kv
    finally:
        server.stop(1.0)
        gateway.close(drain_s=1.0)


def test_the_clients_pins_reach_the_kvmanager_and_the_key_its_placement(served):
    address, gateway, kv = served
    with Client(address, api_key="key-a", timeout_s=30) as client:
        done = client.complete("The ferry was late again", max_tokens=3, ignore_eos=True,
                               cache_pins=[(0, 3600), CachePin(4, 60)], cache_key="ferry")
        assert done.finish_reason == "length" and len(done.token_ids) == 3
        prompt_tokens = done.usage.prompt_tokens
        assert kv.pins[done.req_id] == (PinPoint(prompt_tokens, 3600), PinPoint(4, 60))  # 0 = the whole prompt
        assert done.usage.pinned_tokens == prompt_tokens // PAGE_SIZE * PAGE_SIZE  # the prompt's full pages
        deltas = list(client.generate("The ferry was late again", max_tokens=3, ignore_eos=True))
        assert kv.pins[deltas[-1].req_id] == () and deltas[-1].usage.pinned_tokens == 0  # hit, not pinned by it
        assert deltas[-1].usage.cached_tokens == done.usage.pinned_tokens
        with pytest.raises(InvalidArgument, match="ttl"):
            client.complete("The ferry", max_tokens=1, cache_pins=[(0, 0)])
    idle = {e.info.worker_id: 0 for e in gateway.engines}
    assert gateway.affinity.worker_for("a", "ferry", idle) is not None


def test_the_async_client_sends_pins_and_key_too(served):
    address, gateway, kv = served

    async def run():
        async with AsyncClient(address, api_key="key-a", timeout_s=30) as client:
            stream = await client.generate(prompt_token_ids=[300, 301, 302, 303, 304, 305], max_tokens=2,
                                           ignore_eos=True, cache_pins=[CachePin(0, 120)], cache_key="ids")
            return [delta async for delta in stream]

    deltas = asyncio.run(run())
    assert deltas[-1].finish_reason == "length"
    assert kv.pins[deltas[-1].req_id] == (PinPoint(6, 120),)
    assert gateway.affinity.worker_for("a", "ids", {e.info.worker_id: 0 for e in gateway.engines}) is not None
