"""Issue 38's acceptance run: the shared KV tier on vs off, side by side in one run.

    python bench/bench_tiered.py [--rounds 3] [--sections multi,int8,burst,restarts]    # make bench-tiered

Stacks of the default model on CPU, each with one worker whose pool holds about two conversations
(--num-pages 192: two ~1,250-token prompts fit, three do not), driven through the OpenAI HTTP API with the official
openai client (chat completions, streamed, temperature 0, 16 new tokens, usage with cached_tokens):

  multi    8 conversations, each a distinct ~1,200-token document and a question, revisited round-robin over 3
           rounds, each revisit appending the previous answer and a new question as a chat does. Two `kvserve up`
           stacks run at once, tier on (--kv-store-bytes 2GiB) and off (0); every request goes to both, the order
           alternating. Per request: TTFT, and the prompt tokens served by the pool, by the store (the per-request
           deltas of the kvmanager's prefix_cache_hits and store_hits) and computed; the greedy answers of the two
           stacks compared. float32 pages; `int8` the same with --kv-cache-dtype int8. The tier's load rate (its
           loaded bytes / load seconds, as workers report them) beside the break-even: bytes per token x the
           prefill tokens/s the first visits measured.
  burst    the report's mixed burst (24 requests, prompts of 32-512 tokens, 16-128 new tokens) on a tier-on and
           a tier-off stack of 2048 pages, alternated over rounds, a new burst (seed 1, 2, ...) each round so that
           the tier-on stack writes every round: output tok/s.
  restarts tier on. (a) KV store, kvmanager, worker and gateway as separate processes: the 8 conversations
           written, the worker killed with SIGKILL and started again (a new epoch, an empty pool), every
           conversation revisited; then (b') all four stopped with SIGTERM and started again on their data, every
           conversation revisited. (b) the float32 multi run's tier-on `kvserve up` stopped with SIGTERM and
           started on the same --data-dir, every conversation revisited.

Writes bench/results/tiered-<date>.json, .md and .png (bench/tiered_output.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).parent))
import bench_gateway as bg  # noqa: E402
import bench_http as bh  # noqa: E402
import hf_reference as hf  # noqa: E402
import tiered_output  # noqa: E402
from chaos_procs import Processes  # noqa: E402
from results_io import RESULTS_DIR, write_results  # noqa: E402

from kvserve.common.channels import kvmanager_channel  # noqa: E402
from kvserve.common.embedded_redis import EmbeddedRedis  # noqa: E402
from kvserve.common.processes import die_with_parent  # noqa: E402
from kvserve.common.tokenizer import Tokenizer  # noqa: E402
from kvserve.services.model_store import prepare_default_model  # noqa: E402
from kvserve.v1 import kvmanager_pb2, kvmanager_pb2_grpc  # noqa: E402

UP_READY = re.compile(r"^kvserve up ready: gateway on \S+, OpenAI API at (?P<http>\S+) \(kvmanager (?P<kvm>[^\s,]+),")
GATEWAY_HTTP = re.compile(r"\(HTTP (?P<http>[^\s,]+),")
STORE_BYTES = "2GiB"
BURST_PAGES = 2048
MAX_TOKENS = 16
REPORT_S = 6.0  # a worker reports its load and write counters at most every 5 s
ADMIN_TOKEN = "bench-tiered-admin-token"
QUESTIONS = ("What is this text about?", "Which function or class does it describe first?",
             "Name one argument or parameter it mentions.", "What does it return or produce?",
             "Summarise it in one sentence.", "Does it give a warning or a caveat?")
# The KV store as `kvserve up` means to run it (no AOF, an RDB at stop, an LRU backstop), for the separate stack.
OWN_STORE_ARGS = ("--appendonly", "no", "--save", "3600", "1", "--maxmemory", str(3 << 30),
                  "--maxmemory-policy", "allkeys-lru")


@dataclass
class Target:
    """One stack as the run talks to it: the OpenAI API and the kvmanager's admin Stats."""

    name: str
    http: str
    kvmanager: str
    token: str
    client: openai.OpenAI = field(init=False)

    def __post_init__(self):
        self.client = openai.OpenAI(base_url=self.http, api_key="none", max_retries=0, timeout=600)

    def stats(self) -> kvmanager_pb2.ClusterStats:
        with kvmanager_channel(self.kvmanager) as channel:
            return kvmanager_pb2_grpc.KVAdminServiceStub(channel).Stats(
                kvmanager_pb2.StatsRequest(), timeout=10, metadata=[("authorization", f"Bearer {self.token}")])

    def hits(self) -> tuple[int, int]:
        """(prompt tokens served from cache, of those from the store), all tenants, since the kvmanager started."""
        s = self.stats()
        return s.prefix_cache_hits, sum(t.store_hits for t in s.tenants)

    def store(self) -> dict:
        kv = self.stats().kv_store
        return {f.name: getattr(kv, f.name) for f in kv.DESCRIPTOR.fields}

    def bytes_per_token(self) -> float:
        pool = self.stats().pools[0]
        return pool.pool_bytes / (pool.num_pages * pool.page_size)


