"""Quantised KV cache vs float32, side by side in one run: quality, memory, concurrency and speed.

    python bench/bench_kvquant.py [--quick] [--attention-backend auto|cpu|reference]     # make bench-kvquant

Every row is measured in the same run as float32, on the same text and prompts:

  quality      perplexity of a held text (Debian's /usr/share/common-licenses/GPL-3, its first 4,096 tokens),
               prefilled through the pool in 512-token chunks so that attention reads the stored (quantised) K/V
               of every earlier chunk; teacher-forced, every position's logits. The mean KL divergence of each
               position's next-token distribution from float32's, and how often their argmax agrees. Greedy
               agreement with float32 over 64 chat prompts x 128 new tokens (each asks to explain one 48-token
               slice of /usr/share/common-licenses/Apache-2.0; the slices evenly spaced over the text).
  memory       bytes per token and tokens per 512 MiB pool: the calculator (kvserve kv-mem) vs the worker's
               real tensors (kv_cache + kv_scales nbytes), every dtype and scale scheme
  concurrency  `kvserve up --kv-cache-bytes X --kv-cache-dtype D`, X sized to fit 3 float32 requests of 2,000
               tokens; two more such requests at once than the calculator says fit (~1,990 prompt tokens + the
               rest generated); the peak number running together and the preemptions, from the gateway's
               Prometheus metrics
  decode       tok/s of batch-16 decode steps at contexts of 1k, 2k and 4k tokens, float32 vs int8 vs fp8_e4m3:
               one 4k prompt prefilled per dtype, its pages copied to the other 15 sequences' own pages (so a
               step reads 16 x context of K/V); medians of repeats interleaved across dtypes
  burst        the mixed burst of `make bench` (24 requests) through `kvserve up` per dtype, alternated

Writes bench/results/kvquant-<date>.json (kvquant-quick-<date> with --quick) and the Markdown table beside it.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime as dt
import gc
import hashlib
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_gateway as bg  # noqa: E402
import hf_reference as hf  # noqa: E402
from decode_steps import Decode  # noqa: E402
from results_io import write_results  # noqa: E402

from kvserve.common.kvmem import get_dtype, per_token  # noqa: E402
from kvserve.common.kvmem_models import load_hf_config  # noqa: E402
from kvserve.common.tokenizer import Tokenizer  # noqa: E402
from kvserve.common.wire.worker import StepBatch, StepItem  # noqa: E402
from kvserve.kernels.paged_attention import build_metadata  # noqa: E402
from kvserve.services.client import Client  # noqa: E402
from kvserve.services.model_store import prepare_default_model  # noqa: E402
from kvserve.worker.runner import ModelRunner, RunnerConfig  # noqa: E402

PAGE_SIZE = 16
MIB = 1 << 20
HELD_TEXT = Path("/usr/share/common-licenses/GPL-3")
PROMPT_TEXT = Path("/usr/share/common-licenses/Apache-2.0")
PROMPT_SLICE_TOKENS = 48
QUESTION = "Explain in plain words what this part of a software licence says:\n\n"
ONE_BYTE = ("int8", "fp8_e4m3", "fp8_e5m2")
QUALITY = (("float32", ""),) + tuple((d, s) for d in ("int8", "fp8_e4m3", "fp8_e5m2") for s in ("token_head", "tensor"))
MEMORY_ONLY = (("bfloat16", ""), ("float16", ""))  # the cpu backend reads neither: their pools are only measured
PPL_TARGETS = {("int8", "token_head"), ("fp8_e4m3", "token_head")}  # within 1% of float32's perplexity
PPL_TOLERANCE = 0.01
CONCURRENCY_TARGET = 3.5  # x float32's requests, for each 1-byte dtype
DECODE_TARGET = 1.3  # x float32's tok/s at the longest context
DECODE_DTYPES = ("float32", "int8", "fp8_e4m3")
UP_READY = re.compile(r"^kvserve up ready: gateway on (?P<gateway>\S+) .*metrics on (?P<metrics>[^\s,;)]+)")
RUNNING = re.compile(r"^kvserve:num_requests_running\{[^}]*\} (\S+)$", re.M)
PREEMPTIONS = re.compile(r"^kvserve:num_preemptions_total (\S+)$", re.M)


@dataclass(frozen=True)
class Sizes:
    text_tokens: int = 4096  # of the held text, prefilled in `chunk`-token pieces
    chunk: int = 512
    num_prompts: int = 64
    new_tokens: int = 128
    group: int = 32  # greedy prompts decoded together (a float32 512 MiB pool holds 32 of them)
    fit_float32: int = 3  # requests of `request_tokens` the concurrency pool fits in float32
    request_tokens: int = 2000
    contexts: tuple[int, ...] = (1024, 2048, 4096)
    batch: int = 16
    decode_steps: int = 8  # per repeat; at most a page, so that every sequence writes one scratch page
    repeats: int = 3
    burst_requests: int = 24
    burst_max_new: int = 128
    burst_rounds: int = 2


QUICK = Sizes(text_tokens=1024, num_prompts=16, new_tokens=32, group=16, fit_float32=1, contexts=(256, 512),
              decode_steps=4, repeats=2, burst_requests=8, burst_max_new=32, burst_rounds=1)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def read_text(path: Path) -> tuple[str, str]:
    """(text, sha256 of its bytes); SystemExit with a clear message when the file is missing."""
    if not path.is_file():
        raise SystemExit(f"bench_kvquant: {path} is missing (Debian's base-files ships it); it is the held text "
                         f"and nothing is downloaded in its place")
    raw = path.read_bytes()
    return raw.decode(), hashlib.sha256(raw).hexdigest()


def held_text(tok: Tokenizer, num_tokens: int) -> tuple[list[int], dict]:
    text, sha = read_text(HELD_TEXT)
    ids = tok.encode(text)
    if len(ids) < num_tokens + 1:
        raise SystemExit(f"bench_kvquant: {HELD_TEXT} has {len(ids)} tokens, fewer than {num_tokens + 1}")
    return ids, {"path": str(HELD_TEXT), "sha256": sha, "tokens_in_file": len(ids), "tokens_scored": num_tokens}


def chat_prompts(tok: Tokenizer, num: int) -> tuple[list[list[int]], dict]:
    """``num`` chat prompts, each asking to explain one slice of PROMPT_TEXT; slices evenly spaced."""
    text, sha = read_text(PROMPT_TEXT)
    ids = tok.encode(text)
    span = len(ids) - PROMPT_SLICE_TOKENS
    starts = [i * span // max(1, num - 1) for i in range(num)]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION + tok.decode(
        ids[s:s + PROMPT_SLICE_TOKENS]).strip()}])) for s in starts]
    return prompts, {"path": str(PROMPT_TEXT), "sha256": sha, "num_prompts": num, "slice_tokens":
                     PROMPT_SLICE_TOKENS, "question": QUESTION.strip(), "prompt_tokens_min": min(map(len, prompts)),
                     "prompt_tokens_max": max(map(len, prompts))}


def make_runner(model_dir: Path, compute, dtype: str, scales: str, backend: str, **size) -> ModelRunner:
    """A float32 model on CPU over a pool of ``dtype`` (all runners share one compute thread: one OpenMP team)."""
    cfg = RunnerConfig(model_dir=model_dir, device="cpu", dtype="float32", page_size=PAGE_SIZE,
                       kv_cache_dtype=dtype, kv_scales=scales or "token_head", attention_backend=backend, **size)
    return ModelRunner(cfg, compute)


# -- quality -------------------------------------------------------------------------------------------------
@torch.inference_mode()
def teacher_forced(runner: ModelRunner, ids: list[int], chunk: int, ref: list[torch.Tensor] | None):
    """Prefills ``ids`` in chunks through the pool; per position, the next-token log-probs. Returns (NLL sum, KL
    sum, argmax agreements, positions scored) against ``ref`` (float32's log-prob chunks; None: float32 itself)
    and the log-prob chunks themselves when ``ref`` is None."""
    table = list(range(-(-len(ids) // PAGE_SIZE)))
    nll = kl = agree = 0.0
    own = []
    for i, start in enumerate(range(0, len(ids) - 1, chunk)):
        piece = ids[start:start + chunk]
        meta = build_metadata([start], [len(piece)], [table], PAGE_SIZE, runner.device)
        hidden = runner.model.forward(torch.tensor(piece), meta, runner.kv_cache, runner.kv_scales)
        targets = torch.tensor(ids[start + 1:start + 1 + len(piece)])
        logp = torch.log_softmax(runner.model.logits(hidden), -1)[:len(targets)]
        nll -= logp.gather(1, targets[:, None]).sum(dtype=torch.float64).item()
        if ref is None:
            own.append(logp)
        else:
            kl += (ref[i].exp() * (ref[i] - logp)).sum(dtype=torch.float64).item()
            agree += (ref[i].argmax(-1) == logp.argmax(-1)).sum().item()
    return nll, kl, agree, len(ids) - 1, own


def greedy(runner: ModelRunner, prompts: list[list[int]], new_tokens: int, group: int) -> list[list[int]]:
    """``new_tokens`` greedy tokens after each prompt through runner.step, ``group`` sequences per batch."""
    outputs = []
    for g in range(0, len(prompts), group):
        batch = prompts[g:g + group]
        pages = -(-(max(map(len, batch)) + new_tokens) // PAGE_SIZE)
        assert pages * len(batch) <= runner.info.num_pages, "the quality pool is too small for a prompt group"
        tables = [tuple(range(j * pages, (j + 1) * pages)) for j in range(len(batch))]
        items = tuple(StepItem(f"g{j}", tuple(p), 0, tables[j]) for j, p in enumerate(batch))
        out = [[s.token_id] for s in runner.step(StepBatch(items)).sampled]
        for step in range(1, new_tokens):
            items = tuple(StepItem(f"g{j}", (out[j][-1],), len(p) + step - 1, tables[j]) for j, p in enumerate(batch))
            for j, s in enumerate(runner.step(StepBatch(items)).sampled):
                out[j].append(s.token_id)
        outputs += out
    return outputs


def agreement(ours: list[list[int]], ref: list[list[int]]) -> dict:
    first = [next((i for i, (a, b) in enumerate(zip(o, r, strict=True)) if a != b), len(r))
             for o, r in zip(ours, ref, strict=True)]
    return {"greedy_exact_match": sum(o == r for o, r in zip(ours, ref, strict=True)) / len(ref),
            "greedy_mean_tokens_to_divergence": statistics.mean(first)}


def memory_row(runner: ModelRunner, spec, dtype: str, scales: str) -> dict:
    """Calculator vs the runner's real tensors, for a 512 MiB pool."""
    info = runner.info
    calc = per_token(spec, get_dtype(dtype), scales or "token_head").bytes
    real = runner.kv_cache.nbytes + (runner.kv_scales.nbytes if runner.kv_scales is not None else 0)
    slots = info.num_pages * info.page_size
    return {"kv_dtype": dtype, "kv_scales": scales, "bytes_per_token_calculator": calc,
            "bytes_per_token_worker": info.bytes_per_token, "bytes_per_token_tensors": real / slots,
            "tokens_per_512mib_calculator": 512 * MIB // (calc * PAGE_SIZE) * PAGE_SIZE,
            "tokens_per_512mib_tensors": slots, "pool_bytes_tensors": real}


def quality_and_memory(ctx: dict, sz: Sizes, backend: str) -> tuple[list[dict], list[dict]]:
    """Each configuration in its own runner (512 MiB pool), float32 first: its log-probs and continuations are
    what the others are compared with."""
    ids, prompts = ctx["held_ids"][:sz.text_tokens], ctx["prompts"]
    rows, memory, ref = [], [], {}
    for dtype, scales in QUALITY + MEMORY_ONLY:
        log(f"quality/memory: {dtype} {scales}")
        runner = make_runner(ctx["model_dir"], ctx["compute"], dtype, scales,
                             "reference" if (dtype, scales) in MEMORY_ONLY else backend, kv_cache_bytes=512 * MIB)
        memory.append(memory_row(runner, ctx["spec"], dtype, scales))
        if (dtype, scales) not in MEMORY_ONLY:
            nll, kl, agree, n, own = runner.call(teacher_forced, runner, ids, sz.chunk, ref.get("logp"))
            outs = greedy(runner, prompts, sz.new_tokens, sz.group)
            ppl = float(torch.tensor(nll / n).exp())
            ref = ref or {"logp": own, "outs": outs, "ppl": ppl}
            ratio = ppl / ref["ppl"]
            target = (dtype, scales) in PPL_TARGETS
            rows.append({"kv_dtype": dtype, "kv_scales": scales, "attention_backend": runner.info.attention_backend,
                         "positions": n, "perplexity": ppl, "ppl_over_float32": ratio, "mean_kl_nats": kl / n,
                         "top1_agreement": agree / n if dtype != "float32" else 1.0, **agreement(outs, ref["outs"]),
                         "ppl_target": f"<= {1 + PPL_TOLERANCE:.2f}x" if target else None,
                         "ppl_pass": ratio <= 1 + PPL_TOLERANCE if target else None})
        del runner
        gc.collect()
    return rows, memory


# -- decode speed --------------------------------------------------------------------------------------------
def decode_speed(ctx: dict, sz: Sizes, backend: str) -> dict:
    longest = max(sz.contexts)
    ids = ctx["held_ids"][:longest + 1]
    benches = {}
    for dtype in DECODE_DTYPES:
        log(f"decode: prefill {longest} tokens, {dtype}")
        runner = make_runner(ctx["model_dir"], ctx["compute"], dtype, "token_head" if dtype in ONE_BYTE else "",
                             backend, num_pages=sz.batch * (longest // PAGE_SIZE + 1))
        benches[dtype] = Decode(runner, ids, longest, sz.batch, sz.chunk)
    samples = {(c, d): [] for c in sz.contexts for d in DECODE_DTYPES}
    for r in range(sz.repeats + 1):  # the first round warms up
        log(f"decode: round {r} of {sz.repeats}")
        for c in sz.contexts:
            for d in DECODE_DTYPES[r % 3:] + DECODE_DTYPES[:r % 3]:
                tok_s = benches[d].run(c, sz.decode_steps)
                if r:
                    samples[(c, d)].append(tok_s)
    rows = []
    for c in sz.contexts:
        med = {d: statistics.median(samples[(c, d)]) for d in DECODE_DTYPES}
        rows.append({"context": c, **{f"{d}_tok_s": med[d] for d in DECODE_DTYPES},
                     **{f"{d}_over_float32": med[d] / med["float32"] for d in DECODE_DTYPES[1:]},
                     "samples_tok_s": {d: samples[(c, d)] for d in DECODE_DTYPES}})
    backend_name = benches["int8"].runner.info.attention_backend
    benches.clear()
    gc.collect()
    return {"batch": sz.batch, "decode_steps": sz.decode_steps, "repeats": sz.repeats, "kv_scales": "token_head",
            "attention_backend": backend_name, "rows": rows}


# -- through kvserve up --------------------------------------------------------------------------------------
@contextmanager
def metrics_stack(args: list[str], env: dict[str, str]):
    """`kvserve up` with every service's metrics on a free port; yields (gateway, gateway metrics URL)."""
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "up.stderr", "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "kvserve.services.cli", "up", "--port", "0",
                                 "--kvmanager-port", "0", "--http-port", "0", "--data-dir", f"{tmp}/data", *args],
                                stdout=subprocess.PIPE, stderr=stderr, text=True,
                                env={**env, "KVSERVE_METRICS_PORT": "0"})
        match = UP_READY.match(proc.stdout.readline())
        if not match:
            proc.kill()
            raise RuntimeError(f"kvserve up did not start:\n{(Path(tmp) / 'up.stderr').read_text()}")
        try:
            yield match["gateway"], f"http://{match['metrics']}/metrics"
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)


