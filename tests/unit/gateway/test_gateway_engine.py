"""The gateway's engine loop on in-process backends (tests/support/engine_fakes.py): no gRPC, no model, no processes.
The rule worker answers from the K/V its page tables point at, so a request's tokens equal the reference only if
every page op and page table on the way was right."""

from __future__ import annotations

import pytest
from engine_fakes import EOS, InProcessKVManager, PagedRuleWorker, next_token, reference

from kvserve.common.wire.pages import PoolSpec
from kvserve.common.wire.worker import SamplingParams
from kvserve.kvmanager.invariants import check_invariants
from kvserve.services.gateway.app import Gateway, GatewayConfig
from kvserve.services.gateway.auth import ApiKeys
from kvserve.services.gateway.engine import EngineLoop
from kvserve.services.gateway.errors import KVManagerUnavailable
from kvserve.services.gateway.request import FinishReason, Request, RequestParams
from kvserve.services.gateway.validate import GenerateInput

PROMPT = list(range(300, 310))  # 10 tokens: two full pages of 4 and a partial one


@pytest.fixture
def backends():
    kv, worker = InProcessKVManager(), PagedRuleWorker()
    kv.register(PoolSpec.of(worker.info()))
    return kv, worker


@pytest.fixture
def engine(backends, tokenizer):
    kv, worker = backends
    loop = EngineLoop(worker, worker.info(), kv, tokenizer, max_num_seqs=4, max_num_batched_tokens=8,
                      prefix_caching=True)
    loop.start()
    yield loop
    loop.stop()
    loop.join()


def run(engine: EngineLoop, req_id: str, prompt=PROMPT, max_tokens: int = 6, **params):
    """(tokens, last delta) of one request, run to its end."""
    req = Request(req_id, "t", list(prompt), RequestParams(max_tokens=max_tokens, **params))
    deltas = list(engine.submit(req))
    return [t for d in deltas for t in d.token_ids], deltas[-1]


def assert_all_pages_back(kv: InProcessKVManager) -> None:
    check_invariants(kv.mgr)
    assert all(p.num_used == 0 and p.num_requests == 0 for p in kv.mgr.pools.values())


def test_a_request_runs_to_completion_and_the_next_one_hits_its_pages(engine, backends):
    kv, _ = backends
    tokens, last = run(engine, "a")
    assert tokens == reference(PROMPT, 6)
    assert last.finish_reason is FinishReason.LENGTH
    assert (last.usage.prompt_tokens, last.usage.num_cached_tokens, last.usage.completion_tokens) == (10, 0, 6)
    tokens, last = run(engine, "b")
    assert tokens == reference(PROMPT, 6) and last.usage.num_cached_tokens == 8  # the two full prompt pages
    assert_all_pages_back(kv)


def test_eos_ends_a_request_unless_it_is_ignored(engine, backends):
    kv, _ = backends
    prompt = next(p for p in ([a, b, 300] for a in range(300, 400) for b in range(300, 340))
                  if EOS in reference(p, 8)[2:5])
    at = reference(prompt, 8).index(EOS)
    tokens, last = run(engine, "eos", prompt, max_tokens=8)
    assert tokens == reference(prompt, 8)[:at + 1] and last.finish_reason is FinishReason.EOS
    tokens, last = run(engine, "ignored", prompt, max_tokens=8, ignore_eos=True)
    assert tokens == reference(prompt, 8) and last.finish_reason is FinishReason.LENGTH
    assert_all_pages_back(kv)


def test_the_kvmanager_going_away_fails_the_step_and_the_engine_serves_on(engine, backends):
    kv, _ = backends
    kv.reachable = False
    tokens, last = run(engine, "cut")
    assert tokens == [] and last.finish_reason is FinishReason.ERROR
    assert isinstance(last.error, KVManagerUnavailable) and "UNAVAILABLE" in str(last.error)
    kv.reachable = True
    tokens, last = run(engine, "after")
    assert tokens == reference(PROMPT, 6) and last.finish_reason is FinishReason.LENGTH
    assert_all_pages_back(kv)


def test_a_worker_restart_mid_request_is_recomputed_with_the_same_tokens(engine, backends):
    kv, worker = backends
    worker.restart_before_step = 4  # after the prompt's two chunks and a decode: its pages are gone
    tokens, last = run(engine, "r", max_tokens=6)
    assert tokens == reference(PROMPT, 6) and last.finish_reason is FinishReason.LENGTH
    assert kv.mgr.pools["w0"].spec.epoch == worker.epoch == 2  # the engine registered the new pool
    assert last.usage.num_cached_tokens == 0  # its recompute found nothing cached on the new epoch
    assert_all_pages_back(kv)


