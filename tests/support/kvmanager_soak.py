"""Helpers for the persistence and restart tests: a comparable snapshot of a manager, and a deterministic stream
of scheduler steps (shared prefixes, commits, decode extensions, frees, preemption) that a child process runs
against Redis and the test replays in-process.

Run as a script (``python tests/support/kvmanager_soak.py REDIS_URL PREFIX``) it is the child: it prints
``done <step_id>`` after each step call has been made durable in the call log, until it is killed.
"""

from __future__ import annotations

import copy
import random
import sys
from dataclasses import dataclass, field

from kvserve.common.wire.pages import (
    OpStatus,
    PageAllocation,
    PageCommit,
    PageExtension,
    PageFree,
    PoolSpec,
    StepOps,
    StepResults,
)
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.pool import PagePool
from kvserve.kvmanager.state import RequestPages

PAGE_SIZE = 4
SOAK_SPEC = PoolSpec("w0", 1, 48, PAGE_SIZE, "fp", "float32", 64)
TENANTS = ("A", "B", "C")
MAX_TOKENS = 40


def canonical_lru(pool: PagePool) -> list[int]:
    """The LRU order recovery derives (recovery.py): by last_used, the chain's end first, then page_id."""
    return sorted(pool.evictable, key=lambda p: (pool.block_of[p].last_used, -pool.block_of[p].block_index, p))


def snapshot(mgr: KVManager, clock: bool = True, last_ops: bool = True) -> dict:
    """Everything a reload must reproduce, as plain comparable data (a deep copy). The free list is compared
    as a set and the LRU in its canonical order: their in-memory orders are not persisted."""
    pools = {}
    for w, p in mgr.pools.items():
        pools[w] = {
            "spec": p.spec, "ref_cnt": list(p.ref_cnt), "free": sorted(p.free), "lru": canonical_lru(p),
            "index": {h.hex(): (b.parent_hash.hex(), b.tenant, b.page_id, b.block_index, b.last_used, b.pinned)
                      for h, b in p.index.items()},
            "block_of": [b.block_hash.hex() if b else None for b in p.block_of],
            "num_requests": p.num_requests, "num_evicted": p.num_evicted, "num_window_released": p.num_window_released,
        }
    out = copy.deepcopy({"pools": pools, "requests": dict(mgr.requests), "stale": dict(mgr.stale),
                         "tenants": dict(mgr.tenants)})
    if clock:
        out["clock"] = mgr.clock
    if not last_ops:
        for req in (*out["requests"].values(), *out["stale"].values()):
            req.last_ops = {}
    return out


def assert_last_ops_persisted(orig: RequestPages, loaded: RequestPages) -> None:
    """last_ops as a restart finds them: a call that changed nothing is not logged unless its record went out
    before it was applied (CallLog.send_early), so the result of an op that changed nothing else (an
    extension within its pages, OUT_OF_PAGES, STALE_EPOCH) may be missing after a restart. A retry of that call
    then runs again instead of replaying: it allocates nothing either way."""
    for kind, (step_id, result) in orig.last_ops.items():
        if loaded.last_ops.get(kind) != (step_id, result):
            assert result.status != OpStatus.OK or (kind == "extend" and not result.new_page_ids), (kind, result)


@dataclass(slots=True)
class Running:
    tokens: list[int]  # computed so far (the prompt, then one decoded token per step)
    num_slots: int  # len(page_table) * page_size
    num_committed: int = 0
    preempted: bool = False


