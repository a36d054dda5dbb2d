"""Worker benchmark: paged decode vs HF transformers' forward, prefill steps with the paged prefill kernel vs the
reference, and the KV cache vs recomputation.

    python bench/bench_worker.py [--quick] [--out bench/results/worker-DATE.json]

Everything is measured in one run, interleaved (kvserve, HF, kvserve, HF, ...), and reported as medians and
ratios, because a shared 2-core machine is noisy. Writes JSON and a Markdown table next to it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import torch
from results_io import write_results

from kvserve.common.wire.worker import StepBatch, StepItem
from kvserve.services.gateway.llm import LLM
from kvserve.services.model_store import prepare_default_model
from kvserve.v1 import worker_pb2_grpc
from kvserve.worker.runner import ModelRunner, RunnerConfig
from kvserve.worker.server import start_worker_server

PAGE_SIZE = 16



@contextmanager
def loopback_worker(runner: ModelRunner) -> Iterator[worker_pb2_grpc.WorkerServiceStub]:
    """A real worker gRPC server on a free loopback port, and a stub talking to it."""
    ws = start_worker_server(runner, "127.0.0.1", 0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{ws.port}") as channel:
            yield worker_pb2_grpc.WorkerServiceStub(channel)
    finally:
        ws.stop(1.0)

def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def load_hf(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()


def prompt_ids(batch: int, context: int) -> torch.Tensor:
    return torch.randint(100, 40000, (batch, context), generator=torch.Generator().manual_seed(batch))


class OursDecode:
    """B sequences of `context` tokens prefilled once; each repeat decodes `steps` tokens from `context` on."""

    def __init__(self, runner: ModelRunner, ids: torch.Tensor, steps: int):
        self.runner, self.ids, self.steps = runner, ids, steps
        pages = -(-(ids.shape[1] + steps) // PAGE_SIZE)
        self.tables = [tuple(range(b * pages, (b + 1) * pages)) for b in range(ids.shape[0])]
        for b, row in enumerate(ids.tolist()):
            runner.step(StepBatch((StepItem(f"r{b}", tuple(row), 0, self.tables[b], sample=False),)))

    def run(self) -> None:
        context, tokens = self.ids.shape[1], [5] * self.ids.shape[0]
        for s in range(self.steps):
            items = tuple(StepItem(f"r{b}", (t,), context + s, self.tables[b]) for b, t in enumerate(tokens))
            tokens = [o.token_id for o in self.runner.step(StepBatch(items)).sampled]


class GrpcDecode(OursDecode):
    """The same decode loop through a real gRPC Step call on a loopback server."""

    def __init__(self, runner, ids, steps, stub):
        super().__init__(runner, ids, steps)
        self.stub = stub

    def run(self) -> None:
        from kvserve.v1 import common_pb2, worker_pb2

        context, tokens = self.ids.shape[1], [5] * self.ids.shape[0]
        greedy = common_pb2.SamplingParams()
        for s in range(self.steps):
            items = [worker_pb2.StepItem(req_id=f"r{b}", token_ids=[t], start_pos=context + s,
                                         page_table=self.tables[b], sample=True, sampling=greedy)
                     for b, t in enumerate(tokens)]
            tokens = [r.token_id for r in self.stub.Step(worker_pb2.StepBatch(items=items), timeout=600).results]


class HFDecode:
    """HF's forward with its DynamicCache: prefill once, then each repeat crops back and decodes."""

    def __init__(self, hf, ids: torch.Tensor, steps: int):
        from transformers.cache_utils import DynamicCache

        self.hf, self.steps, self.context = hf, steps, ids.shape[1]
        self.cache = DynamicCache()
        with torch.inference_mode():
            hf(ids, past_key_values=self.cache, use_cache=True)

    @torch.inference_mode()
    def run(self) -> None:
        extra = self.cache.get_seq_length() - self.context
        if extra > 0:
            self.cache.crop(-extra)  # negative: drop that many tokens (the form every transformers version takes)
        tokens = torch.full((self.cache.layers[0].keys.shape[0], 1), 5)
        for _ in range(self.steps):
            logits = self.hf(tokens, past_key_values=self.cache, use_cache=True).logits
            tokens = logits[:, -1].argmax(-1, keepdim=True)


