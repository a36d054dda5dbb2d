"""kvserve's benchmark report: one command, one run, kvserve side by side with HF transformers on this machine.

    python bench/report.py [--quick]        # make bench / make bench-quick

Writes bench/results/<date>[-quick].json (every workload: kvserve's figure, each HF figure from the same run,
and their ratio), PNG plots and a Markdown table next to it. Workloads (seeded, greedy, fixed lengths):

  throughput     the gateway issue's mixed burst through the whole stack (`kvserve up`) vs HF `generate()` one
                 request at a time and HF's continuous batching (`generate_batch`)
  concurrency    32 concurrent requests vs the worker's raw batched forward doing the same work
  prefix         a ~2000-token system prompt + 10 user messages: TTFT of the first vs the mean of the rest,
                 prefix caching on and off, HF (no reuse) for reference
  kv_cache       256 generated tokens with and without the KV cache (kvserve and HF)
  memory         bytes per token and pool bytes (calculator vs the worker's real tensor); page utilisation of the
                 mixed workload (tokens stored / slots allocated) vs padding every request to the longest
  latency        TTFT and time-per-output-token percentiles at 1, 4 and 16 concurrent clients
  tracing        (full run only) the 32-request burst with tracing on vs off
  peers          kvserve and vLLM's CPU build (its best configuration here, and float32) through the same OpenAI
                 protocol: the mixed burst, the prefix workload, latency under load and the long prompt, each
                 server in turn, alternated over rounds; the greedy agreement of their completions
                 (bench/peer_compare.py; vLLM from .venv-vllm, which make bench creates)
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime as dt
import json
import os
import platform
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
import bench_gateway as bg  # noqa: E402
import bench_long as bl  # noqa: E402
import bench_worker as bw  # noqa: E402
import headline  # noqa: E402
import hf_reference as hf  # noqa: E402
import openai_load  # noqa: E402
import peer_compare  # noqa: E402
import report_output  # noqa: E402
import vllm_peer  # noqa: E402
from results_io import cpu_info  # noqa: E402

from kvserve.common.tokenizer import Tokenizer  # noqa: E402
from kvserve.services.client import Client  # noqa: E402
from kvserve.services.model_store import prepare_default_model  # noqa: E402

PAGE_SIZE = 16
CLIENT_COUNTS = openai_load.CLIENT_COUNTS
PEERS = tuple(vllm_peer.VLLM_CONFIGS)  # vllm_bf16, vllm_fp32
# kvserve at its best on an otherwise idle machine, as vLLM is run (bound to every core): a worker thread per core.
# `kvserve up`'s default leaves a core to the services it co-locates (docs/benchmarks/colocate.md).
EVERY_CORE = peer_compare.EVERY_CORE


def latency_under_load(address: str, prompts: list[str], clients: int, per_client: int, max_tokens: int) -> dict:
    """`clients` closed-loop clients, each sending `per_client` requests one after another."""
    def client_loop(i: int) -> list[dict]:
        with Client(address, timeout_s=600) as client:
            return [bg.stream_one(client, prompts[(i * per_client + j) % len(prompts)], max_tokens)
                    for j in range(per_client)]

    with cf.ThreadPoolExecutor(clients) as pool:
        runs = [r for rs in pool.map(client_loop, range(clients)) for r in rs]
    return _percentiles(clients, runs)


class _TokenTimes:
    """An HF generate() streamer that timestamps every generated token (the first put() is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value) -> None:
        if self.prompt_seen:
            self.times.append(time.perf_counter())
        self.prompt_seen = True

    def end(self) -> None:
        pass


