"""The kvserve side of the benchmark report (bench/report.py): `kvserve up` stacks as real processes, bursts
and closed-loop clients through the SDK, the prefix-cache workload, the raw ModelRunner doing the same work,
and tracing on vs off. Plain functions; report.py runs them and puts HF transformers beside them.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent / "tests" / "support"))  # otlp_collector: the tests' OTLP sink
import hf_reference as hf  # noqa: E402

from kvserve.common.tokenizer import Tokenizer  # noqa: E402
from kvserve.common.wire.worker import StepBatch, StepItem  # noqa: E402
from kvserve.services.client import Client  # noqa: E402
from kvserve.worker.runner import ModelRunner, RunnerConfig  # noqa: E402

READY = re.compile(r"^kvserve up ready: gateway on (?P<gateway>[^\s,]+), OpenAI API at (?P<http>\S+) ")
KV_WAIT = re.compile(r"kvmanager wait ([0-9.]+)% of step time")
COMPUTE = re.compile(r"worker compute ([0-9.]+)%")
CALLS = re.compile(r"stopped after ([0-9]+) steps;.* a call in ([0-9]+) steps")
OVERLAPPED = re.compile(r"a call in ([0-9]+) steps, ([0-9]+) of them overlapped")
PAGE_SIZE = 16


@contextmanager
def stack(*args: str, env: dict[str, str] | None = None):
    """`kvserve up` on free ports in a temporary data dir; yields (gateway address, stats dict filled at stop,
    holding the OpenAI API's base URL as "http" from the start)."""
    with tempfile.TemporaryDirectory() as tmp:
        err = Path(tmp) / "up.stderr"
        with err.open("w") as stderr:
            proc = subprocess.Popen([sys.executable, "-m", "kvserve.services.cli", "up", "--port", "0",
                                     "--kvmanager-port", "0", "--http-port", "0", "--data-dir", f"{tmp}/data", *args],
                                    stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
        match = READY.match(proc.stdout.readline())
        if not match:
            proc.kill()
            raise RuntimeError(f"kvserve up did not start:\n{err.read_text()}")
        stats: dict = {"http": match["http"]}
        try:
            yield match["gateway"], stats
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
            log = err.read_text()
            for key, pattern in (("kv_wait_share_pct", KV_WAIT), ("compute_share_pct", COMPUTE)):
                shares = [float(m) for m in pattern.findall(log)]
                stats[key] = statistics.mean(shares) if shares else None
            counts = [(int(steps), int(calls)) for steps, calls in CALLS.findall(log)]
            num_steps = sum(steps for steps, _ in counts)
            stats["kv_call_share_pct"] = 100 * sum(calls for _, calls in counts) / num_steps if num_steps else None
            overlapped = [(int(calls), int(over)) for calls, over in OVERLAPPED.findall(log)]
            num_calls = sum(calls for calls, _ in overlapped)
            stats["kv_calls_overlapped_pct"] = (100 * sum(over for _, over in overlapped) / num_calls
                                                if num_calls else None)


def stream_one(client: Client, text: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    times, usage = [], None
    for delta in client.generate(prompt=text, max_tokens=max_tokens, ignore_eos=True):
        times += [time.perf_counter()] * len(delta.token_ids)
        usage = delta.usage or usage
    ttft = times[0] - t0
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return {"tokens": len(times), "ttft_s": ttft, "tpot_s": tpot, "cached_tokens": usage.cached_tokens}


def kvserve_burst(address: str, jobs: list[tuple[str, int]]) -> dict:
    """Every job at once; generated tokens / wall time, and per-request TTFT and TPOT."""
    with Client(address, timeout_s=3600) as client, cf.ThreadPoolExecutor(len(jobs)) as pool:
        t0 = time.perf_counter()
        results = list(pool.map(lambda j: stream_one(client, *j), jobs))
        wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    return {"generated_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_s": statistics.median(r["ttft_s"] for r in results),
            "tpot_p50_s": statistics.median(r["tpot_s"] for r in results)}


def as_text(tok: Tokenizer, work: list[hf.Workitem]) -> tuple[list[tuple[str, int]], list[hf.Workitem]]:
    """The workload as text for the gateway, and re-tokenised for HF, so both sides see the same tokens."""
    texts = [(tok.decode(list(w.prompt_ids)), w.max_new_tokens) for w in work]
    return texts, [hf.Workitem(tuple(tok.encode(t)), n) for t, n in texts]


def raw_runner(model_dir: Path, work: list[hf.Workitem], max_step_tokens: int = 2048,
               runner: ModelRunner | None = None) -> dict:
    """The same requests through ModelRunner.step in-process: prefill in chunks, then batched decode steps.
    ``runner`` must have pages_for(work) pages; by default one is made."""
    pages = pages_for(work) // len(work)
    runner = runner or ModelRunner(RunnerConfig(model_dir=model_dir, num_pages=pages_for(work), page_size=PAGE_SIZE,
                                                device="cpu", dtype="float32"))
    tables = [tuple(range(i * pages, (i + 1) * pages)) for i in range(len(work))]
    t0 = time.perf_counter()
    last = {}
    for i, w in enumerate(work):  # prefill, one request per step (its chunks), sampling its first token
        for start in range(0, len(w.prompt_ids), max_step_tokens):
            chunk = w.prompt_ids[start:start + max_step_tokens]
            sample = start + len(chunk) == len(w.prompt_ids)
            out = runner.step(StepBatch((StepItem(f"r{i}", chunk, start, tables[i], sample=sample),)))
        last[i] = out.sampled[0].token_id
    generated = len(work)
    for step in range(1, max(w.max_new_tokens for w in work)):
        live = [i for i, w in enumerate(work) if step < w.max_new_tokens]
        items = tuple(StepItem(f"r{i}", (last[i],), len(work[i].prompt_ids) + step - 1, tables[i]) for i in live)
        for s in runner.step(StepBatch(items)).sampled:
            last[int(s.req_id[1:])] = s.token_id
        generated += len(live)
    wall = time.perf_counter() - t0
    return {"generated_tokens": generated, "wall_s": wall, "tokens_per_s": generated / wall}


def pages_for(work: list[hf.Workitem]) -> int:
    """Pages raw_runner needs: every request gets room for the longest one."""
    longest = max(len(w.prompt_ids) + w.max_new_tokens for w in work)
    return -(-longest // PAGE_SIZE) * len(work)


def prefix_workload(tok: Tokenizer, corpus: list[int], system_tokens: int, num_users: int) -> list[str]:
    system = tok.decode(corpus[:system_tokens])
    return [f"{system}\n\nUser {i}: please summarise point {i} of the text above.\nAssistant:"
            for i in range(num_users)]


def kvserve_prefix(address: str, prompts: list[str]) -> dict:
    with Client(address, timeout_s=600) as client:
        stream_one(client, "warm up", 2)
        runs = [stream_one(client, p, 4) for p in prompts]
    rest = [r["ttft_s"] for r in runs[1:]]
    return {"ttft_first_s": runs[0]["ttft_s"], "ttft_rest_mean_s": statistics.mean(rest),
            "rest_over_first": statistics.mean(rest) / runs[0]["ttft_s"],
            "cached_tokens_rest_mean": statistics.mean(r["cached_tokens"] for r in runs[1:])}


def hf_prefix(model, tok: Tokenizer, prompts: list[str]) -> dict:
    ttfts = [hf.hf_ttft_s(model, tok.encode(p)) for p in prompts]
    return {"ttft_first_s": ttfts[0], "ttft_rest_mean_s": statistics.mean(ttfts[1:]),
            "rest_over_first": statistics.mean(ttfts[1:]) / ttfts[0]}


def tracing_overhead(jobs: list[tuple[str, int]], rounds: int) -> dict:
    """The same burst on two identical stacks, tracing off (no SDK) and on (OTLP to a local collector),
    alternated; medians of tokens/s. Also the cost of the gateway's tracing hooks per request when off."""
    from otlp_collector import OtlpCollector

    off, on = [], []
    with OtlpCollector() as collector:
        env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint}  # the SDK's default batching
        with stack("--num-pages", "1024") as (gw_off, _), stack("--num-pages", "1024", env=env) as (gw_on, _):
            kvserve_burst(gw_off, jobs[:2]), kvserve_burst(gw_on, jobs[:2])  # warm-up
            for _ in range(rounds):
                off.append(kvserve_burst(gw_off, jobs)["tokens_per_s"])
                on.append(kvserve_burst(gw_on, jobs)["tokens_per_s"])
        num_spans = len(collector.spans())
    off_s, on_s = statistics.median(off), statistics.median(on)
    return {"off_tokens_per_s": off_s, "on_tokens_per_s": on_s, "on_over_off": on_s / off_s, "rounds": rounds,
            "spans_exported": num_spans, "off_hooks_us_per_request": _noop_hooks_us()}


def _noop_hooks_us(n: int = 20000) -> float:
    """Microseconds per request of the gateway's span and metric hooks with no SDK and no metrics."""
    from kvserve.services.gateway.observe import Observer
    from kvserve.services.gateway.request import Request, RequestParams

    observer, req = Observer(), Request("r", "t", [1, 2, 3], RequestParams(max_tokens=4))
    req.first_token_s = req.last_token_s = req.arrival_s
    t0 = time.perf_counter()
    for _ in range(n):
        observer.started(req, None)
        observer.admitted(req, "w")
        observer.first_token(req)
        observer.finished(req)
    return (time.perf_counter() - t0) / n * 1e6


def strip_outputs(result: dict) -> dict:
    """An HF result without its token lists (kept out of the JSON)."""
    return {k: v for k, v in result.items() if k != "outputs"}
