"""`make chaos`: kvserve's separate processes under closed-loop load, with faults injected in turn (issue 23).

    Redis (Sentinel when available, else one embedded) ── kvmanager leader + standby ── 2 workers ── gateway
    6 closed-loop greedy clients (SDK, streaming, max_tokens 32, ignore_eos) over 8 fixed prompts

Phases, each after a quiet period (a number of requests ended) and drained before the next: a fault-free
baseline, then (a) kill -9 of the leader kvmanager, (b) kill -9 of a worker and a restart, (c) kill -9 of a
worker for good (a fresh one added back), (d) kill -9 of the Redis primary, (e) a worker added mid-load. What
this build cannot do yet is reported as not run, or replaced by the fallback it names (chaos_faults.py).

Per phase: requests, completed, lost (failed), wrong (token ids other than HF transformers' greedy ones,
computed once at start in this process), pages left used on the live pools after the load drained (admin
Stats), and recovery times. Results: bench/results/chaos-<date>.json and .md. Loopback only; a few minutes.

    python bench/chaos.py [--quick] [--clients N] [--faults abcde] [--without FEATURES] [--out PATH] [--logs DIR]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")  # before grpc: children are forked while calls run
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the reference model is loaded from disk, never the hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))
from chaos_output import markdown  # noqa: E402
from chaos_reference import PROMPT_TEXTS, prompt_token_ids, reference_outputs  # noqa: E402
from chaos_run import ChaosConfig, run_chaos  # noqa: E402
from results_io import write_results  # noqa: E402

QUICK = dict(num_clients=3, max_tokens=24, quiet_requests=4)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="3 clients, 24 tokens, 4 requests per quiet period")
    p.add_argument("--clients", type=int, help="closed-loop clients (default 6)")
    p.add_argument("--faults", default="abcde", help="which faults, in order a..e (default all)")
    p.add_argument("--without", default="", help="features not to use, comma-separated, to run the fallbacks: "
                   "membership (a static --workers list), standby (one kvmanager), sentinel (one Redis), "
                   "declare_dead (fault c not run)")
    p.add_argument("--out", type=Path, help="JSON path (default bench/results/chaos-<date>.json)")
    p.add_argument("--logs", type=Path, help="keep the services' logs in this folder")
    return p.parse_args(argv)


def config(args: argparse.Namespace) -> ChaosConfig:
    cfg = ChaosConfig(faults=args.faults, without=tuple(w.strip() for w in args.without.split(",") if w.strip()))
    if args.quick:
        cfg = replace(cfg, **QUICK)
    return replace(cfg, num_clients=args.clients) if args.clients else cfg


def hf_reference(prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], dict]:
    import hf_reference as hf

    t0 = time.perf_counter()
    model = hf.load_hf()
    outputs = reference_outputs(model, prompts, max_tokens)
    return outputs, {"source": "HF transformers greedy generate (fp32, batch 1)",
                     "seconds": time.perf_counter() - t0}


def kvserve_commit() -> str | None:
    """The commit of the kvserve code this run used (``+dirty`` with uncommitted changes), None outside git."""
    import subprocess

    import kvserve.kvmanager

    where = Path(kvserve.kvmanager.__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("+dirty" if dirty else "")


def command_line(argv: list[str]) -> str:
    """How the run was started, for its report: a --logs folder (a path of the machine) shown as DIR."""
    shown = ["DIR" if i and argv[i - 1] == "--logs" else a for i, a in enumerate(argv)]
    return " ".join(["python bench/chaos.py", *shown])


def main(argv=None) -> int:
    from kvserve.common.tokenizer import Tokenizer
    from kvserve.services.model_store import prepare_default_model

    args = parse_args(argv)
    cfg = config(args)
    prompts = prompt_token_ids(Tokenizer(prepare_default_model(progress=False)))
    reference, about = hf_reference(prompts, cfg.max_tokens)
    report = run_chaos(cfg, prompts, reference, log_dir=args.logs)
    report = {"date": dt.date.today().isoformat(),
              "command": command_line(sys.argv[1:]),
              "kvserve_commit": kvserve_commit(), "reference": about, "prompts": list(PROMPT_TEXTS), **report}
    name = "chaos" + ("-quick" if args.quick else "") + "".join(f"-without-{w}" for w in cfg.without)
    write_results(report, name, markdown(report), args.out)
    ran = [p for p in report["phases"] if p["ran"]]
    bad = [p["key"] for p in ran if p["lost"] or p["wrong"] or p["pages_left_total"] or p.get("error")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