def hf_latency_under_load(model, prompts: list[list[int]], clients: int, per_client: int, max_tokens: int) -> dict:
    """HF `generate()` as the naive server it is: one request at a time, first come first served, for
    `clients` closed-loop client threads. The model runs on this (the main) thread only."""
    jobs: queue.Queue = queue.Queue()
    done_records: list[dict] = []

    def client(i: int) -> None:
        for j in range(per_client):
            record = {"t0": time.perf_counter(), "prompt": prompts[(i * per_client + j) % len(prompts)],
                      "done": threading.Event()}
            jobs.put(record)
            record["done"].wait()
            done_records.append(record)
        jobs.put(None)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    finished = 0
    with torch.inference_mode():
        while finished < clients:
            record = jobs.get()
            if record is None:
                finished += 1
                continue
            ids, times = torch.tensor([record["prompt"]]), _TokenTimes()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                           min_new_tokens=max_tokens, do_sample=False, pad_token_id=hf._pad_id(model), streamer=times)
            record["ttft_s"] = times.times[0] - record["t0"]
            record["tpot_s"] = (times.times[-1] - times.times[0]) / max(1, len(times.times) - 1)
            record["done"].set()
    for t in threads:
        t.join()
    return _percentiles(clients, done_records)


def _percentiles(clients: int, runs: list[dict]) -> dict:
    ttft, tpot = [r["ttft_s"] for r in runs], [r["tpot_s"] for r in runs]
    return {"clients": clients, "requests": len(runs),
            **{f"ttft_p{p}_s": openai_load.percentile(ttft, p) for p in (50, 90, 99)},
            **{f"tpot_p{p}_s": openai_load.percentile(tpot, p) for p in (50, 90, 99)}}


def hf_bytes_per_token(model, num_tokens: int = 100) -> float:
    """Bytes of HF's DynamicCache after a forward over num_tokens tokens, per token (measured)."""
    with torch.inference_mode():
        cache = model(torch.arange(100, 100 + num_tokens)[None], use_cache=True).past_key_values
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers) / num_tokens


