"""kvmanager benchmark: latency and throughput of batched StepPages calls, domain core vs service vs gRPC,
with and without persistence (the Redis call log).

    python bench/bench_kvmanager.py [--quick] [--profile] [--server-process] [--out bench/results/kvmanager-DATE.json]

Workload (seeded, deterministic): one registered pool of NUM_PAGES pages of PAGE_SIZE tokens; 2000-token
prompts, half of which start with one of 16 shared 1024-token prefixes (8 tenants x 2) that an earlier request
of the same tenant committed, so they hit exactly 1024 tokens; the other half are unique (no hit). Every call
carries its step_id (counted from 1), as a gateway's does. Scenarios, each a steady state:

    admit    calls of 64 allocations each; then, separately timed, the call committing their prompts' full
             pages (prefill-commit) and the call freeing them (free). The cache is full: allocations evict.
    decode   64 running requests, each extended by one token per call (64 extensions, 4 of which cross into a
             new page) plus the ~4 commits of pages that just filled.
    mixed    a scheduler step with 4 requests finishing (frees), 4 admitted (allocations), the 4 admitted last
             step committing their prompts, and 60 decoding (extensions).
    steady   the same with 1 request finishing and 1 admitted per call (requests of 64 new tokens).
    steady-sparse  the same, with an extension only for a request that needs a new page.
    gateway  the calls the gateway itself makes: its Scheduler (kvserve/services/gateway/scheduler.py, default budget of
             64 running requests and 512 tokens a step, chunked prefill, a page of headroom) runs a stream of
             these prompts, each generating 256 tokens (so that 64 run at once), with a stand-in worker that
             samples a token for every request due one. A step calls the kvmanager only when it must (to admit,
             free, extend past the headroom, or commit prompt pages); calls that admit and calls that do not are
             timed apart.

Configurations: the domain core (KVManager.step), KVService over NullStore and over CallLog (the call log,
in an embedded redis-server), and the real gRPC service (a server on 127.0.0.1 port 0 in this process, a real
channel, StepPages) over each store; --server-process puts each server in a child process instead. "Own core"
is the call-log server in a child process pinned to one CPU, with the client thread pinned to the others while
it drives it: the kvmanager's pod requests a CPU of its own, and on a shared 2-core machine the client, the
server and Redis otherwise preempt one another mid-call. Last, the floor: the same server and servicer over a
service that does no bookkeeping but appends each call to the Redis call log and answers with results of the
right shape, i.e. what a call of that size costs before any page is looked at (the transport, the conversions,
the log). A reference KVManager generates each round's calls, then every configuration replays the same calls
on its own state, interleaved round by round (a shared 2-core machine is noisy), and every answer is checked
against the reference. Latency is per call; requests/s is the number of distinct requests a call carries
divided by the mean call time. The garbage collector stays on: the p99 of the big admit calls includes full
collections over this process's heap, which holds the state of the reference and of every in-process
configuration (longer pauses than a dedicated kvmanager's). --profile adds a cProfile of the servicer called
in-thread with Redis, per call kind. Writes JSON and a Markdown table next to it.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import datetime as dt
import gc
import itertools
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")  # as `kvserve kvmanager` does (kvserve/kvmanager/snapshot.py)

import grpc  # noqa: E402
import numpy as np
from results_io import write_results

from kvserve.common.convert.pages import step_to_request_proto
from kvserve.common.embedded_redis import EmbeddedRedis
from kvserve.common.pages import num_pages_for
from kvserve.common.redis_client import connect
from kvserve.common.wire import pages as wire
from kvserve.common.wire.worker import SampledToken, StepOutput, WorkerInfo
from kvserve.kvmanager.call_log import CallLog
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.server import start_kvmanager_server, tune_gc_for_serving
from kvserve.kvmanager.service import KVService, NullStore
from kvserve.kvmanager.servicer import KVManagerServicer
from kvserve.services.gateway.core import EngineCore, scheduler_config
from kvserve.services.gateway.request import FinishReason, Request, RequestParams
from kvserve.v1 import kvmanager_pb2 as pb
from kvserve.v1 import kvmanager_pb2_grpc

PAGE_SIZE = 16
NUM_PAGES = 16384  # 64 running x (125 prompt + decode) pages, plus room for a cache that outlives one batch
PROMPT_TOKENS = 2000  # 125 full pages
PREFIX_TOKENS = 1024  # 64 pages: a hit request reuses exactly these
BATCH = 64
TENANTS = tuple(f"tenant-{i}" for i in range(8))
PREFIXES_PER_TENANT = 2
MIXED_CHURN = 4  # admissions (and frees) per mixed call: a request lives 16 calls
# "steady": a serving stream where a request generates 64 tokens, so with 64 running one is admitted and one
# freed per call (the gateway issue's mixes have 16 to 128 new tokens per request)
CHURN = {"mixed": MIXED_CHURN, "steady": 1, "steady-sparse": 1}
# "steady-sparse": the same stream, but the gateway sends an extension only for a request that needs a new page
# (its copy of the page table tells it), as vLLM's scheduler allocates slots only when a block fills
SPEC = wire.PoolSpec("w0", 1, NUM_PAGES, PAGE_SIZE, "bench-model-fp", "float32", 2 * 30 * 9 * 64 * 4)
# "gateway": tokens each request generates. The scheduler prefills ~450 prompt tokens a step next to 64 decodes,
# one new request every ~3.3 steps (1,488 prompt tokens to compute on average): 256 generated tokens keep 64
# running (64 would keep ~20).
GATEWAY_GEN_TOKENS = 256
GATEWAY_QUEUE = 4  # "gateway": requests kept waiting, so that a finished request's slot is refilled at once
ADMIN_TOKEN = "bench-admin-token"
TARGET_P50_MS = 2.0
TARGET_SHARE = 0.03
CONFIGS = ("core", "service", "service+log", "grpc", "grpc+log", "grpc+log-own-core", "grpc+log-echo")
CONFIG_TITLES = {"core": "domain core (KVManager.step)", "service": "KVService, NullStore",
                 "grpc": "gRPC StepPages, NullStore",
                 "service+log": "KVService, Redis call log (default)",
                 "grpc+log": "gRPC StepPages, Redis call log (default)",
                 "grpc+log-own-core": "the same, kvmanager process on its own core",
                 "grpc+log-echo": "floor: gRPC + call log, no bookkeeping (echo)"}


# -- the workload ---------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Call:
    kind: str | None  # the row it is timed under; None = untimed (setup, keeping the pool from running out)
    ops: wire.StepOps
    expect: tuple  # fingerprint of the reference answer
    num_requests: int
    msg: pb.StepOps | None = None


@dataclass(slots=True)
class Running:
    req_id: str
    tokens: list[int]  # prompt, then the generated tokens
    n: int  # tokens computed so far (K/V written); the next step computes position n
    committed: int  # tokens whose full pages are committed (or were hit)
    born: int = 0  # call index of its admission (mixed)


def fingerprint(res) -> tuple:
    """(ops not OK, cached tokens, pages handed out) of a StepResults, the dataclass or the proto."""
    if isinstance(res, wire.StepResults):
        groups = (res.allocations, res.extensions, res.commits, res.frees)
        bad = sum(r.status is not wire.OpStatus.OK for g in groups for r in g)
        return (bad, sum(a.num_cached_tokens for a in res.allocations),
                sum(len(a.page_table) for a in res.allocations) + sum(len(e.new_page_ids) for e in res.extensions))
    groups = (res.allocation_results, res.extension_results, res.commit_results, res.free_results)
    bad = sum(r.status != pb.PAGE_OP_STATUS_OK for g in groups for r in g)
    return (bad, sum(a.num_cached_tokens for a in res.allocation_results),
            sum(len(a.page_table) for a in res.allocation_results)
            + sum(len(e.new_page_ids) for e in res.extension_results))


def to_proto(ops: wire.StepOps) -> pb.StepOps:
    return step_to_request_proto(ops)  # what the gateway sends


class RecordingKV:
    """The "gateway" scenario's kvmanager, as the engine core sees it: each call is applied to the workload's
    reference and recorded (timed under ``kind``, "gateway: admits" when it carries an allocation)."""

    def __init__(self, workload: Workload):
        self.workload, self.kind = workload, None

    def step_pages(self, ops: wire.StepOps, traceparents=None) -> wire.StepResults:
        kind = self.kind and ("gateway: admits" if ops.allocations else self.kind)
        return self.workload._call(kind, ops)


class StandInWorker:
    """The "gateway" scenario's worker: computes nothing, samples a random token for each item that samples."""

    address = "stand-in"

    def __init__(self, rng, info: WorkerInfo):
        self.rng, self._info, self.num_items = rng, info, 0

    def info(self, wait_s: float = 60.0) -> WorkerInfo:
        return self._info

    def step(self, batch, traceparents=None) -> StepOutput:
        self.num_items = len(batch.items)
        return StepOutput([SampledToken(i.req_id, int(self.rng.integers(100, 32000)), 0.0)
                           for i in batch.items if i.sample], 0, 0.0)


