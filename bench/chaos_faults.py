"""The faults of the chaos run, each a small step on a running ChaosStack under a ClosedLoop load.

    key  fault                                      needs (else skipped, or the fallback named)
    a    kill -9 of the leader kvmanager            a standby takes over; without one: restarted on its port
    b    kill -9 of a worker, restarted             the same worker_id, a new process (on its old port)
    c    kill -9 of a worker for good               declare_dead; a fresh worker joins at the end (membership)
    d    kill -9 of the Redis primary               Sentinel fails over; without it: restarted on its port+AOF
    e    a worker added mid-load                    membership (the gateway follows the kvmanager's list)

A fault's ``inject(stack, load, deadline)`` does the damage and waits for what recovery means for it, returning
its figures: ``fault_at`` (time.monotonic() of the kill), ``recovered_at`` (from when the load counts as
recovered: the phase then waits for more requests that start after it) and seconds such as
``kvmanager_answering_s``. ``after`` (optional) runs once the phase's load has drained.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from chaos_load import ClosedLoop, InFlight
from chaos_stack import ChaosStack, Features

POLL_S = 0.05
SAMPLE_S = 0.25


@dataclass(frozen=True)
class Fault:
    key: str
    name: str
    inject: Callable[[ChaosStack, ClosedLoop, float], dict]
    missing: Callable[[Features], str | None] = lambda features: None  # why it cannot run in this build
    after: Callable[[ChaosStack, dict], None] | None = None
    describe: Callable[[ChaosStack], str] | None = None  # what was done, when it depends on the build


# -- helpers ----------------------------------------------------------------------------------------------
def pick_victim(stack: ChaosStack, load: ClosedLoop, deadline: float) -> tuple[str, list[InFlight]]:
    """The live worker with the most requests in mid-stream (a first delta came, at most half the tokens did, so
    that the kill lands before they end), and its requests in flight: their workers asked to the kvmanager
    (GetPageTable). Raises TimeoutError."""
    while time.monotonic() < deadline:
        on: dict[str, list[InFlight]] = {}
        for flight in load.snapshot_in_flight():
            worker_id = stack.worker_of(flight.req_id) if flight.req_id else None
            if worker_id in stack.workers:
                on.setdefault(worker_id, []).append(flight)
        early = {w: sum(f.num_tokens <= load.max_tokens // 2 for f in flights) for w, flights in on.items()}
        if any(early.values()):
            worker_id = max(early, key=early.get)
            return worker_id, on[worker_id]
        time.sleep(POLL_S)  # polling a condition under a deadline
    raise TimeoutError("no worker had a request in mid-stream to kill")


def _victim_figures(load: ClosedLoop, victim_flights: list[InFlight], fault_at: float, deadline: float) -> dict:
    done = load.wait_finished(victim_flights, deadline)
    return {"victim_requests": len(victim_flights),
            "victim_requests_done_s": None if done is None else done - fault_at}


def _kill_worker(stack: ChaosStack, load: ClosedLoop, deadline: float) -> tuple[str, list[InFlight], dict]:
    worker_id, flights = pick_victim(stack, load, deadline)
    victim = stack.workers[worker_id]
    fault_at = time.monotonic()
    victim.kill9()
    return worker_id, flights, {"fault_at": fault_at, "victim": worker_id, "victim_port": victim.port}


def steps_computed(metrics_url: str | None) -> int | None:
    """kvserve:worker_step_seconds_count from a worker's /metrics (None without metrics or an answer)."""
    if metrics_url is None:
        return None
    try:
        with urllib.request.urlopen(metrics_url, timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("kvserve:worker_step_seconds_count"):
            return int(float(line.split()[-1]))
    return 0


# -- a: the leader kvmanager ---------------------------------------------------------------------------------
def kill_leader(stack: ChaosStack, load: ClosedLoop, deadline: float) -> dict:
    leader = stack.leader()
    if leader is None:
        raise RuntimeError("no kvmanager answers before the fault")
    fault_at = time.monotonic()
    leader.kill9()
    figures = {"fault_at": fault_at, "killed": leader.address}
    if not stack.features.standby:
        new = stack.restart_kvmanager(leader)
        figures["kvmanager_restarted_s"] = new.started_s - fault_at
    answering = stack.wait_kvmanager_answering(deadline)
    now = time.monotonic()
    figures.update(kvmanager_answering_s=now - fault_at, leader=answering.address, recovered_at=now)
    return figures


def restart_killed_kvmanager(stack: ChaosStack, figures: dict) -> None:
    """With a standby: the killed leader comes back on its port as the next standby, so later faults have one."""
    dead = next((k for k in stack.kvmanagers if not k.alive()), None)
    if dead is not None:
        stack.restart_kvmanager(dead)


# -- b, c: a worker ------------------------------------------------------------------------------------------
def kill_worker_restart(stack: ChaosStack, load: ClosedLoop, deadline: float) -> dict:
    worker_id, flights, figures = _kill_worker(stack, load, deadline)
    new = stack.start_worker(worker_id, port=figures["victim_port"])
    figures["worker_restarted_s"] = new.started_s - figures["fault_at"]
    figures.update(_victim_figures(load, flights, figures["fault_at"], deadline))
    figures["recovered_at"] = time.monotonic()
    return figures


def kill_worker_for_good(stack: ChaosStack, load: ClosedLoop, deadline: float) -> dict:
    worker_id, flights, figures = _kill_worker(stack, load, deadline)
    del stack.workers[worker_id]
    figures.update(_victim_figures(load, flights, figures["fault_at"], deadline))
    figures["recovered_at"] = time.monotonic()
    return figures


def check_dead_pool_dropped(stack: ChaosStack, figures: dict) -> None:
    """After c: the dead worker's pool is gone from the kvmanager; with membership a fresh worker replaces it
    (unless the config says not to: then e's added worker is the second one again)."""
    figures["dead_pool_dropped"] = figures["victim"] not in stack.pools()
    if stack.features.membership and stack.cfg.replace_lost_worker:
        t0 = time.monotonic()
        figures["replacement"] = stack.add_worker().name
        figures["replacement_ready_s"] = time.monotonic() - t0


# -- d: Redis ------------------------------------------------------------------------------------------------
def kill_redis_primary(stack: ChaosStack, load: ClosedLoop, deadline: float) -> dict:
    fault_at = time.monotonic()
    figures = stack.redis.kill_primary()  # returns once a primary answers again
    figures.update(fault_at=fault_at, recovered_at=time.monotonic())
    return figures


def restore_redis(stack: ChaosStack, figures: dict) -> None:
    stack.redis.restore()


# -- e: a worker joins ---------------------------------------------------------------------------------------
def add_worker_mid_load(stack: ChaosStack, load: ClosedLoop, deadline: float) -> dict:
    """A new worker joins under load; it must receive requests without a gateway restart: sampled until one of
    the requests in flight is on its pool (GetPageTable); its metrics count the steps it computed."""
    fault_at = time.monotonic()
    worker = stack.add_worker()
    figures = {"fault_at": fault_at, "added": worker.name, "worker_ready_s": worker.started_s - fault_at}
    seen: set[str] = set()
    while time.monotonic() < deadline and not seen:
        seen = {f.req_id for f in load.snapshot_in_flight()
                if f.req_id and stack.worker_of(f.req_id) == worker.name}
        if not seen:
            time.sleep(SAMPLE_S)  # sampling a condition under a deadline
    now = time.monotonic()
    figures.update(first_request_s=now - worker.started_s if seen else None, recovered_at=now)
    return figures


def count_added_worker_steps(stack: ChaosStack, figures: dict) -> None:
    figures["steps_on_added_worker"] = steps_computed(stack.workers[figures["added"]].metrics_url)


def _describe_a(stack: ChaosStack) -> str:
    return ("kill -9 of the leader kvmanager (the standby takes over)" if stack.features.standby
            else "kill -9 of the only kvmanager (no standby), restarted on its port")


FAULTS = (
    Fault("a", "leader kvmanager", kill_leader, after=restart_killed_kvmanager, describe=_describe_a),
    Fault("b", "worker restarted", kill_worker_restart,
          describe=lambda s: "kill -9 of a worker, a new process with the same worker_id on its port"),
    Fault("c", "worker lost for good", kill_worker_for_good, after=check_dead_pool_dropped,
          missing=lambda f: None if f.declare_dead else "run --without declare_dead",
          describe=lambda s: "kill -9 of a worker, never restarted" + (
              "; a fresh worker joins at the end" if s.features.membership and s.cfg.replace_lost_worker else "")),
    Fault("d", "Redis primary", kill_redis_primary, after=restore_redis, describe=lambda s: s.redis.kind),
    Fault("e", "worker added", add_worker_mid_load, after=count_added_worker_steps,
          missing=lambda f: None if f.membership else "needs worker membership (worker --kvmanager, ListWorkers; "
                                                      "issue 23 point 1): not in this build, or --without membership",
          describe=lambda s: "a new worker joins the kvmanager under load"),
)
