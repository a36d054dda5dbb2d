"""The shared KV tier end to end: a conversation's pages written by one worker and loaded by another, a whole
`kvserve up` stopped and started again on its data dir, both through the official `openai` client; and greedy
tokens with pages loaded from the store equal to HF transformers' on both CPU attention backends.

In each, the revisit must load from the store (cached tokens, the tenant's store hits) and answer the tokens of
the first visit, which computed everything.
"""

from __future__ import annotations

import json
import signal
from collections import Counter

import openai
import pytest
from gateway_stack import running_stack
from kv_tier_engine import TierLLM
from kv_tier_stack import admin_call, tier_env
from polling import wait_for

from kvserve.common.embedded_redis import EmbeddedRedis
from kvserve.v1 import kvmanager_pb2 as pb
from kvserve.worker.runner import ModelRunner, RunnerConfig

PAGE_SIZE = 16
WAIT_S = 30.0  # for a report of written blocks, or the counters (at most every 5 s)
STOP_S = 60.0  # `kvserve up` stopping: the gateway drains, the workers flush their writes, the store saves
SYSTEM = ("You are the booking assistant of a small mountain railway. You answer questions about timetables, "
          "tickets, group fares, bicycles, dogs and the winter service, briefly and politely.")
MESSAGES = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Can I take my bicycle on the first train on Sunday morning?"}]
FILLER = "Write a long story about a lighthouse keeper and the ferry that was always late."
TEXT = ("The glacier above the village had retreated a little every summer since the records began, and the "
        "guides kept a notebook of its edge, measured with a chain from the same painted rock. ")


def admin(stack, method: str, request):
    token = (stack.data_dir / "admin_token").read_text().strip()
    return admin_call(stack.kvmanager, token, method, request)


def tenant_stats(stack, tenant: str) -> pb.TenantStats:
    found = [t for t in stack.admin_stats().tenants if t.tenant == tenant]
    return found[0] if found else pb.TenantStats(tenant=tenant)


def blocks_by_worker(stack, tenant: str) -> Counter:
    report = admin(stack, "InspectTenant", pb.InspectTenantRequest(tenant=tenant, max_blocks=1000))
    return Counter(b.worker_id for b in report.blocks)


def idle(stack) -> bool:
    return stack.used_pages() == 0 and stack.live_requests() == 0


def openai_client(stack, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http, api_key=f"key-{tenant}", max_retries=0, timeout=120)


def chat(client: openai.OpenAI):
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=12,
                                          temperature=0, logprobs=True)


def tokens_of(reply) -> list[str]:
    return [t.token for t in reply.choices[0].logprobs.content]


