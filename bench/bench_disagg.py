"""Prefill/decode disaggregation and page pulls between workers (issue 40's acceptance run), side by side in one run.

    python bench/bench_disagg.py [--quick] [--sections decodes,pull] [--rounds 3]      # make bench-disagg

Every stack is `kvserve up` with two workers of the default model on CPU, each pinned to one of the machine's
two cores and computing on one thread (bench/disagg_stack.py), the shared KV tier off (--kv-store-bytes 0: a
page is in a pool, pulled from one, or computed). Requests go through the gRPC SDK, greedy, ignore_eos; every
prompt is fresh text (a numbered header, then a slice of the corpus), so nothing is cached from an earlier one.

  decodes  (a) disagg: --prefill-workers 1 --decode-workers 1 (prefill-0 on core 0, decode-0 on core 1)
           (b) both:   --workers 2 (worker-0 on core 0, worker-1 on core 1)
           The same load on each: 16 lanes of short requests decode throughout, each a closed loop of 64-token
           prompts with 128 new tokens (streamed; the next sent when the last ends, the lanes' first requests
           shorter so that they restart apart), so the decoding set and its contexts stay the same; once all
           decode, a baseline window with no long prompt; then long prompts of ~2,000, 3,000 and 4,000 tokens
           (8 new tokens) arrive 4 s apart; once they are done, a short after-window, then the lanes stop.
           Figures: the short requests' inter-token gaps (time per output token) p50 and p99 in the baseline
           window and while a long prompt is in flight (from its arrival to its last token: its prefill, in (a)
           its hand-off to decode-0 and the pull, and its few tokens), and while one prefills (arrival to first
           token, which in (a) prefill-0 samples); the long prompts' TTFT and the gap to their second token (in
           (a), the hand-off); generated tokens per second from the first short request sent to the lanes' stop;
           the kvmanager's transfer counters over the run (MB/s, seconds per pull, ok/failed). Both stacks are
           up at once (the idle one only heartbeats); each round runs (a) then (b), the next (b) then (a).
  pull     cache-aware pull against recompute. Two stacks of two `both` workers and --load-penalty-pages 100:
           pull (the default) and recompute (--no-pull-peers). A request with a fresh ~1,200-token prefix
           computes it on worker A and keeps decoding (streamed); the revisit (the same prefix, another short
           question) is placed on the idle worker B (A's one running request outweighs its 75-page hit), which
           pulls the prefix's pages from A or recomputes them. Figures: the revisit's TTFT, its cached tokens,
           the pull's counters, which pool took it. The same prefix goes to both stacks in a round, the order
           alternating; a new prefix every round; round 0 warms up and is left out.

Writes bench/results/disagg-<date>.json, .md and .png (disagg-quick-<date> with --quick; bench/disagg_output.py).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import datetime as dt
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import disagg_output  # noqa: E402
import hf_reference as hf  # noqa: E402
from bench_long import Prompts  # noqa: E402
from chaos import kvserve_commit  # noqa: E402
from disagg_stack import Up, delta  # noqa: E402
from results_io import RESULTS_DIR, write_results  # noqa: E402

from kvserve.common.tokenizer import Tokenizer  # noqa: E402
from kvserve.services.client import Client  # noqa: E402
from kvserve.services.model_store import prepare_default_model  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    rounds: int = 3  # decodes: runs of each configuration
    num_short: int = 16
    short_prompt: int = 64
    short_new: int = 128  # each short request's new tokens; its lane then sends the next
    long_prompts: tuple[int, ...] = (2000, 3000, 4000)
    long_every_s: float = 4.0
    long_new: int = 8
    baseline_s: float = 8.0
    after_s: float = 3.0
    pull_rounds: int = 4  # pull: measured rounds, after round 0
    prefix_tokens: int = 1200
    busy_tokens: int = 1000  # A's request: cancelled once the revisit is done
    load_penalty_pages: int = 100


QUICK = Sizes(rounds=1, num_short=4, short_new=32, long_prompts=(600, 900), long_every_s=2.0, baseline_s=3.0,
              after_s=1.0, pull_rounds=1, prefix_tokens=600)
COMMON = ["--kv-store-bytes", "0"]
# 16 short requests grow past a 512 MiB pool (728 pages) over a run on one core: 2 GiB (2,912 pages) per worker,
# so that no run preempts
DECODES_POOL = ["--kv-cache-bytes", "2GiB"]
DECODES = {"disagg": ([*DECODES_POOL, "--prefill-workers", "1", "--decode-workers", "1"],
                      {"prefill-0": 0, "decode-0": 1}),
           "both": ([*DECODES_POOL, "--workers", "2"], {"worker-0": 0, "worker-1": 1})}
PULLS = {"pull": [], "recompute": ["--no-pull-peers"]}
BOTH_CORES = {"worker-0": 0, "worker-1": 1}
QUESTIONS = ("\n\nQuestion: what is this text about?\nAnswer:",
             "\n\nQuestion: which function does it describe first, and what does it return?\nAnswer:")


class Texts:
    """Fresh text of about n tokens each time: a numbered header and a slice of the corpus, so that no prompt
    shares its first page (and so any page) with an earlier one, even where the corpus wraps."""

    def __init__(self, tok: Tokenizer, corpus: list[int]):
        self.prompts, self.num, self.lock = Prompts(tok, corpus), 0, threading.Lock()

    def take(self, n: int) -> str:
        with self.lock:
            self.num += 1
            return f"Text {self.num}.\n" + self.prompts.take(n)[0]


class Stream:
    """One streamed request, read on a thread: when each token arrived, and the usage."""

    def __init__(self, client: Client, text: str, max_tokens: int):
        self.sent = time.perf_counter()
        self.stream = client.generate(prompt=text, max_tokens=max_tokens, ignore_eos=True)
        self.times: list[float] = []
        self.usage = None

    def read(self) -> Stream:
        for d in self.stream:
            now = time.perf_counter()
            self.times += [now] * len(d.token_ids)
            self.usage = d.usage or self.usage
        return self

    def summary(self, t0: float) -> dict:
        first = self.times[0] if self.times else None
        return {"sent_s": self.sent - t0, "ttft_s": first - self.sent if first else None,
                "done_s": self.times[-1] - t0 if self.times else None, "tokens": len(self.times),
                "second_token_gap_s": self.times[1] - self.times[0] if len(self.times) > 1 else None,
                "prompt_tokens": self.usage.prompt_tokens if self.usage else None,
                "cached_tokens": self.usage.cached_tokens if self.usage else None}


def wait_until(cond, limit_s: float, what: str) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {limit_s:.0f} s")
        time.sleep(0.05)  # polling a condition under a deadline


def long_request(client: Client, text: str, max_tokens: int, at: float) -> Stream:
    time.sleep(max(0.0, at - time.perf_counter()))
    return Stream(client, text, max_tokens).read()


def warm_up(up: Up, texts: Texts) -> None:
    """Two short requests and a 600-token one at once: each worker computes, and a disaggregated stack pulls."""
    jobs = [(texts.take(64), 8), (texts.take(64), 8), (texts.take(600), 4)]
    with Client(up.gateway, timeout_s=600) as client, cf.ThreadPoolExecutor(len(jobs)) as pool:
        list(pool.map(lambda j: Stream(client, *j).read(), jobs))
    up.settle()


def gaps(streams: list[Stream], keep) -> list[float]:
    """Every inter-token gap of ``streams`` whose later token's arrival ``keep`` accepts."""
    return [b - a for s in streams for a, b in zip(s.times, s.times[1:], strict=False) if keep(b)]


