"""The shared KV tier's services as separate processes, each under the test's control: a store Redis the test
owns (EmbeddedRedis: killed, restarted on its port, paused, its values read and damaged), one or two
`kvserve kvmanager` processes (a leader and a standby on a state Redis), member workers that can be SIGKILLed
and restarted, and a gateway with one API key per tenant. The admin RPCs read the tier's index and counters.

    with tier_stack(tmp_path, tenants=("a", "b")) as stack:
        done = stack.complete("a", prompt_ids, max_tokens=4)   # token_ids, usage.cached_tokens
        stack.store_stats().num_blocks, stack.tenant("a").store_hits
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import redis
from polling import wait_for
from service_process import EXIT_TIMEOUT_S, service_process

from kvserve.common.channels import kvmanager_channel
from kvserve.common.convert.worker import info_from_proto
from kvserve.common.embedded_redis import EmbeddedRedis
from kvserve.common.wire.pages import PoolSpec
from kvserve.common.wire.tier import STORE_KEY_PREFIX, store_key
from kvserve.kvmanager.hashing import chain_hashes
from kvserve.kvmanager.pool import PagePool
from kvserve.services.client import Client, Completion
from kvserve.v1 import kvmanager_pb2 as pb
from kvserve.v1 import kvmanager_pb2_grpc, worker_pb2, worker_pb2_grpc

TOKEN = "tier-admin"
PAGE_SIZE = 16
LEASE_S = "2"  # the kvmanagers' --worker-timeout and --leader-lease, the gateway's --worker-timeout
STORE_BYTES = "256MiB"
READY_TIMEOUT_S = 120.0  # a model load on two busy cores
# The workers' store URL asks redis-py for this read timeout instead of the worker's 1 s, so that a write the
# store holds back (CLIENT PAUSE WRITE) waits until the test has killed its worker, instead of timing out first.
WORKER_STORE_TIMEOUT_S = 60
WAIT_S = 30.0  # for what follows a lease, a report (counters come at most every 5 s) or a store backoff
KVMANAGER_READY = re.compile(r"^kvserve kvmanager ready on 127\.0\.0\.1:(\d+) \((leader|standby), ")
GATEWAY_READY = re.compile(r"^kvserve gateway ready on 127\.0\.0\.1:(\d+) ")


def admin_call(kvmanager: str, token: str, method: str, request):
    """One KVAdminService call to the kvmanager leader among ``kvmanager`` (comma-separated addresses)."""
    with kvmanager_channel(kvmanager) as channel:
        stub = kvmanager_pb2_grpc.KVAdminServiceStub(channel)
        return getattr(stub, method)(request, timeout=10, metadata=[("authorization", f"Bearer {token}")])


def tier_env() -> dict[str, str]:
    """This environment minus stray KVSERVE_* settings (but the model cache), on the CPU (float32)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVE_") or k == "KVSERVE_CACHE_DIR"}
    return env | {"KVSERVE_DEVICE": "cpu"}


def worker_ready(worker_id: str) -> re.Pattern:
    return re.compile(rf"^kvserve worker {re.escape(worker_id)} ready on 127\.0\.0\.1:(\d+): .*; kv store read "
                      r"and written")


