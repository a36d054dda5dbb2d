"""Prefill/decode disaggregation and cache-aware pulls through the gateway core, over rule workers
(tests/support/engine_fakes.py) whose "KV" is the token id written at each slot: a pull copies the source's
slots into the receiver's pages, so a request's tokens are right only if every page it reads (pulled, computed
or hit) holds what it should. The kvmanager is the real one, in-process."""

from __future__ import annotations

import dataclasses

import pytest
from engine_fakes import LockedKV, PagedRuleWorker, reference

from kvserve.common.telemetry import NO_TRACES
from kvserve.common.wire.transfer import PullResult
from kvserve.common.wire.worker import SamplingParams
from kvserve.kvmanager.invariants import check_invariants
from kvserve.services.gateway.app import Gateway, GatewayConfig
from kvserve.services.gateway.auth import ApiKeys
from kvserve.services.gateway.request import FinishReason
from kvserve.services.gateway.validate import GenerateInput

PAGE = 4


class PeerRuleWorker(PagedRuleWorker):
    """A rule worker with a role that pulls pages from the others (``peers``: address -> worker): each load's
    source slots are copied into its own page. ``fail_pulls``: pulls answer an error instead (a source gone)."""

    def __init__(self, worker_id: str, role: str, peers: dict, **kw):
        super().__init__(worker_id, num_pages=64, page_size=PAGE, **kw)
        self.role, self.peers, self.address = role, peers, f"addr-{worker_id}"
        self.pulls: list = []  # the orders it got
        self.fail_pulls = False
        self.computed_tokens = 0  # prompt and decode tokens it fed the model
        self.sampled = 0
        peers[self.address] = self

    @property
    def info_now(self):
        return dataclasses.replace(super().info_now, role=self.role)

    def step(self, batch, traceparents=NO_TRACES):
        out = super().step(batch, traceparents)
        self.computed_tokens += out.num_tokens
        self.sampled += len(out.sampled)
        return out

    def pull(self, order):
        self.pulls.append(order)
        if self.fail_pulls:
            return PullResult(error="the source is gone (the test failed it)")
        source = self.peers[order.source_address]
        assert source.epoch == order.source_epoch
        for load in order.loads:
            for o in range(PAGE):
                self.slots[load.page_id * PAGE + o] = source.slots.get(load.src_page_id * PAGE + o, -1)
        return PullResult(len(order.loads), 100 * len(order.loads), 0.001)


def gateway_of(model_dir, kv, workers, **cfg):
    return Gateway(GatewayConfig(model_dir, max_num_batched_tokens=64, **cfg), ApiKeys(), kv, workers)


def run(gateway, prompt_ids, max_tokens=6, tenant="a"):
    inp = GenerateInput(prompt=None, messages=None, prompt_token_ids=list(prompt_ids), sampling=SamplingParams(),
                        max_tokens=max_tokens, ignore_eos=True)
    return gateway.submit(inp, tenant)


def tokens_of(handle) -> list[int]:
    deltas = list(handle)
    assert deltas[-1].finish_reason is FinishReason.LENGTH, deltas[-1]
    return [t for d in deltas for t in d.token_ids]


def assert_all_freed(kv):
    check_invariants(kv.mgr)
    assert not kv.mgr.requests and kv.mgr.num_holds == 0
    for pool in kv.mgr.pools.values():
        assert not any(pool.ref_cnt), f"{pool.spec.worker_id} holds pages after every request ended"


@pytest.fixture
def split(model_dir):
    """(gateway, kv, prefill worker, decode worker)."""
    peers: dict = {}
    kv = LockedKV()
    p, d = PeerRuleWorker("prefill-0", "prefill", peers), PeerRuleWorker("decode-0", "decode", peers)
    gateway = gateway_of(model_dir, kv, [p, d], max_local_prefill=8)
    yield gateway, kv, p, d
    gateway.close(drain_s=1.0)


def test_a_long_prompt_prefills_on_the_prefill_worker_and_decodes_on_the_decode_worker(split):
    gateway, kv, p, d = split
    prompt = list(range(1, 31))  # 30 tokens: all computed there, with the first token sampled
    handle = run(gateway, prompt)
    assert tokens_of(handle) == reference(prompt, 6)
    assert handle.worker_id == "decode-0"  # its handle moved with it
    assert p.sampled == 1 and p.computed_tokens == 30
    # 7 full pages and the last, partial one (2 tokens) pulled: the decode worker only decodes
    assert len(d.pulls) == 1 and len(d.pulls[0].loads) == 8 and d.pulls[0].source_worker_id == "prefill-0"
    assert d.computed_tokens == 5
    assert kv.mgr.transfers.num_moved == 1 and kv.mgr.transfers.num_ok == 1
    assert_all_freed(kv)


