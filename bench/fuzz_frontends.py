"""`make fuzz`: the long fuzz run of issue 35. Thousands of malformed and extreme bodies (tests/support/fuzz_bodies.py's
hypothesis strategies) at the HTTP and gRPC front-ends of one `kvserve up`, from 4 closed-loop clients (so that
odd requests share the engine's steps with valid ones):

    every answer a 2xx, or a client error in the API's shape (HTTP 4xx; gRPC INVALID_ARGUMENT and kin)
    no 5xx, INTERNAL, UNAVAILABLE or error event in a 200 stream; no hang (no answer within 60 s)
    afterwards: no page used, no request live, no worker declared dead or restarted (epochs, gateway log)

After a wrong answer the run waits for the stack to serve a plain request again, so that one failure does not
hide the next. Counts per front-end, endpoint and status, the first bodies of each kind of failure, and the
stack's state afterwards go to bench/results/fuzz-<date>.json and .md; a full run also writes
docs/reliability.md from the JSON (--docs-only JSON rewrites it from an earlier run).

    python bench/fuzz_frontends.py [--quick] [--bodies N] [--clients N] [--out PATH] [--docs-only JSON]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent / "tests" / "support"))  # the tests' strategies and stack
import fuzz_bodies as fb  # noqa: E402
import grpc  # noqa: E402
import httpx  # noqa: E402
from chaos import kvserve_commit  # noqa: E402
from fuzz_output import DOCS_PAGE, docs_page, markdown  # noqa: E402
from gateway_stack import running_stack  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from results_io import cpu_info, write_results  # noqa: E402

from kvserve.v1 import gateway_pb2_grpc  # noqa: E402

DEFAULT_BODIES, QUICK_BODIES = 5000, 500
DEFAULT_CLIENTS = 4
RECOVER_TIMEOUT_S = 120.0
FREED_TIMEOUT_S = 30.0
EXAMPLES_PER_KIND = 3


def draw_cases(strategy, n: int) -> list:
    """``n`` cases from a hypothesis strategy: a @given run that keeps what it is given (derandomised, so that a
    run is repeatable)."""
    cases = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(case):
        cases.append(case)

    collect()
    return cases


class Tally:
    """Answers per endpoint: counts per outcome, latencies, and the first bodies of each kind of failure."""

    def __init__(self):
        self.outcomes: dict[str, Counter] = defaultdict(Counter)
        self.latency_s: dict[str, list[float]] = defaultdict(list)
        self.failures: dict[tuple[str, str], list[dict]] = defaultdict(list)
        self.wrong: Counter = Counter()

    def add(self, endpoint: str, answer: fb.Answer, seconds: float, request: str, log: list[str]) -> None:
        self.outcomes[endpoint][answer.outcome] += 1
        self.latency_s[endpoint].append(seconds)
        if answer.problems:
            self.wrong[endpoint] += 1
            examples = self.failures[endpoint, answer.outcome]
            if len(examples) < EXAMPLES_PER_KIND and all(x["request"] != short(request) for x in examples):
                examples.append({"request": short(request), "problems": [short(p) for p in answer.problems],
                                 "log": [short(line, 400) for line in log[:4]]})

    def report(self) -> dict:
        endpoints = {}
        for endpoint, counts in sorted(self.outcomes.items()):
            lat = self.latency_s[endpoint]
            failures = {o: ex for (e, o), ex in self.failures.items() if e == endpoint}
            endpoints[endpoint] = {"tried": sum(counts.values()), "outcomes": dict(counts.most_common()),
                                   "wrong": self.wrong[endpoint], "hangs": counts["hang"],
                                   "server_errors": sum(n for o, n in counts.items() if _server_error(o)),
                                   "latency_p50_s": statistics.median(lat), "latency_max_s": max(lat),
                                   "failures": failures}
        return endpoints


def short(text: str, limit: int = 600) -> str:
    """``text`` with runs of a repeated piece written once with their count (``<'[' x 50000>``), cut at ``limit``."""
    return re.sub(r"(.{1,6}?)\1{15,}", lambda m: f"<{m[1]!r} x {len(m[0]) // len(m[1])}>", text)[:limit]


def _server_error(outcome: str) -> bool:
    return outcome.startswith("5") or outcome in ("INTERNAL", "UNKNOWN", "UNAVAILABLE", "200 stream error")


def serves(http: httpx.Client, stack) -> bool:
    try:
        reply = http.post(stack.http + "/completions", json={"prompt": "hi", "max_tokens": 1},
                          headers={"authorization": fb.BEARER}, timeout=fb.CLIENT_TIMEOUT_S)
    except httpx.HTTPError:
        return False
    return reply.status_code == 200


def recover(http: httpx.Client, stack) -> float | None:
    """Seconds until the stack serves a plain request again (polled), None if not within RECOVER_TIMEOUT_S."""
    t0 = time.monotonic()
    while not serves(http, stack):
        if time.monotonic() - t0 > RECOVER_TIMEOUT_S:
            return None
        time.sleep(0.5)  # polling under a deadline
    return time.monotonic() - t0


def log_since(stack, offset: int) -> list[str]:
    """The stack's log lines of trouble (fuzz_bodies.trouble_lines) written since byte ``offset``."""
    with stack.stderr_path.open("rb") as f:
        f.seek(offset)
        return fb.trouble_lines(f.read().decode(errors="replace"))