@dataclass
class TierStack:
    tmp: Path
    env: dict[str, str]
    store: EmbeddedRedis
    kvmanager: str = ""  # the kvmanagers' addresses, comma-separated (the leader's first)
    kvmanagers: dict[str, subprocess.Popen] = field(default_factory=dict)  # address -> process
    workers: dict[str, tuple[subprocess.Popen, int]] = field(default_factory=dict)  # worker_id -> (process, port)
    gateway: str = ""
    num_pages: int = 32
    lease_s: str = LEASE_S  # the kvmanager's --worker-timeout
    _exits: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    # -- processes --------------------------------------------------------------------------------------
    def start_kvmanager(self, name: str, state_url: str | None) -> tuple[str, str]:
        """A `kvserve kvmanager` indexing the store (on ``state_url``, else its own embedded Redis); returns
        (address, role)."""
        persistence = ["--redis-url", state_url] if state_url else ["--data-dir", str(self.tmp / name)]
        args = ["kvmanager", "--port", "0", "--admin-token", TOKEN, "--worker-timeout", self.lease_s, "--leader-lease",
                LEASE_S, "--kv-store-url", self.store.url, "--kv-store-bytes", STORE_BYTES, *persistence]
        proc, m = self._exits.enter_context(service_process(args, KVMANAGER_READY, self.env,
                                                            self.tmp / f"{name}.stderr", READY_TIMEOUT_S))
        address = f"127.0.0.1:{m.group(1)}"
        self.kvmanagers[address] = proc
        return address, m.group(2)

    def start_worker(self, worker_id: str = "worker-0", *extra: str) -> int:
        """A member worker writing to and loading from the store; its port once it joined."""
        args = ["worker", "--port", "0", "--worker-id", worker_id, "--num-pages", str(self.num_pages),
                "--page-size", str(PAGE_SIZE), "--kvmanager", self.kvmanager, "--kv-store-url",
                f"{self.store.url}?socket_timeout={WORKER_STORE_TIMEOUT_S}", *extra]
        n = sum(1 for w in self.tmp.glob(f"{worker_id}*.stderr"))
        proc, m = self._exits.enter_context(service_process(args, worker_ready(worker_id), self.env,
                                                            self.tmp / f"{worker_id}.{n}.stderr", READY_TIMEOUT_S))
        self.workers[worker_id] = (proc, int(m.group(1)))
        return int(m.group(1))

    def start_gateway(self, tenants: Sequence[str]) -> None:
        keys = self.tmp / "keys.json"
        keys.write_text(json.dumps({f"key-{t}": t for t in tenants}))
        args = ["gateway", "--port", "0", "--http-port", "0", "--kvmanager", self.kvmanager, "--api-keys-file",
                str(keys), "--worker-timeout", LEASE_S]
        _, m = self._exits.enter_context(service_process(args, GATEWAY_READY, self.env, self.gateway_log_path,
                                                         READY_TIMEOUT_S))
        self.gateway = f"127.0.0.1:{m.group(1)}"

    @property
    def gateway_log_path(self) -> Path:
        return self.tmp / "gateway.stderr"

    def kill(self, proc: subprocess.Popen) -> None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=EXIT_TIMEOUT_S)

    def gateway_serves(self, worker_id: str, port: int) -> None:
        """Waits until the gateway's membership has dialled the worker at ``port``."""
        joined = f"membership: worker {worker_id} joined at 127.0.0.1:{port} "
        wait_for(lambda: joined in self.gateway_log_path.read_text(), f"the gateway serves {worker_id}", WAIT_S)

    # -- requests ---------------------------------------------------------------------------------------
    def complete(self, tenant: str, prompt_ids: Sequence[int], max_tokens: int) -> Completion:
        """A greedy completion of ``prompt_ids`` as ``tenant`` (ignore_eos: always max_tokens tokens)."""
        with Client(self.gateway, api_key=f"key-{tenant}", timeout_s=120) as client:
            return client.complete(prompt_token_ids=list(prompt_ids), max_tokens=max_tokens, ignore_eos=True)

    # -- the kvmanager's view ---------------------------------------------------------------------------
    def admin(self, method: str, request):
        return admin_call(self.kvmanager, TOKEN, method, request)

    def stats(self) -> pb.ClusterStats:
        return self.admin("Stats", pb.StatsRequest())

    def store_stats(self) -> pb.StoreStats:
        return self.stats().kv_store

    def tenant(self, tenant: str) -> pb.TenantStats:
        found = [t for t in self.stats().tenants if t.tenant == tenant]
        return found[0] if found else pb.TenantStats(tenant=tenant)

    def evict_pool(self, tenant: str, worker_id: str) -> int:
        """Evicts the tenant's blocks from one worker's pool (its store entries stay); returns how many."""
        return self.admin("EvictTenant", pb.EvictTenantRequest(tenant=tenant, worker_id=worker_id)).num_evicted_blocks

    def idle(self) -> bool:
        """No page in use and no live request, on every pool."""
        pools = self.stats().pools
        return not any(p.num_used_pages or p.num_requests for p in pools)

    # -- the store --------------------------------------------------------------------------------------
    def store_client(self) -> redis.Redis:
        return redis.Redis.from_url(self.store.url, socket_timeout=10)

    def store_keys(self) -> set[bytes]:
        with contextlib.closing(self.store_client()) as client:
            return set(client.scan_iter(match=STORE_KEY_PREFIX + b"*", count=1000))

    def block_keys(self, tenant: str, token_ids: Sequence[int], worker_id: str = "worker-0") -> list[bytes]:
        """The store keys of the full pages of ``token_ids`` for ``tenant``, chained as the kvmanager chains
        them for the running worker's pool format."""
        with grpc.insecure_channel(f"127.0.0.1:{self.workers[worker_id][1]}") as channel:
            info = worker_pb2_grpc.WorkerServiceStub(channel).Info(worker_pb2.InfoRequest(), timeout=10)
        pool = PagePool(PoolSpec.of(info_from_proto(info)))
        return [store_key(h) for h in chain_hashes(pool.seed_for(tenant), list(token_ids), PAGE_SIZE)]


@contextlib.contextmanager
def tier_stack(tmp: Path, tenants: Sequence[str], *, standby: bool = False, num_pages: int = 32,
               start_worker: bool = True, start_gateway: bool = True, worker_timeout: str = LEASE_S):
    """A store, a kvmanager (and a standby on a shared state Redis), worker-0 and a gateway (each unless told
    not to: the caller starts its own); all stopped after. ``worker_timeout``: the kvmanager's member lease."""
    with contextlib.ExitStack() as exits:
        store = exits.enter_context(EmbeddedRedis(tmp / "kv-store"))
        state_url = exits.enter_context(EmbeddedRedis(tmp / "state")).url if standby else None
        stack = TierStack(tmp, tier_env(), store, num_pages=num_pages, lease_s=worker_timeout)
        exits.enter_context(stack._exits)  # its processes stop before the Redis servers they use
        leader, role = stack.start_kvmanager("kvmanager-0", state_url)
        assert role == "leader"
        stack.kvmanager = leader
        if standby:
            address, role = stack.start_kvmanager("kvmanager-1", state_url)
            assert role == "standby"
            stack.kvmanager = f"{leader},{address}"
        if start_worker:
            stack.start_worker("worker-0")
        if start_gateway:
            stack.start_gateway(tenants)
        yield stack
