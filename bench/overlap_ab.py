"""Page ops overlapped with compute, on against off, alternated round by round.

    python bench/overlap_ab.py [--rounds 8] [--out bench/results/overlap-ab-DATE.json]

Each round runs the report's mixed burst (24 requests, prompts of 32-512 corpus tokens, 16-128 new tokens) through
a `kvserve up` stack twice: as it ships (a kvmanager call that only commits pages and tops up headroom is made
while the worker computes) and with `--no-overlap-page-ops` (every call answered before the worker computes),
the order swapped every round. Per side: generated tokens/s, the share of step wall time the gateway spent
waiting on the kvmanager, the share of steps that called it, and how many calls overlapped. Figures are medians
over rounds; every round is kept.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench_gateway as bg  # noqa: E402
from results_io import write_results  # noqa: E402
from throughput_ab import workload  # noqa: E402

SIDES = {"overlap": (), "no-overlap": ("--no-overlap-page-ops",)}


def run_side(flags: tuple[str, ...], texts) -> dict:
    with bg.stack("--num-pages", "2048", *flags) as (gateway, stats):
        bg.kvserve_burst(gateway, texts[:2])  # warm-up
        burst = bg.kvserve_burst(gateway, texts)
    # the stack has stopped: stats holds what its engines logged when they stopped
    return {"tok_s": burst["tokens_per_s"], "ttft_p50_s": burst["ttft_p50_s"], "tpot_p50_s": burst["tpot_p50_s"],
            "kv_wait_share_pct": stats["kv_wait_share_pct"], "kv_call_share_pct": stats["kv_call_share_pct"],
            "compute_share_pct": stats["compute_share_pct"], "calls_overlapped_pct": stats["kv_calls_overlapped_pct"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    _, (texts, _) = workload()
    rounds = []
    for r in range(args.rounds):
        order = list(SIDES) if r % 2 == 0 else list(SIDES)[::-1]
        result = {side: run_side(SIDES[side], texts) for side in order}
        rounds.append(result)
        print(f"round {r + 1}: " + "; ".join(
            f"{side} {x['tok_s']:.1f} tok/s, kvmanager wait {x['kv_wait_share_pct']:.2f}% of step time"
            for side, x in result.items()), flush=True)
    medians = {side: {k: statistics.median(rnd[side][k] for rnd in rounds) for k in rounds[0][side]}
               for side in SIDES}
    report = {"date": str(dt.date.today()), "workload": "the report's mixed burst, 24 requests, --num-pages 2048",
              "rounds": rounds, "median": medians,
              "tok_s_ratio_median": statistics.median(rnd["overlap"]["tok_s"] / rnd["no-overlap"]["tok_s"]
                                                      for rnd in rounds)}
    lines = ["| side | tok/s | kvmanager wait, % of step time | steps that call, % | calls overlapped, % "
             "| TTFT p50 s | TPOT p50 s |", "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {side} | {m['tok_s']:.1f} | {m['kv_wait_share_pct']:.2f} | {m['kv_call_share_pct']:.1f} "
              f"| {m['calls_overlapped_pct']:.1f} | {m['ttft_p50_s']:.3f} | {m['tpot_p50_s']:.4f} |"
              for side, m in medians.items()]
    lines += ["", f"Medians over {args.rounds} alternated rounds; overlap / no-overlap tok/s, median of the rounds' "
              f"ratios: {report['tok_s_ratio_median']:.3f}."]
    write_results(report, "overlap-ab", "\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