class UpStack:
    """`kvserve up` on free ports with its data in ``data_dir`` (kept across stop and start); stderr in log_dir."""

    def __init__(self, name: str, data_dir: Path, args: list[str], log_dir: Path):
        self.name, self.data_dir, self.args, self.log_dir = name, data_dir, args, log_dir
        self.proc: subprocess.Popen | None = None
        self.num_starts = 0

    def spawn(self) -> UpStack:
        self.num_starts += 1
        self.log = self.log_dir / f"up-{self.name}-{self.num_starts}.log"
        argv = [sys.executable, "-m", "kvserve.services.cli", "up", "--port", "0", "--kvmanager-port", "0",
                "--http-port", "0", "--data-dir", str(self.data_dir), *self.args]
        with self.log.open("w") as stderr:
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL,
                                         text=True, preexec_fn=die_with_parent)
        return self

    def ready(self) -> Target:
        m = UP_READY.match(self.proc.stdout.readline())
        if not m:
            self.proc.kill()
            raise RuntimeError(f"kvserve up ({self.name}) did not start:\n{self.log.read_text()[-3000:]}")
        return Target(self.name, m["http"], m["kvm"], (self.data_dir / "admin_token").read_text().strip())

    def stop(self) -> None:
        """SIGTERM (up stops gateway, workers, kvmanager and its Redis in order), SIGKILL after 120 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class OwnStack:
    """KV store, kvmanager, one worker and the gateway as separate processes (bench/chaos_procs.py), tier on, so
    that the worker alone can be killed."""

    def __init__(self, procs: Processes, data_dir: Path, num_pages: int):
        self.procs, self.data_dir, self.num_pages = procs, data_dir, num_pages
        self.kv_store = EmbeddedRedis(data_dir / "kv-store", args=OWN_STORE_ARGS)

    def start(self) -> Target:
        self.kv_store.start()  # the same port again on a restart
        store = ["--kv-store-url", self.kv_store.url]
        self.kvmanager = self.procs.start("kvmanager", [
            "kvmanager", "--host", "127.0.0.1", "--port", "0", "--data-dir", str(self.data_dir / "kvmanager"),
            "--admin-token", ADMIN_TOKEN, *store, "--kv-store-bytes", STORE_BYTES])
        self.start_worker()
        self.gateway = self.procs.start("gateway", ["gateway", "--host", "127.0.0.1", "--port", "0", "--http-port",
                                                    "0", "--kvmanager", self.kvmanager.address])
        http = GATEWAY_HTTP.search(self.gateway.ready_line)["http"]
        return Target("own", http, self.kvmanager.address, ADMIN_TOKEN)

    def start_worker(self) -> None:
        self.worker = self.procs.start("worker-0", [
            "worker", "--host", "127.0.0.1", "--port", "0", "--worker-id", "worker-0", "--num-pages",
            str(self.num_pages), "--kvmanager", self.kvmanager.address, "--kv-store-url", self.kv_store.url])

    def stop(self) -> None:
        for service in (self.gateway, self.worker, self.kvmanager):  # each SIGTERM, then SIGKILL to its group
            service.stop()
        self.kv_store.stop()  # SIGTERM: its RDB is saved


@dataclass
class Conversation:
    doc: str
    messages: list[dict] = field(default_factory=list)

    def ask(self, round_: int) -> list[dict]:
        question = QUESTIONS[round_ % len(QUESTIONS)]
        self.messages.append({"role": "user", "content": f"{self.doc}\n\n{question}" if not self.messages
                              else question})
        return self.messages

    def answer(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})


def ask(target: Target, model: str, messages: list[dict], max_tokens: int = MAX_TOKENS) -> dict:
    """One streamed chat completion: TTFT (to the first token's chunk, not the role chunk), text and usage."""
    t0 = time.perf_counter()
    first, parts, usage = None, [], None
    for chunk in target.client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                       temperature=0, stream=True,
                                                       stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.role is None:
            first = first or time.perf_counter()
            parts.append(chunk.choices[0].delta.content or "")
        usage = chunk.usage or usage
    details = usage.prompt_tokens_details
    return {"ttft_s": first - t0, "total_s": time.perf_counter() - t0, "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": details.cached_tokens if details else 0,
            "completion_tokens": usage.completion_tokens, "text": "".join(parts)}


def settle(target: Target, poll_s: float = 0.3, limit_s: float = 5.0) -> None:
    """Waits until the store's index stops growing (the last request's writes landed), at most ``limit_s``."""
    deadline, last = time.monotonic() + limit_s, -1
    while time.monotonic() < deadline:
        kv = target.stats().kv_store
        if not kv.capacity_bytes or kv.num_blocks == last:
            return
        last = kv.num_blocks
        time.sleep(poll_s)  # polling a condition under a deadline


def visit(target: Target, model: str, conv: Conversation, round_: int) -> dict:
    """Sends the conversation's next turn; its figures, with the prompt tokens loaded from the store and hit in
    the pool. The kvmanager counts a store hit when it allocates (``kvmanager_store_hits``); a request whose load
    then fails is recomputed with its pool hits only, so usage's cached_tokens, below that count, says so."""
    hits0, store0 = target.hits()
    turn = ask(target, model, conv.ask(round_))
    hits1, store1 = target.hits()
    conv.answer(turn["text"])
    settle(target)
    counted, cached = store1 - store0, turn["cached_tokens"]
    loaded = counted if cached >= counted else 0
    return {"round": round_, **turn, "store_tokens": loaded, "pool_tokens": cached - loaded,
            "failed_load": loaded < counted, "kvmanager_store_hits": counted, "kvmanager_hits": hits1 - hits0}


def warm_up(target: Target, model: str, limit_s: float = 180.0) -> None:
    """A short request, retried until the stack answers (a restarted worker must first rejoin)."""
    deadline = time.monotonic() + limit_s
    while True:
        try:
            ask(target, model, [{"role": "user", "content": "Hello!"}], 4)
            return
        except openai.APIError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)  # polling a condition under a deadline


