"""Call-log snapshots: what the call that makes one due costs when the snapshot is written inline vs by a
forked child, side by side, and what the calls made while a child writes pay for it.

    python bench/bench_snapshots.py [--quick] [--out bench/results/snapshots-DATE.json]

Two kvmanager services (KVService over CallLog, one real embedded Redis) hold the same state: the kvmanager
benchmark's steady workload (64 running requests of 2000-token prompts, half of them hitting a shared prefix,
on a pool of 16,384 pages, about 16,000 of them cached blocks). Both replay the same calls. Each round, the
round's first call is made the one that makes a snapshot due (snapshot_every is set to fall on it), then the
round's other calls follow; the modes take turns going first. Timed:

    due call          the call that makes the snapshot due. Inline: it writes the whole state in one MULTI/EXEC.
                      Forked: it forks the child.
    during the child  the forked service's calls made while its child was writing, against the inline
                      service's same calls (no snapshot running): copy-on-write faults after the fork, Redis
                      taking the child's writes between the parent's appends, and the CPU the child uses.
    child             fork to switch, measured in separate rounds with no calls meanwhile.
    alone             the forked due call again, in a child process holding one manager's state, as a
                      kvmanager does (this process holds three: both services and the workload's reference,
                      and a fork's cost grows with the process).
    restart           that child then logs a full log's worth of calls (snapshot_every, 2000 by default) and a
                      fresh process loads the state as a restarted kvmanager does: the snapshot, then the replay.

Writes JSON and a Markdown table next to it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")  # as `kvserve kvmanager` does (kvserve/kvmanager/snapshot.py)

sys.path.insert(0, str(Path(__file__).parent))
from bench_kvmanager import SPEC, Workload, percentile  # noqa: E402
from results_io import write_results  # noqa: E402

from kvserve.common.embedded_redis import EmbeddedRedis
from kvserve.common.redis_client import connect  # noqa: E402
from kvserve.kvmanager.call_log import DEFAULT_SNAPSHOT_EVERY, CallLog  # noqa: E402
from kvserve.kvmanager.manager import KVManager  # noqa: E402
from kvserve.kvmanager.server import tune_gc_for_serving  # noqa: E402
from kvserve.kvmanager.service import KVService  # noqa: E402
from kvserve.kvmanager.snapshot import SWITCHED  # noqa: E402

NEVER = 1 << 62
MODES = ("inline", "forked")
PLAN = {False: {"rounds": 12, "calls": 300, "child_rounds": 8, "log_calls": DEFAULT_SNAPSHOT_EVERY},
        True: {"rounds": 3, "calls": 100, "child_rounds": 2, "log_calls": 200}}


def build(redis_url: str, name: str, setup_calls, forked: bool) -> KVService:
    store = CallLog(connect(redis_url), f"bench-snap-{name}", snapshot_every=NEVER, snapshot_bytes=NEVER,
                        background=forked)
    svc = KVService(KVManager(), store)
    svc.register_worker(SPEC)
    for call in setup_calls:
        svc.step(call.ops)
    return svc


def timed(svc: KVService, ops) -> float:
    t0 = time.perf_counter()
    svc.step(ops)
    return (time.perf_counter() - t0) * 1000


def due_now(store: CallLog) -> None:
    """The next logged call makes a snapshot due."""
    store.snapshot_every = store.num_logged + 1


def run(redis_url: str, rounds: int, calls_per_round: int, child_rounds: int, seed: int) -> dict:
    wl = Workload("steady", seed)
    wl.setup()
    setup_calls = list(wl.calls)
    services = {mode: build(redis_url, mode, setup_calls, mode == "forked") for mode in MODES}
    tune_gc_for_serving()  # as `kvserve kvmanager` does once its state is loaded
    pool = services["forked"].manager.pools[SPEC.worker_id]
    due = {mode: [] for mode in MODES}
    during = {mode: [] for mode in MODES}  # the same calls: forked while its child ran, inline with none
    overlapped = []
    for r in range(rounds):
        calls = wl.round(calls_per_round)
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            svc = services[mode]
            store = svc.store
            due_now(store)
            due[mode].append(timed(svc, calls[0].ops))
            store.snapshot_every = NEVER
            if mode == "forked":
                assert store.child is not None, "the due call did not fork"
                running = []
                times = []
                for call in calls[1:]:
                    running.append(store.child is not None)  # not reaped yet: the child still ran
                    times.append(timed(svc, call.ops))
                n = sum(running)
                overlapped.append(n)
                assert store.wait_snapshot() in (None, SWITCHED)
                during["forked"].append(times[:n])
            else:
                times = [timed(svc, call.ops) for call in calls[1:]]
                during["inline"].append(times)
    # the inline service's same calls as the forked one's during its children
    paired_inline = [t for n, ts in zip(overlapped, during["inline"], strict=True) for t in ts[:n]]
    paired_forked = [t for ts in during["forked"] for t in ts]
    child_ms = []
    forked = services["forked"]
    for _ in range(child_rounds):
        calls = wl.round(1)
        for mode in MODES:  # both keep replaying the same calls
            if mode == "inline":
                services[mode].step(calls[0].ops)
                continue
            due_now(forked.store)
            t0 = time.perf_counter()
            forked.step(calls[0].ops)
            assert forked.store.wait_snapshot() == SWITCHED
            child_ms.append((time.perf_counter() - t0) * 1000)
            forked.store.snapshot_every = NEVER
    for svc in services.values():
        svc.store.close()
    return {
        "state": {"cached_blocks": pool.num_cached, "pages": SPEC.num_pages,
                  "requests": len(forked.manager.requests)},
        "due_call_ms": {mode: stats(due[mode]) for mode in MODES},
        "during_child_ms": {"forked": stats(paired_forked), "inline_same_calls": stats(paired_inline),
                            "calls_per_child_median": statistics.median(overlapped)},
        "child_fork_to_switch_ms": stats(child_ms),
        "due_call_ratio_inline_over_forked": round(statistics.median(due["inline"])
                                                   / statistics.median(due["forked"]), 1),
    }


def alone(redis_url: str, rounds: int, log_calls: int, seed: int) -> dict:
    """--alone: the forked mode's due call in a process that holds one manager's state; then ``log_calls``
    calls are logged, for the restart figure."""
    wl = Workload("steady", seed)
    wl.setup()
    setup_calls = list(wl.calls)
    calls = wl.round(2 * rounds)
    del wl  # and with it the reference manager
    svc = build(redis_url, "alone", setup_calls, forked=True)
    del setup_calls
    gc.collect()
    tune_gc_for_serving()
    store = svc.store
    due = []
    for i in range(rounds):
        svc.step(calls[2 * i].ops)
        due_now(store)
        due.append(timed(svc, calls[2 * i + 1].ops))
        store.snapshot_every = NEVER
        code = store.wait_snapshot()
        assert code == SWITCHED, f"the snapshot child exited with {code}"
    rss_mb = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    wl = Workload("steady", seed)  # the same seed again: its reference reaches the service's state
    wl.setup()
    wl.round(2 * rounds)
    for call in wl.round(log_calls):
        svc.step(call.ops)
    return {"due_call_ms": stats(due), "max_rss_mb": rss_mb, "logged_calls": store.num_logged}


def restart(redis_url: str) -> dict:
    """--restart: what `kvserve kvmanager` does before it serves, timed: claim, load the snapshot, replay."""
    t0 = time.perf_counter()
    svc = KVService(KVManager(), CallLog(connect(redis_url), "bench-snap-alone"))
    svc.load()
    return {"load_ms": round((time.perf_counter() - t0) * 1000), "replayed_calls": svc.store.num_logged,
            "cached_blocks": svc.manager.pools[SPEC.worker_id].num_cached}


def stats(xs: list[float]) -> dict:
    return {"n": len(xs), "p50": round(statistics.median(xs), 3), "p90": round(percentile(xs, 90), 3),
            "p99": round(percentile(xs, 99), 3), "max": round(max(xs), 3)}


def markdown(report: dict) -> str:
    r = report["results"]
    d, c = r["due_call_ms"], r["during_child_ms"]
    rows = [
        "| | calls | p50 ms | p90 ms | p99 ms | max ms |", "|---|---:|---:|---:|---:|---:|",
        *(f"| due call, {m} | {d[m]['n']} | {d[m]['p50']} | {d[m]['p90']} | {d[m]['p99']} | {d[m]['max']} |"
          for m in MODES),
        *(f"| {title} | {c[k]['n']} | {c[k]['p50']} | {c[k]['p90']} | {c[k]['p99']} | {c[k]['max']} |"
          for k, title in (("forked", "calls while a child writes"),
                           ("inline_same_calls", "the same calls, inline service (no snapshot running)"))),
        f"| child, fork to switch (no calls meanwhile) | {r['child_fork_to_switch_ms']['n']} "
        f"| {r['child_fork_to_switch_ms']['p50']} | {r['child_fork_to_switch_ms']['p90']} "
        f"| {r['child_fork_to_switch_ms']['p99']} | {r['child_fork_to_switch_ms']['max']} |",
        f"| due call, forked, in a process holding one manager ({r['alone']['max_rss_mb']} MB) "
        f"| {r['alone']['due_call_ms']['n']} | {r['alone']['due_call_ms']['p50']} | {r['alone']['due_call_ms']['p90']} "
        f"| {r['alone']['due_call_ms']['p99']} | {r['alone']['due_call_ms']['max']} |",
    ]
    s = r["state"]
    return (f"# Call-log snapshots, inline vs forked ({report['date']})\n\n"
            f"State: {s['cached_blocks']} cached blocks of {s['pages']} pages, {s['requests']} running requests. "
            f"Steady calls (63 decodes + 1 admit/commit/free).\n\n" + "\n".join(rows) + "\n\n"
            f"Due call, inline / forked (medians): **{r['due_call_ratio_inline_over_forked']}x**. "
            f"A child overlapped a median of {c['calls_per_child_median']} calls.\n\n"
            f"Restart: a fresh process loaded the snapshot ({r['restart']['cached_blocks']} cached blocks) and "
            f"replayed {r['restart']['replayed_calls']} logged calls in **{r['restart']['load_ms']} ms**.\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer rounds (under a minute)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--alone", default=None, help=argparse.SUPPRESS)  # REDIS_URL: the child of the alone figure
    p.add_argument("--restart", default=None, help=argparse.SUPPRESS)  # REDIS_URL: the child of the restart one
    args = p.parse_args(argv)
    plan = PLAN[args.quick]
    if args.alone:
        print(json.dumps(alone(args.alone, plan["child_rounds"], plan["log_calls"], args.seed)))
        return 0
    if args.restart:
        print(json.dumps(restart(args.restart)))
        return 0
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-redis-") as tmp, EmbeddedRedis(Path(tmp)) as rs:
        results = run(rs.url, plan["rounds"], plan["calls"], plan["child_rounds"], args.seed)
        cmd = [sys.executable, __file__, "--alone", rs.url, "--seed", str(args.seed), *(["--quick"] * args.quick)]
        results["alone"] = json.loads(subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout)
        cmd = [sys.executable, __file__, "--restart", rs.url]
        results["restart"] = json.loads(subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout)
    report = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "quick": args.quick,
              "cpus": os.cpu_count(), "plan": plan, "results": results,
              "elapsed_s": round(time.perf_counter() - t0, 1)}
    out = write_results(report, "snapshots", markdown(report), args.out)
    print(f"wrote {out} and {out.with_suffix('.md')} ({report['elapsed_s']} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
