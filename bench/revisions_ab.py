"""kvserve at an earlier revision against the working tree, alternated round by round: does a change that should
not move performance (a refactor) leave it where it was?

    python bench/revisions_ab.py --before REV [--rounds 3] [--out bench/results/revisions-ab-DATE.json]

Each round runs `kvserve up` from each side in turn, in the order before, after, then after, before in the next
round, so that a machine whose speed drifts favours neither. On each stack: the report's mixed burst (24
requests, tok/s), the prefix workload (a ~2000-token system prompt and 10 users: TTFT of the hits) and 4
closed-loop clients (TTFT and TPOT p50). The before side is a `git worktree` of REV, imported ahead of the
editable install through PYTHONPATH; both sides use this bench code and the same model, kernels and flags.
Writes the medians over rounds and every round's after/before ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import statistics
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench_gateway as bg  # noqa: E402
import hf_reference as hf  # noqa: E402
from report import latency_under_load  # noqa: E402
from results_io import cpu_info, write_results  # noqa: E402

from kvserve.common.tokenizer import Tokenizer  # noqa: E402
from kvserve.services.model_store import prepare_default_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIGURES = {"burst_tok_s": "higher", "prefix_hit_ttft_s": "lower", "load4_ttft_p50_s": "lower",
           "load4_tpot_p50_s": "lower"}


def packages(tree: Path) -> dict[str, str]:
    """kvserve's subpackages and their folders, as that tree's pyproject.toml maps them (package-dir)."""
    with (tree / "pyproject.toml").open("rb") as f:
        package_dir = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {name.removeprefix("kvserve."): folder for name, folder in package_dir.items()}


@contextlib.contextmanager
def revision_env(rev: str):
    """An environment whose `python -m kvserve...` imports kvserve as it was at ``rev``."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True,
                       capture_output=True)
        try:
            shim = Path(tmp) / "shim" / "kvserve"
            shim.mkdir(parents=True)
            for name, folder in packages(tree).items():
                (shim / name).symlink_to(tree / folder)
            # its own build of the C++ kernels: one cache shared by two source trees would rebuild on every switch
            yield os.environ | {"PYTHONPATH": str(shim.parent), "TORCH_EXTENSIONS_DIR": str(Path(tmp) / "ext")}
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


def workloads():
    model_dir = prepare_default_model(progress=False)
    tok = Tokenizer(model_dir)
    corpus = hf.corpus_token_ids(model_dir)
    burst, _ = bg.as_text(tok, hf.make_workload(24, seed=1, corpus=corpus, max_new=128))
    prefix = bg.prefix_workload(tok, corpus, 2000, 10)
    load = [t for t, _ in burst]
    return burst, prefix, load


def measure(env: dict | None, burst, prefix, load) -> dict:
    with bg.stack("--num-pages", "2048", env=env) as (gateway, _):
        bg.kvserve_burst(gateway, burst[:2])  # warm-up
        b = bg.kvserve_burst(gateway, burst)
        p = bg.kvserve_prefix(gateway, prefix)
        lat = latency_under_load(gateway, load, 4, 2, 16)
    return {"burst_tok_s": b["tokens_per_s"], "prefix_hit_ttft_s": p["ttft_rest_mean_s"],
            "load4_ttft_p50_s": lat["ttft_p50_s"], "load4_tpot_p50_s": lat["tpot_p50_s"]}


def summary(rounds: list[dict]) -> dict:
    out = {}
    for key in FIGURES:
        before = statistics.median(r["before"][key] for r in rounds)
        after = statistics.median(r["after"][key] for r in rounds)
        ratios = [r["after"][key] / r["before"][key] for r in rounds]
        out[key] = {"better": FIGURES[key], "median_before": before, "median_after": after,
                    "median_ratio_after_over_before": statistics.median(ratios), "round_ratios": ratios}
    return out


def markdown(report: dict) -> str:
    lines = [f"kvserve at `{report['before']}` (before) vs the working tree at `{report['after']}` (after), "
             f"{len(report['rounds'])} rounds alternated; medians. CPU: {report['cpu'].get('model', '?')}.", "",
             "| figure | better | before | after | after / before (median of rounds) | rounds |",
             "|---|---|---:|---:|---:|---|"]
    for key, s in report["summary"].items():
        rounds = ", ".join(f"{r:.2f}" for r in s["round_ratios"])
        lines.append(f"| {key} | {s['better']} | {s['median_before']:.3f} | {s['median_after']:.3f} | "
                     f"{s['median_ratio_after_over_before']:.2f} | {rounds} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="the git revision to compare the working tree with")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    git = ["git", "-C", str(ROOT), "rev-parse", "--short"]
    before = subprocess.run([*git, args.before], check=True, capture_output=True, text=True).stdout.strip()
    after = subprocess.run([*git, "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    work = workloads()
    rounds = []
    with revision_env(args.before) as before_env:
        for r in range(args.rounds):
            sides = [("before", before_env), ("after", None)]
            row = {side: measure(env, *work) for side, env in (sides if r % 2 == 0 else sides[::-1])}
            rounds.append(row)
            print(f"round {r + 1}: " + ", ".join(f"{k} {row['after'][k] / row['before'][k]:.2f}x" for k in FIGURES),
                  flush=True)
    report = {"date": str(dt.date.today()), "cpu": cpu_info(), "before": before, "after": after,
              "command": f"python bench/revisions_ab.py --before {args.before} --rounds {args.rounds}",
              "rounds": rounds, "summary": summary(rounds)}
    write_results(report, "revisions-ab", markdown(report), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
