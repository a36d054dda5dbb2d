"""Long prompts: TTFT and time per output token across prompt lengths, kvserve vs HF transformers vs kvserve's
reference prefill path, in one run; and the decodes that run while a long prompt prefills.

    python bench/bench_long.py [--quick] [--out bench/results/long-DATE.json]          # make bench-long

  lengths   one request at a time, greedy, 64 new tokens (ignore_eos), prefix caching off, each prompt a fresh
            slice of real text: through `kvserve up` (the cpu backend's paged prefill kernel), through `kvserve
            up` with KVSERVE_PREFILL_KERNEL=0 (the reference backend's gather + SDPA for prefill chunks), and
            HF's `generate` (TTFT: generate(max_new_tokens=1); TPOT: (generate(64) - TTFT) / 63). The three
            alternate per repeat; medians of the repeats.
  bandwidth decode attention at 7k context, one layer in-process (the cpu kernel), batch 1 and 16: the K/V
            bytes it reads per second, against the machine's read bandwidth measured in the same run (a sum
            over a 1 GiB tensor: one read of every byte); median of repeats
  floor     the least a prefill can cost on this machine (the model's multiply-adds at its float32 GEMM rate),
            against HF's TTFT at the longest length (bench/long_floor.py)
  steps     one 512-token prefill step over 0 to 6.5k cached tokens, in-process: the paged prefill kernel vs the
            reference path, alternated (bench/long_floor.py)
  decodes   16 short requests decoding (64-token prompts, 192 new tokens) when a 4k-token prompt arrives:
            the short requests' time per output token before it arrives, while it prefills (its arrival to its
            first token) and after; the long request's TTFT; for a 512- and a 2,048-token step budget, and for
            the 512 budget with --long-prefill-token-threshold 128 and 64.

Writes bench/results/long-<date>.json (long-quick-<date> with --quick), the Markdown table and a PNG plot.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import datetime as dt
import os
import platform
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench_gateway as bg  # noqa: E402
import hf_reference as hf  # noqa: E402
import long_floor  # noqa: E402
from results_io import write_results  # noqa: E402

from kvserve.common.tokenizer import Tokenizer  # noqa: E402
from kvserve.services.client import Client  # noqa: E402
from kvserve.services.model_store import prepare_default_model  # noqa: E402

NEW_TOKENS = 64


@dataclass(frozen=True)
class Sizes:
    lengths: tuple[int, ...] = (256, 1024, 2048, 4096, 7000, 8000)
    repeats: int = 2
    num_short: int = 16
    short_prompt: int = 64
    short_new: int = 192
    long_prompt: int = 4096
    budgets: tuple[int, ...] = (512, 2048)
    thresholds: tuple[int, ...] = (0, 128, 64)  # --long-prefill-token-threshold, each with the first budget


QUICK = Sizes(lengths=(256, 1024), repeats=1, num_short=4, short_new=64, long_prompt=1024, budgets=(512,),
              thresholds=(0, 64))


class Prompts:
    """Fresh slices of the corpus as text, each of about n tokens as the gateway tokenises them."""

    def __init__(self, tok: Tokenizer, corpus: list[int]):
        self.tok, self.corpus, self.at = tok, corpus, 0

    def take(self, n: int) -> tuple[str, list[int]]:
        if self.at + n > len(self.corpus):
            self.at = (self.at + 7919) % max(1, len(self.corpus) - n)  # wrap, at another offset
        ids = self.corpus[self.at:self.at + n]
        self.at += n
        text = self.tok.decode(ids)
        return text, self.tok.encode(text)


def kvserve_one(address: str, text: str) -> dict:
    with Client(address, timeout_s=3600) as client:
        r = bg.stream_one(client, text, NEW_TOKENS)
    return {"ttft_s": r["ttft_s"], "tpot_s": r["tpot_s"], "cached_tokens": r["cached_tokens"]}


def hf_one(model, ids: list[int]) -> dict:
    ttft = hf.hf_ttft_s(model, ids)
    t0 = time.perf_counter()
    out = hf.hf_generate_serial(model, [hf.Workitem(tuple(ids), NEW_TOKENS)], warmup=False)
    total = time.perf_counter() - t0
    assert len(out["outputs"][0]) == NEW_TOKENS, "HF stopped early"
    return {"ttft_s": ttft, "tpot_s": (total - ttft) / (NEW_TOKENS - 1)}


STACKS = {"kvserve": {}, "kvserve_reference": {"KVSERVE_PREFILL_KERNEL": "0"}}


def lengths_section(sz: Sizes, prompts: Prompts, model) -> dict:
    runs: dict[str, dict[int, list[dict]]] = {name: {n: [] for n in sz.lengths} for name in [*STACKS, "hf"]}
    actual: dict[int, int] = {}
    for rep in range(sz.repeats):
        texts = {n: prompts.take(n) for n in sz.lengths}  # the same prompts for all three in this repeat
        for n, (_, ids) in texts.items():
            actual[n] = len(ids)
        for name, env in STACKS.items():
            print(f"[{time.strftime('%X')}] lengths: {name}, repeat {rep + 1}", flush=True)
            with bg.stack("--no-prefix-caching", "--max-num-batched-tokens", "2048",
                          env={**os.environ, **env}) as (address, _):
                kvserve_one(address, prompts.take(64)[0])  # warm-up
                for n in sz.lengths:
                    runs[name][n].append(kvserve_one(address, texts[n][0]))
        print(f"[{time.strftime('%X')}] lengths: hf, repeat {rep + 1}", flush=True)
        for n in sz.lengths:
            runs["hf"][n].append(hf_one(model, texts[n][1]))
    rows = []
    for n in sz.lengths:
        row = {"prompt_tokens": actual[n]}
        for name in runs:
            row[f"{name}_ttft_s"] = statistics.median(r["ttft_s"] for r in runs[name][n])
            row[f"{name}_tpot_s"] = statistics.median(r["tpot_s"] for r in runs[name][n])
        row["ttft_vs_hf"] = row["kvserve_ttft_s"] / row["hf_ttft_s"]
        row["ttft_vs_reference"] = row["kvserve_ttft_s"] / row["kvserve_reference_ttft_s"]
        row["tpot_hf_over_kvserve"] = row["hf_tpot_s"] / row["kvserve_tpot_s"]
        rows.append(row)
    return {"rows": rows, "runs": {name: {str(n): v for n, v in r.items()} for name, r in runs.items()}}


def median_ms(fn, repeats: int = 15) -> float:
    """fn's median wall time in ms over ``repeats`` calls, after one untimed call."""
    return 1e3 * long_floor.median_s(fn, repeats)


