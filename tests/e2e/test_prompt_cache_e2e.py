"""OpenAI's prompt caching fields end to end, through the official `openai` client:

- prompt_cache_key on `kvserve up --workers 2`: a tenant's requests with one key and different prompts all land
  on one worker, even while the kvmanager's placement would spread them by load, as it spreads the same requests
  sent without a key. Where a tenant's requests ran is read from where its cached blocks are (InspectTenant).
- prompt_cache_retention "24h" with the shared KV tier (kv_tier_stack.py, a store of a few dozen pages): the
  prefix it pinned survives a restart of the only worker (its pool is gone) and a flood of other prompts that
  evicts an unpinned prefix from the store; the revisit is served from the store, the unpinned control is not.
"""

from __future__ import annotations

import contextlib
import json
import math
import re

import kv_tier_stack
import openai
import pytest
from gateway_stack import running_stack
from kv_tier_stack import LEASE_S, PAGE_SIZE, READY_TIMEOUT_S, WAIT_S, TierStack, tier_env
from polling import wait_for
from service_process import service_process

from kvserve.common.embedded_redis import EmbeddedRedis
from kvserve.v1 import kvmanager_pb2 as pb

KEYED = {"prompt_cache_key": "railway-faq", "prompt_cache_retention": "24h"}
GREEDY = dict(temperature=0)
# Prompts of over two pages that share no first token, so that no placement is a prefix hit.
PROMPTS = [f"{topic} " + "The committee met on Tuesday to discuss the timetable, the fares for groups and the new "
           "rolling stock, and agreed to meet again after the summer holidays with a full report." for topic in
           ("Rivers", "Owls", "Copper", "Glaciers", "Bakers", "Tides", "Violins")]
FILLER = "Write a long story about a lighthouse keeper and the ferry that was always late."