def test_cached_tokens_count_the_admission_whose_prefill_ran(engine, backends):
    """b is admitted with a hit on a's pages, then the worker restarts before b's prefill runs: the hit was never
    used (b is recomputed on the new epoch from nothing), so b's usage reports 0 cached tokens, not 8."""
    kv, worker = backends
    run(engine, "a")
    worker.restart_before_step = worker.num_steps + 1
    tokens, last = run(engine, "b")
    assert tokens == reference(PROMPT, 6) and worker.epoch == 2
    assert kv.mgr.tenants["t"].prefix_cache_hits == 8  # the kvmanager did hand b a's two pages at first
    assert last.usage.num_cached_tokens == 0
    assert_all_pages_back(kv)


@pytest.mark.parametrize("reserve_ahead", [True, False])
def test_requests_admitted_while_others_run_get_their_pages_ahead_and_the_right_tokens(backends, tokenizer,
                                                                                      reserve_ahead):
    """Twelve requests on four sequence slots: each admission and free comes while others decode. Reserved
    ahead, they ride with the calls made while the worker computes (and those calls are then most of them);
    the tokens (read back from the pages) and the cache hits are what they are with every call waited for."""
    kv, worker = backends
    loop = EngineLoop(worker, worker.info(), kv, tokenizer, max_num_seqs=4, max_num_batched_tokens=8,
                      prefix_caching=True, reserve_ahead=reserve_ahead)
    loop.start()
    try:
        prompts = [PROMPT[:4 + i % 3 * 4] + list(range(400 + 7 * i, 403 + 7 * i)) for i in range(12)]
        handles = [loop.submit(Request(f"r{i}", "t", p, RequestParams(max_tokens=5 + i % 4)))
                   for i, p in enumerate(prompts)]
        outs = [list(h) for h in handles]
    finally:
        loop.stop()
        loop.join()
    for i, (prompt, deltas) in enumerate(zip(prompts, outs, strict=True)):
        assert [t for d in deltas for t in d.token_ids] == reference(prompt, 5 + i % 4)
    hits = sum(d[-1].usage.num_cached_tokens for d in outs)
    s = loop.stats
    if reserve_ahead:
        assert s.num_admitted_ahead >= 4 and s.num_kv_calls_overlapped > (s.num_kv_calls - s.num_kv_calls_overlapped)
    else:
        assert s.num_admitted_ahead == 0
    assert hits >= 8 * 4  # later requests hit the shared first pages
    assert_all_pages_back(kv)


def test_the_gateway_core_serves_text_and_stops_at_a_stop_string(backends, model_dir):
    kv, worker = backends
    gateway = Gateway(GatewayConfig(model_dir, max_num_batched_tokens=8), ApiKeys(), kv, [worker])
    try:
        prompt_ids = gateway.tokenizer.encode("Hello there")
        expected = reference(prompt_ids, 12)
        text = gateway.tokenizer.decode(expected)
        stop = next(gateway.tokenizer.decode(expected[:k])[-3:] for k in range(4, 12)
                    if len(gateway.tokenizer.decode(expected[:k])) >= 3)
        handle = gateway.submit(GenerateInput(prompt="Hello there", messages=None, sampling=SamplingParams(),
                                              max_tokens=12, stop=(stop,), ignore_eos=True), "default")
        deltas = list(handle)
        assert deltas[-1].finish_reason is FinishReason.STOP
        got = "".join(d.text for d in deltas)
        assert got == text[:text.index(stop)] and stop not in got
    finally:
        gateway.close(drain_s=1.0)
    assert_all_pages_back(kv)


def test_the_rule_worker_answers_from_its_pages(backends):
    """The fake is only as good as this: fed another page table than the one it wrote, it answers otherwise."""
    _, worker = backends
    from kvserve.common.wire.worker import StepBatch, StepItem

    out = worker.step(StepBatch((StepItem("x", (5, 6, 7), 0, (3,)),), epoch=worker.epoch))
    assert out.sampled[0].token_id == next_token([5, 6, 7])
    moved = worker.step(StepBatch((StepItem("y", (8,), 3, (4,)),), epoch=worker.epoch))  # page 4 holds no 5, 6, 7
    assert moved.sampled[0].token_id != next_token([5, 6, 7, 8])
