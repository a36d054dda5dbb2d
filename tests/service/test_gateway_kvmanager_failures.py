"""The gateway against kvmanager failures.

- The kvmanager killed with SIGKILL while the gateway streams a request, then restarted on the same port and
  Redis (as its Kubernetes Deployment would restart it): the gateway's page ops wait for it (UNAVAILABLE is
  retried with the same step_id), the request keeps its pages and finishes with the tokens of an uninterrupted
  run, its blocks stay cached, and every page comes back; also when the outage outlasts a call's timeout (the
  call is sent again, idempotent by its step_id).
- The gateway stopping while the kvmanager is down: it stops, and says which pages stay allocated.
- A gateway that died with requests running: the next one frees their pages when it registers the worker.
- New requests while the kvmanager is down (two workers): placed on the least queued worker at once, they wait
  for the kvmanager in their first page op and finish once it is back.
- A call the kvmanager applied but whose answer never came: its requests fail, and the next call (their frees
  and a new request's admission) goes through.
- Redis restarted while the gateway streams: the kvmanager answers UNAVAILABLE (nothing it answers is lost), the
  gateway retries with the same step_id, and the request finishes with the same tokens.

Redis is the test's own, so it outlives the kvmanager's SIGKILL as a managed Redis would. The gateway and the
worker run in this process; the killed kvmanager is a real `kvserve kvmanager` process.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import grpc
import pytest
from conftest import TEST_NUM_PAGES, TEST_PAGE_SIZE
from kvmanager_processes import kvmanager_process, stop_cleanly

from kvserve.common.embedded_redis import EmbeddedRedis
from kvserve.common.redis_client import connect
from kvserve.common.wire.pages import PageAllocation, PageCommit, PoolSpec, StepOps
from kvserve.common.wire.worker import SamplingParams
from kvserve.kvmanager.call_log import CallLog
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.server import start_kvmanager_server
from kvserve.kvmanager.service import KVService, NullStore
from kvserve.services.gateway.app import Gateway, GatewayConfig
from kvserve.services.gateway.auth import ApiKeys
from kvserve.services.gateway.request import FinishReason
from kvserve.services.gateway.rpc.connect import connect_gateway
from kvserve.services.gateway.validate import GenerateInput
from kvserve.v1 import kvmanager_pb2 as pb
from kvserve.v1 import kvmanager_pb2_grpc
from kvserve.worker.runner import ModelRunner, RunnerConfig
from kvserve.worker.server import start_worker_server

TOKEN = "admin-token"
PROMPT = ("The history of the railway in Europe began in the early nineteenth century, when the first steam "
          "locomotives pulled coal wagons between mines and ports, and")  # 28 tokens: one full page to cache
MAX_TOKENS = 40  # decoding crosses page boundaries (16 tokens a page), so the gateway must call the kvmanager


def request(max_tokens: int = MAX_TOKENS) -> GenerateInput:
    return GenerateInput(prompt=PROMPT, messages=None, sampling=SamplingParams(), max_tokens=max_tokens,
                         ignore_eos=True)


def stream(gateway: Gateway, on_token=None) -> tuple[list[int], object]:
    """The request's token ids and its usage (prompt_tokens, cached_tokens, completion_tokens); on_token(n)
    after the n-th token arrives."""
    out, usage = [], None
    for delta in gateway.submit(request(), "default"):
        out += delta.token_ids
        usage = delta.usage or usage
        if on_token and delta.token_ids:
            on_token(len(out))
    return out, usage


def running(gateway: Gateway, max_tokens: int = MAX_TOKENS):
    """A request that has streamed a token (so it holds pages): (its tokens so far, the deltas still to come)."""
    deltas = iter(gateway.submit(request(max_tokens), "default"))
    seen: list[int] = []
    while not seen:
        seen += next(deltas).token_ids
    return seen, deltas


def assert_cut_short(expected: list[int], seen: list[int], rest: list, max_tokens: int = MAX_TOKENS) -> None:
    """A request that the gateway's stop cut short: it ends CANCELLED, after fewer tokens than it asked for,
    and those agree with an uninterrupted run's."""
    got = seen + [t for delta in rest for t in delta.token_ids]
    n = min(len(got), len(expected))
    assert rest[-1].finish_reason is FinishReason.CANCELLED
    assert 0 < len(got) < max_tokens and got[:n] == expected[:n]


def close_within_120_s(gateway: Gateway) -> None:
    """Stops the gateway at once (no drain); fails if that takes longer than 120 s (it waited on something)."""
    closing = threading.Thread(target=gateway.close, kwargs={"drain_s": 0.0})
    closing.start()
    closing.join(timeout=120)
    assert not closing.is_alive()