class Workload:
    """Generates a scenario's calls with a reference KVManager (the commits need its num_cached_tokens) and
    checks that the workload is what it claims: every op OK, hit requests hit exactly PREFIX_TOKENS."""

    def __init__(self, scenario: str, seed: int):
        self.scenario = scenario
        self.rng = np.random.default_rng(seed)
        self.ref = KVManager()
        self.ref.register_worker(SPEC)
        self.step_id = 0
        self.num_req = 0
        self.num_calls = 0
        self.hit_turn = 0
        self.prefixes = [(t, self._tokens(PREFIX_TOKENS)) for t in TENANTS for _ in range(PREFIXES_PER_TENANT)]
        self.running: dict[str, Running] = {}
        self.calls: list[Call] = []
        # "gateway": the gateway's engine core, and how many of its steps (timed ones) made a call
        info = WorkerInfo("w0", 1, "bench", SPEC.model_fingerprint, PAGE_SIZE, NUM_PAGES, "float32", 1, 1, 1, 1, 1, 1,
                          32000, 4096, (), "cpu", "none")
        self.kv, self.worker = RecordingKV(self), StandInWorker(self.rng, info)
        self.core = EngineCore(self.worker, info, self.kv, scheduler_config(info, max_num_seqs=64,
                                                                            max_num_batched_tokens=512))
        self.gateway_steps = {"steps": 0, "calls": 0, "running": []}

    def _tokens(self, n: int) -> tuple[int, ...]:
        return tuple(self.rng.integers(100, 32000, n).tolist())

    def _apply(self, kind: str | None, **lists) -> wire.StepResults:
        return self._call(kind, wire.StepOps(self.step_id + 1, **lists))

    def _call(self, kind: str | None, ops: wire.StepOps) -> wire.StepResults:
        """Applies ``ops`` (renumbered with this workload's step_id) to the reference and records the call."""
        self.step_id += 1
        self.num_calls += 1
        ops = dataclasses.replace(ops, step_id=self.step_id)
        res = self.ref.step(ops)
        expect = fingerprint(res)
        assert expect[0] == 0, f"{self.scenario}: the workload ran out of pages or hit a stale op: {res}"
        ids = {o.req_id for group in (ops.allocations, ops.extensions, ops.commits, ops.frees) for o in group}
        self.calls.append(Call(kind, ops, expect, len(ids)))
        return res

    def _new_requests(self, n: int, hit_every: int = 2, offset: int = 0) -> list[tuple[wire.PageAllocation, bool]]:
        """n new requests; those with (i + offset) % hit_every == 0 start with a cached shared prefix."""
        out = []
        for i in range(n):
            self.num_req += 1
            req_id = f"req-{self.num_req}"
            if (i + offset) % hit_every == 0:
                tenant, prefix = self.prefixes[self.hit_turn % len(self.prefixes)]
                self.hit_turn += 1
                tokens = prefix + self._tokens(PROMPT_TOKENS - PREFIX_TOKENS)
                out.append((wire.PageAllocation(req_id, tenant, tokens, SPEC.worker_id), True))
            else:
                tenant = TENANTS[int(self.rng.integers(len(TENANTS)))]
                out.append((wire.PageAllocation(req_id, tenant, self._tokens(PROMPT_TOKENS), SPEC.worker_id), False))
        return out

    def _admit(self, kind: str | None, new: list[tuple[wire.PageAllocation, bool]], **other) -> list[Running]:
        res = self._apply(kind, allocations=tuple(a for a, _ in new), **other)
        admitted = []
        for (a, hit), r in zip(new, res.allocations, strict=True):
            assert r.num_cached_tokens == (PREFIX_TOKENS if hit else 0), (a.req_id, hit, r.num_cached_tokens)
            run = Running(a.req_id, list(a.token_ids), 0, r.num_cached_tokens, self.num_calls)
            self.running[a.req_id] = run
            admitted.append(run)
        return admitted

    @staticmethod
    def _prompt_commit(run: Running) -> wire.PageCommit:
        op = wire.PageCommit(run.req_id, run.committed, tuple(run.tokens[run.committed:PROMPT_TOKENS]), PROMPT_TOKENS)
        run.n = run.committed = PROMPT_TOKENS
        return op

    def _decode_ops(self, runs) -> tuple[list[wire.PageExtension], list[wire.PageCommit]]:
        """One decode step of ``runs``: extend each to cover position n; commit pages that filled."""
        exts, commits = [], []
        for run in runs:
            full = run.n // PAGE_SIZE * PAGE_SIZE
            if full > run.committed:
                commits.append(wire.PageCommit(run.req_id, run.committed, tuple(run.tokens[run.committed:full]), run.n))
                run.committed = full
            if not self.scenario.endswith("-sparse") or run.n % PAGE_SIZE == 0:
                exts.append(wire.PageExtension(run.req_id, run.n + 1))
        return exts, commits

    def _advance(self, runs) -> None:
        for run in runs:
            run.n += 1
            run.tokens.append(int(self.rng.integers(100, 32000)))

    def _free(self, kind: str | None, req_ids) -> None:
        self._apply(kind, frees=tuple(wire.PageFree(r) for r in req_ids))
        for r in req_ids:
            del self.running[r]

    # -- scenarios: setup (untimed) and one round's calls --------------------------------------------------
    def setup(self) -> None:
        # An earlier request of each tenant commits each shared prefix.
        seeds = [(wire.PageAllocation(f"seed-{i}", t, p + self._tokens(PROMPT_TOKENS - PREFIX_TOKENS), SPEC.worker_id),
                  False)
                 for i, (t, p) in enumerate(self.prefixes)]
        runs = self._admit(None, seeds)
        self._apply(None, commits=tuple(self._prompt_commit(r) for r in runs))
        self._free(None, [r.req_id for r in runs])
        if self.scenario == "admit":
            while self.ref.pools["w0"].num_free > 0:  # fill the cache: from here on allocations evict
                self._admit_cycle(None)
        elif self.scenario == "decode":
            runs = self._admit(None, self._new_requests(BATCH))
            commits = tuple(self._prompt_commit(r) for r in runs)
            for i, run in enumerate(runs):  # stagger: request i has generated i % 16 tokens
                for _ in range(i % PAGE_SIZE):
                    self._advance([run])
            self._apply(None, commits=commits, extensions=tuple(wire.PageExtension(r.req_id, r.n) for r in runs))
        elif self.scenario in CHURN:
            while self.ref.pools["w0"].num_free > 0 or len(self.running) < BATCH:
                self._mixed_call(None)
        elif self.scenario == "gateway":
            for _ in range(100_000):
                if self.ref.pools["w0"].num_free == 0 and self.core.scheduler.num_running == BATCH:
                    break
                self._gateway_step(None)
            else:
                raise AssertionError("gateway: the scheduler never reached 64 running requests and a full cache")

    def round(self, num_calls: int) -> list[Call]:
        self.calls = []
        for _ in range(num_calls):
            if self.scenario == "admit":
                self._admit_cycle("admit")
            elif self.scenario == "gateway":
                while not self._gateway_step("gateway"):
                    pass
            elif self.scenario == "decode":
                runs = list(self.running.values())
                exts, commits = self._decode_ops(runs)
                self._apply("decode", extensions=tuple(exts), commits=tuple(commits))
                self._advance(runs)
            else:
                self._mixed_call(self.scenario)
        calls = self.calls
        for c in calls:
            c.msg = to_proto(c.ops)
        return calls

    def _admit_cycle(self, kind: str | None) -> None:
        runs = self._admit(kind, self._new_requests(BATCH))
        self._apply(kind and "admit: prefill-commit", commits=tuple(self._prompt_commit(r) for r in runs))
        self._free(kind and "admit: free", [r.req_id for r in runs])

    def _gateway_step(self, kind: str | None) -> bool:
        """One step of the gateway's engine core, with a stand-in worker; True when the step called the
        kvmanager (a timed call under ``kind``, "gateway: admits" when it carries an allocation)."""
        core = self.core
        while core.scheduler.num_waiting < GATEWAY_QUEUE:
            a, _ = self._new_requests(1, offset=self.num_req)[0]  # every other request hits a shared prefix
            core.add(Request(a.req_id, a.tenant, list(a.token_ids),
                             RequestParams(max_tokens=GATEWAY_GEN_TOKENS, ignore_eos=True)))
        self.kv.kind, self.worker.num_items = kind, 0
        num_preemptions = core.scheduler.num_preemptions
        events = core.step()
        failed = [req for req, _ in events.ended if req.finish_reason is FinishReason.ERROR]
        assert core.scheduler.num_preemptions == num_preemptions and not failed, "the gateway scenario ran out of pages"
        called = events.scheduled.ops is not None
        if kind is not None:
            g = self.gateway_steps
            g["steps"] += 1
            g["calls"] += called
            g["running"].append(self.worker.num_items)
        return called

    def _mixed_call(self, kind: str | None) -> None:
        churn = CHURN[self.scenario]
        life = BATCH // churn  # calls a request stays running
        now = self.num_calls + 1
        done = [r.req_id for r in self.running.values() if now - r.born >= life]
        fresh = [r for r in self.running.values() if r.born == now - 1]
        decoding = [r for r in self.running.values() if now - r.born not in (1, life) and now - r.born < life]
        commits = [self._prompt_commit(r) for r in fresh]
        exts, decode_commits = self._decode_ops(fresh + decoding)
        for r in done:
            del self.running[r]
        self._admit(kind, self._new_requests(churn, offset=now % 2), frees=tuple(wire.PageFree(r) for r in done),
                    commits=tuple(commits + decode_commits), extensions=tuple(exts))
        self._advance(fresh + decoding)


