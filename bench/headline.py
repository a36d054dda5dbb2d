"""The README's headline ratios, written from the newest full report (bench/results/<date>.json) so that the
front page quotes exactly what `make bench` measured: kvserve against vLLM's CPU build and HF transformers.

    python bench/headline.py            # rewrites README.md between the headline markers
    python bench/headline.py --check    # exit 1 if README.md differs from what the newest report gives

make bench runs it after the report; tests/repo/test_docs.py checks that the README still matches.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS = ROOT / "bench" / "results"
START, END = "<!-- headline: start (bench/headline.py writes this) -->", "<!-- headline: end -->"
REPORT = re.compile(r"^\d{4}-\d\d-\d\d\.json$")


def newest_report() -> Path:
    """The newest full report that ran the vLLM comparison."""
    for path in sorted((p for p in RESULTS.iterdir() if REPORT.match(p.name)), reverse=True):
        if "servers" in json.loads(path.read_text()).get("peers", {}):
            return path
    raise FileNotFoundError("no full report with vLLM rows in bench/results (make bench writes one)")


def _x(value: float) -> str:
    return f"{value:.1f}x" if value >= 10 else f"{value:.2f}x"


def render(report: dict, name: str) -> str:
    """The headline bullets for ``report`` (the JSON of bench/results/``name``)."""
    peers = report["peers"]
    r_best, r_fp32 = peers["ratios"]["vllm_bf16"], peers["ratios"]["vllm_fp32"]
    ours = peers["servers"]["kvserve"]["median"]
    t, p, lp = report["throughput"], report["prefix"], report["long_prompt"]
    hf_cb = ours["burst_tokens_per_s"] / t["hf_generate_batch"]["tokens_per_s"]
    hf_serial = ours["burst_tokens_per_s"] / t["hf_generate"]["tokens_per_s"]
    agree, agree_bf16 = peers["agreement"]["vllm_fp32"], peers["agreement"]["vllm_bf16"]
    version = peers["servers"]["vllm_bf16"]["config"]["version"]
    cpu = report["cpu"]
    link = f"bench/results/{name}"
    lines = [
        f"On one machine ({cpu['model']}, {cpu['cores']} cores, {' '.join(cpu['flags'])}), the same weights and "
        f"workloads through the same OpenAI client, from [`{link}`]({link}) (`make bench`; "
        f"[the report](docs/benchmarks/report.md)). Each figure is kvserve's speed over the other's (above 1: "
        f"kvserve is faster), against vLLM {version}'s CPU build in float32 (like for like) / in bfloat16 (its best "
        f"here; kvserve keeps float32 to match HF token for token):",
        "",
        f"- a mixed burst of {peers['workloads']['burst_requests']} requests: **{_x(r_fp32['burst_throughput'])}** "
        f"/ {_x(r_best['burst_throughput'])} vLLM's throughput; **{_x(hf_cb)}** HF transformers' continuous "
        f"batching, **{_x(hf_serial)}** HF `generate()`;",
        f"- a prefix hit on a ~2,000-token shared prompt: time to first token **{_x(r_fp32['prefix_hit_ttft'])}** "
        f"/ {_x(r_best['prefix_hit_ttft'])} vLLM's own prefix hit; "
        f"**{_x(p['hf']['ttft_rest_mean_s'] / ours['prefix_ttft_rest_mean_s'])}** HF's, which reuses nothing;",
        f"- a fresh {ours['long_prompt_tokens']:,.0f}-token prompt: time to first token {_x(r_fp32['long_ttft'])} / "
        f"{_x(r_best['long_ttft'])} vLLM's, {_x(lp['hf']['ttft_s'] / ours['long_ttft_s'])} HF's; time per output "
        f"token after it **{_x(r_fp32['long_tpot'])}** / {_x(r_best['long_tpot'])} vLLM's;",
        f"- 16 closed-loop clients: TTFT p50 **{_x(r_fp32['latency_ttft_p50'][-1])}** / "
        f"{_x(r_best['latency_ttft_p50'][-1])} vLLM's, time per output token {_x(r_fp32['latency_tpot_p50'][-1])} / "
        f"{_x(r_best['latency_tpot_p50'][-1])};",
        f"- greedy completions identical to vLLM float32's on **{agree['identical']} of {agree['of']}** "
        f"(bfloat16's: {agree_bf16['identical']} of {agree_bf16['of']}).",
    ]
    return "\n".join(lines)


def rewrite(text: str, block: str) -> str:
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise ValueError(f"README.md has no headline markers ({START} ... {END})")
    return pattern.sub(lambda _: f"{START}\n{block}\n{END}", text)


def expected_readme() -> str:
    path = newest_report()
    return rewrite(README.read_text(), render(json.loads(path.read_text()), path.name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    expected = expected_readme()
    if args.check:
        if expected != README.read_text():
            print("README.md's headline differs from the newest report: run python bench/headline.py",
                  file=sys.stderr)
            return 1
        return 0
    README.write_text(expected)
    return 0


if __name__ == "__main__":
    sys.exit(main())
