"""kill -9 of a process driving the kvmanager (KVService + CallLog, a snapshot due every 16 calls, written
by a forked child) mid-traffic, then a reload from Redis: every page table, ref_cnt, index entry, counter, the
clock and the free list and LRU in their exact order are those of the last acknowledged step (or of the one
after, if it was logged but not yet acknowledged), and it carries on."""

from __future__ import annotations

import copy
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

from kvmanager_soak import assert_last_ops_persisted, make_store, replay, snapshot  # noqa: E402

from kvserve.common.embedded_redis import EmbeddedRedis
from kvserve.kvmanager.invariants import check_invariants
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.service import KVService

SOAK = Path(__file__).resolve().parents[1] / "support" / "kvmanager_soak.py"
KILL_AFTER_STEP = 40
PREFIX = "soak"


def run_child_until_killed(url: str) -> tuple[int, str]:
    """Starts the soak child, SIGKILLs it once it reported KILL_AFTER_STEP, returns the last step it reported
    done (all its output read) and its stderr."""
    child = subprocess.Popen([sys.executable, str(SOAK), url, PREFIX], stdout=subprocess.PIPE,
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


def test_kill_9_mid_traffic_then_reload_recovers_every_page(tmp_path):
    with EmbeddedRedis(tmp_path / "redis") as server:
        last_done, _ = run_child_until_killed(server.url)
        reloaded = KVManager()
        store = make_store(server.url, PREFIX)
        store.load(reloaded)  # runs check_invariants
        # Redis holds the calls up to step last_done, or up to last_done + 1 if the child was killed between
        # that step's append and its print: never part of a call (one RPUSH per call).
        mgr, soak = replay(last_done)
        candidates = [(snapshot(mgr, last_ops=False), copy.deepcopy(soak), copy.deepcopy(mgr))]
        ops = soak.next_ops(last_done + 1)
        soak.observe(ops, mgr.step(ops))
        candidates.append((snapshot(mgr, last_ops=False), copy.deepcopy(soak), mgr))
        got = snapshot(reloaded, last_ops=False)
        matches = [i for i, (snap, _, _) in enumerate(candidates) if snap == got]
        assert matches, f"reloaded state matches neither step {last_done} nor {last_done + 1}"
        _, soak, live = candidates[matches[0]]
        assert_same_order(reloaded, live)  # the replay ran on the live free list and LRU order
        for req_id, req in live.requests.items():
            assert_last_ops_persisted(req, reloaded.requests[req_id])
        assert reloaded.requests and any(reloaded.pools["w0"].ref_cnt)  # requests in flight kept their pages
        assert reloaded.pools["w0"].index and reloaded.pools["w0"].num_evicted > 0

        # the restarted kvmanager carries on with the same traffic, logging it, and reloads again
        service = KVService(reloaded, store)
        first = last_done + 1 + matches[0]
        for step_id in range(first, first + 100):
            ops = soak.next_ops(step_id)
            soak.observe(ops, service.step(ops))
            check_invariants(reloaded)
        again = KVManager()
        make_store(server.url, PREFIX).load(again)
        assert snapshot(again, last_ops=False) == snapshot(reloaded, last_ops=False)
        assert_same_order(again, reloaded)
        for req_id, req in reloaded.requests.items():
            assert_last_ops_persisted(req, again.requests[req_id])


def assert_same_order(got: KVManager, want: KVManager) -> None:
    for worker_id, pool in want.pools.items():
        assert list(got.pools[worker_id].free) == list(pool.free), worker_id
        assert list(got.pools[worker_id].evictable) == list(pool.evictable), worker_id
