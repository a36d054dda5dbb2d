"""kill -9 of a process driving the kvmanager (KVService + RedisStore) mid-traffic, then a reload from Redis:
every page table, ref_cnt, index entry and counter of the last acknowledged step is back, and it carries on."""

from __future__ import annotations

import copy
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvserve.kvmanager.invariants import check_invariants
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.redis_server import EmbeddedRedis
from kvserve.kvmanager.service import KVService

sys.path.insert(0, str(Path(__file__).parent))
from kvmanager_soak import assert_last_ops_persisted, make_store, replay, snapshot  # noqa: E402

SOAK = Path(__file__).parent / "kvmanager_soak.py"
KILL_AFTER_STEP = 40
PREFIX = "soak"


def run_child_until_killed(url: str, kind: str) -> tuple[int, str]:
    """Starts the soak child, SIGKILLs it once it reported KILL_AFTER_STEP, returns the last step it reported
    done (all its output read) and its stderr."""
    child = subprocess.Popen([sys.executable, str(SOAK), url, PREFIX, kind], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in child.stdout], daemon=True)
    reader.start()
    last_done = 0
    try:
        while last_done < KILL_AFTER_STEP:
            line = lines.get(timeout=30)  # the child prints a line per step: a stall means it failed
            if line.startswith("done "):
                last_done = int(line.split()[1])
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    reader.join(10)
    while not lines.empty():
        line = lines.get()
        if line.startswith("done "):
            last_done = int(line.split()[1])
    stderr = child.stderr.read()
    assert child.returncode == -signal.SIGKILL, f"child exited with {child.returncode}:\n{stderr}"
    return last_done, stderr


@pytest.mark.parametrize("kind", ["state", "log"])
def test_kill_9_mid_traffic_then_reload_recovers_every_page(tmp_path, kind):
    with EmbeddedRedis(tmp_path / "redis") as server:
        last_done, _ = run_child_until_killed(server.url, kind)
        reloaded = KVManager()
        store = make_store(kind, server.url, PREFIX)
        store.load(reloaded)  # runs check_invariants
        # Redis holds the state after step last_done, or after last_done + 1 if the child was killed between
        # that step's EXEC and its print: never anything in between (one MULTI/EXEC per step).
        mgr, soak = replay(last_done)
        candidates = [(snapshot(mgr), copy.deepcopy(soak), copy.deepcopy(mgr))]
        ops = soak.next_ops(last_done + 1)
        soak.observe(ops, mgr.step(ops))
        candidates.append((snapshot(mgr), copy.deepcopy(soak), mgr))
        got = snapshot(reloaded, clock=False, last_ops=False)
        matches = [i for i, (snap, _, _) in enumerate(candidates) if _without(snap) == got]
        assert matches, f"reloaded state matches neither step {last_done} nor {last_done + 1}"
        want, soak, live = candidates[matches[0]]
        if kind == "log":  # the calls after the snapshot are replayed: onto the live free list and LRU order
            assert_same_order(reloaded, live)
        assert reloaded.clock <= want["clock"]  # a step that changed nothing writes nothing, its clock tick too
        for req_id, req in want["requests"].items():
            assert_last_ops_persisted(req, reloaded.requests[req_id])
        assert reloaded.requests and any(reloaded.pools["w0"].ref_cnt)  # requests in flight kept their pages
        assert reloaded.pools["w0"].index and reloaded.pools["w0"].num_evicted > 0

        # the restarted kvmanager carries on with the same traffic, writing through, and reloads again
        service = KVService(reloaded, store)
        first = last_done + 1 + matches[0]
        for step_id in range(first, first + 100):
            ops = soak.next_ops(step_id)
            soak.observe(ops, service.step(ops))
            check_invariants(reloaded)
        again = KVManager()
        make_store(kind, server.url, PREFIX).load(again)
        assert snapshot(again, clock=False, last_ops=False) == snapshot(reloaded, clock=False, last_ops=False)
        if kind == "log":
            assert_same_order(again, reloaded)


def assert_same_order(got: KVManager, want: KVManager) -> None:
    for worker_id, pool in want.pools.items():
        assert list(got.pools[worker_id].free) == list(pool.free), worker_id
        assert list(got.pools[worker_id].evictable) == list(pool.evictable), worker_id


def _without(snap: dict) -> dict:
    out = {k: v for k, v in snap.items() if k != "clock"}
    out["requests"] = {r: _no_last_ops(req) for r, req in out["requests"].items()}
    out["stale"] = {r: _no_last_ops(req) for r, req in out["stale"].items()}
    return out


def _no_last_ops(req):
    req = copy.copy(req)
    req.last_ops = {}
    return req