# -- the configurations -----------------------------------------------------------------------------------
class Target:
    """One configuration: its own state, fed the same calls as every other."""

    name = ""
    checks_answers = True  # False: its answers only have the reference's shape (the echo floor)
    client_cpus: set[int] | None = None  # the CPUs the calling thread is pinned to while it drives this target

    def register(self) -> None: ...

    def call(self, c: Call): ...

    def extra_ms(self) -> float | None:
        """After a call: the server-side or store time it reported, if any."""
        return None

    def close(self) -> None: ...


class CoreTarget(Target):
    name = "core"

    def __init__(self):
        self.mgr = KVManager()

    def register(self):
        self.mgr.register_worker(SPEC)

    def call(self, c):
        return self.mgr.step(c.ops)


class ServiceTarget(Target):
    def __init__(self, store, name):
        self.svc, self.name = KVService(KVManager(), store), name

    def register(self):
        self.svc.register_worker(SPEC)

    def call(self, c):
        return self.svc.step(c.ops)

    def extra_ms(self):
        return self.svc.last_store_ms if isinstance(self.svc.store, CallLog) else None


class GrpcTarget(Target):
    """A real server on 127.0.0.1 port 0 (in this process, or with ``separate`` in a child process, as a
    deployed kvmanager is to its gateway), a real channel, StepPages."""

    def __init__(self, name: str, redis_url: str | None, prefix: str, separate: bool,
                 service: KVService | None = None, cpus: tuple[set[int], set[int]] | None = None):
        """``redis_url``: the call log's Redis (None: NullStore). ``service``: serve this one (in this process)
        instead of a KVService over that store.
        ``cpus``: (the server's CPUs, the client's CPUs): a child process pinned to the first, the calling thread
        to the second while it drives this target."""
        self.name, self.child, self.server = name, None, None
        if cpus is not None:
            separate, self.client_cpus = True, cpus[1]
        if separate:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", "--prefix", prefix] + (
                ["--cpus", ",".join(map(str, sorted(cpus[0])))] if cpus else [])
            self.child = subprocess.Popen(cmd + (["--redis-url", redis_url] if redis_url else []),
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            port = int(self.child.stdout.readline())
        else:
            service = service or KVService(KVManager(), make_store(redis_url, prefix))
            self.server = start_kvmanager_server(service, "127.0.0.1", 0, admin_token=ADMIN_TOKEN)
            port = self.server.port
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}",
                                             options=[("grpc.max_receive_message_length", 64 << 20)])
        self.stub = kvmanager_pb2_grpc.KVManagerServiceStub(self.channel)
        self.handle_ms = 0.0

    def register(self):
        self.stub.RegisterWorker(pb.PoolSpec(
            worker_id=SPEC.worker_id, epoch=SPEC.epoch, num_pages=SPEC.num_pages, page_size=SPEC.page_size,
            model_fingerprint=SPEC.model_fingerprint, kv_dtype=SPEC.kv_dtype, bytes_per_token=SPEC.bytes_per_token),
            timeout=30)

    def call(self, c):
        res = self.stub.StepPages(c.msg, timeout=60)
        self.handle_ms = res.handle_ms
        return res

    def extra_ms(self):
        return self.handle_ms

    def close(self):
        self.channel.close()
        if self.server is not None:
            self.server.stop(0)
        if self.child is not None:
            self.child.stdin.close()  # the child stops its server at EOF
            self.child.wait(30)