class PeakRunning(threading.Thread):
    """Scrapes the gateway's metrics every ``period_s``; keeps the highest kvserve:num_requests_running."""

    def __init__(self, url: str, period_s: float = 0.1):
        super().__init__(daemon=True)
        self.url, self.period_s, self.peak, self.done = url, period_s, 0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.period_s):
            self.peak = max(self.peak, int(sum(float(v) for v in RUNNING.findall(scrape(self.url)))))


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def capacity_prompts(tok: Tokenizer, corpus: list[int], num: int, request_tokens: int) -> list[tuple[str, int]]:
    """``num`` distinct prompts of request_tokens - 15 .. request_tokens - 5 tokens (as the gateway tokenises them),
    each with max_tokens making it exactly ``request_tokens``: every prompt needs all of its request's pages at
    admission, so nothing that is admitted needs a page later. Windows of ``corpus``, cut again after re-encoding
    (decoded text re-encodes to a few more tokens)."""
    prompts, width = [], request_tokens - 10
    for start in range(0, len(corpus) - width + 1, width):
        text = tok.decode(corpus[start:start + width])
        for _ in range(4):
            ids = tok.encode(text)
            if request_tokens - PAGE_SIZE + 1 <= len(ids) <= request_tokens - 5:
                prompts.append((text, request_tokens - len(ids)))
                break
            text = tok.decode(ids[:width])
        if len(prompts) == num:
            return prompts
    raise RuntimeError(f"the corpus holds only {len(prompts)} prompts of {width} tokens, not {num}")


