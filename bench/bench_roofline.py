"""A roofline for the CPU worker: this machine's limits, measured in the same run, and how close kvserve comes to
them per workload.

    python bench/bench_roofline.py [--quick] [--threads N] [--out FILE]          # make bench-roofline

  limits   float32 GEMM: torch.mm (MKL's sgemm) on the default model's linear shapes at 512 rows and on
           2048 x 2048, at torch's thread count (the cores, unless --threads; the stacks' workers get the same
           count, `kvserve up --worker-threads`); the best of them is the GEMM limit. Read bandwidth: a sum over
           a 1 GiB float32 tensor, far beyond the last-level cache (bench_long.read_bandwidth_gbs).
  prefill  one 512-token chunk at 0, 2k and 4k cached tokens through a ModelRunner (long_floor.steps_section):
           its multiply-adds per second against the GEMM limit.
  decode   one decode step at batch 1/16/64 and contexts 300/4k/16k through the ModelRunner's forward and
           sampling (the cpu backend) over a pool of random K/V: bytes read (weights once + every sequence's
           K/V) per second against the read bandwidth, and its floor (roofline_floor); then the decode attention
           kernel alone, one layer over a 1 GiB pool (bench_long.decode_read_rate): K/V bytes per second.
  burst    report.py's mixed burst (24 requests, seed 1, up to 128 new tokens): its floor under the raw runner's
           batching (roofline_floor.burst_steps) against its wall time through `kvserve up` (as report.py
           measures it) and through the raw runner in-process (bench_gateway.raw_runner).
  long     a 7,000-token prompt's TTFT through `kvserve up` (2,048-token steps, prefix caching off) against HF's
           generate, and its floor.

Every in-process measurement runs on the main thread (the ModelRunners' compute executor runs inline), so that one
OpenMP team does all torch work. Writes bench/results/roofline-<date>.json and .md (roofline-quick-<date> with
--quick).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_gateway as bg  # noqa: E402
import bench_long as bl  # noqa: E402
import hf_reference as hf  # noqa: E402
import long_floor  # noqa: E402
import roofline_floor as rf  # noqa: E402
import roofline_output  # noqa: E402
from engine_fakes import InlineExecutor  # noqa: E402  (tests/support, on the path bench_gateway sets)
from results_io import write_results  # noqa: E402

from kvserve.common.tokenizer import Tokenizer  # noqa: E402
from kvserve.common.wire.worker import StepBatch, StepItem  # noqa: E402
from kvserve.kernels.cpu_paged import CPUPagedBackend  # noqa: E402
from kvserve.services.model_store import prepare_default_model  # noqa: E402
from kvserve.worker.runner import ModelRunner, RunnerConfig  # noqa: E402

PAGE = 16
GEMM_ROWS = 512  # the rows of the linear shapes timed (a prefill chunk's)
READ_METHOD = ("the median time of torch.sum over a float32 tensor of read_bytes (one streaming read of every "
               "byte), 7 times")


@dataclass(frozen=True)
class Sizes:
    contexts: tuple[int, ...] = (300, 4096, 16384)
    batches: tuple[int, ...] = (1, 16, 64)
    prefill_starts: tuple[int, ...] = (0, 2048, 4096)
    pool_bytes: int = 8 << 30  # the decode runner's pool: a batch needing more K/V wraps around it
    kernel_pool_bytes: int = 1 << 30
    read_bytes: int = 1 << 30
    repeats: int = 3
    burst_requests: int = 24
    burst_new: int = 128
    burst_rounds: int = 3
    long_prompt: int = 7000
    long_repeats: int = 2


QUICK = Sizes(contexts=(300, 2048), batches=(1, 8), prefill_starts=(0,), pool_bytes=1 << 30,
              kernel_pool_bytes=256 << 20, read_bytes=512 << 20, repeats=2, burst_requests=8, burst_new=32,
              burst_rounds=1, long_prompt=1024, long_repeats=1)


def limits(s: long_floor.Shape, sz: Sizes) -> dict:
    """The GEMM rate on the model's linear shapes and a big square one, and the read bandwidth."""
    kv = s.kv_heads * s.head_dim
    shapes = {"qkv": (GEMM_ROWS, s.hidden, s.hidden + 2 * kv), "o": (GEMM_ROWS, s.hidden, s.hidden),
              "gate_up": (GEMM_ROWS, s.hidden, 2 * s.intermediate), "down": (GEMM_ROWS, s.intermediate, s.hidden),
              "square": (2048, 2048, 2048)}
    gemm = [{"name": name, "m": m, "k": k, "n": n, "macs_per_s": long_floor.mm_rate(m, k, n)}
            for name, (m, k, n) in shapes.items()]
    read_gbs = bl.read_bandwidth_gbs(sz.read_bytes)
    return {"threads": torch.get_num_threads(), "gemm": gemm,
            "gemm_macs_per_s": max(g["macs_per_s"] for g in gemm), "read_bytes_per_s": read_gbs * 1e9,
            "read_bytes": sz.read_bytes, "read_method": READ_METHOD}