def page_utilisation(work: list[hf.Workitem]) -> dict:
    """Tokens stored / slots allocated at the end of the mixed workload: pages of 16 vs padding to the longest."""
    lengths = [len(w.prompt_ids) + w.max_new_tokens for w in work]
    paged_slots = sum(-(-n // PAGE_SIZE) * PAGE_SIZE for n in lengths)
    padded_slots = len(lengths) * max(lengths)
    return {"tokens": sum(lengths), "paged_slots": paged_slots, "padded_slots": padded_slots,
            "paged_utilisation": sum(lengths) / paged_slots, "padded_utilisation": sum(lengths) / padded_slots}


def memory(runner, work: list[hf.Workitem]) -> dict:
    from kvserve.common.kvmem import get_dtype, per_token
    from kvserve.common.kvmem_models import load_hf_config

    info = runner.info
    calc_per_token = per_token(load_hf_config(runner.cfg.model_dir / "config.json"), get_dtype(info.kv_dtype)).bytes
    calc_pool = calc_per_token * info.page_size * info.num_pages
    measured_pool = runner.kv_cache.numel() * runner.kv_cache.element_size()
    return {"kv_dtype": info.kv_dtype, "bytes_per_token_calculator": calc_per_token,
            "bytes_per_token_worker": info.bytes_per_token, "pool_bytes_calculator": calc_pool,
            "pool_bytes_measured": measured_pool, "calculator_over_measured": calc_pool / measured_pool,
            "pages": page_utilisation(work)}


class Report:
    """Runs the stages in order with one progress bar; everything lands in ``self.out``."""

    def __init__(self, quick: bool, peers: tuple[str, ...] = PEERS, peer_rounds: int | None = None):
        self.quick = quick
        self.peers, self.peer_rounds = peers, peer_rounds or (1 if quick else 2)
        self.model_dir = prepare_default_model(progress=False)
        self.tok = Tokenizer(self.model_dir)
        corpus = hf.corpus_token_ids(self.model_dir)
        n_mixed, self.n_conc = (12, 16) if quick else (24, 32)
        self.mixed_text, self.mixed_hf = bg.as_text(self.tok, hf.make_workload(
            n_mixed, seed=1, corpus=corpus, max_new=64 if quick else 128))
        self.conc_text, self.conc_hf = bg.as_text(self.tok, hf.make_workload(
            self.n_conc, seed=2, min_prompt=128, max_prompt=128, min_new=64, max_new=64, corpus=corpus))
        self.prefix_prompts = bg.prefix_workload(self.tok, corpus, 2000, 10)
        self.load_text = [t for t, _ in bg.as_text(self.tok, hf.make_workload(
            32, seed=3, min_prompt=64, max_prompt=256, corpus=corpus))[0]]
        self.load_shape = (2, 16) if quick else (4, 32)  # (requests per client, max_tokens)
        # one long prompt, prefilled fresh (the prefix-caching-off stack): a slice of the corpus, as text
        self.long_text = self.tok.decode(corpus[3000:3000 + (2048 if quick else 4096)])
        self.long_ids = self.tok.encode(self.long_text)
        self.out: dict = {"quick": quick, "date": str(dt.date.today())}

    def stages(self):
        stages = [("kvserve, prefix caching on", self.kvserve_on), ("kvserve, prefix caching off", self.kvserve_off)]
        if not self.quick:
            stages.append(("tracing off vs on", self.tracing))
        # Each in-process measurement runs in a fresh process: a thread that ran torch keeps its own OpenMP
        # team, and two teams on two cores slow every op down (README, "The worker"), so HF measured after a
        # ModelRunner existed (or the runner after HF ran) came out 15-30% slow.
        stages += [("HF transformers", lambda: self.isolated("hf")),
                   ("raw runner, KV cache, memory", lambda: self.isolated("runner"))]
        if self.peers:
            stages.append(("kvserve vs vLLM", self.vllm))
        return stages

    def vllm(self) -> None:
        """kvserve and vLLM through the OpenAI protocol (bench/peer_compare.py); skipped, and said so in the
        report, where vLLM's environment is missing."""
        missing = vllm_peer.available()
        if missing:
            self.out["peers"] = {"skipped": missing}
            print(f"bench: vLLM rows skipped: {missing}", file=sys.stderr)
            return
        work = peer_compare.Workloads(self.mixed_text, self.prefix_prompts, self.load_text, self.load_shape,
                                      self.long_text, bl.NEW_TOKENS)
        servers = (peer_compare.KVSERVE, *self.peers)
        self.out["peers"] = peer_compare.run(self.model_dir, work, servers, self.peer_rounds,
                                             lambda msg: print(f"bench: peers, {msg}", file=sys.stderr))

    def kvserve_on(self) -> None:
        with bg.stack("--num-pages", "2048", *EVERY_CORE) as (gateway, stats):
            bg.kvserve_burst(gateway, self.mixed_text[:2])  # warm-up
            self.out["throughput"] = {"kvserve": bg.kvserve_burst(gateway, self.mixed_text)}
            self.out["concurrency"] = {"kvserve": bg.kvserve_burst(gateway, self.conc_text),
                                       "num_requests": self.n_conc}
            self.out["prefix"] = {"kvserve_on": bg.kvserve_prefix(gateway, self.prefix_prompts)}
            self.out["latency"] = {"kvserve": [latency_under_load(gateway, self.load_text, c, *self.load_shape)
                                               for c in CLIENT_COUNTS], "max_tokens": self.load_shape[1],
                                   "requests_per_client": self.load_shape[0]}
        self.out["kv_wait_share_pct"] = stats["kv_wait_share_pct"]
        self.out["compute_share_pct"] = stats["compute_share_pct"]
        self.out["kv_call_share_pct"] = stats["kv_call_share_pct"]

    def kvserve_off(self) -> None:
        with bg.stack("--num-pages", "1024", "--no-prefix-caching", *EVERY_CORE) as (gateway, _):
            self.out["prefix"]["kvserve_off"] = bg.kvserve_prefix(gateway, self.prefix_prompts)
            self.out["long_prompt"] = {"kvserve": bl.kvserve_one(gateway, self.long_text),
                                       "prompt_tokens": len(self.long_ids), "new_tokens": bl.NEW_TOKENS}

    def tracing(self) -> None:
        self.out["tracing"] = bg.tracing_overhead(self.conc_text, rounds=5)

    def isolated(self, stage: str) -> None:
        """Runs ``<stage>_results`` in a fresh `python bench/report.py --stage` process; merges its answer."""
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "stage.json"
            subprocess.run([sys.executable, __file__, "--stage", stage, "--stage-out", str(out),
                            *(["--quick"] if self.quick else [])], check=True)
            merge(self.out, json.loads(out.read_text()))

    def runner_results(self) -> dict:
        """The raw runner, the KV cache with and without (HF on the runner's compute thread), memory."""
        from kvserve.worker.runner import ModelRunner, RunnerConfig

        runner = ModelRunner(RunnerConfig(model_dir=self.model_dir, num_pages=bg.pages_for(self.conc_hf),
                                          page_size=PAGE_SIZE, device="cpu", dtype="float32"))
        raw = bg.raw_runner(self.model_dir, self.conc_hf, runner=runner)
        kv_cache = bw.bench_kv_cache(runner, hf.load_hf(self.model_dir), 64 if self.quick else 256)
        return {"concurrency": {"raw_runner": raw}, "kv_cache": kv_cache, "memory": memory(runner, self.mixed_hf)}

    def hf_results(self) -> dict:
        """HF transformers on this process' main thread, before anything else ran torch here."""
        model = hf.load_hf(self.model_dir)
        load_ids = [self.tok.encode(t) for t in self.load_text]
        return {"throughput": {"hf_generate": bg.strip_outputs(hf.hf_generate_serial(model, self.mixed_hf)),
                               "hf_generate_batch": bg.strip_outputs(hf.hf_generate_batch(model, self.mixed_hf))},
                "prefix": {"hf": bg.hf_prefix(model, self.tok, self.prefix_prompts[:3] if self.quick
                                              else self.prefix_prompts)},
                "latency": {"hf_generate": [hf_latency_under_load(model, load_ids, c, *self.load_shape)
                                            for c in CLIENT_COUNTS]},
                "memory": {"bytes_per_token_hf_measured": hf_bytes_per_token(model)},
                "long_prompt": {"hf": bl.hf_one(model, self.long_ids)}}

    def run(self) -> dict:
        stages = self.stages()
        with tqdm(stages, desc="bench", unit="stage", file=sys.stderr) as bar:
            for name, stage in bar:
                bar.set_postfix_str(name)
                stage()
        report_output.add_ratios(self.out)
        return self.out


def merge(into: dict, new: dict) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvserve vs HF transformers, one run, JSON + plots + table")
    parser.add_argument("--quick", action="store_true", help="smaller workloads, under 5 minutes")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--peers", default=",".join(PEERS),
                        help=f"vLLM configurations to compare with (of {', '.join(PEERS)}; '' for none)")
    parser.add_argument("--peer-rounds", type=int, help="rounds of the vLLM comparison (default 2; 1 with --quick)")
    parser.add_argument("--stage", choices=("hf", "runner"), help=argparse.SUPPRESS)  # one isolated stage
    parser.add_argument("--stage-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    if args.stage:
        args.stage_out.write_text(json.dumps(getattr(Report(args.quick), f"{args.stage}_results")()))
        return 0
    peers = tuple(p for p in args.peers.split(",") if p)
    unknown = set(peers) - set(PEERS)
    if unknown:
        parser.error(f"--peers: unknown {', '.join(sorted(unknown))} (known: {', '.join(PEERS)})")
    out = Report(args.quick, peers, args.peer_rounds).run()
    out["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                      "python": platform.python_version()}
    out["cpu"] = cpu_info()
    stem = args.out_dir / f"{dt.date.today()}{'-quick' if args.quick else ''}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(out, indent=2))
    plots = report_output.plots(out, stem)
    table = report_output.markdown(out, [p.name for p in plots])
    stem.with_suffix(".md").write_text(table)
    print(table)
    print(f"wrote {stem}.json, {stem}.md and {len(plots)} plots", file=sys.stderr)
    if not args.quick and "servers" in out.get("peers", {}) and args.out_dir.resolve() == headline.RESULTS:
        headline.main([])  # the README's headline ratios, from this file
        print("rewrote README.md's headline from it", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
