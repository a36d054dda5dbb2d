"""Page ops overlap compute: a kvmanager call that only commits pages (and tops up headroom) is made while the
worker computes the step, instead of before it.

The kvmanager below holds the first such call until the worker has started that step's Step. An engine that
waited for the answer before computing would never start it, and the call would time out unanswered; an engine
that overlaps starts it at once. The tokens are the same either way."""

from __future__ import annotations

import threading

import grpc
import pytest

from kvserve.common.wire.worker import SamplingParams
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.server import start_kvmanager_server
from kvserve.kvmanager.service import KVService, NullStore
from kvserve.services.gateway.app import GatewayConfig
from kvserve.services.gateway.auth import ApiKeys
from kvserve.services.gateway.rpc.connect import connect_gateway
from kvserve.services.gateway.validate import GenerateInput

STEP_PAGES = "/kvserve.v1.KVManagerService/StepPages"
PROMPT = "The history of the railway in Europe began in the early nineteenth century, when " * 3
HOLD_S = 60.0  # how long the held call waits for the worker; reached only when the engine does not overlap


class HoldFirstCommitOnlyCall(grpc.ServerInterceptor):
    """Holds the first StepPages call that commits and neither admits, extends nor frees, until ``release``
    is set; records whether it was set in time."""

    def __init__(self, release: threading.Event):
        self.release = release
        self.held: list[bool] = []

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if details.method != STEP_PAGES:
            return handler

        def step_pages(request, context):
            commit_only = request.commits and not (request.allocations or request.extensions or request.frees)
            if commit_only and not self.held:
                self.held.append(self.release.wait(HOLD_S))
            return handler.unary_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(step_pages, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


def generate(model_dir, worker_port: int, overlap: bool, interceptors=()) -> tuple[list[int], object]:
    """One greedy request through a gateway (16 tokens a step: the prompt is prefilled in chunks, and each
    chunk's step commits the page the chunk before filled) over a fresh kvmanager; its tokens and engine stats."""
    server = start_kvmanager_server(KVService(KVManager(), NullStore()), "127.0.0.1", 0, admin_token="t",
                                    interceptors=tuple(interceptors))
    gateway = connect_gateway(f"127.0.0.1:{server.port}", (f"127.0.0.1:{worker_port}",),
                              GatewayConfig(model_dir, max_num_batched_tokens=16, overlap_page_ops=overlap), ApiKeys())
    try:
        handle = gateway.submit(GenerateInput(prompt=PROMPT, messages=None, sampling=SamplingParams(),
                                                      max_tokens=8, ignore_eos=True), "default")
        out = [t for delta in handle for t in delta.token_ids]
        return out, gateway.engines[0].stats
    finally:
        gateway.close(drain_s=1.0)
        server.stop(0)


@pytest.fixture
def step_starts(runner, monkeypatch):
    """Events set when the worker starts its 1st, 2nd, ... Step (the session's runner, wrapped for the test)."""
    events = [threading.Event() for _ in range(64)]
    count = iter(events)
    step = runner.step

    def counted(batch):
        next(count).set()
        return step(batch)

    monkeypatch.setattr(runner, "step", counted)
    return events


def test_a_commit_only_call_is_answered_while_the_worker_computes(model_dir, worker_server, step_starts):
    hold = HoldFirstCommitOnlyCall(release=step_starts[1])  # the 2nd step: the first one that commits only
    overlapped, stats = generate(model_dir, worker_server.port, overlap=True, interceptors=[hold])
    assert hold.held == [True]  # the worker started that step while the kvmanager still held its call
    assert stats.num_kv_calls_overlapped >= 3  # prompt of ~50 tokens in chunks of 16: a commit per chunk
    waited, stats_off = generate(model_dir, worker_server.port, overlap=False)
    assert stats_off.num_kv_calls_overlapped == 0 and stats_off.num_kv_calls == stats.num_kv_calls
    assert overlapped == waited and len(overlapped) == 8
