"""A worker that restarts mid-request (a new process would have a new epoch and an empty pool): the gateway
re-sends the step once the worker is back, learns its new epoch, re-registers the pool with the kvmanager
(which drops the old epoch's pages) and recomputes the request. The client sees the same tokens. And when the
kvmanager cannot register the new pool at that moment, the engine keeps the old epoch until it can."""

from __future__ import annotations

import contextlib
import threading

import grpc
import pytest

from kvserve.common.wire.worker import SamplingParams
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.server import start_kvmanager_server
from kvserve.kvmanager.service import KVService, NullStore
from kvserve.services.gateway.app import GatewayConfig
from kvserve.services.gateway.auth import ApiKeys
from kvserve.services.gateway.errors import BackendFailure
from kvserve.services.gateway.rpc.connect import connect_gateway
from kvserve.services.gateway.validate import GenerateInput
from kvserve.worker.runner import ModelRunner, RunnerConfig
from kvserve.worker.server import start_worker_server

PROMPT = "The history of the railway in Europe began"


def new_runner(model_dir, num_pages: int = 64, page_size: int = 16) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_dir=model_dir, num_pages=num_pages, page_size=page_size, device="cpu",
                                    dtype="float32", worker_id="worker-0"))


def restart_at(n: int, servers: list, restarted: ModelRunner, port: int, first=None):
    """An on_token callback: at the n-th token, (first() then) the worker's server stops and ``restarted`` is
    served on its port, as a restarted worker process would be; the new server is appended to ``servers``."""
    def on_token(num_tokens: int) -> None:
        if num_tokens == n:
            if first is not None:
                first()
            servers[0].stop(0)
            servers.append(start_worker_server(restarted, "127.0.0.1", port))
    return on_token


@contextlib.contextmanager
def served_worker(model_dir, kv_address, runner: ModelRunner | None = None):
    """A worker server on a free port and a gateway over it; yields (gateway, servers): servers[0] is the
    worker's server, and a restart appends the next one. Everything is stopped at the end."""
    servers = [start_worker_server(runner or new_runner(model_dir), "127.0.0.1", 0)]
    gateway = connect_gateway(kv_address, (f"127.0.0.1:{servers[0].port}",), GatewayConfig(model_dir), ApiKeys())
    try:
        yield gateway, servers
    finally:
        gateway.close(drain_s=1.0)
        servers[-1].stop(0)


def greedy(max_tokens: int, prompt: str = PROMPT) -> GenerateInput:
    return GenerateInput(prompt=prompt, messages=None, sampling=SamplingParams(), max_tokens=max_tokens,
                         ignore_eos=True)


def tokens(handle, on_token=None) -> list[int]:
    out = []
    for delta in handle:
        out += delta.token_ids
        if on_token and delta.token_ids:
            on_token(len(out))
    return out


class RefuseRegistration(grpc.ServerInterceptor):
    """While ``refusing`` is set, RegisterWorker answers UNAVAILABLE, as the kvmanager does when it cannot
    reach Redis; every other call is served."""

    def __init__(self):
        self.refusing = threading.Event()

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if not details.method.endswith("/RegisterWorker"):
            return handler

        def register(request, context):
            if self.refusing.is_set():
                context.abort(grpc.StatusCode.UNAVAILABLE, "Redis unreachable (the test refuses it)")
            return handler.unary_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(register, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


@pytest.fixture
def refusal():
    return RefuseRegistration()


@pytest.fixture
def kvmanager(refusal):
    service = KVService(KVManager(), NullStore())
    server = start_kvmanager_server(service, "127.0.0.1", 0, admin_token="t", interceptors=(refusal,))
    yield service, f"127.0.0.1:{server.port}"
    server.stop(0)


def test_a_worker_restart_mid_request_recomputes_with_identical_output(model_dir, kvmanager):
    service, kv_address = kvmanager
    runner = new_runner(model_dir)
    with served_worker(model_dir, kv_address, runner) as (gateway, servers):
        expected = tokens(gateway.submit(greedy(24), "default"))
        restarted = new_runner(model_dir)  # loaded before the restart, so the gap stays short

        got = tokens(gateway.submit(greedy(24), "default"), restart_at(5, servers, restarted, servers[0].port))
        assert got == expected
        assert len(servers) == 2 and restarted.info.epoch != runner.info.epoch
        pool = service.manager.pools["worker-0"]
        assert pool.spec.epoch == restarted.info.epoch  # re-registered: the old epoch's pages are gone
        assert gateway.engines[0].info.epoch == restarted.info.epoch


def test_a_restarted_worker_whose_registration_failed_is_never_served_the_old_epochs_cache(model_dir, kvmanager,
                                                                                          refusal):
    """The worker restarts while the kvmanager cannot register its new pool. The requests fail, and the
    engine must stay on the old epoch: had it taken the new one, the kvmanager (still on the old epoch) would
    hand the next request prefix hits on pages the restarted worker never wrote. Instead its first step is
    refused by the worker, the engine registers again, and the request is computed from scratch."""
    service, kv_address = kvmanager
    request = greedy(12, PROMPT * 4)
    with served_worker(model_dir, kv_address) as (gateway, servers):
        gateway.kv.retry_for_s = 0.5  # a refused registration fails the step after 0.5 s instead of 60
        port = servers[0].port
        expected = tokens(gateway.submit(request, "default"))  # caches the prompt's full pages
        restarted = new_runner(model_dir)
        handle = gateway.submit(request, "default")
        tokens(handle, restart_at(3, servers, restarted, port, first=refusal.refusing.set))
        assert handle.req.finish_reason.name == "ERROR"  # its re-registration was refused
        assert gateway.engines[0].info.epoch != restarted.info.epoch
        refusal.refusing.clear()
        again = gateway.submit(request, "default")
        assert tokens(again) == expected  # not computed over the zeroed pages of the restarted worker
        assert service.manager.pools["worker-0"].spec.epoch == restarted.info.epoch
        assert gateway.engines[0].info.epoch == restarted.info.epoch


@pytest.mark.parametrize("change", ["a resized pool", "another page size"])
def test_a_worker_restarted_with_another_config_is_followed_or_refused(model_dir, kvmanager, change):
    """A resized pool is followed (the request recomputes, identical). Another page size is not: the gateway's
    page tables and chunking were made for the old one, so its requests fail with a message that says so, and
    so does every later submission, instead of computing garbage."""
    service, kv_address = kvmanager
    request = greedy(12)
    with served_worker(model_dir, kv_address) as (gateway, servers):
        port = servers[0].port
        expected = tokens(gateway.submit(request, "default"))
        restarted = new_runner(model_dir, num_pages=48) if change == "a resized pool" else new_runner(
            model_dir, page_size=32)

        handle = gateway.submit(request, "default")
        got = tokens(handle, restart_at(3, servers, restarted, port))
        engine = gateway.engines[0]
        if change == "a resized pool":
            assert got == expected and engine.core.scheduler.cfg.num_pages == 48
            assert service.manager.pools["worker-0"].spec.num_pages == 48
            return
        assert handle.req.finish_reason.name == "ERROR" and "page size 16 -> 32" in str(handle.req.error)
        with pytest.raises(BackendFailure, match="restarted with page size 16 -> 32; .* restart the gateway"):
            gateway.submit(request, "default")
        assert service.manager.pools["worker-0"].spec.page_size == 16  # never registered under this gateway