class OnComputeThread:
    """Runs a subject's ``run`` on the runner's compute thread (the gRPC subject gets there by itself)."""

    def __init__(self, runner: ModelRunner, subject):
        self.runner, self.subject = runner, subject

    def run(self) -> None:
        self.runner.call(self.subject.run)


def bench_decode(runner, hf, stub, batch: int, context: int, steps: int, repeats: int) -> dict:
    ids = prompt_ids(batch, context)
    subjects = {"kvserve": OursDecode(runner, ids, steps), "kvserve_grpc": GrpcDecode(runner, ids, steps, stub),
                "hf_forward": OnComputeThread(runner, runner.call(HFDecode, hf, ids, steps))}
    for s in subjects.values():
        s.run()  # warm-up
    samples = {name: [] for name in subjects}
    for _ in range(repeats):
        for name, s in subjects.items():
            samples[name].append(batch * steps / timed(s.run))
    med = {name: statistics.median(v) for name, v in samples.items()}
    return {"batch": batch, "context": context, "decode_steps": steps, "repeats": repeats,
            **{f"{name}_tok_s": round(v, 2) for name, v in med.items()},
            "ratio_kvserve_vs_hf": round(med["kvserve"] / med["hf_forward"], 3),
            "ratio_grpc_vs_hf": round(med["kvserve_grpc"] / med["hf_forward"], 3),
            "samples_tok_s": {k: [round(x, 2) for x in v] for k, v in samples.items()}}