class Lane:
    """One of the steady short requests: a closed loop that sends a fresh short prompt as soon as its last request
    ends, until stopped, so that the set of decoding requests (and the length of their contexts) stays the same
    through a run. Lane i of n first asks for (i + 1) / n of the new tokens, so that the lanes restart apart."""

    def __init__(self, client: Client, texts: Texts, sz: Sizes, i: int):
        self.client, self.texts, self.sz = client, texts, sz
        self.first_tokens = max(1, sz.short_new * (i + 1) // sz.num_short)
        self.streams: list[Stream] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        max_tokens = self.first_tokens
        while not self.stopped.is_set():
            s = Stream(self.client, self.texts.take(self.sz.short_prompt), max_tokens)
            self.streams.append(s)
            if self.stopped.is_set():
                s.stream.cancel()
            s.read()
            max_tokens = self.sz.short_new

    def stop(self) -> None:
        self.stopped.set()
        if self.streams:
            self.streams[-1].stream.cancel()


def decodes_run(up: Up, texts: Texts, sz: Sizes) -> dict:
    """One run of the decodes load on ``up`` (see the module docstring); its figures and a binned timeline."""
    long_texts = [texts.take(n) for n in sz.long_prompts]
    before, preempted = up.transfers(), up.num_preempted()
    with Client(up.gateway, timeout_s=3600) as client, \
            cf.ThreadPoolExecutor(sz.num_short + len(long_texts)) as pool:
        t0 = time.perf_counter()
        lanes = [Lane(client, texts, sz, i) for i in range(sz.num_short)]
        running = [pool.submit(lane.run) for lane in lanes]
        wait_until(lambda: all(lane.streams and lane.streams[0].times for lane in lanes), 300,
                   "first token of every short request")
        base_from = time.perf_counter() + 0.5
        arrive = base_from + sz.baseline_s
        longs = [pool.submit(long_request, client, text, sz.long_new, arrive + i * sz.long_every_s)
                 for i, text in enumerate(long_texts)]
        longs = [f.result() for f in longs]
        done = max(s.times[-1] for s in longs)
        time.sleep(sz.after_s)
        end = time.perf_counter()
        for lane in lanes:
            lane.stop()
        for f in running:
            f.result()
    shorts = [s for lane in lanes for s in lane.streams]
    prefilling = [(s.sent, s.times[0]) for s in longs]
    in_flight = [(s.sent, s.times[-1]) for s in longs]
    windows = {"baseline": gaps(shorts, lambda t: base_from < t <= arrive),
               "in_flight": gaps(shorts, lambda t: any(a < t <= b for a, b in in_flight)),
               "prefilling": gaps(shorts, lambda t: any(a < t <= b for a, b in prefilling)),
               "after": gaps(shorts, lambda t: done < t <= end)}
    generated = sum(1 for s in shorts for t in s.times if t0 < t <= end) + sum(len(s.times) for s in longs)
    return {"short": {k: disagg_output.gap_stats(v) for k, v in windows.items()}, "num_short_requests": len(shorts),
            "long": [s.summary(t0) for s in longs], "generated_tokens": generated, "wall_s": end - t0,
            "tokens_per_s": generated / (end - t0), "transfers": delta(up.transfers(), before),
            "num_preempted": up.num_preempted() - preempted,
            "timeline": disagg_output.timeline(shorts, t0, end, [(a - t0, b - t0) for a, b in in_flight]),
            "load_avg_1min": os.getloadavg()[0]}


def start(stacks: dict[str, tuple[list[str], dict[str, int]]], log_dir: Path, texts: Texts) -> dict[str, Up]:
    """Every stack spawned at once (the model loads in parallel), then each made ready, pinned and warmed up."""
    log_dir.mkdir(parents=True, exist_ok=True)
    ups = {name: Up(name, [*COMMON, *args], log_dir).spawn() for name, (args, _) in stacks.items()}
    try:
        for name, up in ups.items():
            up.ready(stacks[name][1])
            print(f"  {name} ready: gateway {up.gateway}; pinned {up.pinned}", flush=True)
        for up in ups.values():
            warm_up(up, texts)
    except BaseException:
        for up in ups.values():
            up.stop()
        raise
    return ups


def decodes_section(sz: Sizes, texts: Texts, log_dir: Path) -> dict:
    ups = start(DECODES, log_dir, texts)
    runs: list[dict] = []
    try:
        for r in range(sz.rounds):
            order = list(DECODES) if r % 2 == 0 else list(DECODES)[::-1]
            for name in order:
                print(f"[{time.strftime('%X')}] decodes: {name}, round {r + 1} of {sz.rounds}", flush=True)
                run = {"config": name, "round": r, **decodes_run(ups[name], texts, sz)}
                runs.append(run)
                print(f"  {disagg_output.decodes_line(run)}", flush=True)
                ups[name].settle()
    finally:
        for up in ups.values():
            up.stop()
    return {"configs": {name: {"args": [*COMMON, *args], "cores": cores, "pinned": ups[name].pinned}
                        for name, (args, cores) in DECODES.items()}, "runs": runs}


def pull_round(up: Up, prefix: str, sz: Sizes) -> dict:
    """A's request computes ``prefix`` and keeps decoding; the revisit goes to B, pulls or recomputes."""
    with Client(up.gateway, timeout_s=600) as client:
        busy = Stream(client, prefix + QUESTIONS[0], sz.busy_tokens)
        reading = threading.Thread(target=busy.read)
        reading.start()
        try:
            wait_until(lambda: len(busy.times) >= 4, 300, "4 tokens of A's request")  # its prefix committed
            pools0, before = up.pools(), up.transfers()
            revisit = Stream(client, prefix + QUESTIONS[1], 4).read()
            pools1, after = up.pools(), up.transfers()
        finally:
            busy.stream.cancel()
            reading.join()
    settled = up.settle()
    grew = {w: (p["num_used_pages"] + p["num_cached_pages"]) - (pools0[w]["num_used_pages"]
                                                                 + pools0[w]["num_cached_pages"])
            for w, p in pools1.items()}
    busy_worker = next((w for w, p in pools0.items() if p["num_requests"]), None)
    revisit_worker = max(grew, key=grew.get)
    return {"busy_ttft_s": busy.times[0] - busy.sent, "busy_worker": busy_worker, "revisit_worker": revisit_worker,
            "pages_grown": grew, "revisit": revisit.summary(revisit.sent), "transfers": delta(after, before),
            "settled": settled, "load_avg_1min": os.getloadavg()[0]}


def pull_section(sz: Sizes, texts: Texts, log_dir: Path) -> dict:
    penalty = ["--workers", "2", "--load-penalty-pages", str(sz.load_penalty_pages)]
    stacks = {name: ([*penalty, *args], BOTH_CORES) for name, args in PULLS.items()}
    ups = start(stacks, log_dir, texts)
    rounds: list[dict] = []
    try:
        for r in range(sz.pull_rounds + 1):
            prefix = texts.take(sz.prefix_tokens)
            order = list(PULLS) if r % 2 == 0 else list(PULLS)[::-1]
            for name in order:
                rounds.append({"config": name, "round": r, **pull_round(ups[name], prefix, sz)})
                print(f"[{time.strftime('%X')}] pull: {disagg_output.pull_line(rounds[-1])}", flush=True)
    finally:
        for up in ups.values():
            up.stop()
    return {"configs": {name: {"args": [*COMMON, *args], "cores": BOTH_CORES, "pinned": ups[name].pinned}
                        for name, (args, _) in stacks.items()}, "rounds": rounds}


def command(argv: list[str]) -> str:
    """The run's command line, less the options that name this machine's paths."""
    kept = [a for i, a in enumerate(argv) if a not in ("--keep-logs", "--out")
            and (i == 0 or argv[i - 1] not in ("--keep-logs", "--out"))]
    return " ".join(["python bench/bench_disagg.py", *kept])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small version of both sections (a smoke run)")
    p.add_argument("--sections", default="decodes,pull", help="comma-separated subset of decodes,pull")
    p.add_argument("--rounds", type=int, default=None, help="decodes: runs of each configuration")
    p.add_argument("--pull-rounds", type=int, default=None, help="pull: measured rounds, after round 0")
    p.add_argument("--keep-logs", type=Path, help="keep the stacks' logs and data here (default: a temporary dir)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the stacks stop in the finally blocks
    sz = QUICK if args.quick else Sizes()
    sz = dataclasses.replace(sz, **{k: v for k, v in (("rounds", args.rounds), ("pull_rounds", args.pull_rounds))
                                    if v is not None})
    model_dir = prepare_default_model(progress=False)
    texts = Texts(Tokenizer(model_dir), hf.corpus_token_ids(model_dir))
    sections = set(args.sections.split(","))
    name = "disagg-quick" if args.quick else "disagg"
    report = {"date": str(dt.date.today()), "quick": args.quick, "command": command(argv or sys.argv[1:]),
              "kvserve": kvserve_commit(), "sizes": dataclasses.asdict(sz), "common_args": COMMON,
              "load_avg_1min_start": os.getloadavg()[0]}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = args.keep_logs or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        if "decodes" in sections:
            report["decodes"] = decodes_section(sz, texts, log_dir / "decodes")
        if "pull" in sections:
            report["pull"] = pull_section(sz, texts, log_dir / "pull")
    report["wall_s"] = time.monotonic() - t0
    disagg_output.summarise(report)
    out = write_results(report, name, disagg_output.markdown(report),
                        args.out or RESULTS_DIR / f"{name}-{report['date']}.json")
    if report.get("decodes"):
        disagg_output.plot(report, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
