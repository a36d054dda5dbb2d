"""Issue 41, point 4: a worker that shares its machine. The report's mixed burst (24 requests, prompts of 32-512
tokens, up to 128 new tokens) through the OpenAI protocol, kvserve (`kvserve up`) and vLLM's CPU build side by
side, unloaded and with one core taken by an unrelated busy process.

The busy process is a pure-Python loop in a session of its own (as an unrelated process's), pinned with
sched_setaffinity to BUSY_CPU (CPU 0): the core of kvserve's bound rows and one of those vLLM binds its model
threads to, so the worst place for a bound worker, while an unbound one may move away from it. Each server is
started once; inside it, after a warm-up burst, each round runs the burst unloaded and loaded (the busy process
started before the burst and killed after), the order alternating round by round. Throughput is generated
tokens / wall time; medians over the rounds, and loaded / unloaded. The 1-minute load average before each burst
is recorded.

Rows: kvserve's defaults now (`kvserve up`: one thread per CPU less one, unbound), kvserve's old default
(`--worker-cpus none`: torch's threads, one per core, unbound), vLLM's choice made with kvserve's flags (one
thread bound to CPU 0) and two threads bound to both cores; then vLLM bfloat16 (its best here) and, unless
--no-fp32, vLLM float32 (like for like).

    python bench/bench_colocate.py            # ~20 minutes on two cores
    python bench/bench_colocate.py --quick    # 1 round, 8 requests of up to 32 new tokens, kvserve only
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench_gateway as bg  # noqa: E402
import colocate_output  # noqa: E402
import hf_reference as hf  # noqa: E402
import openai_load  # noqa: E402
import vllm_peer  # noqa: E402
from chaos import kvserve_commit  # noqa: E402
from disagg_stack import children_of  # noqa: E402
from results_io import cpu_info, write_results  # noqa: E402

from kvserve.common.tokenizer import Tokenizer  # noqa: E402
from kvserve.services.model_store import prepare_default_model  # noqa: E402

BUSY_CPU = 0
BUSY_LOOP = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"
STACK_ARGS = ("--num-pages", "1024")  # room for the whole burst, as the report's stack

# name -> (what it is, `kvserve up` flags)
KVSERVE_CONFIGS = {
    "kvserve": ("kvserve up's defaults: 1 thread (the CPUs less one), unbound", ()),
    "kvserve_old_default": ("the default before --worker-cpus: torch's threads (2), unbound",
                            ("--worker-cpus", "none")),
    "kvserve_1t_bound": ("vLLM's default choice: 1 thread bound to CPU 0, CPU 1 left to the other services",
                         ("--worker-cpus", "0")),
    "kvserve_2t_bound": ("2 threads bound to CPUs 0-1", ("--worker-cpus", "0-1")),
}


class Busy:
    """The unrelated busy process on ``cpu`` while the block runs."""

    def __init__(self, cpu: int):
        self.cpu = cpu

    def __enter__(self):
        # A session of its own, as an unrelated process has: with the kernel's autogroup scheduling, CPU time is
        # shared fairly between sessions first, and vLLM's server runs in a session of its own (vllm_peer.py)
        # where kvserve's stack runs in this benchmark's; a busy loop in this session would compete with kvserve's
        # worker alone.
        self.proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(self.cpu)], start_new_session=True)
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


def affinities() -> dict[str, list[str]]:
    """For each process this benchmark started (the servers' processes): its command's first words and the
    distinct CPU lists its threads may run on (from /proc)."""
    out = {}
    for pid in children_of(os.getpid()):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            lists, tasks = set(), list(Path(f"/proc/{pid}/task").iterdir())
            for task in tasks:
                status = (task / "status").read_text()
                lists.add(status.split("Cpus_allowed_list:")[1].split()[0])
        except (OSError, IndexError):
            continue
        words = [a.decode() for a in argv if a][1:]
        name = " ".join(w for w in words[:6] if "/" not in w)
        out[f"{pid} {name}"] = {"cpus": sorted(lists), "threads": len(tasks)}
    return out


def rounds(base_url: str, model: str, jobs: list, num_rounds: int) -> dict:
    """A warm-up burst (the whole burst: the first run of each prompt shape costs more on either server), then
    ``num_rounds`` rounds of the burst unloaded and loaded (order alternating)."""
    openai_load.burst(base_url, model, jobs)
    runs: dict[str, list[dict]] = {"unloaded": [], "loaded": []}
    for r in range(num_rounds):
        for condition in (("unloaded", "loaded") if r % 2 == 0 else ("loaded", "unloaded")):
            load_avg = os.getloadavg()[0]
            with Busy(BUSY_CPU) if condition == "loaded" else contextlib.nullcontext():
                result = openai_load.burst(base_url, model, jobs)
            result["load_avg_1m_before"] = load_avg
            runs[condition].append(result)
            print(f"  round {r}: {condition} {result['tokens_per_s']:.1f} tok/s", flush=True)
    return summarise(runs)


def summarise(runs: dict[str, list[dict]]) -> dict:
    out = {"runs": runs}
    for condition, results in runs.items():
        for key in ("tokens_per_s", "ttft_p50_s", "tpot_p50_s"):
            out[f"{condition}_{key}"] = statistics.median(r[key] for r in results)
    out["loaded_over_unloaded"] = out["loaded_tokens_per_s"] / out["unloaded_tokens_per_s"]
    return out


def run_kvserve(name: str, jobs: list, num_rounds: int, model: str) -> dict:
    why, flags = KVSERVE_CONFIGS[name]
    print(f"{name}: {why}", flush=True)
    t0 = time.perf_counter()
    with bg.stack(*STACK_ARGS, *flags) as (_, stats):
        start_s = time.perf_counter() - t0
        bound = affinities()
        result = rounds(stats["http"], model, jobs, num_rounds)
    return {**result, "server": "kvserve", "why": why, "flags": list(flags), "start_s": start_s,
            "processes": bound}


def run_vllm(name: str, model_dir: Path, jobs: list, num_rounds: int) -> dict:
    config = vllm_peer.VLLM_CONFIGS[name]
    print(f"{name}: {config.why}", flush=True)
    with vllm_peer.vllm_server(model_dir, config) as server:
        bound = affinities()
        result = rounds(server.base_url, server.model, jobs, num_rounds)
    return {**result, "server": "vllm", "why": config.why, "version": server.version, "argv": list(server.argv),
            "env": server.env, "start_s": server.start_s, "processes": bound}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 round, a smaller burst, kvserve only")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per server (default 3; --quick 1)")
    ap.add_argument("--no-vllm", action="store_true", help="kvserve's rows only")
    ap.add_argument("--no-fp32", action="store_true", help="leave out vLLM float32")
    ap.add_argument("--configs", default=",".join(KVSERVE_CONFIGS), help="kvserve rows, comma-separated")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    num_rounds = args.rounds or (1 if args.quick else 3)
    t0 = time.perf_counter()
    model_dir = prepare_default_model(progress=False)
    tok = Tokenizer(model_dir)
    corpus = hf.corpus_token_ids(model_dir)
    n, max_new = (8, 32) if args.quick else (24, 128)
    jobs, _ = bg.as_text(tok, hf.make_workload(n, seed=1, corpus=corpus, max_new=max_new))
    rows = {name: run_kvserve(name, jobs, num_rounds, model_dir.name) for name in args.configs.split(",") if name}
    if not (args.quick or args.no_vllm):
        why_not = vllm_peer.available()
        names = ["vllm_bf16"] + ([] if args.no_fp32 else ["vllm_fp32"])
        for name in names:
            rows[name] = {"skipped": why_not} if why_not else run_vllm(name, model_dir, jobs, num_rounds)
    report = {"bench": "colocate", "date": dt.date.today().isoformat(), "quick": args.quick, "rounds": num_rounds,
              "requests": n, "max_new": max_new,
              "busy_cpu": BUSY_CPU, "cpu": cpu_info(), "kvserve": kvserve_commit(),
              "wall_min": (time.perf_counter() - t0) / 60, "rows": rows}
    name = "colocate-quick" if args.quick else "colocate"
    write_results(report, name, colocate_output.markdown(report), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
