"""The worker over real gRPC: Info, health, and bad input to Step."""

from __future__ import annotations

import math

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserve.v1 import common_pb2, worker_pb2

TEST_NUM_PAGES, TEST_PAGE_SIZE = 256, 16  # as the runner fixture in conftest.py


def item(req_id="r", token_ids=(1, 2, 3), start_pos=0, page_table=(0,), sample=True, **sampling):
    return worker_pb2.StepItem(req_id=req_id, token_ids=token_ids, start_pos=start_pos, page_table=page_table,
                               sample=sample, sampling=common_pb2.SamplingParams(**sampling))


def test_info_reports_the_exact_pool_size(worker_stub, runner):
    info = worker_stub.Info(worker_pb2.InfoRequest(), timeout=10)
    per_token = 2 * 30 * 3 * 64 * 4  # layers * kv_heads * head_dim * fp32 bytes, K and V
    assert info.bytes_per_token == per_token == 46080
    assert info.num_pages == TEST_NUM_PAGES and info.page_size == TEST_PAGE_SIZE
    assert info.pool_bytes == per_token * TEST_PAGE_SIZE * TEST_NUM_PAGES == runner.kv_cache.nbytes
    assert info.kv_dtype == "float32" and info.vocab_size == 49152 and info.num_kv_heads == 3
    assert len(info.model_fingerprint) == 32 and info.epoch > 0 and list(info.eos_token_ids) == [2]


def test_health_is_serving(worker_channel):
    stub = health_pb2_grpc.HealthStub(worker_channel)
    for service in ("", "kvserve.v1.WorkerService"):
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


BAD_ITEMS = [  # each rejected alone: the step computes the good item beside it (page 3)
    ("page table too short", item(token_ids=tuple(range(1, 21)), page_table=(0,)),
     "page_table has 1 pages but positions [0, 20) need 2"),
    ("page id out of range", item(page_table=(TEST_NUM_PAGES,)), f"page id {TEST_NUM_PAGES} is out of range"),
    ("negative page id", item(page_table=(-1,)), "page id -1 is out of range"),
    ("token id >= vocab", item(token_ids=(5, 49152)), "token id 49152 is outside the vocabulary"),
    ("negative token id", item(token_ids=(-3,)), "token id -3 is outside"),
    ("negative position", item(start_pos=-1), "start_pos -1 is negative"),
    ("empty token_ids", item(token_ids=()), "token_ids must not be empty"),
    ("position past the model", item(start_pos=8190, page_table=tuple(range(4, TEST_NUM_PAGES))),
     "exceed max_model_len 8192"),
    ("negative temperature", item(temperature=-0.5), "temperature must be finite and >= 0"),
    ("nan temperature", item(temperature=math.nan), "temperature must be finite"),
    ("temperature past float32", item(temperature=math.inf), "temperature must be finite"),
    ("top_p above one", item(top_p=1.5), "top_p must lie in (0, 1]"),
    ("top_p zero", item(top_p=0.0), "top_p must lie in (0, 1]"),
    ("negative top_k", item(top_k=-2), "top_k must be >= 0"),
    ("too many logprobs", item(top_logprobs=50), "top_logprobs must lie in [0, 20]"),
    ("a page twice in one table", item(token_ids=(7,), start_pos=16, page_table=(4, 4)),
     "page 4 appears twice in its page_table"),
    ("a page twice past the positions", item(page_table=(4,) + (5,) * 1000), "page 5 appears twice"),
]


@pytest.mark.parametrize("bad,message", [(i, m) for _, i, m in BAD_ITEMS], ids=[c[0] for c in BAD_ITEMS])
def test_a_bad_item_is_rejected_alone_and_the_step_computes_the_others(worker_stub, runner, bad, message):
    alone = worker_stub.Step(worker_pb2.StepBatch(items=[item("good", page_table=(3,))]), timeout=30)
    runner.kv_cache.zero_()
    resp = worker_stub.Step(worker_pb2.StepBatch(items=[bad, item("good", page_table=(3,))]), timeout=30)
    assert [(r.req_id, r.invalid) for r in resp.rejected] == [("r", True)] and message in resp.rejected[0].message
    assert [r.req_id for r in resp.results] == ["good"] and resp.num_tokens == 3
    assert resp.results[0].token_id == alone.results[0].token_id  # the good item's answer is unchanged
    written = runner.kv_cache.abs().sum(dim=(0, 1, 4, 5)) != 0  # [num_pages, page_size]
    assert written[3, :3].all() and written.sum() == 3, "the rejected item must write nothing"


BAD_STEPS = [  # malformed as a whole: nothing computed
    ("empty batch", [], "empty batch"),
    ("step past the worker's tokens", [item(token_ids=(1,) * 16385, page_table=tuple(range(TEST_NUM_PAGES)))],
     "takes at most 16384"),
    ("duplicate req_id", [item(page_table=(0,)), item(page_table=(1,))], "duplicate req_id 'r'"),
    ("shared page", [item("a", page_table=(4,)), item("b", page_table=(4,))], "both write page 4"),
    ("a page one item reads and another writes",  # r reads page 4 (its prefix) while w writes into it
     [item("r", token_ids=(7,), start_pos=16, page_table=(4, 5)), item("w", page_table=(4,))],
     "item 'r' reads page 4, which item 'w' writes in the same step"),
    ("empty req_id", [item(req_id="")], "empty req_id"),
]