def revisit_all(target: Target, model: str, convs: list[Conversation], round_: int) -> list[dict]:
    turns = [{"conversation": c, **visit(target, model, conv, round_)} for c, conv in enumerate(convs)]
    print(f"  round {round_} on {target.name}: revisit TTFT median "
          f"{statistics.median(t['ttft_s'] for t in turns):.2f} s", flush=True)
    return turns


def multi_turn(args, docs: list[str], model: str, dtype: str, log_dir: Path) -> tuple[dict, UpStack, dict]:
    """Tier off and on at once, every turn to both (order alternating). Returns the figures, and the tier-on stack
    (still running) with its conversations for the stack restart."""
    common = ["--num-pages", str(args.num_pages), "--kv-cache-dtype", dtype]
    stacks = {m: UpStack(f"{dtype}-{m}", log_dir / f"data-{dtype}-{m}", common + ["--kv-store-bytes", b], log_dir)
              for m, b in (("off", "0"), ("on", STORE_BYTES))}
    for s in stacks.values():  # both load the model at once
        s.spawn()
    targets = {m: s.ready() for m, s in stacks.items()}
    convs = {m: [Conversation(d) for d in docs] for m in stacks}
    for t in targets.values():
        warm_up(t, model)
    turns: dict[str, list] = {"off": [], "on": []}
    for r in range(args.rounds + 1):
        for c in range(len(docs)):
            for m in (("off", "on") if (r * len(docs) + c) % 2 == 0 else ("on", "off")):
                turns[m].append({"conversation": c, **visit(targets[m], model, convs[m][c], r)})
        medians = {m: statistics.median(t["ttft_s"] for t in turns[m][-len(docs):]) for m in turns}
        print(f"  {dtype} round {r}: TTFT median off {medians['off']:.2f} s, on {medians['on']:.2f} s", flush=True)
    time.sleep(REPORT_S)
    result = {"dtype": dtype, "turns": turns, "kv_store": {m: t.store() for m, t in targets.items()},
              "bytes_per_token": targets["on"].bytes_per_token()}
    stacks["off"].stop()
    return result, stacks["on"], {"target": targets["on"], "convs": convs["on"], "next_round": args.rounds + 1}