def test_a_short_prompt_stays_on_the_decode_worker(split):
    gateway, kv, p, d = split
    prompt = [9, 8, 7, 6, 5, 4]
    handle = run(gateway, prompt)
    assert handle.worker_id == "decode-0"
    assert tokens_of(handle) == reference(prompt, 6)
    assert p.computed_tokens == 0 and not d.pulls
    assert_all_freed(kv)


def test_a_failed_pull_recomputes_on_the_decode_worker(split):
    gateway, kv, p, d = split
    d.fail_pulls = True
    prompt = list(range(40, 70))
    assert tokens_of(run(gateway, prompt)) == reference(prompt, 6)
    assert len(d.pulls) == 1 and kv.mgr.transfers.num_failed == 1
    assert d.computed_tokens == 31 + 4  # the prompt and the first token again, without peer hits
    assert_all_freed(kv)


def test_many_requests_mixed_lengths_all_right_and_nothing_leaks(split):
    gateway, kv, p, d = split
    lengths = (3, 30, 12, 41, 9, 26, 17, 33, 5, 21)
    prompts = [list(range(1 + 37 * k, 1 + 37 * k + n)) for k, n in enumerate(lengths)]
    handles = [run(gateway, prompt, max_tokens=8) for prompt in prompts]
    for prompt, handle in zip(prompts, handles, strict=True):
        assert tokens_of(handle) == reference(prompt, 8)
    # every long prompt moved and was pulled (one preempted on the decode worker pulls again when readmitted)
    assert kv.mgr.transfers.num_moved == sum(1 for prompt in prompts if len(prompt) > 8) <= len(d.pulls)
    assert not p.pulls
    # cached on both pools (unless the decode worker's pool evicted it: then it pulls from the prefill worker's)
    again = run(gateway, prompts[3], max_tokens=8)
    assert tokens_of(again) == reference(prompts[3], 8)
    assert_all_freed(kv)


def test_a_prefix_in_a_busy_workers_pool_is_pulled_by_an_idle_one(model_dir):
    """Two `both` workers: w0 computed a prefix; with w0 busy, placement sends its revisit to w1, which pulls the
    prefix's pages from w0 instead of recomputing them."""
    peers: dict = {}
    kv = LockedKV()
    w0, w1 = PeerRuleWorker("w0", "both", peers), PeerRuleWorker("w1", "both", peers)
    gateway = gateway_of(model_dir, kv, [w0, w1])
    try:
        prompt = list(range(100, 140))
        first = run(gateway, prompt)
        assert tokens_of(first) == reference(prompt, 6)
        source = first.worker_id
        receiver = w1 if source == "w0" else w0
        computed = receiver.computed_tokens
        # Two requests on the source: 10 pages of hit - 2 x 4 = 2 there, 10 / 2 = 5 pages of peer hit on the idle
        # one (a peer hit counts half a pool hit), which wins; were peer hits not counted, the source would
        with kv.lock:
            kv.mgr.pools[source].num_requests += 2
        try:
            revisit = run(gateway, prompt + [7, 7, 7])
            assert revisit.worker_id == receiver.worker_id
            assert tokens_of(revisit) == reference(prompt + [7, 7, 7], 6)
        finally:
            with kv.lock:
                kv.mgr.pools[source].num_requests -= 2
        assert len(receiver.pulls) == 1 and len(receiver.pulls[0].loads) == 10  # the prompt's 40 tokens
        assert receiver.computed_tokens - computed == 43 - 40 + 5
        assert_all_freed(kv)
    finally:
        gateway.close(drain_s=1.0)


def test_without_a_decode_worker_the_prefill_worker_serves_alone(model_dir):
    peers: dict = {}
    kv = LockedKV()
    p = PeerRuleWorker("prefill-0", "prefill", peers)
    gateway = gateway_of(model_dir, kv, [p], max_local_prefill=8)
    try:
        prompt = list(range(1, 31))
        assert tokens_of(run(gateway, prompt)) == reference(prompt, 6)
        assert p.sampled == 6 and not p.pulls
        assert_all_freed(kv)
    finally:
        gateway.close(drain_s=1.0)


def test_without_pulls_prefill_workers_get_no_prompts_to_prefill_for_others(model_dir):
    """--no-pull-peers: a long prompt is not prefilled on the prefill worker (its pages could not move): the
    decode worker computes it all."""
    peers: dict = {}
    kv = LockedKV()
    p, d = PeerRuleWorker("prefill-0", "prefill", peers), PeerRuleWorker("decode-0", "decode", peers)
    gateway = gateway_of(model_dir, kv, [p, d], max_local_prefill=8, pull_peers=False)
    try:
        prompt = list(range(1, 31))
        assert tokens_of(run(gateway, prompt)) == reference(prompt, 6)
        assert p.computed_tokens == 0 and not d.pulls and d.computed_tokens == 30 + 5
        assert kv.mgr.transfers.num_moved == 0
        assert_all_freed(kv)
    finally:
        gateway.close(drain_s=1.0)