@pytest.mark.parametrize("items,message", [(i, m) for _, i, m in BAD_STEPS], ids=[c[0] for c in BAD_STEPS])
def test_bad_step_is_invalid_argument_and_writes_nothing(worker_stub, runner, items, message):
    before = runner.kv_cache.clone()
    with pytest.raises(grpc.RpcError) as err:
        worker_stub.Step(worker_pb2.StepBatch(items=items), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    assert torch.equal(runner.kv_cache, before), "a rejected step must not touch the pool"
    # the worker keeps serving the next valid request
    ok = worker_stub.Step(worker_pb2.StepBatch(items=[item(page_table=(3,))]), timeout=30)
    assert len(ok.results) == 1 and 0 <= ok.results[0].token_id < 49152 and ok.num_tokens == 3


def test_a_temperature_too_small_to_divide_by_samples_greedily(worker_stub):
    """logits / 1e-38 overflows to inf and softmax to NaN: below 1e-5 the temperature means greedy."""
    greedy = worker_stub.Step(worker_pb2.StepBatch(items=[item(page_table=(3,))]), timeout=30)
    tiny = worker_stub.Step(worker_pb2.StepBatch(items=[item(page_table=(3,), temperature=1e-38)]), timeout=30)
    assert tiny.results[0].token_id == greedy.results[0].token_id


def test_stale_epoch_is_failed_precondition(worker_stub, runner):
    with pytest.raises(grpc.RpcError) as err:
        worker_stub.Step(worker_pb2.StepBatch(items=[item()], epoch=runner.epoch - 1), timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert str(runner.epoch) in err.value.details()
    ok = worker_stub.Step(worker_pb2.StepBatch(items=[item()], epoch=runner.epoch), timeout=30)
    assert len(ok.results) == 1


def test_step_writes_kv_only_into_the_assigned_slots(worker_stub, runner):
    """A 20-token prefill on pages (9, 5) fills all of page 9 and 4 slots of page 5, nothing else."""
    runner.kv_cache.zero_()
    worker_stub.Step(worker_pb2.StepBatch(items=[item(token_ids=tuple(range(100, 120)), page_table=(9, 5),
                                                      sample=False)]), timeout=30)
    written = runner.kv_cache.abs().sum(dim=(0, 1, 4, 5)) != 0  # [num_pages, page_size]
    assert written[9].all() and written[5, :4].all()
    assert written.sum() == 20


def test_sampled_results_come_in_item_order_with_logprobs(worker_stub):
    items = [item("b", (7, 8), page_table=(20,), top_logprobs=3), item("a", (9,), page_table=(21,), sample=False),
             item("c", (10, 11, 12), page_table=(22,))]
    resp = worker_stub.Step(worker_pb2.StepBatch(items=items), timeout=30)
    assert [r.req_id for r in resp.results] == ["b", "c"] and resp.num_tokens == 6 and resp.compute_ms > 0
    b = resp.results[0]
    assert len(b.top_logprobs) == 3 and b.top_logprobs[0].token_id == b.token_id  # greedy = the most likely
    assert b.logprob == pytest.approx(b.top_logprobs[0].logprob) and b.logprob <= 0


def test_an_item_whose_logits_are_not_finite_fails_alone(runner, monkeypatch):
    """A NaN or inf logit row cannot be sampled (multinomial raises, argmax is arbitrary): that item is answered
    as rejected (not invalid: it was computed) and the other items of the step get their tokens."""
    from kvserve.common.wire.worker import SamplingParams, StepBatch, StepItem

    logits = runner.model.logits

    def poisoned(hidden):
        out = logits(hidden)
        out[1, 7] = math.nan  # the second sampled row
        out[2, 9] = math.inf
        return out

    items = tuple(StepItem(req_id, (1, 2, 3), 0, (page,), sampling=SamplingParams(temperature=t, seed=1))
                  for req_id, page, t in (("a", 40, 0.0), ("nan", 41, 0.8), ("inf", 42, 0.0), ("b", 43, 0.8)))
    clean = runner.step(StepBatch(items))
    monkeypatch.setattr(runner.model, "logits", poisoned)
    out = runner.step(StepBatch(items))
    assert [(r.req_id, r.invalid) for r in out.rejected] == [("nan", False), ("inf", False)]
    assert "NaN or an infinity at position 3" in out.rejected[0].message
    assert [(s.req_id, s.token_id) for s in out.sampled] == [(s.req_id, s.token_id) for s in clean.sampled
                                                             if s.req_id in ("a", "b")]


def test_the_gateway_client_reads_rejected_items_and_a_refused_step_as_the_worker_alive(worker_server, runner,
                                                                                     monkeypatch):
    """Over real gRPC: an item rejected alone comes back in StepOutput.rejected, with the other item's token;
    an error while computing (UNKNOWN) is WorkerRejected, never WorkerUnavailable (which declares it gone)."""
    from kvserve.common.wire.worker import SamplingParams, StepBatch, StepItem
    from kvserve.services.gateway.errors import WorkerRejected, WorkerUnavailable
    from kvserve.services.gateway.rpc.clients import WorkerClient

    client = WorkerClient(f"127.0.0.1:{worker_server.port}", retry_for_s=1.0)
    try:
        batch = StepBatch((StepItem("hot", (1, 2, 3), 0, (50,), sampling=SamplingParams(temperature=1e308)),
                           StepItem("ok", (1, 2, 3), 0, (51,))))
        out = client.step(batch)
        assert [(r.req_id, r.invalid) for r in out.rejected] == [("hot", True)]
        assert "temperature must be finite" in out.rejected[0].message and [s.req_id for s in out.sampled] == ["ok"]

        def broken(_batch):
            raise RuntimeError("a bug while computing")

        monkeypatch.setattr(runner, "step", broken)
        with pytest.raises(WorkerRejected) as err:
            client.step(batch)
        assert not isinstance(err.value, WorkerUnavailable) and "a bug while computing" in str(err.value)
    finally:
        client.close()