class EchoService(KVService):
    """A KVService that does no bookkeeping: it appends each call to the Redis call log as the default store
    does (sent before the work, reply awaited before the answer) and answers with results of the right shape
    (a page table of the right length for each allocation). Served by the real server and servicer, it is the
    floor a call of that size pays for the transport, the conversions and the log, before any page is
    looked at."""

    def __init__(self, redis_url: str, prefix: str):
        super().__init__(KVManager(), CallLog(connect(redis_url), prefix, snapshot_every=1 << 62))

    def step(self, ops: wire.StepOps) -> wire.StepResults:
        with self.lock:
            record = ("step", ops)
            early = self.store.send_early(record)
            ok = wire.OpStatus.OK
            results = wire.StepResults(
                allocations=[wire.PageAllocationResult(a.req_id, ok, SPEC.worker_id, SPEC.epoch,
                                                       list(range(num_pages_for(len(a.token_ids), PAGE_SIZE))), 0)
                             for a in ops.allocations],
                extensions=[wire.PageExtensionResult(e.req_id, ok, [], num_pages_for(e.num_tokens, PAGE_SIZE))
                            for e in ops.extensions],
                commits=[wire.PageCommitResult(c.req_id, ok, c.start_pos + len(c.token_ids)) for c in ops.commits],
                frees=[wire.PageFreeResult(f.req_id, ok) for f in ops.frees],
                pools=[wire.PoolSummary(SPEC.worker_id, SPEC.epoch, 0, 0)])
            self._persist(record, force=early)
            return results


