"""One chaos run: the stack (chaos_stack.py), the closed-loop load (chaos_load.py), then a fault-free baseline
and each fault of chaos_faults.py in turn, with a quiet period around each. Used by bench/chaos.py (`make
chaos`) and, shorter, by tests/e2e/test_chaos.py.

A phase:

    resume the load ── wait for quiet_requests ended ── inject the fault (and wait for its recovery) ──
    wait for quiet_requests more, started after the recovery ── pause: the running requests end ──
    the live pools' used pages, polled down to 0 (or a deadline) ── the fault's ``after`` (e.g. a worker back)

and its figures count the requests that started in it: completed, lost (an error, or still running at the
drain deadline), wrong (token ids other than the reference's), and the times the fault reported.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from chaos_faults import FAULTS, Fault
from chaos_load import ClosedLoop, Outcome
from chaos_procs import Processes
from chaos_stack import ChaosStack, Features, StackConfig

MAX_ERRORS_KEPT = 3


@dataclass(frozen=True)
class ChaosConfig:
    num_clients: int = 6
    max_tokens: int = 32
    quiet_requests: int = 8  # ended requests before each fault, and again after its recovery
    phase_timeout_s: float = 180.0
    request_timeout_s: float = 150.0  # the SDK's deadline of one request: a request past it is lost
    drain_timeout_s: float = 150.0
    pages_timeout_s: float = 15.0
    faults: str = "abcde"
    without: tuple[str, ...] = ()  # features not to use, to run the fallbacks (Features.all_but)
    stack: StackConfig = field(default_factory=StackConfig)


def run_chaos(cfg: ChaosConfig, prompts: Sequence[Sequence[int]], reference: Sequence[Sequence[int]],
              log_dir: Path | None = None) -> dict:
    """Starts everything, runs the baseline and the faults, stops everything (also on failure); the report."""
    features = Features.all_but(cfg.without)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvserve-chaos-") as tmp:
        log_dir = Path(log_dir or Path(tmp) / "logs")
        with Processes(log_dir) as procs:
            stack = ChaosStack(procs, features, cfg.stack, Path(tmp))
            load = None
            try:
                stack.start()
                started_s = time.monotonic() - t0
                load = ClosedLoop(stack.gateway.address, prompts, cfg.num_clients, cfg.max_tokens,
                                  cfg.request_timeout_s)
                phases = [run_phase(None, stack, load, reference, cfg)]
                phases += [run_phase(f, stack, load, reference, cfg) for f in FAULTS if f.key in cfg.faults]
            finally:
                if load is not None:
                    load.close()
                stack.close()
    return {"features": features.as_dict(), "config": _config(cfg), "redis": stack.redis.kind,
            "kvmanagers": 2 if features.standby else 1,
            "gateway_worker_timeout_s": stack.gateway_worker_timeout_s,
            "workers_follow": "kvmanager membership" if features.membership else "static --workers list",
            "stack_start_s": started_s, "total_s": time.monotonic() - t0, "phases": phases}


def _config(cfg: ChaosConfig) -> dict:
    out = asdict(cfg)
    out["stack"].pop("admin_token")  # not a figure
    return out


def run_phase(fault: Fault | None, stack: ChaosStack, load: ClosedLoop, reference: Sequence[Sequence[int]],
              cfg: ChaosConfig) -> dict:
    """One phase (fault None: the fault-free baseline); its figures."""
    key, name = (fault.key, fault.name) if fault else ("-", "no fault (baseline)")
    missing = fault.missing(stack.features) if fault else None
    if missing:
        return {"key": key, "name": name, "ran": False, "skipped": missing}
    what = (fault.describe(stack) if fault.describe else fault.name) if fault else "none"
    start = time.monotonic()
    deadline = start + cfg.phase_timeout_s
    load.resume()
    load.wait_ended(cfg.quiet_requests, start, deadline)
    figures, error = {}, None
    if fault is not None:
        try:
            figures = fault.inject(stack, load, deadline)
        except (RuntimeError, TimeoutError) as e:
            error = f"{type(e).__name__}: {e}"
    load.wait_ended(cfg.quiet_requests, figures.get("recovered_at", start), deadline)
    drained = load.pause(time.monotonic() + cfg.drain_timeout_s)
    end = time.monotonic()
    stuck = [] if drained else load.snapshot_in_flight()
    pages = stack.wait_pages_free(time.monotonic() + cfg.pages_timeout_s)
    if fault is not None and fault.after is not None and error is None:
        fault.after(stack, figures)
    outcomes = load.outcomes_between(start, end)
    return {"key": key, "name": name, "fault": what, "ran": True, "error": error, "duration_s": end - start,
            **_counts(outcomes, reference, len(stuck)), "pages_left": pages, "pages_left_total": sum(pages.values()),
            "recovery": _recovery(outcomes, figures), "figures": _plain(figures),
            "workers_after": sorted(stack.workers)}


def _counts(outcomes: list[Outcome], reference: Sequence[Sequence[int]], num_stuck: int) -> dict:
    ok = [o for o in outcomes if o.ok]
    wrong = [o for o in ok if list(o.token_ids) != list(reference[o.prompt])]
    errors = list(dict.fromkeys(o.error or f"finish_reason {o.finish_reason}" for o in outcomes if not o.ok))
    return {"requests": len(outcomes) + num_stuck, "completed": len(ok),
            "lost": len(outcomes) - len(ok) + num_stuck, "stuck": num_stuck, "wrong": len(wrong),
            "errors": errors[:MAX_ERRORS_KEPT],
            "wrong_examples": [{"prompt": o.prompt, "got": list(o.token_ids)} for o in wrong[:MAX_ERRORS_KEPT]]}


def _recovery(outcomes: list[Outcome], figures: dict) -> dict:
    """Seconds from the fault: to the first request completing after it, and to the first completing of those
    that started after it; and the fault's own (``*_s``) figures."""
    fault_at = figures.get("fault_at")
    if fault_at is None:
        return {}
    ok = [o for o in outcomes if o.ok]
    first = min((o.end_s for o in ok if o.end_s > fault_at), default=None)
    first_new = min((o.end_s for o in ok if o.start_s > fault_at), default=None)
    out = {"first_completion_s": None if first is None else first - fault_at,
           "first_new_request_completed_s": None if first_new is None else first_new - fault_at}
    out.update({k: v for k, v in figures.items() if k.endswith("_s")})
    return out


def _plain(figures: dict) -> dict:
    """The fault's figures that are neither times of the monotonic clock nor already under recovery."""
    return {k: v for k, v in figures.items() if k not in ("fault_at", "recovered_at") and not k.endswith("_s")}