def admin_stats(port: int) -> pb.ClusterStats:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return kvmanager_pb2_grpc.KVAdminServiceStub(channel).Stats(
            pb.StatsRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10)


class LogSeen(logging.Handler):
    """Sets ``event`` once a record of the gateway's logger contains ``text``."""

    def __init__(self, text: str):
        super().__init__()
        self.text, self.event = text, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


@pytest.mark.parametrize("outage", ["restart", "longer than a call's timeout"])
def test_kvmanager_kill9_mid_stream_then_restart_the_request_finishes_identically(tmp_path, model_dir,
                                                                                  worker_server, monkeypatch,
                                                                                  outage):
    with EmbeddedRedis(tmp_path / "redis") as redis, contextlib.ExitStack() as kvmanagers:
        args = ("--redis-url", redis.url, "--admin-token", TOKEN, "--data-dir", str(tmp_path / "data"))
        first, ready = kvmanagers.enter_context(kvmanager_process(tmp_path, *args))
        port = int(ready.group(1))
        gateway = connect_gateway(f"127.0.0.1:{port}", (f"127.0.0.1:{worker_server.port}",),
                              GatewayConfig(model_dir), ApiKeys())
        timed_out = LogSeen("kvmanager unavailable (DEADLINE_EXCEEDED")
        logging.getLogger("kvserve.gateway").addHandler(timed_out)
        try:
            expected, _ = stream(gateway)  # uninterrupted; it also caches the prompt's full page
            calls = watch_calls(gateway, monkeypatch)
            if outage != "restart":
                gateway.kv.timeout_s = 1.0  # a call waits 1 s for the kvmanager, then is sent again
            restarted = []

            def kill_and_restart_after_5(num_tokens: int) -> None:
                if num_tokens == 5:
                    first.kill()
                    first.wait(timeout=10)
                    with calls:  # the engine has a page op to make (or is making one): it waits for the kvmanager
                        assert calls.wait_for(lambda: calls.pending > 0, timeout=60)
                    if outage != "restart":
                        assert timed_out.event.wait(60)  # a try ran out of time: it is retried, not failed
                    restarted.append(kvmanagers.enter_context(
                        kvmanager_process(tmp_path, *args, "--port", str(port))))

            got, usage = stream(gateway, kill_and_restart_after_5)
            assert restarted and got == expected and len(got) == MAX_TOKENS
            assert usage.num_cached_tokens > 0  # the second run hit what the first cached
            pool = admin_stats(port).pools[0]  # the restarted kvmanager: the request freed, its blocks cached
            assert pool.num_used_pages == 0 and pool.num_requests == 0 and pool.num_cached_pages > 0
            _, again = stream(gateway)
            assert again.num_cached_tokens == usage.num_cached_tokens  # the index survived the kill
        finally:
            logging.getLogger("kvserve.gateway").removeHandler(timed_out)
            gateway.close(drain_s=1.0)
        stop_cleanly(restarted[0][0])


def watch_calls(gateway: Gateway, monkeypatch) -> threading.Condition:
    """A condition whose ``pending`` counts the gateway's StepPages calls not answered yet."""
    calls = threading.Condition()
    calls.pending = 0
    step_pages = gateway.kv.step_pages

    def watched(*a, **kw):
        with calls:
            calls.pending += 1
            calls.notify_all()
        try:
            return step_pages(*a, **kw)
        finally:
            with calls:
                calls.pending -= 1

    monkeypatch.setattr(gateway.kv, "step_pages", watched)
    return calls


def test_the_gateway_stops_while_the_kvmanager_is_down(model_dir, worker_server, caplog):
    """Its frees cannot go out: it says so and stops, instead of retrying them forever."""
    server = start_kvmanager_server(KVService(KVManager(), NullStore()), "127.0.0.1", 0, admin_token=TOKEN)
    gateway = connect_gateway(f"127.0.0.1:{server.port}", (f"127.0.0.1:{worker_server.port}",),
                              GatewayConfig(model_dir), ApiKeys())
    gateway.kv.timeout_s = 1.0  # a page op already waiting for the kvmanager gives up after 1 s, not 10
    expected, _ = stream(gateway)
    seen, deltas = running(gateway)
    server.stop(0)  # its decode needs a page op within two pages: it cannot finish
    close_within_120_s(gateway)
    assert_cut_short(expected, seen, list(deltas))
    assert "stopping with the kvmanager unreachable; the pages of 1 requests stay allocated there" in caplog.text


