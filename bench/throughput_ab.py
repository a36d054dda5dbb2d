"""The report's mixed burst, kvserve against HF's continuous batching, alternated round by round.

    python bench/throughput_ab.py [--rounds 3] [--out bench/results/throughput-ab-DATE.json]

`make bench` measures each side once, minutes apart; on a shared machine whose speed drifts by 20-40% within
an hour, that ratio moves with the drift. Here each round runs the same 24-request burst through a `kvserve up`
stack, then HF's `generate_batch` over the same prompts in a fresh process (as the report does, so that no
OpenMP team of the other side slows it), and the figures are medians over rounds, with every round's ratio.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench_gateway as bg  # noqa: E402
import hf_reference as hf  # noqa: E402
from results_io import cpu_info  # noqa: E402

from kvserve.common.tokenizer import Tokenizer  # noqa: E402
from kvserve.services.model_store import prepare_default_model  # noqa: E402


def workload():
    """The report's mixed burst: 24 requests, prompts of 32-512 corpus tokens, 16-128 new tokens, seed 1."""
    model_dir = prepare_default_model(progress=False)
    tok = Tokenizer(model_dir)
    return model_dir, bg.as_text(tok, hf.make_workload(24, seed=1, corpus=hf.corpus_token_ids(model_dir),
                                                       max_new=128))


def hf_round(out: Path) -> None:
    """--hf: HF's continuous batching over the burst, in this fresh process; writes its result to ``out``."""
    model_dir, (_, work) = workload()
    result = bg.strip_outputs(hf.hf_generate_batch(hf.load_hf(model_dir), work))
    out.write_text(json.dumps(result))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    p.add_argument("--hf", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.hf:
        hf_round(args.hf)
        return 0
    _, (texts, _) = workload()
    rounds = []
    for r in range(args.rounds):
        with bg.stack("--num-pages", "2048") as (gateway, _):
            bg.kvserve_burst(gateway, texts[:2])  # warm-up
            ours = bg.kvserve_burst(gateway, texts)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "hf.json"
            subprocess.run([sys.executable, __file__, "--hf", str(out)], check=True)
            theirs = json.loads(out.read_text())
        rounds.append({"kvserve_tok_s": ours["tokens_per_s"], "hf_generate_batch_tok_s": theirs["tokens_per_s"],
                       "ratio": ours["tokens_per_s"] / theirs["tokens_per_s"]})
        print(f"round {r + 1}: kvserve {ours['tokens_per_s']:.1f} tok/s, HF continuous batching "
              f"{theirs['tokens_per_s']:.1f} tok/s, {rounds[-1]['ratio']:.2f}x", flush=True)
    report = {"date": str(dt.date.today()), "cpu": cpu_info(), "rounds": rounds,
              "median_kvserve_tok_s": statistics.median(x["kvserve_tok_s"] for x in rounds),
              "median_hf_generate_batch_tok_s": statistics.median(x["hf_generate_batch_tok_s"] for x in rounds),
              "median_ratio": statistics.median(x["ratio"] for x in rounds)}
    print(f"median: kvserve {report['median_kvserve_tok_s']:.1f} tok/s, HF continuous batching "
          f"{report['median_hf_generate_batch_tok_s']:.1f} tok/s; median of the rounds' ratios "
          f"{report['median_ratio']:.2f}x")
    out = args.out or Path(__file__).parent / "results" / f"throughput-ab-{report['date']}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
