"""Requests whose stream must end although they never finished normally, in a gateway in this process with a
real worker and kvmanager.

- With one seat (max_num_seqs=1), a second request queues behind the first. Cancelled there, or left queued
  when the gateway stops, it holds no pages, so its stream must end at once instead of waiting for a free
  that never comes (a stream that never ends holds a gateway handler thread for good).
- A step that raises an unexpected error (a bug) fails the requests it ran, frees their pages, and the engine
  goes on serving: its loop must not die with every stream open.
"""

from __future__ import annotations

import pytest

from kvserve.common.wire.worker import SamplingParams
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.server import start_kvmanager_server
from kvserve.kvmanager.service import KVService, NullStore
from kvserve.services.gateway.app import Gateway, GatewayConfig
from kvserve.services.gateway.auth import ApiKeys
from kvserve.services.gateway.request import FinishReason
from kvserve.services.gateway.rpc.connect import connect_gateway
from kvserve.services.gateway.validate import GenerateInput

PROMPT = "The history of the railway in Europe began"
END_WITHIN_S = 60  # a guard, not a measure: without the fix the stream never ends


def request(max_tokens: int) -> GenerateInput:
    return GenerateInput(prompt=PROMPT, messages=None, sampling=SamplingParams(), max_tokens=max_tokens,
                         ignore_eos=True)


@pytest.fixture
def gateway(model_dir, worker_server):
    service = KVService(KVManager(), NullStore())
    server = start_kvmanager_server(service, "127.0.0.1", 0, admin_token="t")
    gw = connect_gateway(f"127.0.0.1:{server.port}", (f"127.0.0.1:{worker_server.port}",),
                         GatewayConfig(model_dir, max_num_seqs=1), ApiKeys())
    gw.pool = next(iter(service.manager.pools.values()))
    yield gw
    gw.close(drain_s=1.0)
    server.stop(0)


def start_two(gateway: Gateway):
    """The first request running (it has streamed a token) and the second queued behind it."""
    running = gateway.submit(request(max_tokens=20), "default")
    queued = gateway.submit(request(max_tokens=5), "default")
    deltas = iter(running)
    while not next(deltas).token_ids:
        pass
    return gateway.engines[0], deltas, queued


def last_delta(handle):
    delta = handle.deltas.get(timeout=END_WITHIN_S)
    assert delta.finish_reason is not None
    return delta


def test_cancelling_a_queued_request_ends_its_stream_and_the_running_one_goes_on(gateway):
    engine, running, queued = start_two(gateway)
    queued.cancel()
    end = last_delta(queued)
    assert end.finish_reason is FinishReason.CANCELLED and not end.token_ids and end.usage.completion_tokens == 0
    rest = list(running)
    assert rest[-1].finish_reason is FinishReason.LENGTH and sum(len(d.token_ids) for d in rest) == 19
    assert engine.idle.wait(END_WITHIN_S)
    assert gateway.pool.num_used == 0 and gateway.pool.num_requests == 0


def test_stopping_ends_the_queued_requests_stream_too(gateway):
    engine, running, queued = start_two(gateway)
    gateway.close(drain_s=0.0)
    assert last_delta(queued).finish_reason is FinishReason.CANCELLED
    assert list(running)[-1].finish_reason is FinishReason.CANCELLED
    assert gateway.pool.num_used == 0 and gateway.pool.num_requests == 0


def test_a_step_that_raises_fails_its_requests_and_the_engine_serves_on(gateway, monkeypatch):
    engine = gateway.engines[0]
    update = engine.core.scheduler.update
    raised = []

    def update_once_broken(batch, sampled, stopped):
        if not raised:
            raised.append(True)
            raise RuntimeError("a bug")
        return update(batch, sampled, stopped)

    monkeypatch.setattr(engine.core.scheduler, "update", update_once_broken)
    broken = gateway.submit(request(max_tokens=5), "default")
    end = last_delta(broken)
    assert end.finish_reason is FinishReason.ERROR and "internal error in the gateway: RuntimeError: a bug" in str(
        end.error)
    ok = gateway.submit(request(max_tokens=5), "default")
    assert sum(len(d.token_ids) for d in ok) == 5 and ok.req.finish_reason is FinishReason.LENGTH
    assert engine.idle.wait(END_WITHIN_S)
    assert gateway.pool.num_used == 0 and gateway.pool.num_requests == 0


def test_a_stop_string_completed_by_the_last_allowed_token_is_a_stop(gateway):
    """The token that reaches max_tokens also completes a stop string: the request stopped on the string (its
    text is cut there), so it ends STOP, not LENGTH."""
    def run(max_tokens: int, stop: tuple[str, ...] = ()):
        handle = gateway.submit(GenerateInput(prompt=PROMPT, messages=None, sampling=SamplingParams(),
                                              max_tokens=max_tokens, stop=stop, ignore_eos=True), "default")
        deltas = list(handle)
        return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas), deltas[-1]

    tokens, _, _ = run(12)
    for n in range(4, 13):  # the first length whose last token adds text seen nowhere before it
        before, through = (gateway.tokenizer.decode(tokens[:k]) for k in (n - 1, n))
        last = through[len(before):].strip()
        if last and through.startswith(before) and last not in before:
            break
    else:
        pytest.fail(f"no usable last token in {tokens}")
    got, text, end = run(n, (last,))
    assert got == tokens[:n] and last not in text
    assert end.finish_reason is FinishReason.STOP