def weight_bytes(runner: ModelRunner) -> int:
    """The bytes of the weights as the worker holds them (block panels' parts, norms, the LM head), read once
    per step."""
    w = runner.model.weights
    held = [getattr(layer, f.name) for layer in w.layers for f in dataclasses.fields(layer)]
    held += [w.final_norm, w.lm_head, w.embed]
    parts = [p for m in held if m is not None for p in ([m] if isinstance(m, torch.Tensor) else [m.q, m.d, m.m])]
    return sum(p.numel() * p.element_size() for p in parts)


def decode_batch(batch: int, context: int, perm: torch.Tensor) -> StepBatch:
    """``batch`` sequences of ``context`` cached tokens each decoding one token, their pages consecutive runs
    of ``perm`` (a shuffled pool), wrapping around it when they need more pages than it holds."""
    pages = -(-(context + 1) // PAGE)
    return StepBatch(tuple(StepItem(f"r{b}", (1000 + b,), context,
                                    tuple(perm[(b * pages + torch.arange(pages)) % len(perm)].tolist()))
                           for b in range(batch)))


def decode_section(model_dir: Path, sz: Sizes, held: int) -> list[dict]:
    """One decode step through the runner's forward and sampling per (context, batch); the pool holds random
    K/V. Steps call ModelRunner._run, past the step's validation: 16k positions exceed the model's context."""
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, kv_cache_bytes=sz.pool_bytes, page_size=PAGE,
                                      device="cpu", dtype="float32"), InlineExecutor())
    runner.kv_cache.uniform_(-1, 1)
    perm = torch.randperm(runner.kv_cache.shape[2], generator=torch.Generator().manual_seed(0))
    pool = runner.kv_cache.numel() * runner.kv_cache.element_size()
    rows = []
    for context in sz.contexts:
        for batch in sz.batches:
            print(f"[{time.strftime('%X')}] decode: context {context}, batch {batch}", flush=True)
            step = decode_batch(batch, context, perm)
            ms = 1e3 * long_floor.median_s(lambda step=step: runner._run(step), sz.repeats)
            rows.append({"context": context, "batch": batch, "step_ms": ms, "weight_bytes": held,
                         "pool_bytes": pool})
    return rows


def kernel_section(sz: Sizes, rows: list[dict]) -> None:
    """The decode attention kernel alone, one layer, at each row's context and batch (added to the row)."""
    ext = CPUPagedBackend().ext
    cache = bl.one_layer_pool(sz.kernel_pool_bytes)
    for row in rows:
        print(f"[{time.strftime('%X')}] kernel: context {row['context']}, batch {row['batch']}", flush=True)
        row["kernel"] = bl.decode_read_rate(ext, cache, row["context"], row["batch"], 1.0)  # of_machine: derive()


def prefill_section(model_dir: Path, sz: Sizes) -> list[dict]:
    return long_floor.steps_section(model_dir, sz.prefill_starts, repeats=sz.repeats, compute=InlineExecutor())


def worker_threads() -> tuple[str, ...]:
    """`kvserve up`'s worker at this process' thread count, the one the limits are measured at (up's own default
    leaves a CPU to the other services)."""
    return "--worker-threads", str(torch.get_num_threads())


