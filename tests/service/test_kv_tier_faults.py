"""The shared KV tier under failure, with real processes and the real model: a store Redis the test owns, a
kvmanager leader and a standby on a state Redis, a member worker with a 32-page pool, and a gateway
(kv_tier_stack.py). A test serves prompts of 5 full pages and a tail, and evicts their blocks from the worker's
pool (admin EvictTenant with the worker's id: the store's entries stay) so that a revisit must load them from
the store; something breaks: the store dies, a value is damaged, the worker dies with its writes in flight,
the kvmanager leader dies. The revisit must give the first answer's tokens, no page may stay in use, and the
tier's index must hold only values the store has.

One stack serves the module (one model load per worker process); each test has its own tenant. The leader's
kill comes last.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib

import grpc
import pytest
from kv_tier_stack import PAGE_SIZE, WAIT_S, tier_stack
from polling import wait_for

from kvserve.common.wire.tier import PAGE_VALUE_HEADER_BYTES

pytestmark = pytest.mark.slow  # separate kvserve processes (tier_stack)

TENANTS = ("store-down", "probe", "resumed", "damaged", "worker-killed", "takeover", "new-leader")
NUM_PAGES = 5
PROMPT_TOKENS = NUM_PAGES * PAGE_SIZE + 3  # with MAX_TOKENS, the generated tokens fill no further page
MAX_TOKENS = 4
TEXT = ("The lighthouse keeper wrote down the weather every morning: wind from the west, a grey sea, gulls over "
        "the harbour wall, and the ferry late again because of the fog that rolled in from the islands. ")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with tier_stack(tmp_path_factory.mktemp("kv-tier"), TENANTS, standby=True) as s:
        yield s


def prompt(tokenizer, topic: str) -> list[int]:
    ids = tokenizer.encode(f"{topic}. " + TEXT * 4)
    assert len(ids) >= PROMPT_TOKENS
    return ids[:PROMPT_TOKENS]


def served_and_stored(stack, tenant: str, *prompts: list[int]):
    """Serves prompts new to the tenant (no write of its in flight), waits until the store's index records their
    5 blocks each (each value present), then evicts them from the worker's pool. Returns (the completions, the
    blocks' store keys), one per prompt."""
    recorded = stack.tenant(tenant).num_store_blocks
    firsts = [stack.complete(tenant, p, MAX_TOKENS) for p in prompts]
    keys = [stack.block_keys(tenant, p) for p in prompts]
    assert all(len(k) == NUM_PAGES for k in keys)
    wait_for(lambda: stack.tenant(tenant).num_store_blocks == recorded + NUM_PAGES * len(prompts),
             f"{tenant}'s blocks are recorded", WAIT_S)
    assert set().union(*keys) <= stack.store_keys()
    assert stack.evict_pool(tenant, "worker-0") == NUM_PAGES * len(prompts)
    return firsts, keys


def no_pages_leaked(stack) -> None:
    wait_for(stack.idle, "every page freed and no request live", WAIT_S)


def test_a_dead_store_makes_the_revisits_recompute_identically_and_writes_resume_once_it_is_back(stack, tokenizer):
    """The store's Redis is killed just before three revisits that must load: each load fails (the first with
    the store's error, the others as the store is marked down, or skipped by the gateway's backoff), and each
    request is recomputed with the first visit's tokens. The store then starts again on its port."""
    tenant = "store-down"
    prompts = [prompt(tokenizer, topic) for topic in ("Harbour", "Ferry", "Islands")]
    firsts, _ = served_and_stored(stack, tenant, *prompts)
    before = stack.store_stats()
    stack.store.kill()
    try:
        with cf.ThreadPoolExecutor(len(prompts)) as pool:  # revisits together: loads of one step fail together
            agains = list(pool.map(lambda p: stack.complete(tenant, p, MAX_TOKENS), prompts))
        assert [a.token_ids for a in agains] == [f.token_ids for f in firsts]
        assert [a.usage.cached_tokens for a in agains] == [0] * len(prompts)  # recomputed: no store, no pool
        wait_for(lambda: stack.store_stats().num_failed_loads >= before.num_failed_loads + 1,
                 "the failed loads counted", WAIT_S)
        assert stack.store_stats().num_loaded_pages == before.num_loaded_pages
        no_pages_leaked(stack)
    finally:
        stack.store.start()  # the same port, its data (AOF) back
    writes_land_again(stack, tokenizer)


def writes_land_again(stack, tokenizer) -> None:
    """After the store came back: for the worker's backoff (5 s) writes are dropped without a try, then a
    commit's writes land again (polled with new prompts); a prompt written now is loaded by its revisit."""
    written, topics = stack.store_stats().num_written_pages, iter(range(1000))

    def write_lands() -> bool:
        stack.complete("probe", prompt(tokenizer, f"Probe {next(topics)}"), MAX_TOKENS)
        return stack.store_stats().num_written_pages > written
    wait_for(write_lands, "a write lands in the store again", WAIT_S)

    later_prompt = prompt(tokenizer, "After the outage")
    (later,), _ = served_and_stored(stack, "resumed", later_prompt)
    hits = stack.tenant("resumed").store_hits
    revisit = stack.complete("resumed", later_prompt, MAX_TOKENS)
    assert revisit.token_ids == later.token_ids
    assert revisit.usage.cached_tokens == NUM_PAGES * PAGE_SIZE  # loaded from the store again
    assert stack.tenant("resumed").store_hits == hits + NUM_PAGES * PAGE_SIZE
    no_pages_leaked(stack)