def _sends(stack, http: httpx.Client, stub, http_cases: list, grpc_cases: list) -> list[tuple]:
    """(endpoint, send, request as text) per case, HTTP and gRPC interleaved in a fixed order."""
    sends = [(f"HTTP /v1{c.path}", lambda c=c: fb.send_http(http, stack.http, c),
              f"{c.path} authorization={c.authorization!r} {c.body!r}") for c in http_cases]
    sends += [(f"gRPC {c.method}", lambda c=c: fb.send_grpc(stub, c),
               f"{c.method} authorization={c.authorization!r} {c.request}".replace("\n", " ")) for c in grpc_cases]
    random.Random(0).shuffle(sends)
    return sends


def fuzz(stack, http_cases: list, grpc_cases: list, tally: Tally, num_clients: int) -> list[float | None]:
    """Sends every case from ``num_clients`` closed-loop clients, so that odd requests share steps with others;
    after a wrong answer, that client waits for the stack to serve again. Returns the recovery times (None: it did
    not come back, and the run stopped there)."""
    recoveries: list[float | None] = []
    lock, stop = threading.Lock(), threading.Event()
    with httpx.Client() as http, grpc.insecure_channel(stack.gateway) as channel:
        def one(item) -> None:
            endpoint, send, request = item
            if stop.is_set():
                return
            t0, offset = time.perf_counter(), stack.stderr_path.stat().st_size
            answer = send()
            log = log_since(stack, offset) if answer.problems else []  # also what other clients' requests logged
            with lock:
                tally.add(endpoint, answer, time.perf_counter() - t0, request, log)
            if answer.problems:
                took = recover(http, stack)
                with lock:
                    recoveries.append(took)
                if took is None:
                    print(f"the stack did not serve again within {RECOVER_TIMEOUT_S:g} s; stopping")
                    stop.set()

        sends = _sends(stack, http, gateway_pb2_grpc.GatewayServiceStub(channel), http_cases, grpc_cases)
        with ThreadPoolExecutor(num_clients) as pool:
            for i, _ in enumerate(pool.map(one, sends)):
                if i % 500 == 0:
                    print(f"{i}/{len(sends)} sent", flush=True)
    return recoveries