def stack_restart(stack: UpStack, model: str, state: dict) -> dict:
    """(b): `kvserve up` stopped with SIGTERM and started on the same --data-dir; every conversation revisited."""
    print("restart (b): kvserve up stopped and started on its data dir", flush=True)
    stack.stop()
    target = stack.spawn().ready()
    warm_up(target, model)
    turns = revisit_all(target, model, state["convs"], state["next_round"])
    time.sleep(REPORT_S)
    kv = target.store()
    stack.stop()
    return {"turns": turns, "kv_store": kv}


def own_stack_restarts(args, docs: list[str], model: str, log_dir: Path) -> dict:
    """(a) the worker killed with SIGKILL and restarted, then (b') every process stopped and started again."""
    print("restarts (a), (b'): separate processes", flush=True)
    with Processes(log_dir / "own") as procs:
        stack = OwnStack(procs, log_dir / "data-own", args.num_pages)
        target = stack.start()
        warm_up(target, model)
        convs = [Conversation(d) for d in docs]
        written = revisit_all(target, model, convs, 0)
        stack.worker.kill9()
        stack.start_worker()
        warm_up(target, model)
        after_kill = revisit_all(target, model, convs, 1)
        time.sleep(REPORT_S)
        kv_kill = target.store()
        stack.stop()
        target = stack.start()
        warm_up(target, model)
        after_stop = revisit_all(target, model, convs, 2)
        time.sleep(REPORT_S)
        kv_stop = target.store()
        stack.stop()
    return {"first_visits": written, "worker_kill9": {"turns": after_kill, "kv_store": kv_kill},
            "stack_restart_own_store": {"turns": after_stop, "kv_store": kv_stop}}


