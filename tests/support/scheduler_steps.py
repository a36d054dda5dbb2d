"""Driving an engine core step by step, for the gateway's scheduler tests against the real kvmanager domain
(tests/unit/gateway/test_gateway_scheduler.py, test_gateway_page_groups.py): a request with greedy sampling, one
step, and every step until nothing is left, the kvmanager's invariants checked after each."""

from __future__ import annotations

from engine_fakes import InlineExecutor

from kvserve.common.wire.worker import StepBatch
from kvserve.kvmanager.invariants import check_invariants
from kvserve.services.gateway.core import EngineCore
from kvserve.services.gateway.request import Request, RequestParams


def request(req_id, prompt, max_tokens=3, tenant="t"):
    return Request(req_id, tenant, list(prompt), RequestParams(max_tokens=max_tokens, ignore_eos=True))


def run_step(core: EngineCore, overlap=False):
    """One step of the engine core: (the step's schedule, the batch it computed; the worker keeps the last batch it
    was sent in ``batch``). ``overlap``: with an executor, as the engine loop runs a step whose call can overlap
    compute (the batch first, the answer applied before update)."""
    core.executor = InlineExecutor() if overlap else None
    core.worker.batch = StepBatch(())
    events = core.step()
    return events.scheduled, core.worker.batch


def drain(core: EngineCore, max_steps=100, overlap=False):
    steps = []
    while core.has_work() and len(steps) < max_steps:
        steps.append(run_step(core, overlap))
        check_invariants(core.kv.mgr)
    assert not core.has_work()
    return steps