def afterwards(stack, epochs_before: dict[str, int]) -> dict:
    """Pages and requests still held once the last answer came (polled up to FREED_TIMEOUT_S), epochs, log."""
    deadline = time.monotonic() + FREED_TIMEOUT_S
    while (stack.used_pages() or stack.live_requests()) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling under a deadline
    trouble = fb.trouble_lines(stack.log())
    distinct = dict.fromkeys(re.sub(r"^\d{4}-\d\d-\d\d [\d:,.]+ ", "", line) for line in trouble)
    epochs_after = fb.worker_epochs(stack.kvmanager)
    return {"pages_used": stack.used_pages(), "requests_live": stack.live_requests(),
            "workers_with_new_epoch": sum(epochs_after.get(w) != e for w, e in epochs_before.items()),
            "trouble_log_lines": len(trouble),
            "trouble_by_kind": dict(Counter(next((t for t in fb.TROUBLE if t in line), "traceback")
                                            for line in trouble)),
            "trouble_examples": [short(line, 400) for line in list(distinct)[:10]]}


def run(num_bodies: int, num_clients: int) -> dict:
    num_http = num_bodies * 2 // 3
    http_cases, grpc_cases = draw_cases(fb.http_cases(), num_http), draw_cases(fb.grpc_cases(), num_bodies - num_http)
    tally = Tally()
    with tempfile.TemporaryDirectory() as tmp:
        keys_file = Path(tmp) / "keys.json"
        keys_file.write_text(json.dumps(fb.KEYS))
        with running_stack(Path(tmp), dict(os.environ), "--api-keys-file", str(keys_file),
                           *fb.STACK_FLAGS) as stack:
            epochs = fb.worker_epochs(stack.kvmanager)
            t0 = time.perf_counter()
            recoveries = fuzz(stack, http_cases, grpc_cases, tally, num_clients)
            wall_s = time.perf_counter() - t0
            state = afterwards(stack, epochs)
    endpoints = tally.report()
    return {"bodies": sum(e["tried"] for e in endpoints.values()), "clients": num_clients, "wall_s": wall_s,
            "endpoints": endpoints,
            "server_errors": sum(e["server_errors"] for e in endpoints.values()),
            "hangs": sum(e["hangs"] for e in endpoints.values()),
            "wrong": sum(e["wrong"] for e in endpoints.values()), "recoveries_s": recoveries, "after": state}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"{QUICK_BODIES} bodies; docs/reliability.md untouched")
    p.add_argument("--bodies", type=int, help=f"bodies in all, 2/3 HTTP and 1/3 gRPC (default {DEFAULT_BODIES})")
    p.add_argument("--clients", type=int, default=DEFAULT_CLIENTS, help="concurrent closed-loop clients")
    p.add_argument("--out", type=Path, help="JSON path (default bench/results/fuzz-<date>.json)")
    p.add_argument("--docs-only", type=Path, metavar="JSON", help="only rewrite docs/reliability.md from JSON")
    args = p.parse_args(argv)
    DOCS_PAGE.parent.mkdir(exist_ok=True)
    if args.docs_only:
        DOCS_PAGE.write_text(docs_page(json.loads(args.docs_only.read_text()), args.docs_only.name))
        return 0
    num_bodies = args.bodies or (QUICK_BODIES if args.quick else DEFAULT_BODIES)
    report = {"date": dt.date.today().isoformat(),
              "command": "python bench/fuzz_frontends.py" + "".join(f" {a}" for a in sys.argv[1:]),
              "kvserve_commit": kvserve_commit(),
              "stack_flags": list(fb.STACK_FLAGS), "client_timeout_s": fb.CLIENT_TIMEOUT_S, "cpu": cpu_info(),
              **run(num_bodies, args.clients)}
    name = "fuzz-quick" if args.quick else "fuzz"
    out = write_results(report, name, markdown(report), args.out)
    if not args.quick:
        DOCS_PAGE.write_text(docs_page(report, out.name))
    after = report["after"]
    clean = not (report["wrong"] or after["pages_used"] or after["requests_live"] or after["trouble_log_lines"]
                 or after["workers_with_new_epoch"])
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
