"""A worker lost for good (it stops answering and never comes back): after the worker timeout the gateway declares
it dead, the kvmanager drops its pool, and each of its running and queued requests is recomputed on the live
worker, its stream going on with no token missing or repeated: the client sees HF's greedy tokens. A draining
worker hands its queued requests over and finishes the running ones itself."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
from polling import wait_for

from kvserve.common.wire.worker import SamplingParams
from kvserve.kvmanager import admin
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.server import start_kvmanager_server
from kvserve.kvmanager.service import KVService, NullStore
from kvserve.services.gateway.app import GatewayConfig
from kvserve.services.gateway.auth import ApiKeys
from kvserve.services.gateway.rpc.connect import connect_gateway
from kvserve.services.gateway.validate import GenerateInput
from kvserve.worker.runner import ModelRunner, RunnerConfig
from kvserve.worker.server import start_worker_server

PROMPTS = ["The history of the railway in Europe began", "A short guide to growing tomatoes at home:",
           "In mathematics, a prime number is", "The old lighthouse keeper looked out at the sea and"]
WORKER_TIMEOUT_S = 1.0
# The kvmanager's answer to the LeaveWorker of a worker the gateway declared dead, slowed: a hand-over placed
# before the lost worker's pool is dropped would have the live worker allocate req_ids that are still live there,
# and be refused.
LEAVE_LATENCY_S = 0.5
MAX_TOKENS = 24
TIMEOUT_S = 120.0


def greedy(prompt: str) -> GenerateInput:
    return GenerateInput(prompt=prompt, messages=None, sampling=SamplingParams(), max_tokens=MAX_TOKENS,
                         ignore_eos=True)


@contextlib.contextmanager
def two_workers(model_dir, max_num_seqs: int = 8):
    """A kvmanager, two worker servers and a gateway over a static list of both; yields (gateway, service,
    servers by worker_id)."""
    service = KVService(KVManager(), NullStore())
    kv_server = start_kvmanager_server(service, "127.0.0.1", 0, admin_token="t")
    servers = {}
    for worker_id in ("worker-a", "worker-b"):
        runner = ModelRunner(RunnerConfig(model_dir=model_dir, num_pages=64, page_size=16, device="cpu",
                                          dtype="float32", worker_id=worker_id))
        servers[worker_id] = start_worker_server(runner, "127.0.0.1", 0)
    cfg = GatewayConfig(model_dir, worker_timeout_s=WORKER_TIMEOUT_S, max_num_seqs=max_num_seqs)
    gateway = connect_gateway(f"127.0.0.1:{kv_server.port}", [f"127.0.0.1:{s.port}" for s in servers.values()],
                              cfg, ApiKeys())
    try:
        yield gateway, service, servers
    finally:
        gateway.close(drain_s=1.0)
        for server in servers.values():
            server.stop(0)
        kv_server.stop(0)


def collect(handle, out: list, on_token=None) -> None:
    for delta in handle:
        out += delta.token_ids
        if on_token is not None and delta.token_ids:
            on_token(len(out))
        if delta.finish_reason is not None:
            out.append(delta.finish_reason.name)


def used_pages(service: KVService, worker_id: str) -> int:
    pool = next(p for p in service.read(admin.stats).pools if p.worker_id == worker_id)
    return pool.num_used_pages


@pytest.fixture(scope="module")
def reference(model_dir, hf_greedy, tokenizer):
    return {p: hf_greedy(tokenizer.encode(p), MAX_TOKENS) for p in PROMPTS}


def slow_leave(service: KVService) -> None:
    leave_worker = service.leave_worker

    def slowly(worker_id: str, epoch: int) -> tuple[str, ...]:
        time.sleep(LEAVE_LATENCY_S)  # a slow answer, not a synchronisation: nothing waits on it here
        return leave_worker(worker_id, epoch)

    service.leave_worker = slowly


def test_a_worker_lost_mid_stream_has_its_requests_finished_on_the_live_worker(model_dir, reference, tokenizer):
    with two_workers(model_dir) as (gateway, service, servers):
        slow_leave(service)
        handles = [gateway.submit(greedy(p), "t") for p in PROMPTS]
        victim = handles[0].worker_id
        on_victim = [h for h in handles if h.worker_id == victim]
        killed = threading.Event()
        killed_at = []

        def kill_at(n: int) -> None:
            if n == 5 and not killed.is_set():
                killed.set()
                killed_at.append(time.monotonic())
                servers[victim].stop(0)  # gone for good: nothing serves its port again

        outs = {h.req.req_id: [] for h in handles}
        threads = [threading.Thread(target=collect, args=(h, outs[h.req.req_id], kill_at if h is handles[0] else None))
                   for h in handles]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT_S)
        finished_s = time.monotonic() - killed_at[0]
        assert killed.is_set() and on_victim
        for h, prompt in zip(handles, PROMPTS, strict=True):
            assert outs[h.req.req_id] == [*reference[prompt], "LENGTH"], prompt  # none missing, none repeated
        assert all(h.worker_id != victim for h in on_victim)  # rebound to the live worker
        live = next(w for w in servers if w != victim)
        assert [e.info.worker_id for e in gateway.engines] == [live]
        assert victim not in service.manager.pools  # declared dead: its pool and index entries are gone
        assert used_pages(service, live) == 0
        # The worker timeout, then a recompute of at most MAX_TOKENS + a prompt: well within the bound.
        assert finished_s < WORKER_TIMEOUT_S + 30, finished_s


def test_queued_requests_of_a_lost_worker_move_too(model_dir, reference):
    with two_workers(model_dir, max_num_seqs=1) as (gateway, service, servers):
        handles = [gateway.submit(greedy(p), "t") for p in PROMPTS * 2]
        by_worker = {}
        for h in handles:
            by_worker.setdefault(h.worker_id, []).append(h)
        victim = max(by_worker, key=lambda w: len(by_worker[w]))
        assert len(by_worker[victim]) >= 2  # one runs there, the rest queue behind it (max_num_seqs 1)
        servers[victim].stop(0)
        outs = [[] for _ in handles]
        for h, out in zip(handles, outs, strict=True):
            collect(h, out)
        for h, out in zip(handles, outs, strict=True):
            assert out == [*reference[PROMPTS[handles.index(h) % len(PROMPTS)]], "LENGTH"]
        live = next(w for w in servers if w != victim)
        assert used_pages(service, live) == 0 and victim not in service.manager.pools


def test_a_draining_worker_finishes_its_running_requests_and_hands_its_queue_over(model_dir, reference):
    with two_workers(model_dir, max_num_seqs=1) as (gateway, service, servers):
        first = gateway.submit(greedy(PROMPTS[0]), "t")
        drained = next(e for e in gateway.engines if e.info.worker_id == first.worker_id)
        queued = [gateway.submit(greedy(p), "t") for p in PROMPTS[1:]]
        stays = [h for h in queued if h.worker_id == drained.info.worker_id]
        drained.drain()
        later = gateway.submit(greedy(PROMPTS[1]), "t")
        assert later.worker_id != drained.info.worker_id  # a draining worker takes nothing new
        outs = {}
        for h in [first, *queued, later]:
            outs[h.req.req_id] = []
            collect(h, outs[h.req.req_id])
        assert outs[first.req.req_id] == [*reference[PROMPTS[0]], "LENGTH"]
        assert first.worker_id == drained.info.worker_id  # it finished where it ran
        for h in stays:
            assert h.worker_id != drained.info.worker_id  # handed over
        for h, prompt in zip(queued, PROMPTS[1:], strict=True):
            assert outs[h.req.req_id] == [*reference[prompt], "LENGTH"]
        assert all(used_pages(service, w) == 0 for w in servers)


@contextlib.contextmanager
def membership_stack(model_dir, worker_ids=("worker-a",)):
    """A kvmanager whose members are joined by hand (as each worker's lease keeper would), worker servers, and a
    gateway following the membership (no static list); yields (gateway, service, servers, join)."""
    from kvserve.common.wire.pages import PoolSpec

    service = KVService(KVManager(), NullStore(), worker_timeout_s=600.0)
    kv_server = start_kvmanager_server(service, "127.0.0.1", 0, admin_token="t")
    servers = {}

    def join(worker_id: str):
        runner = ModelRunner(RunnerConfig(model_dir=model_dir, num_pages=64, page_size=16, device="cpu",
                                          dtype="float32", worker_id=worker_id))
        servers[worker_id] = server = start_worker_server(runner, "127.0.0.1", 0)
        service.join_worker(PoolSpec.of(runner.info), f"127.0.0.1:{server.port}")
        return runner

    for worker_id in worker_ids:
        join(worker_id)
    cfg = GatewayConfig(model_dir, worker_timeout_s=WORKER_TIMEOUT_S, membership_poll_s=0.05)
    gateway = connect_gateway(f"127.0.0.1:{kv_server.port}", None, cfg, ApiKeys())
    try:
        yield gateway, service, servers, join
    finally:
        gateway.close(drain_s=1.0)
        for server in servers.values():
            server.stop(0)
        kv_server.stop(0)


def test_the_gateway_follows_membership_a_joining_worker_takes_traffic_a_leaving_one_hands_over(model_dir, reference):
    with membership_stack(model_dir) as (gateway, service, servers, join):
        assert [e.info.worker_id for e in gateway.engines] == ["worker-a"]
        join("worker-b")  # added while the gateway runs: no restart
        wait_for(lambda: len(gateway.engines) == 2, "the joined worker's engine")
        handles = [gateway.submit(greedy(p), "t") for p in PROMPTS]
        assert {h.worker_id for h in handles} == {"worker-a", "worker-b"}  # both take traffic
        leaving = handles[0].worker_id
        outs = {h.req.req_id: [] for h in handles}
        left = threading.Event()

        def leave_at(n: int) -> None:
            if n == 3 and not left.is_set():
                left.set()
                epoch = next(e.info.epoch for e in gateway.engines if e.info.worker_id == leaving)
                service.leave_worker(leaving, epoch)  # gone from the membership with requests running
                servers[leaving].stop(0)

        threads = [threading.Thread(target=collect, args=(h, outs[h.req.req_id], leave_at if h is handles[0] else None))
                   for h in handles]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT_S)
        for h, prompt in zip(handles, PROMPTS, strict=True):
            assert outs[h.req.req_id] == [*reference[prompt], "LENGTH"], prompt
        live = next(w for w in servers if w != leaving)
        assert [e.info.worker_id for e in gateway.engines] == [live]
        assert used_pages(service, live) == 0


def test_requests_of_the_only_worker_wait_for_the_next_one_to_join(model_dir, reference):
    with membership_stack(model_dir) as (gateway, service, servers, join):
        handle = gateway.submit(greedy(PROMPTS[0]), "t")
        out = []
        joined = []

        def replace_at(n: int) -> None:
            if n == 4 and not joined:
                servers["worker-a"].stop(0)  # lost for good: its steps fail, the gateway declares it dead
                wait_for(lambda: not gateway.engines, "the lost worker's engine to retire")
                joined.append(join("worker-c"))  # the only worker now, joined after the loss

        collect(handle, out, replace_at)
        assert out == [*reference[PROMPTS[0]], "LENGTH"]
        assert handle.worker_id == "worker-c"
        assert "worker-a" not in service.manager.pools and used_pages(service, "worker-c") == 0