def run_request(client: Client, text: str, max_tokens: int) -> dict:
    tokens, usage = 0, None
    for delta in client.generate(prompt=text, max_tokens=max_tokens, ignore_eos=True):
        tokens += len(delta.token_ids)
        usage = delta.usage or usage
    return {"prompt_tokens": usage.prompt_tokens, "generated_tokens": tokens}


def concurrency(ctx: dict, sz: Sizes, env: dict[str, str]) -> dict:
    """The same requests, all at once, through a stack per dtype with the same pool bytes."""
    pages_per_request = -(-sz.request_tokens // PAGE_SIZE)
    pool_bytes = sz.fit_float32 * pages_per_request * per_token(ctx["spec"], get_dtype("float32")).bytes * PAGE_SIZE

    def predicted(dtype: str) -> int:
        page_bytes = per_token(ctx["spec"], get_dtype(dtype), "token_head").bytes * PAGE_SIZE
        return pool_bytes // page_bytes // pages_per_request

    every = capacity_prompts(ctx["tok"], ctx["corpus"], max(map(predicted, ONE_BYTE)) + 2, sz.request_tokens)
    rows = []
    for dtype in ("float32",) + ONE_BYTE:
        prompts = every[:predicted(dtype) + 2]  # two more than the calculator says fit
        log(f"concurrency: {len(prompts)} requests of {sz.request_tokens} tokens, {dtype}")
        # a step budget that admits several whole prompts at once, so that admissions never wait on decodes
        args = ["--kv-cache-bytes", str(pool_bytes), "--kv-cache-dtype", dtype, "--kv-scales", "token_head",
                "--max-num-batched-tokens", "8192", "--no-prefix-caching"]
        with metrics_stack(args, env) as (gateway, metrics_url):
            poller = PeakRunning(metrics_url)
            poller.start()
            t0 = time.perf_counter()
            with Client(gateway, timeout_s=3600) as client, cf.ThreadPoolExecutor(len(prompts)) as pool:
                done = list(pool.map(lambda p: run_request(client, *p), prompts))
            wall = time.perf_counter() - t0
            poller.done.set()
            poller.join()
            preemptions = int(float(PREEMPTIONS.search(scrape(metrics_url))[1]))
        rows.append({"kv_dtype": dtype, "requests_sent": len(prompts), "predicted_requests": predicted(dtype),
                     "peak_running": poller.peak,
                     "preemptions": preemptions, "wall_s": wall,
                     "prompt_tokens": sorted({d["prompt_tokens"] for d in done}),
                     "all_generated": all(d["generated_tokens"] == m for d, (_, m) in zip(done, prompts, strict=True))})
    for row in rows:
        row["over_float32"] = row["peak_running"] / rows[0]["peak_running"]
    return {"pool_bytes": pool_bytes, "request_tokens": sz.request_tokens, "kv_scales": "token_head",
            "max_num_batched_tokens": 8192, "rows": rows}


def bursts(ctx: dict, sz: Sizes, env: dict[str, str]) -> dict:
    """make bench's mixed burst on one stack per dtype, all up at once, alternated over rounds."""
    jobs, _ = bg.as_text(ctx["tok"], hf.make_workload(sz.burst_requests, seed=1, corpus=ctx["corpus"],
                                                      max_new=sz.burst_max_new))
    dtypes = ("float32",) + ONE_BYTE
    samples: dict[str, list[float]] = {d: [] for d in dtypes}
    with ExitStack() as stacks:
        gateways = {}
        for d in dtypes:
            log(f"burst: starting a stack, {d}")
            gateways[d] = stacks.enter_context(bg.stack("--num-pages", "2048", "--kv-cache-dtype", d, env=env))[0]
            bg.kvserve_burst(gateways[d], jobs[:2])  # warm-up
        for r in range(sz.burst_rounds):
            for d in dtypes[r % 4:] + dtypes[:r % 4]:
                log(f"burst: round {r + 1} of {sz.burst_rounds}, {d}")
                samples[d].append(bg.kvserve_burst(gateways[d], jobs)["tokens_per_s"])
    med = {d: statistics.median(v) for d, v in samples.items()}
    return {"requests": len(jobs), "rounds": sz.burst_rounds, "num_pages": 2048, "kv_scales": "token_head",
            "rows": [{"kv_dtype": d, "tokens_per_s": med[d], "over_float32": med[d] / med["float32"],
                      "samples_tok_s": samples[d]} for d in dtypes]}


# -- verdicts and tables -------------------------------------------------------------------------------------
def targets(report: dict) -> list[dict]:
    """Each of the issue's targets with what this run measured, pass or fail."""
    out = [{"section": "quality", "kv_dtype": r["kv_dtype"], "target": f"perplexity, {r['kv_dtype']} "
            f"{r['kv_scales']}: within 1% of float32's", "measured": f"{r['ppl_over_float32']:.4f}x",
            "pass": r["ppl_pass"]} for r in report.get("quality", []) if r["ppl_target"]]
    if "concurrency" in report:
        c = report["concurrency"]
        clean = all(r["preemptions"] == 0 for r in c["rows"])
        f32 = c["rows"][0]["peak_running"]
        out += [{"section": "concurrency", "kv_dtype": r["kv_dtype"], "target": f"concurrent {c['request_tokens']}-"
                 f"token requests without preemption, {r['kv_dtype']}: >= {CONCURRENCY_TARGET}x float32's",
                 "measured": f"{r['peak_running']} vs {f32} ({r['over_float32']:.2f}x), {r['preemptions']} "
                 "preemptions", "pass": clean and r["over_float32"] >= CONCURRENCY_TARGET} for r in c["rows"][1:]]
    if "decode" in report:
        last = report["decode"]["rows"][-1]
        out += [{"section": "decode", "kv_dtype": d, "target": f"decode tok/s at batch {report['decode']['batch']}, "
                 f"context {last['context']}, {d}: >= {DECODE_TARGET}x float32's",
                 "measured": f"{last[f'{d}_over_float32']:.2f}x", "pass": last[f"{d}_over_float32"] >= DECODE_TARGET}
                for d in DECODE_DTYPES[1:]]
    return out


def _verdict(ok: bool | None) -> str:
    return "" if ok is None else ("pass" if ok else "**miss**")


def quality_table(report: dict) -> list[str]:
    t = report["held_text"]
    lines = [f"Quality: perplexity of the first {t['tokens_scored']:,} tokens of {Path(t['path']).name} "
             f"({report['sizes']['chunk']}-token chunks through the pool, teacher-forced), KL and argmax agreement "
             f"vs float32 at the same positions; greedy agreement over {report['prompts']['num_prompts']} chat prompts "
             f"x {report['sizes']['new_tokens']} new tokens.", "",
             "| KV dtype | scales | perplexity | vs float32 | mean KL (nats) | argmax agrees | greedy exact | "
             "tokens to 1st divergence | target |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in report["quality"]:
        target = f"{r['ppl_target']}: {_verdict(r['ppl_pass'])}" if r["ppl_target"] else ""
        lines.append(f"| {r['kv_dtype']} | {r['kv_scales'] or '-'} | {r['perplexity']:.3f} | "
                     f"{r['ppl_over_float32']:.4f}x | {r['mean_kl_nats']:.2e} | {100 * r['top1_agreement']:.1f}% | "
                     f"{100 * r['greedy_exact_match']:.0f}% | {r['greedy_mean_tokens_to_divergence']:.1f} | {target} |")
    return lines


def memory_table(report: dict) -> list[str]:
    base = report["memory"][0]["bytes_per_token_tensors"]
    lines = ["Memory: bytes per token and tokens in a 512 MiB pool, calculator vs the worker's real tensors "
             "(kv_cache + kv_scales nbytes).", "",
             "| KV dtype | scales | bytes/token, calculator | bytes/token, tensors | tokens/512 MiB, calculator | "
             "tokens/512 MiB, pool | vs float32 |", "|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['kv_dtype']} | {r['kv_scales'] or '-'} | {r['bytes_per_token_calculator']:,} | "
              f"{r['bytes_per_token_tensors']:,.0f} | {r['tokens_per_512mib_calculator']:,} | "
              f"{r['tokens_per_512mib_tensors']:,} | {base / r['bytes_per_token_tensors']:.2f}x |"
              for r in report["memory"]]
    return lines


def concurrency_table(report: dict) -> list[str]:
    c = report["concurrency"]
    lines = [f"Concurrency: requests of {c['request_tokens']:,} tokens, two more than the calculator says fit, sent "
             f"at once to `kvserve up --kv-cache-bytes {c['pool_bytes']}` (token_head scales); peak running and "
             "preemptions from the gateway's metrics.", "",
             "| KV dtype | sent | calculator: fit | peak running | preemptions | vs float32 (calculator) | target |",
             "|---|---:|---:|---:|---:|---:|---|"]
    verdicts = {t["kv_dtype"]: t["pass"] for t in report["targets"] if t["section"] == "concurrency"}
    f32 = c["rows"][0]["predicted_requests"]
    lines += [f"| {r['kv_dtype']} | {r['requests_sent']} | {r['predicted_requests']} | {r['peak_running']} | "
              f"{r['preemptions']} | "
              f"{r['over_float32']:.2f}x ({r['predicted_requests'] / f32:.2f}x) | "
              f"{_verdict(verdicts.get(r['kv_dtype']))} |" for r in c["rows"]]
    return lines


def decode_table(report: dict) -> list[str]:
    d = report["decode"]
    lines = [f"Decode: tok/s at batch {d['batch']}, {d['decode_steps']} steps per repeat, median of {d['repeats']} "
             f"interleaved repeats (token_head scales, {d['attention_backend']} backend).", "",
             "| context | float32 | int8 | fp8_e4m3 | int8 / float32 | fp8_e4m3 / float32 |",
             "|---:|---:|---:|---:|---:|---:|"]
    return lines + [f"| {r['context']:,} | {r['float32_tok_s']:.1f} | {r['int8_tok_s']:.1f} | "
                    f"{r['fp8_e4m3_tok_s']:.1f} | {r['int8_over_float32']:.2f}x | {r['fp8_e4m3_over_float32']:.2f}x |"
                    for r in d["rows"]]


def burst_table(report: dict) -> list[str]:
    b = report["burst"]
    lines = [f"Mixed burst of `make bench` ({b['requests']} requests) through `kvserve up`, tok/s, median of "
             f"{b['rounds']} alternated rounds.", "", "| KV dtype | tok/s | vs float32 |", "|---|---:|---:|"]
    return lines + [f"| {r['kv_dtype']} | {r['tokens_per_s']:.1f} | {r['over_float32']:.2f}x |" for r in b["rows"]]


def markdown(report: dict) -> str:
    parts = [f(report) for key, f in (("quality", quality_table), ("memory", memory_table),
                                      ("concurrency", concurrency_table), ("decode", decode_table),
                                      ("burst", burst_table)) if key in report]
    parts.append(["Targets:", ""] + [f"- {t['target']}: {t['measured']}, {_verdict(t['pass'])}"
                                     for t in report["targets"]])
    return "\n\n".join("\n".join(p) for p in parts if p) + "\n"


# -- main ----------------------------------------------------------------------------------------------------
SECTIONS = ("quality", "decode", "concurrency", "burst")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smaller smoke run of every section")
    p.add_argument("--attention-backend", default="auto", choices=("auto", "cpu", "reference"),
                   help="of every runner and worker (bfloat16/float16 pools, measured only, always use reference)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def context(sz: Sizes) -> dict:
    model_dir = prepare_default_model(progress=False)
    tok = Tokenizer(model_dir)
    held_ids, held = held_text(tok, max(sz.text_tokens, max(sz.contexts)))
    held["tokens_scored"] = sz.text_tokens
    prompts, prompt_meta = chat_prompts(tok, sz.num_prompts)
    return {"model_dir": model_dir, "tok": tok, "held_ids": held_ids, "held": held, "prompts": prompts,
            "prompt_meta": prompt_meta, "spec": load_hf_config(model_dir / "config.json"),
            "corpus": hf.corpus_token_ids(model_dir),
            "compute": cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvquant-compute")}


def run(args, sz: Sizes) -> dict:
    sections = [s for s in args.sections.split(",") if s]
    if unknown := set(sections) - set(SECTIONS):
        raise SystemExit(f"bench_kvquant: unknown sections {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    ctx = context(sz)
    env = dict(os.environ)
    if args.attention_backend != "auto":
        env["KVSERVE_ATTENTION_BACKEND"] = args.attention_backend  # every worker of kvserve up reads it
    report = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "quick": args.quick,
              "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                          "python": platform.python_version(), "processor": platform.processor() or platform.machine()},
              "model": ctx["model_dir"].name, "attention_backend_requested": args.attention_backend,
              "sizes": asdict(sz), "held_text": ctx["held"], "prompts": ctx["prompt_meta"], "wall_s": {},
              "load_avg_1min_after": {"start": os.getloadavg()[0]}}
    stages = {"quality": lambda: dict(zip(("quality", "memory"), quality_and_memory(ctx, sz, args.attention_backend),
                                          strict=True)),
              "decode": lambda: {"decode": decode_speed(ctx, sz, args.attention_backend)},
              "concurrency": lambda: {"concurrency": concurrency(ctx, sz, env)},
              "burst": lambda: {"burst": bursts(ctx, sz, env)}}
    for name in SECTIONS:
        if name in sections:
            t0 = time.perf_counter()
            report.update(stages[name]())
            report["wall_s"][name] = round(time.perf_counter() - t0, 1)
            report["load_avg_1min_after"][name] = os.getloadavg()[0]  # others' work on the machine shows here
            log(f"{name} done in {report['wall_s'][name]:.0f} s")
    report["targets"] = targets(report)
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sz = QUICK if args.quick else Sizes()
    t0 = time.perf_counter()
    report = run(args, sz)
    report["wall_s"]["total"] = round(time.perf_counter() - t0, 1)
    out = write_results(report, "kvquant-quick" if args.quick else "kvquant", markdown(report), args.out)
    print(f"wrote {out} and {out.with_suffix('.md')} in {report['wall_s']['total']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
