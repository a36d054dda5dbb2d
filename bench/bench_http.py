"""The OpenAI-compatible HTTP API under load, in one `kvserve up`:

  burst      the report's mixed burst (24 requests, prompts of 32-512 tokens, 16-128 new tokens, all at once,
             greedy, ignore_eos) through HTTP (the official openai client, streaming) and through gRPC (the SDK),
             alternated round by round; generated tokens / wall time, and the ratio HTTP / gRPC per round
  guidellm   guidellm (a third-party load generator for OpenAI servers, from PyPI) at 1, 4 and 16 concurrent
             streams of synthetic 128-token prompts and 64 new tokens: TTFT, inter-token latency, throughput

guidellm runs from its own virtual environment (`make bench-http` makes .venv-guidellm): it pins click and
pulls pandas/pyarrow/datasets, which kvserve's environment does not need.

    python bench/bench_http.py [--quick] [--sections burst,guidellm] [--guidellm PATH]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench_gateway as bg  # noqa: E402
import hf_reference as hf  # noqa: E402
import openai_load  # noqa: E402
from http_output import markdown  # noqa: E402
from results_io import write_results  # noqa: E402

from kvserve.common.tokenizer import Tokenizer  # noqa: E402
from kvserve.services.model_store import prepare_default_model  # noqa: E402

GUIDELLM = Path(__file__).resolve().parent.parent / ".venv-guidellm" / "bin" / "guidellm"
STREAMS = (1, 4, 16)
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "GUIDELLM__MAX_WORKER_PROCESSES": "1"}  # one client process: these machines have two cores


def http_burst(base_url: str, model: str, jobs: list[tuple[str, int]]) -> dict:
    """Every job at once through the HTTP API, as bench_gateway.kvserve_burst does through gRPC."""
    return openai_load.burst(base_url, model, jobs)


def burst(gateway: str, base_url: str, model: str, jobs: list[tuple[str, int]], rounds: int) -> dict:
    """HTTP and gRPC alternated (which goes first alternates too), after one small warm-up of each."""
    bg.kvserve_burst(gateway, jobs[:2])
    http_burst(base_url, model, jobs[:2])
    out = {"grpc": [], "http": []}
    for i in range(rounds):
        order = ("grpc", "http") if i % 2 == 0 else ("http", "grpc")
        for kind in order:
            out[kind].append(bg.kvserve_burst(gateway, jobs) if kind == "grpc" else http_burst(base_url, model, jobs))
    ratios = [h["tokens_per_s"] / g["tokens_per_s"] for h, g in zip(out["http"], out["grpc"], strict=True)]
    return {**out, "ratio_per_round": ratios, "ratio_median": statistics.median(ratios),
            "num_requests": len(jobs), "generated_tokens": out["grpc"][0]["generated_tokens"]}


def _level(b: dict) -> dict:
    m = b["metrics"]

    def ok(key):
        return m[key]["successful"]

    return {"streams": b["config"]["strategy"]["streams"],
            "ttft_ms_p50": ok("time_to_first_token_ms")["median"],
            "ttft_ms_p90": ok("time_to_first_token_ms")["percentiles"]["p90"],
            "itl_ms_p50": ok("inter_token_latency_ms")["median"],
            "itl_ms_p90": ok("inter_token_latency_ms")["percentiles"]["p90"],
            "output_tokens_per_s": m["output_tokens_per_second"]["total"]["mean"],
            "requests_per_s": m["requests_per_second"]["total"]["mean"],
            "concurrency_p50": m["request_concurrency"]["total"]["median"],
            "output_tokens_p50": ok("output_token_count")["median"],
            "successful": m["request_totals"]["successful"], "errored": m["request_totals"]["errored"],
            "incomplete": m["request_totals"]["incomplete"]}


def run_guidellm(guidellm: Path, base_url: str, model: str, model_dir: Path, requests: list[int],
                 prompt_tokens: int, output_tokens: int) -> dict:
    """One guidellm sweep over STREAMS (``requests[i]`` requests at level i); its per-level summary."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "guidellm.json"
        argv = [str(guidellm), "run",
                "--backend", f"kind=openai_http,target={base_url},model={model},request_format=/v1/completions,"
                             "timeout=600",
                "--tokenizer", f"kind=huggingface_auto,model={model_dir}",
                "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
                "--profile", "kind=concurrent", "--override", "profile.streams", ",".join(map(str, STREAMS)),
                "--constraint", json.dumps({"kind": "max_requests", "count": requests}),
                "--metrics", "kind=generative,sample_size=0", "--output", f"kind=json,path={out}",
                "--disable-progress"]
        t0 = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **OFFLINE}, timeout=3600)
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"guidellm failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        levels = [_level(b) for b in json.loads(out.read_text())["benchmarks"]]
    version = subprocess.run([str(guidellm.with_name("python")), "-c",
                              "import importlib.metadata as m; print(m.version('guidellm'))"],
                             capture_output=True, text=True).stdout.strip()
    return {"guidellm": version, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "requests": requests, "wall_s": wall, "levels": levels,
            "command": " ".join(argv[1:]).replace(str(model_dir), "<model dir>").replace(str(out), "<out>")
                       .replace(base_url, "<base url>")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="12 requests in the burst, 2 rounds, fewer for guidellm")
    p.add_argument("--sections", default="burst,guidellm")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--guidellm", type=Path, default=GUIDELLM)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    sections = set(args.sections.split(","))
    model_dir = prepare_default_model(progress=False)
    tok = Tokenizer(model_dir)
    jobs, _ = bg.as_text(tok, hf.make_workload(12 if args.quick else 24, seed=1, corpus=hf.corpus_token_ids(model_dir),
                                               max_new=64 if args.quick else 128))
    report: dict = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "quick": args.quick,
                    "cores": os.cpu_count()}
    with bg.stack("--num-pages", "2048") as (gateway, stats):
        base_url, model = stats["http"], model_dir.name
        if "burst" in sections:
            report["burst"] = burst(gateway, base_url, model, jobs, args.rounds or (2 if args.quick else 4))
        if "guidellm" in sections:
            requests = [4, 8, 16] if args.quick else [8, 16, 48]
            report["guidellm"] = run_guidellm(args.guidellm, base_url, model, model_dir, requests, 128, 64)
    write_results(report, "http-quick" if args.quick else "http", markdown(report), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