class EchoTarget(GrpcTarget):
    checks_answers = False

    def __init__(self, redis_url: str, prefix: str):
        super().__init__("grpc+log-echo", None, prefix, separate=False, service=EchoService(redis_url, prefix))


def make_store(redis_url: str | None, prefix: str):
    return CallLog(connect(redis_url), prefix) if redis_url else NullStore()


def serve_child(redis_url: str | None, prefix: str, cpus: str = "") -> int:
    """--serve: a kvmanager server for GrpcTarget(separate=True); prints its port, serves until stdin closes.
    ``cpus``: comma-separated CPUs to pin this process (all its threads) to."""
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    service = KVService(KVManager(), make_store(redis_url, prefix))
    tune_gc_for_serving()  # as `kvserve kvmanager` does once its state is loaded
    server = start_kvmanager_server(service, "127.0.0.1", 0, admin_token=ADMIN_TOKEN)
    print(server.port, flush=True)
    sys.stdin.read()
    server.stop(0)
    return 0


class DirectServicerTarget(Target):
    """The servicer's StepPages called in this thread (no transport): for profiling conversion + service +
    store in one profile (cProfile sees only its own thread, and the gRPC server handles calls on others)."""

    name = "servicer+redis (in-thread)"

    def __init__(self, store):
        self.servicer = KVManagerServicer(KVService(KVManager(), store))

    def register(self):
        self.servicer.service.register_worker(SPEC)

    def call(self, c):
        return self.servicer.StepPages(c.msg, None)


def own_core_split() -> tuple[set[int], set[int]] | None:
    """(one CPU for the kvmanager, the others for the client), as deployed: the kvmanager's pod requests one
    CPU of its own (k8s/kvmanager-deployment.yaml). None with fewer than two CPUs."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return ({cpus[-1]}, set(cpus[:-1])) if len(cpus) >= 2 else None


def make_targets(redis_url: str, scenario: str, separate: bool) -> list[Target]:
    prefix = f"bench-{scenario}"
    split = own_core_split()
    return [CoreTarget(), ServiceTarget(NullStore(), "service"),
            ServiceTarget(CallLog(connect(redis_url), prefix=f"{prefix}-svclog"), "service+log"),
            GrpcTarget("grpc", None, prefix, separate),
            GrpcTarget("grpc+log", redis_url, f"{prefix}-grpclog", separate),
            *([GrpcTarget("grpc+log-own-core", redis_url, f"{prefix}-grpclog-own", separate, cpus=split)]
              if split else []),
            EchoTarget(redis_url, f"{prefix}-echo")]


def replay(target: Target, calls: list[Call], samples: dict | None) -> None:
    """Runs ``calls`` on ``target``; timed ones append (seconds, extra_ms) to samples[kind]. Checks answers."""
    perf = time.perf_counter
    with pinned(target.client_cpus):
        _replay(target, calls, samples, perf)


@contextlib.contextmanager
def pinned(cpus: set[int] | None):
    """Pins the calling thread to ``cpus`` (None: leaves it), then restores its affinity."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)  # pid 0 is the calling thread on Linux
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _replay(target: Target, calls: list[Call], samples: dict | None, perf) -> None:
    for c in calls:
        t0 = perf()
        res = target.call(c)
        t = perf() - t0
        got = fingerprint(res) if target.checks_answers else c.expect
        if got != c.expect:
            raise AssertionError(f"{target.name}: step {c.ops.step_id} answered {got}, the reference {c.expect}")
        if c.kind is not None and samples is not None:
            samples.setdefault(c.kind, []).append((t, target.extra_ms(), c.num_requests))