def test_a_starting_gateway_frees_what_a_dead_one_left_running(model_dir, worker_server, runner, caplog):
    """A gateway killed with requests running never freed them. The next one registers the worker with
    release_requests: their pages come back, their cached blocks stay, and it serves as usual."""
    service = KVService(KVManager(), NullStore())
    server = start_kvmanager_server(service, "127.0.0.1", 0, admin_token=TOKEN)
    spec = PoolSpec.of(runner.info)  # registered by the gateway that died, which then admitted a request
    service.register_worker(spec)
    orphan = PageAllocation("orphan", "default", tuple(range(100, 140)), spec.worker_id)
    service.step(StepOps(1, allocations=(orphan,), commits=()))
    service.step(StepOps(2, commits=(PageCommit("orphan", 0, orphan.token_ids[:32], 40),)))
    pool = service.manager.pools[spec.worker_id]
    assert pool.num_used == 3 and pool.num_requests == 1
    gateway = connect_gateway(f"127.0.0.1:{server.port}", (f"127.0.0.1:{worker_server.port}",),
                              GatewayConfig(model_dir), ApiKeys())
    try:
        assert pool.num_used == 0 and pool.num_requests == 0 and pool.num_cached == 2
        assert "freed the pages of 1 requests a previous gateway left running" in caplog.text
        got, _ = stream(gateway)
        assert len(got) == MAX_TOKENS and pool.num_used == 0
    finally:
        gateway.close(drain_s=1.0)
        server.stop(0)


def test_a_redis_restart_mid_stream_is_retried_through(tmp_path, model_dir, worker_server, monkeypatch):
    with EmbeddedRedis(tmp_path / "redis") as redis:
        service = KVService(KVManager(), CallLog(connect(redis.url)))
        server = start_kvmanager_server(service, "127.0.0.1", 0, admin_token=TOKEN)
        gateway = connect_gateway(f"127.0.0.1:{server.port}", (f"127.0.0.1:{worker_server.port}",),
                                  GatewayConfig(model_dir), ApiKeys())
        refused = LogSeen("kvmanager unavailable (UNAVAILABLE")
        logging.getLogger("kvserve.gateway").addHandler(refused)
        try:
            expected, _ = stream(gateway)
            calls = watch_calls(gateway, monkeypatch)

            def restart_redis_after_5(num_tokens: int) -> None:
                if num_tokens == 5:
                    redis.stop()
                    with calls:
                        assert calls.wait_for(lambda: calls.pending > 0, timeout=60)
                    assert refused.event.wait(60)  # the kvmanager could not make a call durable: refused
                    redis.start()

            got, _ = stream(gateway, restart_redis_after_5)
            assert got == expected and service.store_ok
            pool = service.manager.pools[runner_worker_id(gateway)]
            assert pool.num_used == 0 and pool.num_requests == 0
            reloaded = KVManager()
            CallLog(connect(redis.url)).load(reloaded)  # what a restart would load: everything answered
            assert reloaded.pools[pool.spec.worker_id].num_cached == pool.num_cached > 0
            assert not reloaded.requests
        finally:
            logging.getLogger("kvserve.gateway").removeHandler(refused)
            gateway.close(drain_s=1.0)
            server.stop(0)


def runner_worker_id(gateway: Gateway) -> str:
    return gateway.engines[0].info.worker_id


@pytest.fixture
def second_worker(model_dir):
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, num_pages=TEST_NUM_PAGES, page_size=TEST_PAGE_SIZE,
                                      device="cpu", dtype="float32", worker_id="worker-1"))
    server = start_worker_server(runner, "127.0.0.1", 0)
    yield server
    server.stop(1.0)


def test_while_the_kvmanager_is_down_new_requests_are_placed_by_load_and_wait_for_it(model_dir, worker_server,
                                                                                   second_worker, monkeypatch,
                                                                                   caplog):
    """Placement is a hint: with the kvmanager down, submit() does not wait out the outage (holding every other
    submission behind it) but queues the request on the least queued worker, whose page ops wait for the
    kvmanager as running requests' do. Once it is back, every request finishes, and placement is its again."""
    caplog.set_level(logging.INFO, logger="kvserve.gateway")
    service = KVService(KVManager(), NullStore())
    server = start_kvmanager_server(service, "127.0.0.1", 0, admin_token=TOKEN)
    workers = (f"127.0.0.1:{worker_server.port}", f"127.0.0.1:{second_worker.port}")
    gateway = connect_gateway(f"127.0.0.1:{server.port}", workers, GatewayConfig(model_dir), ApiKeys())
    try:
        expected, _ = stream(gateway)
        calls = watch_calls(gateway, monkeypatch)
        server.stop(0)
        a = gateway.submit(request(), "default")
        with calls:  # A's first page op waits for the kvmanager, and its engine's loop with it
            assert calls.wait_for(lambda: calls.pending > 0, timeout=60)
        b = gateway.submit(request(), "default")  # A waits for pages on the first engine: the other
        c = gateway.submit(request(), "default")  # one queued on each: the first of the least queued
        first, other = (e.info.worker_id for e in gateway.engines)
        assert [h.worker_id for h in (a, b, c)] == [first, other, first]
        assert caplog.text.count("placing new requests on the least queued worker") == 1
        server = start_kvmanager_server(service, "127.0.0.1", server.port, admin_token=TOKEN)
        assert [tokens_of(h) for h in (a, b, c)] == [expected] * 3
        stream(gateway)
        assert "kvmanager placement answers again" in caplog.text
        assert all(pool.num_used == 0 and pool.num_requests == 0 for pool in service.manager.pools.values())
    finally:
        gateway.close(drain_s=1.0)
        server.stop(0)


