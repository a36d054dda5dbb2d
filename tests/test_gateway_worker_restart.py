"""A worker that restarts mid-request (a new process would have a new epoch and an empty pool): the gateway
re-sends the step once the worker is back, learns its new epoch, re-registers the pool with the kvmanager
(which drops the old epoch's pages) and recomputes the request. The client sees the same tokens."""

from __future__ import annotations

import pytest

from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.server import start_kvmanager_server
from kvserve.kvmanager.service import KVService, NullStore
from kvserve.services.gateway.app import Gateway, GatewayConfig
from kvserve.services.gateway.auth import ApiKeys
from kvserve.services.gateway.validate import GenerateInput
from kvserve.worker.batch import SamplingParams
from kvserve.worker.runner import ModelRunner, RunnerConfig
from kvserve.worker.server import start_worker_server

PROMPT = "The history of the railway in Europe began"


def new_runner(model_dir) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_dir=model_dir, num_pages=64, page_size=16, device="cpu",
                                    dtype="float32", worker_id="worker-0"))


def tokens(handle, on_token=None) -> list[int]:
    out = []
    for delta in handle:
        out += delta.token_ids
        if on_token and delta.token_ids:
            on_token(len(out))
    return out


@pytest.fixture
def kvmanager():
    service = KVService(KVManager(), NullStore())
    server = start_kvmanager_server(service, "127.0.0.1", 0, admin_token="t")
    yield service, f"127.0.0.1:{server.port}"
    server.stop(0)


def test_a_worker_restart_mid_request_recomputes_with_identical_output(model_dir, kvmanager):
    service, kv_address = kvmanager
    runner = new_runner(model_dir)
    first = start_worker_server(runner, "127.0.0.1", 0)
    port = first.port
    gateway = Gateway(GatewayConfig(kv_address, (f"127.0.0.1:{port}",), model_dir), ApiKeys())
    request = GenerateInput(prompt=PROMPT, messages=None, sampling=SamplingParams(), max_tokens=24, ignore_eos=True)
    servers = [first]
    try:
        expected = tokens(gateway.submit(request, "default")[0])
        restarted = new_runner(model_dir)  # loaded before the restart, so the gap stays short

        def restart_after_5(num_tokens: int) -> None:
            if num_tokens == 5:
                servers[0].stop(0)
                servers.append(start_worker_server(restarted, "127.0.0.1", port))

        got = tokens(gateway.submit(request, "default")[0], restart_after_5)
        assert got == expected
        assert len(servers) == 2 and restarted.info.epoch != runner.info.epoch
        pool = service.manager.pools["worker-0"]
        assert pool.spec.epoch == restarted.info.epoch  # re-registered: the old epoch's pages are gone
        assert gateway.engines[0].info.epoch == restarted.info.epoch
    finally:
        gateway.close(drain_s=1.0)
        servers[-1].stop(0)
