"""Which vLLM configuration is its best on this machine: the report's mixed burst through vLLM's OpenAI server for
each dtype (bfloat16, float32) and thread binding (vLLM's default "auto": the model's threads bound to all cores but
the ones it reserves for its front end, one on a 2-core machine; or every core bound to the model), the burst twice
per server start, the configurations alternated over rounds; medians. `make bench` then runs the best of them and
float32 beside kvserve (bench/vllm_peer.py's VLLM_CONFIGS).

    python bench/vllm_configs.py [--rounds 1] [--quick]     # make bench-vllm-configs
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench_gateway as bg  # noqa: E402
import hf_reference as hf  # noqa: E402
import openai_load  # noqa: E402
import vllm_peer  # noqa: E402
from results_io import write_results  # noqa: E402

from kvserve.common.tokenizer import Tokenizer  # noqa: E402
from kvserve.services.model_store import prepare_default_model  # noqa: E402


def candidates() -> list[vllm_peer.VllmConfig]:
    every_core = vllm_peer.EVERY_CORE  # the binding make bench then runs with
    return [vllm_peer.VllmConfig(f"{dtype}, {label}", dtype, env)
            for dtype in ("bfloat16", "float32")
            for label, env in (("auto binding", {}),
                               (f"bound to {every_core['VLLM_CPU_OMP_THREADS_BIND']}", every_core))]


def markdown(report: dict) -> str:
    rows = ["| configuration | dtype | environment | burst tok/s (median) | per burst | TTFT p50 s | TPOT p50 ms |",
            "|---|---|---|---:|---|---:|---:|"]
    for c in report["configs"]:
        env = " ".join(f"{k}={v}" for k, v in c["env"].items()) or "(default)"
        rows.append(f"| {c['name']} | {c['dtype']} | `{env}` | {c['tokens_per_s']:.1f} | "
                    f"{', '.join(f'{r:.1f}' for r in c['per_round'])} | {c['ttft_p50_s']:.2f} | "
                    f"{1e3 * c['tpot_p50_s']:.0f} |")
    best = max(report["configs"], key=lambda c: c["tokens_per_s"])
    title = (f"vLLM {report['vllm']} on the report's mixed burst ({report['requests']} requests), "
             f"{report['rounds']} round(s), two bursts per start. Best: **{best['name']}**.")
    return "\n".join([title, "", *rows]) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="12 requests, one round")
    args = p.parse_args(argv)
    missing = vllm_peer.available()
    if missing:
        raise SystemExit(f"vllm_configs: {missing}")
    model_dir = prepare_default_model(progress=False)
    jobs, _ = bg.as_text(Tokenizer(model_dir), hf.make_workload(
        12 if args.quick else 24, seed=1, corpus=hf.corpus_token_ids(model_dir), max_new=64 if args.quick else 128))
    rounds = 1 if args.quick else args.rounds
    configs = candidates()
    runs: dict[str, list[dict]] = {c.name: [] for c in configs}
    for r in range(rounds):
        for config in configs[r % len(configs):] + configs[:r % len(configs)]:
            print(f"vllm_configs: round {r + 1}/{rounds}: {config.name}", file=sys.stderr)
            with vllm_peer.vllm_server(model_dir, config) as server:
                openai_load.burst(server.base_url, server.model, jobs[:2])  # warm-up
                for _ in range(2):
                    runs[config.name].append(openai_load.burst(server.base_url, server.model, jobs))
    report = {"vllm": vllm_peer.version(), "rounds": rounds, "requests": len(jobs), "cores": os.cpu_count(),
              "configs": [{"name": c.name, "dtype": c.dtype, "env": c.env,
                           "tokens_per_s": statistics.median(x["tokens_per_s"] for x in runs[c.name]),
                           "per_round": [x["tokens_per_s"] for x in runs[c.name]],
                           "ttft_p50_s": statistics.median(x["ttft_p50_s"] for x in runs[c.name]),
                           "tpot_p50_s": statistics.median(x["tpot_p50_s"] for x in runs[c.name])}
                          for c in configs]}
    write_results(report, "vllm-configs-quick" if args.quick else "vllm-configs", markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
