"""One bad request never takes a worker down (issue 35), on in-process backends: an item the worker rejects
fails that request alone; a step the worker refuses as a whole, or loses itself over, is retried one request at a
time, and the request that fails alone fails, on whichever worker, instead of being handed around. The rule
worker answers from its pages, so the other requests' tokens equal the reference only if the engine's page
state survived the failure."""

from __future__ import annotations

import time

import pytest
from engine_fakes import InProcessKVManager, PagedRuleWorker, reference
from test_gateway_engine import assert_all_pages_back

from kvserve.common.wire.worker import RejectedItem, StepBatch, StepOutput
from kvserve.services.gateway.app import Gateway, GatewayConfig
from kvserve.services.gateway.auth import ApiKeys
from kvserve.services.gateway.errors import (
    KVManagerFailed,
    RequestFailed,
    RequestRejected,
    WorkerRejected,
    WorkerRestarted,
    WorkerUnavailable,
)
from kvserve.services.gateway.request import FinishReason, Request, RequestParams

POISON = 666  # a prompt holding this token id breaks the step it is in, by each worker's rule below
PROMPTS = [list(range(300 + 10 * i, 310 + 10 * i)) for i in range(4)]
POISONED = [301, 302, POISON, 304, 305]
MAX_TOKENS = 6
DEADLINE_S = 10.0  # "within seconds": far below the gateway's 5 s worker timeout + a client's 120 s


class PoisonWorker(PagedRuleWorker):
    """The rule worker, and what a step holding POISON does to it: ``how`` = "item" rejects that item alone (as
    the real worker answers a malformed item), "step" refuses the whole step (as the worker's INTERNAL for an
    error while computing it), "lost" fails the step as a worker that died under it (no answer), "restart" comes
    back as a new incarnation (a crash under a supervisor)."""

    def __init__(self, worker_id: str, how: str):
        super().__init__(worker_id, num_pages=64)
        self.how = how
        self.poisoned_steps = 0  # steps that held the poisoned request: how often it was tried here

    def step(self, batch: StepBatch, traceparents=None) -> StepOutput:
        bad = [i.req_id for i in batch.items if POISON in i.token_ids]
        if not bad:
            return super().step(batch)
        self.poisoned_steps += 1
        if self.how == "step":
            raise WorkerRejected(f"worker {self.worker_id} refused the step: UNKNOWN: injected fault")
        if self.how == "lost":
            raise WorkerUnavailable(f"worker {self.worker_id} step failed: UNAVAILABLE: injected fault")
        if self.how == "restart":
            self.restart()
            raise WorkerRestarted(f"worker {self.worker_id} restarted: injected fault")
        out = super().step(StepBatch(tuple(i for i in batch.items if i.req_id not in bad), batch.epoch))
        out.rejected = [RejectedItem(r, f"item {r!r}: token id {POISON} is poison") for r in bad]
        return out


def serve(workers, kv: InProcessKVManager, tokenizer_dir):
    """The poisoned request among four others through a gateway over ``workers``, each run to its end. Returns
    (handles, out, poisoned_s, engines at the start, engines at the end): see submit_all and collect."""
    gateway = Gateway(GatewayConfig(tokenizer_dir, max_num_batched_tokens=16, worker_timeout_s=5.0), ApiKeys(), kv,
                      workers)
    before = gateway.engines
    try:
        handles = submit_all(gateway)
        out, poisoned_s = collect(handles)
        return handles, out, poisoned_s, before, gateway.engines
    finally:
        gateway.close(drain_s=1.0)


def submit_all(gateway: Gateway):
    """The poisoned request among four others, all submitted at once to the gateway's engines."""
    handles = {}
    for i, prompt in enumerate([*PROMPTS[:2], POISONED, *PROMPTS[2:]]):
        req = Request(f"r{i}", "t", list(prompt), RequestParams(max_tokens=MAX_TOKENS))
        engine = gateway.engines[i % len(gateway.engines)]
        handles[req.req_id] = (prompt, engine.submit(req))
    return handles