# -- statistics and the report ----------------------------------------------------------------------------
def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    return float(np.percentile(xs, q))


def summarize(kind: str, config: str, samples: list) -> dict:
    ts = [s[0] * 1000 for s in samples]
    extra = [s[1] for s in samples if s[1] is not None]
    reqs = statistics.mean(s[2] for s in samples)
    mean = statistics.mean(ts)
    out = {"scenario": kind, "config": config, "calls": len(ts), "requests_per_call": round(reqs, 2),
           "p50_ms": round(statistics.median(ts), 4), "p90_ms": round(percentile(ts, 90), 4),
           "p99_ms": round(percentile(ts, 99), 4), "mean_ms": round(mean, 4), "max_ms": round(max(ts), 4),
           "requests_per_s": round(reqs / mean * 1000, 1), "calls_per_s": round(1000 / mean, 1)}
    if extra:
        key = "server_handle_p50_ms" if config.startswith("grpc") else "store_write_p50_ms"
        out[key] = round(statistics.median(extra), 4)
    return out


def worker_step_time(results_dir: Path) -> dict | None:
    """The decode step time of the newest worker benchmark: batch 32 kvserve_tok_s -> 32 / tok_s seconds."""
    files = sorted(results_dir.glob("worker-*.json"))
    if not files:
        return None
    report = json.loads(files[-1].read_text())
    row = next((d for d in report.get("decode", []) if d.get("batch") == 32), None)
    if row is None:
        return None
    return {"file": files[-1].name, "batch": 32, "context": row["context"], "kvserve_tok_s": row["kvserve_tok_s"],
            "step_ms": round(32 / row["kvserve_tok_s"] * 1000, 2)}


def verdicts(report: dict) -> dict:
    rows = {(r["scenario"], r["config"]): r for r in report["results"]}
    out = {"target_p50_ms": TARGET_P50_MS, "config": "grpc+log", "met": {}, "met_own_core": {}}
    for kind in report["scenarios_timed"]:
        for key, cfg in (("met", "grpc+log"), ("met_own_core", "grpc+log-own-core")):
            r = rows.get((kind, cfg))
            if r is not None:
                out[key][kind] = r["p50_ms"] < TARGET_P50_MS
    step = report.get("worker_step")
    decode = rows.get(("decode", "grpc+log"))
    if step and decode:
        share = decode["p50_ms"] / step["step_ms"]
        out["decode_share_of_worker_step"] = round(share, 5)
        out["decode_share_target_met"] = share < TARGET_SHARE
    g = report.get("gateway_steps")
    if step and g:  # the gateway's mean wait per step (calls included or not) over the worker's decode step
        calls = [rows[(k, "grpc+log")] for k in ("gateway", "gateway: admits") if (k, "grpc+log") in rows]
        per_step_ms = sum(r["calls"] * r["mean_ms"] for r in calls) / sum(r["calls"] for r in calls) \
            * g["calls_per_step"]
        out["gateway_ms_per_step"] = round(per_step_ms, 4)
        out["gateway_share_of_worker_step"] = round(per_step_ms / step["step_ms"], 5)
        out["gateway_share_target_met"] = per_step_ms / step["step_ms"] < TARGET_SHARE
    return out