def burst(args, tok: Tokenizer, model: str, model_dir: Path, log_dir: Path) -> dict:
    """The mixed burst, tier off vs on, alternated; a new burst (seed r + 1) every round."""
    corpus = hf.corpus_token_ids(model_dir)
    stacks = {m: UpStack(f"burst-{m}", log_dir / f"data-burst-{m}", ["--num-pages", str(BURST_PAGES),
                                                                      "--kv-store-bytes", b], log_dir)
              for m, b in (("off", "0"), ("on", STORE_BYTES))}
    for s in stacks.values():
        s.spawn()
    targets = {m: s.ready() for m, s in stacks.items()}
    warm, _ = bg.as_text(tok, hf.make_workload(2, seed=0, corpus=corpus, max_new=16))
    for t in targets.values():
        bh.http_burst(t.http, model, warm)
    rounds = []
    for r in range(args.burst_rounds):
        jobs, _ = bg.as_text(tok, hf.make_workload(24, seed=r + 1, corpus=corpus, max_new=128))
        out = {}
        for m in (("off", "on") if r % 2 == 0 else ("on", "off")):
            out[m] = bh.http_burst(targets[m].http, model, jobs)
            settle(targets[m])
        rounds.append({"seed": r + 1, "off_tok_s": out["off"]["tokens_per_s"], "on_tok_s": out["on"]["tokens_per_s"],
                       "ratio": out["on"]["tokens_per_s"] / out["off"]["tokens_per_s"], **out})
        print(f"  burst round {r + 1}: off {rounds[-1]['off_tok_s']:.1f} tok/s, on {rounds[-1]['on_tok_s']:.1f} tok/s, "
              f"{rounds[-1]['ratio']:.3f}x", flush=True)
    time.sleep(REPORT_S)
    kv = targets["on"].store()
    for s in stacks.values():
        s.stop()
    return {"num_requests": 24, "num_pages": BURST_PAGES, "rounds": rounds, "kv_store_on": kv}


def command(argv: list[str]) -> str:
    """The run's command line, less the options that name this machine's paths."""
    kept = [a for i, a in enumerate(argv) if a not in ("--keep-logs", "--out")
            and (i == 0 or argv[i - 1] not in ("--keep-logs", "--out"))]
    return " ".join(["python bench/bench_tiered.py", *kept])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--doc-tokens", type=int, default=1200)
    p.add_argument("--rounds", type=int, default=3, help="revisit rounds after the first visits")
    p.add_argument("--num-pages", type=int, default=192, help="pages of the multi-turn and restart workers' pools")
    p.add_argument("--burst-rounds", type=int, default=4)
    p.add_argument("--sections", default="multi,int8,burst,restarts")
    p.add_argument("--keep-logs", type=Path, help="keep the stacks' logs and data here (default: a temporary dir)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    sections = set(args.sections.split(","))
    model_dir = prepare_default_model(progress=False)
    tok, model = Tokenizer(model_dir), model_dir.name
    corpus = hf.corpus_token_ids(model_dir)
    docs = [tok.decode(corpus[i * args.doc_tokens:(i + 1) * args.doc_tokens]) for i in range(args.conversations)]
    report = {"date": str(dt.date.today()), "command": command(argv or sys.argv[1:]),
              "config": {"conversations": args.conversations, "doc_tokens": args.doc_tokens, "rounds": args.rounds,
                         "num_pages": args.num_pages, "page_size": 16, "max_tokens": MAX_TOKENS,
                         "kv_store_bytes": STORE_BYTES, "burst_rounds": args.burst_rounds},
              "multi_turn": {}, "restarts": {}}
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = args.keep_logs or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        for dtype in [d for d, s in (("float32", "multi"), ("int8", "int8")) if s in sections]:
            print(f"multi-turn, {dtype} pages: tier off and on", flush=True)
            result, on_stack, state = multi_turn(args, docs, model, dtype, log_dir)
            report["multi_turn"][dtype] = result
            if dtype == "float32" and "restarts" in sections:
                report["restarts"]["stack_restart"] = stack_restart(on_stack, model, state)
            on_stack.stop()
        if "burst" in sections:
            print("mixed burst: tier off and on, alternated", flush=True)
            report["burst"] = burst(args, tok, model, model_dir, log_dir)
        if "restarts" in sections:
            report["restarts"].update(own_stack_restarts(args, docs, model, log_dir))
        report["wall_s"] = time.monotonic() - t0
    out = args.out or RESULTS_DIR / f"tiered-{report['date']}.json"
    tiered_output.summarise(report)
    write_results(report, "tiered", tiered_output.markdown(report, out.with_suffix(".png").name), out)
    tiered_output.plot(report, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