def tokens_of(handle) -> list[int]:
    return [t for delta in handle for t in delta.token_ids]


class LoseRepliesToFirstCommit(grpc.ServerInterceptor):
    """Applies every attempt of the first StepPages call that commits, but loses its reply (UNAVAILABLE, as
    when the connection drops after the kvmanager answered), once ``go`` is set; ``seen`` is set at the first
    attempt. Every other call is served."""

    def __init__(self):
        self.seen, self.go = threading.Event(), threading.Event()
        self.step_id = None

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if not details.method.endswith("/StepPages"):
            return handler

        def step_pages(request, context):
            if self.step_id is None and request.commits:
                self.step_id = request.step_id
            reply = handler.unary_unary(request, context)
            if request.step_id == self.step_id:
                self.seen.set()
                self.go.wait(60)
                context.abort(grpc.StatusCode.UNAVAILABLE, "the reply was lost (the test loses it)")
            return reply

        return grpc.unary_unary_rpc_method_handler(step_pages, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


def test_a_call_applied_but_never_answered_fails_only_its_own_requests(model_dir, worker_server):
    """The gateway gave up on a call the kvmanager had applied (its commits included), and failed its requests.
    Their frees go out with the next call; commits computed before the lost answer must not (they would be
    refused as out of order, and the whole call with them): the request admitted in that call runs."""
    service = KVService(KVManager(), NullStore())
    loser = LoseRepliesToFirstCommit()
    server = start_kvmanager_server(service, "127.0.0.1", 0, admin_token=TOKEN, interceptors=(loser,))
    # 16-token chunks: a commit a step
    gateway = connect_gateway(f"127.0.0.1:{server.port}", (f"127.0.0.1:{worker_server.port}",),
                              GatewayConfig(model_dir, max_num_batched_tokens=16), ApiKeys())
    gateway.kv.retry_for_s = 0.5  # the lost call fails after 0.5 s of retries instead of 60
    try:
        first = gateway.submit(request(), "default")
        assert loser.seen.wait(60)  # the engine's loop is in the call: what is submitted now waits in its inbox
        second = gateway.submit(request(), "default")
        loser.go.set()
        assert list(first)[-1].finish_reason is FinishReason.ERROR
        got = [t for delta in second for t in delta.token_ids]
        assert second.req.finish_reason is FinishReason.LENGTH and len(got) == MAX_TOKENS
        pool = service.manager.pools[runner_worker_id(gateway)]
        assert pool.num_used == 0 and pool.num_requests == 0
    finally:
        gateway.close(drain_s=1.0)
        server.stop(0)


def test_the_gateway_stops_at_once_with_its_worker_gone_and_frees_the_pages(model_dir, second_worker):
    """The worker dies mid-stream and the gateway is stopped. The step waiting for the worker is cancelled (it
    would otherwise wait out its 120 s timeout), and the request's pages are freed: the kvmanager is there."""
    service = KVService(KVManager(), NullStore())
    server = start_kvmanager_server(service, "127.0.0.1", 0, admin_token=TOKEN)
    gateway = connect_gateway(f"127.0.0.1:{server.port}", (f"127.0.0.1:{second_worker.port}",),
                              GatewayConfig(model_dir), ApiKeys())
    gateway.engines[0].worker.timeout_s = 600.0  # were the step waited for, the test would hit its own limit
    try:
        expected, _ = stream(gateway)
        seen, deltas = running(gateway, max_tokens=1000)  # far more than it computes before the worker is gone
        second_worker.stop(0)
        close_within_120_s(gateway)
        assert_cut_short(expected, seen, list(deltas), max_tokens=1000)
        pool = service.manager.pools["worker-1"]
        assert pool.num_used == 0 and pool.num_requests == 0
    finally:
        server.stop(0)