def test_a_conversation_served_on_one_worker_is_loaded_from_the_store_by_the_other(tmp_path):
    """A filler request keeps worker-0 busy, so the conversation goes to worker-1 (placement's load penalty);
    its blocks are then evicted from worker-1's pool, and the revisit goes to worker-0 (equal store hits on
    both, equal room: the first worker), which has never seen the conversation: it loads it from the store."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"key-chat": "chat", "key-filler": "filler"}))
    with running_stack(tmp_path, tier_env(), "--workers", "2", "--num-pages", "48", "--kv-store-bytes", "256MiB",
                       "--api-keys-file", str(keys)) as stack, \
            openai_client(stack, "chat") as client, openai_client(stack, "filler") as filler:
        busy = filler.completions.create(model=client.models.list().data[0].id, prompt=FILLER, max_tokens=400,
                                         temperature=0, stream=True, extra_body={"ignore_eos": True})
        next(iter(busy))  # running on worker-0 now (equal pools: the first worker)
        assert [(p.worker_id, p.num_requests) for p in stack.admin_stats().pools] == [("worker-0", 1), ("worker-1", 0)]
        first = chat(client)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        busy.close()  # cancels the filler
        wait_for(lambda: idle(stack), "the filler's pages freed", WAIT_S)
        prompt_pages = (first.usage.prompt_tokens - 1) // PAGE_SIZE
        served_by = blocks_by_worker(stack, "chat")
        assert served_by.keys() == {"worker-1"} and served_by["worker-1"] >= prompt_pages
        wait_for(lambda: tenant_stats(stack, "chat").num_store_blocks >= prompt_pages, "its blocks in the store",
                 WAIT_S)
        evicted = admin(stack, "EvictTenant", pb.EvictTenantRequest(tenant="chat", worker_id="worker-1"))
        assert evicted.num_evicted_blocks >= prompt_pages
        hits = tenant_stats(stack, "chat").store_hits

        again = chat(client)
        assert again.choices[0].message.content == first.choices[0].message.content
        assert tokens_of(again) == tokens_of(first)
        assert again.usage.prompt_tokens_details.cached_tokens == prompt_pages * PAGE_SIZE
        assert tenant_stats(stack, "chat").store_hits == hits + prompt_pages * PAGE_SIZE
        assert blocks_by_worker(stack, "chat")["worker-0"] >= prompt_pages  # served by the other worker
        wait_for(lambda: idle(stack), "every page freed", WAIT_S)


def test_a_stack_stopped_and_started_again_on_its_data_dir_loads_the_revisit_from_the_store(tmp_path):
    """`kvserve up` stopped with SIGTERM and started again on the same --data-dir: the kvmanager's index comes
    back from its Redis, the KV values from the store's RDB file, and the new worker's empty pool loads the
    revisit's prefix from the store."""
    prompt = TEXT * 3
    args = ("--num-pages", "32", "--kv-store-bytes", "256MiB")
    with running_stack(tmp_path, tier_env(), *args) as stack, openai_client(stack, "default") as client:
        first = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=12,
                                          temperature=0, logprobs=1, extra_body={"ignore_eos": True})
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        prompt_pages = (first.usage.prompt_tokens - 1) // PAGE_SIZE
        wait_for(lambda: tenant_stats(stack, "default").num_store_blocks >= prompt_pages, "its blocks in the store",
                 WAIT_S)
        stack.proc.send_signal(signal.SIGTERM)
        assert stack.proc.wait(timeout=STOP_S) == 0

    with running_stack(tmp_path, tier_env(), *args) as stack, openai_client(stack, "default") as client:
        assert tenant_stats(stack, "default").num_store_blocks >= prompt_pages  # the index came back
        hits = tenant_stats(stack, "default").store_hits
        again = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=12,
                                          temperature=0, logprobs=1, extra_body={"ignore_eos": True})
        assert again.choices[0].text == first.choices[0].text
        assert again.choices[0].logprobs.tokens == first.choices[0].logprobs.tokens
        assert again.usage.prompt_tokens_details.cached_tokens == prompt_pages * PAGE_SIZE  # the pool is new
        assert tenant_stats(stack, "default").store_hits == hits + prompt_pages * PAGE_SIZE
        wait_for(lambda: idle(stack), "every page freed", WAIT_S)


PROMPT_LENGTHS = [17, 48, 90, 150]  # tokens: one page and a token, three pages exactly, and longer
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    ids = tokenizer.encode(TEXT * 8)
    return [ids[i * 5: i * 5 + n] for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="module")
def hf_tokens(prompts, hf_greedy_alone) -> list[list[int]]:
    """HF's greedy tokens for each prompt alone."""
    return hf_greedy_alone(prompts, MAX_TOKENS)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_greedy_tokens_with_pages_loaded_from_the_store_equal_hf(tmp_path, model_dir, prompts, hf_tokens, backend):
    """The same prompts computed, then with their prefixes loaded from the store: HF's tokens both times."""
    with EmbeddedRedis(tmp_path / "kv-store") as store:
        runner = ModelRunner(RunnerConfig(model_dir=model_dir, num_pages=64, page_size=PAGE_SIZE, device="cpu",
                                          dtype="float32", attention_backend=backend, kv_store_url=store.url))
        try:
            assert runner.info.attention_backend == backend
            llm = TierLLM(runner)
            assert llm.generate(prompts, MAX_TOKENS) == hf_tokens  # computed
            llm.settle()
            assert len(llm.mgr.tier) > 0 and llm.evict_pool() > 0

            assert llm.generate(prompts, MAX_TOKENS) == hf_tokens  # loaded from the store
            num_loaded = sum((len(p) - 1) // PAGE_SIZE for p in prompts)  # every full page but the last token's
            assert llm.mgr.tier.totals.num_hit_pages == num_loaded
            stats = runner.tier.stats()
            assert stats.num_loaded_pages == num_loaded
            assert stats.num_failed_loads == 0 and stats.num_verify_failures == 0
        finally:
            runner.close_tier(5.0)