def test_a_damaged_value_is_detected_dropped_and_recomputed_identically(stack, tokenizer):
    tenant = "damaged"
    prompt_ids = prompt(tokenizer, "Damaged")
    (first,), (keys,) = served_and_stored(stack, tenant, prompt_ids)
    with contextlib.closing(stack.store_client()) as client:
        value = bytearray(client.get(keys[0]))
        value[PAGE_VALUE_HEADER_BYTES + 7] ^= 0x01  # one bit of the first layer's K, the header intact
        client.set(keys[0], bytes(value))
    before = stack.store_stats()

    again = stack.complete(tenant, prompt_ids, MAX_TOKENS)
    assert again.token_ids == first.token_ids
    assert again.usage.cached_tokens == 0  # the first page failed: the request recomputed from the start
    wait_for(lambda: stack.store_stats().num_verify_failures == before.num_verify_failures + 1,
             "the verification failure counted", WAIT_S)
    wait_for(lambda: stack.store_stats().num_dropped_missing == before.num_dropped_missing + 1,
             "the damaged block's entry dropped", WAIT_S)
    with contextlib.closing(stack.store_client()) as client:  # deleted by the janitor, or written again whole
        wait_for(lambda: client.get(keys[0]) != bytes(value), "the damaged value leaves the store", WAIT_S)
    no_pages_leaked(stack)


def blocked_write(client) -> bool:
    """Whether a client of the store waits in a SET (the store pauses writes)."""
    return any(c["cmd"] == "set" and "b" in c["flags"] for c in client.client_list())


def test_a_worker_killed_with_its_writes_in_flight_leaves_no_entry_for_values_that_never_landed(stack, tokenizer):
    """The store pauses writes (CLIENT PAUSE WRITE), so the worker's SETs of the request's blocks wait in the
    store; the worker is killed while one waits. None of those values landed, so the index must record none of
    them: an entry without its value would make every later revisit fail its load."""
    tenant = "worker-killed"
    prompt_ids = prompt(tokenizer, "Killed")
    keys = stack.block_keys(tenant, prompt_ids)
    worker, _ = stack.workers["worker-0"]
    with contextlib.closing(stack.store_client()) as client:
        client.client_pause(60_000, all=False)  # WRITE: reads go on, writes wait
        try:
            first = stack.complete(tenant, prompt_ids, MAX_TOKENS)  # a step never waits on the store
            wait_for(lambda: blocked_write(client), "the worker's SET waits in the paused store", WAIT_S)
            stack.kill(worker)
        finally:
            client.client_unpause()
        assert not client.exists(*keys)  # the killed worker's SETs never ran
    assert stack.tenant(tenant).num_store_blocks == 0  # and the index records none of them

    port = stack.start_worker("worker-0")  # a restarted worker: a new epoch, an empty pool
    stack.gateway_serves("worker-0", port)
    again = stack.complete(tenant, prompt_ids, MAX_TOKENS)
    assert again.token_ids == first.token_ids
    assert again.usage.cached_tokens == 0  # nothing was recorded, so nothing was loaded
    wait_for(lambda: stack.tenant(tenant).num_store_blocks == NUM_PAGES, "the blocks are recorded now", WAIT_S)
    assert set(keys) <= stack.store_keys()  # each with its value
    no_pages_leaked(stack)


def test_a_standby_takes_over_with_the_tier_index_intact_and_the_revisit_hits_the_store(stack, tokenizer):
    tenant = "takeover"
    prompt_ids = prompt(tokenizer, "Takeover")
    (first,), _ = served_and_stored(stack, tenant, prompt_ids)
    before = stack.stats()
    leader = stack.kvmanager.split(",")[0]

    stack.kill(stack.kvmanagers[leader])
    after = wait_for(lambda: answered(stack.stats), "the standby answers as the leader", WAIT_S)
    assert index_of(after) == index_of(before)  # every entry, its bytes, and the per-tenant counts and hits
    assert stack.tenant(tenant).num_store_blocks == NUM_PAGES
    hits = stack.tenant(tenant).store_hits
    loaded = after.kv_store.num_loaded_pages

    again = stack.complete(tenant, prompt_ids, MAX_TOKENS)
    assert again.token_ids == first.token_ids
    assert again.usage.cached_tokens == NUM_PAGES * PAGE_SIZE  # every block loaded from the store
    assert stack.tenant(tenant).store_hits == hits + NUM_PAGES * PAGE_SIZE
    wait_for(lambda: stack.store_stats().num_loaded_pages >= loaded + NUM_PAGES, "the loads counted", WAIT_S)
    served_and_stored(stack, "new-leader", prompt(tokenizer, "New leader"))  # the worker reports to it
    no_pages_leaked(stack)


def index_of(stats) -> tuple:
    """What the kvmanager itself changes in the tier: its index and the allocations' store hits (not the
    workers' counters, which a report may add to at any time)."""
    s = stats.kv_store
    return ((s.num_blocks, s.num_bytes, s.num_hit_pages, s.num_added_blocks, s.num_evicted_blocks,
             s.num_dropped_missing), [(t.tenant, t.num_store_blocks, t.store_hits) for t in stats.tenants])


def answered(call):
    """call()'s answer, or None while the kvmanagers answer UNAVAILABLE (no leader yet)."""
    try:
        return call()
    except grpc.RpcError as e:
        if e.code() is not grpc.StatusCode.UNAVAILABLE:
            raise
        return None