def collect(handles) -> tuple[dict, float]:
    """Each request's (tokens, last delta), and when the poisoned one ended (seconds after submission)."""
    t0, poisoned_s, out = time.monotonic(), None, {}
    for req_id, (prompt, handle) in handles.items():
        deltas = list(handle)
        out[req_id] = ([t for d in deltas for t in d.token_ids], deltas[-1])
        if prompt is POISONED:
            poisoned_s = time.monotonic() - t0
    return out, poisoned_s


def check_the_others(out, handles) -> None:
    for req_id, (prompt, _) in handles.items():
        if prompt is not POISONED:
            tokens, last = out[req_id]
            assert tokens == reference(prompt, MAX_TOKENS) and last.finish_reason is FinishReason.LENGTH, req_id


def test_an_item_the_worker_rejects_fails_that_request_alone(tokenizer, model_dir):
    kv, worker = InProcessKVManager(), PoisonWorker("w0", "item")
    epoch = worker.epoch
    handles, out, poisoned_s, before, after = serve([worker], kv, model_dir)
    tokens, last = out["r2"]
    assert tokens == [] and last.finish_reason is FinishReason.ERROR
    assert isinstance(handles["r2"][1].req.error, RequestRejected) and "token id 666" in str(handles["r2"][1].req.error)
    assert worker.poisoned_steps == 1 and poisoned_s < DEADLINE_S
    check_the_others(out, handles)
    assert after == before and not after[0].retiring and worker.epoch == epoch  # no membership change
    assert_all_pages_back(kv)


@pytest.mark.parametrize("how", ["step", "lost", "restart"])
def test_a_request_that_fails_on_every_worker_ends_in_seconds_and_is_never_handed_around(tokenizer, model_dir,
                                                                                         how):
    """Two workers, each breaking any step that holds the poisoned request. "step": the worker refuses the step
    (it is alive): the step's requests compute one at a time, the poisoned one fails alone, on the worker where it
    failed twice. "lost": its steps fail as if the worker died: the first worker is declared gone, the request goes
    to the second, where it is the only request under suspicion in its step, fails again and is failed, never
    handed back. "restart": the worker comes
    back after each: everything it ran is recomputed, the poisoned request alone first, and it fails there."""
    kv = InProcessKVManager()
    workers = [PoisonWorker("w0", how), PoisonWorker("w1", how)]
    handles, out, poisoned_s, _, engines = serve(workers, kv, model_dir)
    tokens, last = out["r2"]
    assert tokens == [] and last.finish_reason is FinishReason.ERROR and poisoned_s < DEADLINE_S
    error = handles["r2"][1].req.error
    assert isinstance(error, RequestFailed) and "failed in 2 steps in a row" in str(error)
    assert sum(w.poisoned_steps for w in workers) == 2  # tried twice in all: never cycled
    check_the_others(out, handles)
    if how in ("step", "restart"):
        assert workers[0].poisoned_steps == 2 and [e.info.worker_id for e in engines] == ["w0", "w1"]
    else:
        assert [w.poisoned_steps for w in workers] == [1, 1] and [e.info.worker_id for e in engines] == ["w1"]
    assert_all_pages_back(kv)


class RefusingKVManager(InProcessKVManager):
    """Refuses any call that allocates for the poisoned prompt, naming that request (as the real kvmanager's
    refusal names the request it is about in its trailing metadata)."""

    def step_pages(self, ops, traceparents=None):
        bad = next((a.req_id for a in ops.allocations if POISON in a.token_ids), None)
        if bad is not None:
            raise KVManagerFailed(f"kvmanager call failed: INVALID_ARGUMENT: allocation {bad!r}: injected",
                                  req_id=bad)
        return super().step_pages(ops)


def test_a_page_op_the_kvmanager_refuses_fails_its_request_not_the_engine(tokenizer, model_dir):
    kv, worker = RefusingKVManager(), PagedRuleWorker("w0", num_pages=64)
    handles, out, poisoned_s, before, after = serve([worker], kv, model_dir)
    tokens, last = out["r2"]
    assert tokens == [] and last.finish_reason is FinishReason.ERROR and poisoned_s < DEADLINE_S
    assert "the kvmanager refused its page op" in str(handles["r2"][1].req.error)
    check_the_others(out, handles)
    assert after == before and not after[0].retiring  # the engine served on: never retired
    assert_all_pages_back(kv)