def markdown(report: dict) -> str:
    w = report["workload"]
    lines = [f"kvmanager StepPages calls: {w['requests_per_call']} requests per call, {w['prompt_tokens']}-token "
             f"prompts, {int(w['prefix_hit_fraction'] * 100)}% of them hitting a {w['shared_prefix_tokens']}-token "
             f"cached prefix; pool of {w['num_pages']} pages of {w['page_size']} tokens; loopback, "
             f"{report['machine']['cpus']} CPUs{' (quick run)' if report['quick'] else ''}.", "",
             "| scenario | configuration | calls | p50 ms | p99 ms | mean ms | requests/s | inside, p50 ms |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in report["results"]:
        inside = r.get("server_handle_p50_ms", r.get("store_write_p50_ms"))
        lines.append(f"| {r['scenario']} | {CONFIG_TITLES[r['config']]} | {r['calls']} | {r['p50_ms']:.3f} "
                     f"| {r['p99_ms']:.3f} | {r['mean_ms']:.3f} | {r['requests_per_s']:,.0f} "
                     f"| {'' if inside is None else f'{inside:.3f}'} |")
    lines += ["", "Requests/s: distinct requests per call / mean call time. Inside: for gRPC, the server's own time "
              "(StepResults.handle_ms: request conversion, the service, the store write); for KVService "
              "over the call log, the store write (KVService.last_store_ms)."]
    v = report["verdict"]

    def met_missed(verdict: dict) -> str:
        met = [k for k, ok in verdict.items() if ok]
        missed = [k for k, ok in verdict.items() if not ok]
        return f"met for: {', '.join(met) or 'none'}; not met for: {', '.join(missed) or 'none'}"

    lines += ["", f"Target: p50 under {TARGET_P50_MS:g} ms for a 64-request call over gRPC with the default "
              f"persistence (Redis call log). Everything on the shared CPUs: {met_missed(v['met'])}."]
    if v.get("met_own_core"):
        lines.append(f"The kvmanager process on its own core (as its pod requests one CPU; the client and Redis "
                     f"share the others): {met_missed(v['met_own_core'])}.")
    floor = report.get("grpc_floor")
    if floor:
        lines.append("gRPC floor on the same loopback (no ops, no store write): "
                     + ", ".join(f"{k} p50 {f['p50_ms']:.3f} ms (p99 {f['p99_ms']:.3f})" for k, f in floor.items())
                     + ".")
    g = report.get("gateway_steps")
    if g:
        lines.append(f"Gateway scenario: a call is one step of the gateway's scheduler and carries only the ops "
                     f"that step needs; {g['steps']} timed steps, {g['running_p50']:g} requests running at the "
                     f"median (at least {g['running_min']}), {g['calls_per_step'] * 100:.0f}% of the steps called "
                     f"the kvmanager.")
    step = report.get("worker_step")
    if step and "decode_share_of_worker_step" in v:
        lines.append(f"Share of a decode step: decode-scenario gRPC + Redis call log p50 / worker decode step "
                     f"({step['step_ms']:.1f} ms = 32 / {step['kvserve_tok_s']} tok/s, batch 32, context "
                     f"{step['context']}, {step['file']}) = {v['decode_share_of_worker_step'] * 100:.2f}% "
                     f"(target under {TARGET_SHARE * 100:g}%: {'met' if v['decode_share_target_met'] else 'not met'}).")
    if step and "gateway_share_of_worker_step" in v:
        lines.append(f"Share of a decode step, gateway scenario: mean call time x calls per step = "
                     f"{v['gateway_ms_per_step']:.2f} ms per step, {v['gateway_share_of_worker_step'] * 100:.2f}% "
                     f"of the same worker step (target under {TARGET_SHARE * 100:g}%: "
                     f"{'met' if v['gateway_share_target_met'] else 'not met'}).")
    return "\n".join(lines) + "\n"


def grpc_floor(num_calls: int) -> dict:
    """What the transport alone costs: an empty StepPages call (no ops, nothing to write) and a health Check,
    on a loopback server like the one above."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = GrpcTarget("grpc", None, "bench-floor", separate=False)
    try:
        target.register()
        health_stub = health_pb2_grpc.HealthStub(target.channel)
        step_ids = itertools.count(1)  # every call carries one
        calls = {"empty StepPages": lambda: target.stub.StepPages(pb.StepOps(step_id=next(step_ids)), timeout=10),
                 "health Check": lambda: health_stub.Check(health_pb2.HealthCheckRequest(), timeout=10)}
        samples = {k: [] for k in calls}
        for _ in range(num_calls):
            for k, fn in calls.items():
                t0 = time.perf_counter()
                fn()
                samples[k].append((time.perf_counter() - t0) * 1000)
    finally:
        target.close()
    return {k: {"calls": len(v), "p50_ms": round(statistics.median(v), 4), "p99_ms": round(percentile(v, 99), 4)}
            for k, v in samples.items()}


# -- profiling ----------------------------------------------------------------------------------------------
def profile(redis_url: str, scenario: str, rounds: int, calls: int, seed: int, top: int = 14) -> list[dict]:
    """cProfile of the in-thread servicer with the default store (Redis call log) over one scenario's timed calls, one
    profile per call kind (row of the table)."""
    wl = Workload(scenario, seed)
    wl.setup()
    client = connect(redis_url)
    target = DirectServicerTarget(CallLog(client, prefix=f"bench-profile-{scenario}"))
    target.register()
    for c in wl.calls:
        c.msg = to_proto(c.ops)
    replay(target, wl.calls, None)
    profs: dict[str, cProfile.Profile] = {}
    counts: dict[str, int] = {}
    for _ in range(rounds):
        batch = wl.round(calls)
        gc.collect()
        for c in batch:
            if c.kind is None:
                replay(target, [c], None)
                continue
            prof = profs.setdefault(c.kind, cProfile.Profile())
            counts[c.kind] = counts.get(c.kind, 0) + 1
            prof.enable()
            replay(target, [c], None)
            prof.disable()
    client.flushdb()
    client.close()
    out = []
    for kind, prof in profs.items():
        n = counts[kind]
        stats = pstats.Stats(prof)
        entries = []
        for (file, line, func), (_cc, ncalls, tt, ct, _callers) in stats.stats.items():
            entries.append({"function": f"{Path(file).name}:{line}({func})", "ncalls_per_call": round(ncalls / n, 1),
                            "tottime_ms_per_call": round(tt / n * 1000, 4),
                            "cumtime_ms_per_call": round(ct / n * 1000, 4)})
        by_own = sorted(entries, key=lambda e: -e["tottime_ms_per_call"])[:top]
        by_cum = sorted(entries, key=lambda e: -e["cumtime_ms_per_call"])[:top]
        out.append({"scenario": kind, "calls_profiled": n,
                    "ms_per_call_under_profiler": round(stats.total_tt / n * 1000, 3),
                    "top_tottime": by_own, "top_cumtime": by_cum})
    return out


# -- main -----------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer rounds (about a minute)")
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    p.add_argument("--profile", action="store_true", help="also cProfile the servicer with Redis, per scenario")
    p.add_argument("--server-process", action="store_true",
                   help="run each gRPC server in a child process instead of this one")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child of --server-process
    p.add_argument("--redis-url", default=None, help=argparse.SUPPRESS)
    p.add_argument("--prefix", default="bench", help=argparse.SUPPRESS)
    p.add_argument("--cpus", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


# rounds x calls per round, per scenario (an admit "call" is an admit + prefill-commit + free cycle). Decode is
# bounded by the pool: every request grows by one token per call, 64 x (126 + calls / 16) pages.
PLAN = {False: {"admit": (12, 8), "decode": (10, 150), "mixed": (10, 200), "steady": (10, 200),
               "steady-sparse": (10, 200), "gateway": (10, 200)},
        True: {"admit": (3, 4), "decode": (4, 60), "mixed": (4, 60), "steady": (4, 60), "steady-sparse": (4, 60),
               "gateway": (4, 60)}}
SCENARIOS = tuple(PLAN[False])


def run_scenario(scenario: str, redis_url: str, client, rounds: int, calls: int, seed: int,
                 separate: bool) -> tuple[dict[str, dict], Workload]:
    wl = Workload(scenario, seed)
    wl.setup()
    setup = wl.calls
    for c in setup:
        c.msg = to_proto(c.ops)
    targets = make_targets(redis_url, scenario, separate)
    samples: dict[str, dict[str, list]] = {t.name: {} for t in targets}
    try:
        for t in targets:
            t.register()
            replay(t, setup, None)
        for r in range(rounds):
            batch = wl.round(calls)
            order = targets[r % len(targets):] + targets[:r % len(targets)]  # rotate who goes first
            for t in order:
                gc.collect()
                replay(t, batch, samples[t.name])
    finally:
        for t in targets:
            t.close()
        client.flushdb()
    return samples, wl


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.serve:
        return serve_child(args.redis_url, args.prefix, args.cpus)
    plan = PLAN[args.quick]
    report = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "quick": args.quick,
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "grpc": grpc.__version__,
                          "processor": platform.processor() or platform.machine()},
              "workload": {"page_size": PAGE_SIZE, "num_pages": NUM_PAGES, "prompt_tokens": PROMPT_TOKENS,
                           "shared_prefix_tokens": PREFIX_TOKENS, "prefix_hit_fraction": 0.5,
                           "requests_per_call": BATCH, "tenants": len(TENANTS),
                           "shared_prefixes": len(TENANTS) * PREFIXES_PER_TENANT, "mixed_churn_per_call": MIXED_CHURN,
                           "seed": args.seed, "plan_rounds_x_calls": {s: plan[s] for s in args.scenarios}},
              "configs": CONFIG_TITLES, "scenarios_timed": [], "results": []}
    results_dir = Path(__file__).parent / "results"
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-redis-") as tmp, EmbeddedRedis(Path(tmp)) as rs:
        client = connect(rs.url)
        report["machine"]["redis"] = client.info("server")["redis_version"]
        for scenario in args.scenarios:
            rounds, calls = plan[scenario]
            print(f"{scenario}: {rounds} rounds x {calls} ...", file=sys.stderr, flush=True)
            samples, wl = run_scenario(scenario, rs.url, client, rounds, calls, args.seed, args.server_process)
            if scenario == "gateway":
                g = wl.gateway_steps
                report["gateway_steps"] = {"steps": g["steps"], "calls": g["calls"],
                                           "calls_per_step": round(g["calls"] / g["steps"], 4),
                                           "running_p50": statistics.median(g["running"]),
                                           "running_min": min(g["running"])}
            kinds = list(dict.fromkeys(k for per in samples.values() for k in per))
            for kind in kinds:
                report["scenarios_timed"].append(kind)
                for cfg in CONFIGS:
                    if cfg in samples:
                        report["results"].append(summarize(kind, cfg, samples[cfg][kind]))
        report["grpc_floor"] = grpc_floor(300 if args.quick else 1000)
        if args.profile:
            report["profile"] = []
            for scenario in args.scenarios:
                print(f"profiling {scenario} ...", file=sys.stderr, flush=True)
                rounds, calls = PLAN[True][scenario]
                report["profile"] += profile(rs.url, scenario, rounds, calls, args.seed)
        client.close()
    report["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    report["worker_step"] = worker_step_time(results_dir)
    report["verdict"] = verdicts(report)
    out = write_results(report, "kvmanager", markdown(report), args.out)
    for prof in report.get("profile", []):
        print(f"\nprofile, {prof['scenario']} ({prof['calls_profiled']} calls, in-thread servicer + Redis, "
              f"{prof['ms_per_call_under_profiler']} ms/call under the profiler), top by own time:")
        for e in prof["top_tottime"]:
            print(f"  {e['tottime_ms_per_call']:8.3f} ms  cum {e['cumtime_ms_per_call']:8.3f} ms  "
                  f"{e['ncalls_per_call']:>10}x  {e['function']}")
        print("  top by cumulative time:")
        for e in prof["top_cumtime"]:
            print(f"  {e['tottime_ms_per_call']:8.3f} ms  cum {e['cumtime_ms_per_call']:8.3f} ms  "
                  f"{e['ncalls_per_call']:>10}x  {e['function']}")
    print(f"wrote {out} and {out.with_suffix('.md')} ({report['elapsed_s']} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