@dataclass(slots=True)
class Soak:
    """Deterministic given the seed and the results it observes (which are deterministic given the ops)."""

    seed: int = 0
    rng: random.Random = field(init=False)
    prefixes: dict[str, list[list[int]]] = field(init=False)  # per tenant: shared 3-page prompt prefixes
    running: dict[str, Running] = field(default_factory=dict)
    num_allocated: int = 0
    pending: tuple = ()  # (req_id, prompt) of this step's allocations; (req_id, token) of its extensions

    def __post_init__(self):
        self.rng = random.Random(self.seed)
        self.prefixes = {t: [[self.rng.randrange(1000) for _ in range(12)] for _ in range(2)] for t in TENANTS}

    def next_ops(self, step_id: int) -> StepOps:
        rng = self.rng
        frees = [r for r, st in self.running.items()
                 if st.preempted or len(st.tokens) >= MAX_TOKENS or rng.random() < 0.1]
        live = [r for r in self.running if r not in frees]
        commits = []
        for r in live:
            st = self.running[r]
            full = len(st.tokens) // PAGE_SIZE * PAGE_SIZE
            if full > st.num_committed:
                commits.append(PageCommit(r, st.num_committed, tuple(st.tokens[st.num_committed:full]), len(st.tokens)))
        decode = [(r, rng.randrange(1000)) for r in live if rng.random() < 0.7]
        extensions = [PageExtension(r, len(self.running[r].tokens) + 1) for r, _ in decode]
        allocations = []
        for _ in range(rng.choice((1, 1, 2))):
            tenant = rng.choice(TENANTS)
            prompt = list(rng.choice(self.prefixes[tenant])) if rng.random() < 0.7 else []
            prompt += [rng.randrange(1000) for _ in range(rng.randrange(1, 7))]
            req_id = f"r{self.num_allocated}"
            self.num_allocated += 1
            allocations.append(PageAllocation(req_id, tenant, tuple(prompt), SOAK_SPEC.worker_id))
        self.pending = (decode, {a.req_id: list(a.token_ids) for a in allocations}, commits)
        frees = tuple(PageFree(r) for r in frees)
        return StepOps(step_id, tuple(allocations), tuple(extensions), tuple(commits), frees)

    def observe(self, ops: StepOps, results: StepResults) -> None:
        decode, prompts, commits = self.pending
        for f in ops.frees:
            del self.running[f.req_id]
        for c in commits:
            self.running[c.req_id].num_committed += len(c.token_ids)
        for (req_id, token), res in zip(decode, results.extensions, strict=True):
            st = self.running[req_id]
            if res.status == OpStatus.OK:
                st.tokens.append(token)
                st.num_slots = res.num_pages * PAGE_SIZE
            else:
                st.preempted = True  # freed next step, as the gateway's scheduler would
        for res in results.allocations:
            if res.status == OpStatus.OK:
                self.running[res.req_id] = Running(prompts[res.req_id], len(res.page_table) * PAGE_SIZE,
                                                   num_committed=res.num_cached_tokens)


def replay(num_steps: int, seed: int = 0) -> tuple[KVManager, Soak]:
    """The first ``num_steps`` steps on a fresh in-memory manager."""
    mgr, soak = KVManager(), Soak(seed)
    mgr.register_worker(SOAK_SPEC)
    for step_id in range(1, num_steps + 1):
        ops = soak.next_ops(step_id)
        soak.observe(ops, mgr.step(ops))
    return mgr, soak


def make_store(url: str, prefix: str):
    """The call log with a snapshot due every 16 calls (so that snapshots fall due during a short soak)."""
    from kvserve.common.redis_client import connect
    from kvserve.kvmanager.call_log import CallLog

    return CallLog(connect(url), prefix, snapshot_every=16)


def run_child(url: str, prefix: str, seed: int = 0, max_steps: int = 100_000) -> None:
    from kvserve.kvmanager.service import KVService

    service = KVService(KVManager(), make_store(url, prefix))
    service.load()
    service.register_worker(SOAK_SPEC)
    soak = Soak(seed)
    print("ready", flush=True)
    for step_id in range(1, max_steps + 1):
        ops = soak.next_ops(step_id)
        soak.observe(ops, service.step(ops))
        print(f"done {step_id}", flush=True)


if __name__ == "__main__":
    run_child(sys.argv[1], sys.argv[2])