def burst_section(model_dir: Path, tok: Tokenizer, corpus: list[int], sz: Sizes) -> dict:
    """The mixed burst's wall time through `kvserve up` and through the raw runner, medians."""
    jobs, work = bg.as_text(tok, hf.make_workload(sz.burst_requests, seed=1, corpus=corpus, max_new=sz.burst_new))
    print(f"[{time.strftime('%X')}] burst: kvserve up", flush=True)
    with bg.stack("--num-pages", "2048", *worker_threads()) as (gateway, _):
        bg.kvserve_burst(gateway, jobs[:2])  # warm-up
        stack = [bg.kvserve_burst(gateway, jobs) for _ in range(sz.burst_rounds)]
    print(f"[{time.strftime('%X')}] burst: raw runner", flush=True)
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, num_pages=bg.pages_for(work), page_size=PAGE,
                                      device="cpu", dtype="float32"), InlineExecutor())
    bg.raw_runner(model_dir, work[:2], runner=runner)  # warm-up
    raw = [bg.raw_runner(model_dir, work, runner=runner) for _ in range(sz.burst_rounds)]
    return {"requests": [[len(w.prompt_ids), w.max_new_tokens] for w in work],
            "kvserve_wall_s": statistics.median(r["wall_s"] for r in stack),
            "raw_runner_wall_s": statistics.median(r["wall_s"] for r in raw),
            "kvserve_rounds": [r["wall_s"] for r in stack], "raw_runner_rounds": [r["wall_s"] for r in raw]}


def long_section(model_dir: Path, prompts: bl.Prompts, sz: Sizes) -> dict:
    """A long prompt's TTFT through `kvserve up` and HF's generate (after the stack stopped), medians."""
    text, ids = prompts.take(sz.long_prompt)
    print(f"[{time.strftime('%X')}] long: kvserve up, {len(ids)} tokens", flush=True)
    with bg.stack("--no-prefix-caching", "--max-num-batched-tokens", "2048", *worker_threads()) as (gateway, _):
        bl.kvserve_one(gateway, prompts.take(64)[0])  # warm-up
        kvserve = [bl.kvserve_one(gateway, text)["ttft_s"] for _ in range(sz.long_repeats)]
    print(f"[{time.strftime('%X')}] long: HF", flush=True)
    model = hf.load_hf(model_dir)
    hf.hf_ttft_s(model, ids[:64])  # warm-up
    hf_ttft = [hf.hf_ttft_s(model, ids) for _ in range(sz.long_repeats)]
    return {"prompt_tokens": len(ids), "kvserve_ttft_s": statistics.median(kvserve),
            "hf_ttft_s": statistics.median(hf_ttft), "kvserve_rounds": kvserve, "hf_rounds": hf_ttft}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small shapes, one round (a smoke run, a few minutes)")
    p.add_argument("--threads", type=int, default=None, help="torch's threads (default: torch's own, the cores)")
    p.add_argument("--sections", default="prefill,decode,burst,long",
                   help="comma-separated subset of prefill,decode,burst,long (the limits always run)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sz, sections = QUICK if args.quick else Sizes(), set(args.sections.split(","))
    model_dir = prepare_default_model(progress=False)
    s, tok = long_floor.Shape.of(model_dir), Tokenizer(model_dir)
    corpus = hf.corpus_token_ids(model_dir)
    report: dict = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "quick": args.quick,
                    "sizes": dataclasses.asdict(sz),  # worker_threads: the stacks' workers', as the limits'
                    "limits": {"runs": [limits(s, sz)], "worker_threads": torch.get_num_threads()}}
    report["weight_bytes"] = held = weight_bytes(ModelRunner(RunnerConfig(
        model_dir=model_dir, num_pages=8, page_size=PAGE, device="cpu", dtype="float32"), InlineExecutor()))
    if "prefill" in sections:
        report["prefill"] = prefill_section(model_dir, sz)
    if "decode" in sections:
        report["decode"] = decode_section(model_dir, sz, held)
        gc.collect()  # the decode runner's pool, before the kernel's
        kernel_section(sz, report["decode"])
    if "burst" in sections:
        report["burst"] = burst_section(model_dir, tok, corpus, sz)
    if "long" in sections:
        report["long"] = long_section(model_dir, bl.Prompts(tok, corpus), sz)
    report["limits"]["runs"].append(limits(s, sz))  # again at the end: the machine is shared, its speed moves
    rf.derive(report, s)
    write_results(report, "roofline-quick" if args.quick else "roofline", roofline_output.markdown(report), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