def generate_without_cache(runner: ModelRunner, prompt: list[int], num_tokens: int) -> list[int]:
    """Every step recomputes the whole sequence from position 0: what decoding costs without a KV cache."""
    table = tuple(range(-(-(len(prompt) + num_tokens) // PAGE_SIZE)))
    seq, out = list(prompt), []
    for _ in range(num_tokens):
        res = runner.step(StepBatch((StepItem("nocache", tuple(seq), 0, table),)))
        out.append(res.sampled[0].token_id)
        seq.append(out[-1])
    return out


def bench_kv_cache(runner, hf, num_tokens: int, prompt_len: int = 32) -> dict:
    prompt = prompt_ids(1, prompt_len)[0].tolist()
    llm = LLM(runner, prefix_caching=False)  # every run computes the prompt: no hit on the run before
    results: dict[str, list[int]] = {}

    def ours_cached():
        (results["cached"],) = llm.generate([prompt], num_tokens, ignore_eos=True)

    def ours_uncached():
        results["uncached"] = generate_without_cache(runner, prompt, num_tokens)

    def hf_run(use_cache: bool):
        with torch.inference_mode():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                              do_sample=False, use_cache=use_cache, pad_token_id=2)
        results[f"hf_{use_cache}"] = out[0, prompt_len:].tolist()

    times = {"kvserve_with_cache": timed(ours_cached), "kvserve_without_cache": timed(ours_uncached),
             "hf_with_cache": timed(lambda: runner.call(hf_run, True)),
             "hf_without_cache": timed(lambda: runner.call(hf_run, False))}
    tok_s = {k: round(num_tokens / v, 2) for k, v in times.items()}
    return {"generated_tokens": num_tokens, "prompt_tokens": prompt_len,
            **{f"{k}_tok_s": v for k, v in tok_s.items()},
            "speedup_kvserve": round(tok_s["kvserve_with_cache"] / tok_s["kvserve_without_cache"], 2),
            "speedup_hf": round(tok_s["hf_with_cache"] / tok_s["hf_without_cache"], 2),
            "same_tokens_with_and_without_cache": results["cached"] == results["uncached"]}


def bench_prefill(runner: ModelRunner, chunk_sets: list[list[int]], repeats: int) -> list[dict]:
    """Prefill steps through the cpu backend's paged prefill kernel and through the reference backend's gather +
    SDPA (the backend's ``prefill_kernel`` switch), alternated; fresh prompts, sampling each chunk's last token."""
    backend = runner.model.backend
    if not hasattr(backend, "prefill_kernel"):
        return []
    results = []
    for lengths in chunk_sets:
        ids = prompt_ids(len(lengths), max(lengths))
        first, items = 0, []
        for b, n in enumerate(lengths):
            pages = -(-n // PAGE_SIZE)
            items.append(StepItem(f"p{b}", tuple(ids[b, :n].tolist()), 0, tuple(range(first, first + pages))))
            first += pages
        batch = StepBatch(tuple(items))
        times: dict[bool, list[float]] = {True: [], False: []}
        tokens: dict[bool, list[int]] = {}
        for _ in range(repeats):
            for kernel in (True, False):
                backend.prefill_kernel = kernel
                t0 = time.perf_counter()
                tokens[kernel] = [s.token_id for s in runner.call(runner._run, batch)]
                times[kernel].append(time.perf_counter() - t0)
        backend.prefill_kernel = True
        kernel_ms, reference_ms = (1000 * statistics.median(times[k]) for k in (True, False))
        results.append({"chunks": lengths, "kernel_ms": round(kernel_ms, 1), "reference_ms": round(reference_ms, 1),
                        "reference_over_kernel": round(reference_ms / kernel_ms, 3),
                        "same_tokens": tokens[True] == tokens[False]})
    return results


def markdown(report: dict) -> str:
    lines = ["| batch | context | kvserve tok/s | kvserve over gRPC tok/s | HF forward tok/s | kvserve / HF |",
             "|---:|---:|---:|---:|---:|---:|"]
    for d in report["decode"]:
        lines.append(f"| {d['batch']} | {d['context']} | {d['kvserve_tok_s']:.1f} | {d['kvserve_grpc_tok_s']:.1f} "
                     f"| {d['hf_forward_tok_s']:.1f} | {d['ratio_kvserve_vs_hf']:.2f} |")
    k = report["kv_cache"]
    lines += ["", f"KV cache vs recomputation, {k['generated_tokens']} generated tokens after a "
              f"{k['prompt_tokens']}-token prompt, batch 1:", "",
              "| | with KV cache tok/s | without tok/s | speed-up |", "|---|---:|---:|---:|",
              f"| kvserve | {k['kvserve_with_cache_tok_s']:.1f} | {k['kvserve_without_cache_tok_s']:.1f} "
              f"| {k['speedup_kvserve']:.1f}x |",
              f"| HF transformers | {k['hf_with_cache_tok_s']:.1f} | {k['hf_without_cache_tok_s']:.1f} "
              f"| {k['speedup_hf']:.1f}x |"]
    if report.get("prefill"):
        lines += ["", "Prefill steps (fresh prompts, one step each), the paged prefill kernel vs the reference's "
                  "gather + SDPA, alternated:", "",
                  "| chunks | kernel ms | reference ms | reference / kernel | same tokens |",
                  "|---|---:|---:|---:|---|"]
        lines += [f"| {' + '.join(map(str, p['chunks']))} | {p['kernel_ms']:.1f} | {p['reference_ms']:.1f} "
                  f"| {p['reference_over_kernel']:.3f} | {p['same_tokens']} |" for p in report["prefill"]]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repeats and tokens (about a minute)")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    steps, repeats, gen_tokens = (8, 3, 64) if args.quick else (16, 7, 256)
    model_dir = prepare_default_model(progress=False)
    pages = max(args.batches) * -(-(args.context + steps) // PAGE_SIZE) + 32
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, num_pages=pages, page_size=PAGE_SIZE,
                                      device="cpu", dtype="float32"))
    # All torch work, HF's included, runs on the runner's one compute thread (see ModelRunner.__init__).
    hf = runner.call(load_hf, model_dir)
    report = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "quick": args.quick,
              "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                          "torch": torch.__version__, "python": platform.python_version(),
                          "processor": platform.processor() or platform.machine()},
              "model": runner.info.model_name, "dtype": "float32", "page_size": PAGE_SIZE, "decode": []}
    with loopback_worker(runner) as stub:
        for b in args.batches:
            print(f"decode batch {b} ...", file=sys.stderr, flush=True)
            report["decode"].append(bench_decode(runner, hf, stub, b, args.context, steps, repeats))
    print("prefill steps, kernel vs reference ...", file=sys.stderr, flush=True)
    report["prefill"] = bench_prefill(runner, [[512], [256, 128, 96, 32]], repeats)
    print(f"KV cache vs none, {gen_tokens} tokens ...", file=sys.stderr, flush=True)
    report["kv_cache"] = bench_kv_cache(runner, hf, gen_tokens)
    out = write_results(report, "worker", markdown(report), args.out)
    print(f"wrote {out} and {out.with_suffix('.md')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