def read_bandwidth_gbs(num_bytes: int = 1 << 30, repeats: int = 7) -> float:
    """This machine's read bandwidth in GB/s: the median time of a sum over a float32 tensor of ``num_bytes``
    (far beyond the last-level cache: one streaming read of every byte)."""
    import torch

    big = torch.ones(num_bytes // 4)
    return big.numel() * 4 / median_ms(big.sum, repeats) / 1e6


KV_SHAPE = (9, 3, 64, 16)  # the default model's attention: heads, kv heads, head dim, and the page size


def one_layer_pool(pool_bytes: int):
    """One layer's float32 K/V pages filling ``pool_bytes``: [2, pages, page, kv heads, head dim]."""
    import torch

    _, kv_heads, head_dim, page = KV_SHAPE
    return torch.randn(2, pool_bytes // (2 * page * kv_heads * head_dim * 4), page, kv_heads, head_dim)


def decode_read_rate(ext, cache, context: int, batch: int, machine_gbs: float) -> dict:
    """One layer of decode attention (the cpu kernel) at ``batch`` sequences of ``context`` tokens over the pool
    ``cache`` (one_layer_pool): the K/V bytes it reads per second. Every call reads other pages of the pool
    (disjoint page tables, cycled through; a batch that needs more pages than the pool holds wraps around it), so
    the K/V come from memory when the pool is far beyond the last-level cache."""
    import itertools

    import torch

    heads, kv_heads, head_dim, page = KV_SHAPE
    num_pages, pages = cache.shape[1], -(-context // page)
    sets = max(1, num_pages // (batch * pages))
    perm = torch.randperm(num_pages)
    tables = itertools.cycle([perm[(i * batch * pages + torch.arange(batch * pages)) % num_pages]
                              .view(batch, pages).contiguous() for i in range(sets)])
    lens = torch.full((batch,), context, dtype=torch.long)
    q = torch.randn(batch, heads, head_dim)
    ms = median_ms(lambda: ext.paged_decode(q, cache, None, next(tables), lens, head_dim ** -0.5), 3 * sets)
    read = batch * context * kv_heads * head_dim * 4 * 2
    return {"batch": batch, "ms_per_layer": ms, "kv_bytes": read, "table_sets": sets,
            "gbs": read / ms / 1e6, "of_machine": read / ms / 1e6 / machine_gbs}


def bandwidth_section(context: int = 7000, pool_bytes: int = 1 << 30) -> dict:
    """Decode attention's K/V read rate at a long context vs the machine's read bandwidth. The pool is 1 GiB
    (far beyond the last-level cache) and every call reads other pages of it, so the K/V come from memory."""
    from kvserve.kernels.cpu_paged import CPUPagedBackend

    ext = CPUPagedBackend().ext
    machine_gbs = read_bandwidth_gbs(pool_bytes)
    cache = one_layer_pool(pool_bytes)
    return {"context": context, "machine_read_gbs": machine_gbs, "pool_bytes": pool_bytes,
            "batches": [decode_read_rate(ext, cache, context, batch, machine_gbs) for batch in (1, 16)]}


def short_stream(client: Client, text: str, max_tokens: int, times: list[float], started: threading.Event,
                 counter: list[int], num: int, lock: threading.Lock) -> None:
    first = True
    for delta in client.generate(prompt=text, max_tokens=max_tokens, ignore_eos=True):
        now = time.perf_counter()
        times.extend([now] * len(delta.token_ids))
        if first and delta.token_ids:
            first = False
            with lock:
                counter[0] += 1
                if counter[0] == num:
                    started.set()


def gaps_in(times_per_req: list[list[float]], lo: float, hi: float) -> list[float]:
    """Every inter-token gap of the short requests whose token arrived in (lo, hi]."""
    return [b - a for ts in times_per_req for a, b in zip(ts, ts[1:], strict=False) if lo < b <= hi]


def decodes_section(sz: Sizes, prompts: Prompts) -> list[dict]:
    out = []
    configs = [(b, 0) for b in sz.budgets] + [(sz.budgets[0], t) for t in sz.thresholds if t]
    for budget, threshold in configs:
        print(f"[{time.strftime('%X')}] decodes while a {sz.long_prompt}-token prompt prefills, budget {budget}, "
              f"threshold {threshold}", flush=True)
        shorts = [prompts.take(sz.short_prompt)[0] for _ in range(sz.num_short)]
        long_text, long_ids = prompts.take(sz.long_prompt)
        with bg.stack("--no-prefix-caching", "--max-num-batched-tokens", str(budget),
                      "--long-prefill-token-threshold", str(threshold)) as (address, _), \
                Client(address, timeout_s=3600) as client, cf.ThreadPoolExecutor(sz.num_short) as pool:
            kvserve_one(address, prompts.take(64)[0])  # warm-up
            times: list[list[float]] = [[] for _ in shorts]
            started, counter, lock = threading.Event(), [0], threading.Lock()
            futures = [pool.submit(short_stream, client, text, sz.short_new, times[i], started, counter,
                                   sz.num_short, lock) for i, text in enumerate(shorts)]
            started.wait()
            time.sleep(1.0)  # a second of steady decoding before the long prompt arrives (a baseline window)
            arrive = time.perf_counter()
            long = bg.stream_one(client, long_text, 16)
            first_token = arrive + long["ttft_s"]
            for f in futures:
                f.result()
        before = gaps_in(times, 0.0, arrive)
        during = gaps_in(times, arrive, first_token)
        after = gaps_in(times, first_token, float("inf"))
        out.append({"budget": budget, "threshold": threshold, "long_prompt_tokens": len(long_ids),
                    "long_ttft_s": long["ttft_s"],
                    "tpot_before_s": statistics.median(before) if before else None,
                    "tpot_during_s": statistics.median(during) if during else None,
                    "tpot_during_max_s": max(during) if during else None,
                    "tpot_after_s": statistics.median(after) if after else None,
                    "gaps_during": len(during)})
    return out


def markdown(report: dict) -> str:
    header = ["One request at a time, greedy, 64 new tokens, prefix caching off; medians of "
             f"{report['sizes']['repeats']} alternated repeats. TTFT in seconds, time per output token (TPOT) in ms.",
             "", "| prompt tokens | kvserve TTFT | reference path TTFT | HF TTFT | kvserve / HF | kvserve / reference "
             "| kvserve TPOT | reference TPOT | HF TPOT | HF / kvserve TPOT |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines = header if report["lengths"]["rows"] else []
    for r in report["lengths"]["rows"]:
        lines.append(f"| {r['prompt_tokens']:,} | {r['kvserve_ttft_s']:.2f} | {r['kvserve_reference_ttft_s']:.2f} | "
                     f"{r['hf_ttft_s']:.2f} | {r['ttft_vs_hf']:.2f}x | {r['ttft_vs_reference']:.2f}x | "
                     f"{1e3 * r['kvserve_tpot_s']:.1f} | {1e3 * r['kvserve_reference_tpot_s']:.1f} | "
                     f"{1e3 * r['hf_tpot_s']:.1f} | {r['tpot_hf_over_kvserve']:.2f}x |")

    def ms(x):
        return "-" if x is None else f"{1e3 * x:.1f}"

    if report.get("bandwidth"):
        bw = report["bandwidth"]
        lines += ["", f"Decode attention at {bw['context']:,} tokens of context, one layer (float32 K/V), against this "
                  f"machine's read bandwidth ({bw['machine_read_gbs']:.1f} GB/s, measured in the same run); each "
                  "call reads other pages of a 1 GiB pool, so K/V come from memory, not the caches:", "",
                  "| batch | ms per layer | K/V read | GB/s | of the machine's |", "|---:|---:|---:|---:|---:|"]
        for b in bw["batches"]:
            lines.append(f"| {b['batch']} | {b['ms_per_layer']:.2f} | {b['kv_bytes'] / 1e6:.1f} MB | {b['gbs']:.1f} | "
                         f"{100 * b['of_machine']:.0f}% |")
        lines.append("")
    lines += long_floor.markdown(report.get("floor"), report.get("steps", []))
    if not report["decodes"]:
        return "\n".join(lines) + "\n"
    lines += ["", f"{report['sizes']['num_short']} short requests decoding when a long prompt arrives (their time "
              "per output token, median of the inter-token gaps in each window, ms):", "",
              "| step budget | long-prefill threshold | long prompt tokens | its TTFT s | TPOT before | TPOT while it "
              "prefills | worst gap while it prefills | TPOT after |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]

    for d in report["decodes"]:
        lines.append(f"| {d['budget']} | {d.get('threshold', 0) or 'off'} | {d['long_prompt_tokens']:,} | "
                     f"{d['long_ttft_s']:.2f} | "
                     f"{ms(d['tpot_before_s'])} | {ms(d['tpot_during_s'])} | {ms(d['tpot_during_max_s'])} | "
                     f"{ms(d['tpot_after_s'])} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["lengths"]["rows"]
    n = [r["prompt_tokens"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("kvserve", "kvserve"), ("kvserve_reference", "kvserve, reference prefill"), ("hf", "HF")):
        a.plot(n, [r[f"{key}_ttft_s"] for r in rows], marker="o", label=label)
        b.plot(n, [1e3 * r[f"{key}_tpot_s"] for r in rows], marker="o", label=label)
    a.set(xlabel="prompt tokens", ylabel="TTFT (s)", title="time to first token")
    b.set(xlabel="prompt tokens", ylabel="ms per output token", title="time per output token")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="two short lengths, one repeat (a smoke run)")
    p.add_argument("--sections", default="lengths,bandwidth,floor,steps,decodes",
                   help="comma-separated subset of lengths,bandwidth,floor,steps,decodes")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="prompt lengths instead of the default")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    sz = QUICK if args.quick else Sizes()
    if args.lengths:
        sz = dataclasses.replace(sz, lengths=tuple(args.lengths))
    if args.repeats:
        sz = dataclasses.replace(sz, repeats=args.repeats)
    sections = set(args.sections.split(","))
    model_dir = prepare_default_model(progress=False)
    tok = Tokenizer(model_dir)
    prompts = Prompts(tok, hf.corpus_token_ids(model_dir))
    report = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "quick": args.quick,
              "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
              "sizes": sz.__dict__ | {"lengths": list(sz.lengths), "budgets": list(sz.budgets),
                                     "thresholds": list(sz.thresholds)},
              "lengths": {"rows": []}, "decodes": []}
    hf_model = hf.load_hf(model_dir) if sections & {"lengths", "floor"} else None
    if "lengths" in sections:
        report["lengths"] = lengths_section(sz, prompts, hf_model)
    if "bandwidth" in sections:
        report["bandwidth"] = bandwidth_section()
    if "floor" in sections:
        report["floor"] = long_floor.floor_section(model_dir, sz.lengths,
                                                   lambda n: hf.hf_ttft_s(hf_model, prompts.take(n)[1]))
    if "steps" in sections:
        report["steps"] = long_floor.steps_section(model_dir, repeats=2 if args.quick else 5)
    if "decodes" in sections:
        report["decodes"] = decodes_section(sz, prompts)
    out = write_results(report, "long-quick" if args.quick else "long", markdown(report), args.out)
    if report["lengths"]["rows"]:
        plot(report, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