def openai_client(base_url: str, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=f"key-{tenant}", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prompt-cache-key")
    keys = tmp / "keys.json"
    keys.write_text(json.dumps({f"key-{t}": t for t in ("spread", "keyed", "filler")}))
    with running_stack(tmp, tier_env(), "--workers", "2", "--num-pages", "128", "--api-keys-file",
                       str(keys)) as stack:
        yield stack


def workers_of(stack, tenant: str) -> set[str]:
    """The workers whose pools hold the tenant's cached blocks: where its requests ran."""
    token = (stack.data_dir / "admin_token").read_text().strip()
    report = kv_tier_stack.admin_call(stack.kvmanager, token, "InspectTenant",
                                      pb.InspectTenantRequest(tenant=tenant, max_blocks=1000))
    return {b.worker_id for b in report.blocks}


def idle(stack) -> bool:
    return stack.used_pages() == 0 and stack.live_requests() == 0


def streams(client: openai.OpenAI, prompts: list[str], **extra):
    """One streamed completion per prompt, all in flight: each is submitted (placed) once create() returns."""
    model = client.models.list().data[0].id
    return [client.completions.create(model=model, prompt=p, max_tokens=24, stream=True, **GREEDY,
                                      extra_body={"ignore_eos": True, **extra}) for p in prompts]


def finish(stream) -> str:
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    return "".join(c.choices[0].text for c in chunks)


def test_a_keyed_tenants_requests_stay_on_one_worker_while_unkeyed_ones_spread_by_load(two_workers):
    stack = two_workers
    with openai_client(stack.http, "spread") as spread, openai_client(stack.http, "keyed") as keyed, \
            openai_client(stack.http, "filler") as filler:
        for s in streams(spread, PROMPTS[:3]):  # no key: the second one goes to the idle worker
            finish(s)
        assert workers_of(stack, "spread") == {"worker-0", "worker-1"}
        wait_for(lambda: idle(stack), "every page freed", WAIT_S)

        busy = streams(filler, [FILLER])[0]  # a long request keeps one worker busy
        next(iter(busy))
        busy_worker = next(p.worker_id for p in stack.admin_stats().pools if p.num_requests == 1)
        # with the key: the first is placed by load on the other worker, the next two follow the key there (the
        # third would go to the busy worker by load: one request there, two on the other)
        for s in streams(keyed, PROMPTS[3:6], **KEYED):
            finish(s)
        busy.close()
        wait_for(lambda: idle(stack), "the filler's pages freed", WAIT_S)
        keyed_worker = ({"worker-0", "worker-1"} - {busy_worker}).pop()
        assert workers_of(stack, "keyed") == {keyed_worker}

        # both idle (Place's tie would name worker-0): the key still decides; the chat call's fields are typed
        reply = keyed.chat.completions.create(model=keyed.models.list().data[0].id, max_tokens=8, **GREEDY,
                                              messages=[{"role": "user", "content": PROMPTS[6]}], **KEYED)
        assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
        assert workers_of(stack, "keyed") == {keyed_worker}
        wait_for(lambda: idle(stack), "every page freed", WAIT_S)


NUM_PAGES = 5
PROMPT_TOKENS = NUM_PAGES * PAGE_SIZE + 3  # with MAX_TOKENS, the generated tokens fill no further page
MAX_TOKENS = 4
STORE_BYTES = "12MiB"  # some 17 pages of the CPU's float32 K/V: the pinned prefix, the control, a little more
TEXT = ("The lighthouse keeper wrote down the weather every morning: wind from the west, a grey sea, gulls over "
        "the harbour wall, and the ferry late again because of the fog that rolled in from the islands. ")
GATEWAY_READY = re.compile(r"^kvserve gateway ready on 127\.0\.0\.1:(\d+) \(HTTP (\S+),")


@pytest.fixture
def small_tier(tmp_path, monkeypatch):
    """kv_tier_stack's store, kvmanager and worker-0 with a small store, and a gateway whose OpenAI API is
    known: (the stack, the API's base URL)."""
    monkeypatch.setattr(kv_tier_stack, "STORE_BYTES", STORE_BYTES)  # read as its kvmanager starts
    with contextlib.ExitStack() as exits:
        stack = TierStack(tmp_path, tier_env(), exits.enter_context(EmbeddedRedis(tmp_path / "kv-store")))
        exits.enter_context(stack._exits)  # its processes stop before the store
        stack.kvmanager, _ = stack.start_kvmanager("kvmanager-0", None)
        stack.start_worker("worker-0")
        keys = tmp_path / "keys.json"
        keys.write_text(json.dumps({"key-retained": "retained"}))
        args = ["gateway", "--port", "0", "--http-port", "0", "--kvmanager", stack.kvmanager, "--api-keys-file",
                str(keys), "--worker-timeout", LEASE_S]
        _, m = stack._exits.enter_context(service_process(args, GATEWAY_READY, stack.env, stack.gateway_log_path,
                                                          READY_TIMEOUT_S))
        stack.gateway = f"127.0.0.1:{m.group(1)}"
        yield stack, m.group(2)


def prompt(tokenizer, topic: str) -> list[int]:
    ids = tokenizer.encode(f"{topic}. " + TEXT * 4)
    assert len(ids) >= PROMPT_TOKENS
    return ids[:PROMPT_TOKENS]


def complete(client: openai.OpenAI, prompt_ids: list[int], **extra):
    return client.completions.create(model=client.models.list().data[0].id, prompt=prompt_ids,
                                     max_tokens=MAX_TOKENS, **GREEDY, extra_body={"ignore_eos": True, **extra})


def cached_tokens(reply) -> int:
    return reply.usage.prompt_tokens_details.cached_tokens


def test_a_24h_retained_prefix_survives_a_worker_restart_and_a_flood_through_the_store(small_tier, tokenizer):
    stack, http = small_tier
    pinned, control = prompt(tokenizer, "Pinned"), prompt(tokenizer, "Control")
    with openai_client(http, "retained") as client:
        first = complete(client, pinned, prompt_cache_retention="24h")
        wait_for(lambda: stack.tenant("retained").num_store_blocks == NUM_PAGES, "the pinned blocks stored", WAIT_S)
        complete(client, control, prompt_cache_retention="in_memory")
        wait_for(lambda: stack.tenant("retained").num_store_blocks == 2 * NUM_PAGES, "the control stored", WAIT_S)
        store = stack.store_stats()
        capacity_blocks = store.capacity_bytes // (store.num_bytes // store.num_blocks)
        assert capacity_blocks >= 2 * NUM_PAGES  # both fit, and the pin is within half the store (its budget)

        worker, _ = stack.workers["worker-0"]
        stack.kill(worker)
        port = stack.start_worker("worker-0")  # a new epoch, an empty pool: only the store holds the prefixes
        stack.gateway_serves("worker-0", port)

        # other prompts, of more blocks than the store has room for beside the pinned ones
        flood = [prompt(tokenizer, f"Flood {i}") for i in range(math.ceil(capacity_blocks / NUM_PAGES))]
        added = store.num_added_blocks
        for ids in flood:
            complete(client, ids)
        wait_for(lambda: stack.store_stats().num_added_blocks >= added + NUM_PAGES * len(flood),
                 "the flood's blocks stored", WAIT_S)
        assert stack.store_stats().num_evicted_blocks >= NUM_PAGES  # at least the control's worth went
        hits = stack.tenant("retained").store_hits

        again = complete(client, pinned, prompt_cache_retention="24h")
        assert again.choices[0].text == first.choices[0].text
        assert cached_tokens(again) == NUM_PAGES * PAGE_SIZE  # every pinned page, loaded from the store
        assert stack.tenant("retained").store_hits == hits + NUM_PAGES * PAGE_SIZE
        assert cached_tokens(complete(client, control)) == 0  # evicted by the flood: computed again
        wait_for(stack.idle, "every page freed and no request live", WAIT_S)
