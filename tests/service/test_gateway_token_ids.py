"""Token ids as a prompt through the gateway's gRPC API (GenerateRequest.prompt_token_ids), with the SDK over a
real channel to a gateway in this process, a real worker and a real kvmanager (all on port 0).

- Greedy, the ids of a text generate the same tokens and text as the text itself, streamed and unary.
- An id at or above the vocabulary size, or no id at all, is INVALID_ARGUMENT with the gateway core's message
  (kvserve/services/gateway/validate.py), and leaves no page or request behind.
"""

from __future__ import annotations

import pytest

from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.server import start_kvmanager_server
from kvserve.kvmanager.service import KVService, NullStore
from kvserve.services.client import Client, InvalidArgument
from kvserve.services.gateway.app import GatewayConfig
from kvserve.services.gateway.auth import ApiKeys
from kvserve.services.gateway.rpc.connect import connect_gateway
from kvserve.services.gateway.rpc.server import start_gateway_server

PROMPT = "The history of the railway in Europe began in the early nineteenth century, when the first steam"
MAX_TOKENS = 4
TIMEOUT_S = 120  # a guard for 2 busy cores, not a measure


@pytest.fixture(scope="module")
def stack(model_dir, worker_server):
    """(SDK client, gateway, its worker's pool in the kvmanager)."""
    service = KVService(KVManager(), NullStore())
    kvmanager = start_kvmanager_server(service, "127.0.0.1", 0, admin_token="t")
    gateway = connect_gateway(f"127.0.0.1:{kvmanager.port}", (f"127.0.0.1:{worker_server.port}",),
                              GatewayConfig(model_dir), ApiKeys())
    server = start_gateway_server(gateway, "127.0.0.1", 0)
    pool = next(iter(service.manager.pools.values()))
    with Client(f"127.0.0.1:{server.port}", timeout_s=TIMEOUT_S) as client:
        yield client, gateway, pool
    server.stop(1.0)
    gateway.close(drain_s=1.0)
    kvmanager.stop(0)


def assert_nothing_left(gateway, pool) -> None:
    assert all(engine.idle.wait(TIMEOUT_S) for engine in gateway.engines)
    assert pool.num_used == 0 and pool.num_requests == 0


def test_the_ids_of_a_text_complete_it_token_for_token_as_the_text_does(stack):
    client, gateway, pool = stack
    ids = gateway.tokenizer.encode(PROMPT)
    as_text = client.complete(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
    as_ids = client.complete(prompt_token_ids=ids, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert len(as_text.token_ids) == MAX_TOKENS
    assert (as_ids.token_ids, as_ids.text, as_ids.finish_reason) == (as_text.token_ids, as_text.text, "length")
    assert as_ids.usage.prompt_tokens == as_text.usage.prompt_tokens == len(ids)
    assert as_ids.usage.cached_tokens > 0  # the same tokens, so the text's full pages were hits
    streamed = list(client.generate(prompt_token_ids=ids, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert tuple(t for d in streamed for t in d.token_ids) == as_text.token_ids
    assert "".join(d.text for d in streamed) == as_text.text
    assert_nothing_left(gateway, pool)


def test_an_id_outside_the_vocabulary_or_none_at_all_is_invalid_argument_and_leaves_no_pages(stack):
    client, gateway, pool = stack
    vocab_size = gateway.limits.vocab_size
    assert vocab_size > 0
    cases = (([1, vocab_size, 2], f"prompt_token_ids[1] = {vocab_size} is not a token id of this model "
                                  f"(0 to {vocab_size - 1})"),
             ([], "empty prompt_token_ids: send at least one token id"))
    for ids, message in cases:
        with pytest.raises(InvalidArgument) as info:
            client.complete(prompt_token_ids=ids, max_tokens=MAX_TOKENS)
        assert info.value.details == message
        with pytest.raises(InvalidArgument) as info:
            list(client.generate(prompt_token_ids=ids, max_tokens=MAX_TOKENS))
        assert info.value.details == message
    assert_nothing_left(gateway, pool)
