"""The benchmark report's ratios, plots (matplotlib, PNG) and Markdown table, from its JSON."""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import peer_output  # noqa: E402


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def add_ratios(out: dict) -> None:
    t, c, p = out["throughput"], out["concurrency"], out["prefix"]
    t["kvserve_over_hf_generate"] = _ratio(t["kvserve"]["tokens_per_s"], t["hf_generate"]["tokens_per_s"])
    t["kvserve_over_hf_generate_batch"] = _ratio(t["kvserve"]["tokens_per_s"], t["hf_generate_batch"]["tokens_per_s"])
    c["kvserve_over_raw_runner"] = _ratio(c["kvserve"]["tokens_per_s"], c["raw_runner"]["tokens_per_s"])
    p["cached_ttft_over_hf_ttft"] = _ratio(p["kvserve_on"]["ttft_rest_mean_s"], p["hf"]["ttft_rest_mean_s"])
    k = out["kv_cache"]
    k["kvserve_over_hf_with_cache"] = _ratio(k["kvserve_with_cache_tok_s"], k["hf_with_cache_tok_s"])
    lat = out["latency"]
    lat["kvserve_over_hf"] = [{"clients": k["clients"], "ttft_p50": _ratio(k["ttft_p50_s"], h["ttft_p50_s"]),
                               "ttft_p99": _ratio(k["ttft_p99_s"], h["ttft_p99_s"]),
                               "tpot_p50": _ratio(k["tpot_p50_s"], h["tpot_p50_s"])}
                              for k, h in zip(lat["kvserve"], lat["hf_generate"], strict=True)]


def _bars(ax, labels, values, title, ylabel):
    bars = ax.bar(labels, values, color=["#2b6cb0", "#a0aec0", "#718096", "#4a5568"][: len(values)])
    ax.bar_label(bars, fmt="%.1f")
    ax.set_title(title)
    ax.set_ylabel(ylabel)


def plots(out: dict, stem: Path) -> list[Path]:
    t, p, lat, mem = out["throughput"], out["prefix"], out["latency"], out["memory"]
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    _bars(ax, ["kvserve", "HF generate()", "HF generate_batch"],
          [t["kvserve"]["tokens_per_s"], t["hf_generate"]["tokens_per_s"], t["hf_generate_batch"]["tokens_per_s"]],
          "Mixed burst throughput", "generated tokens/s")
    paths.append(_save(fig, stem, "throughput"))
    fig, ax = plt.subplots(figsize=(7, 4))
    groups = [("kvserve, cache on", p["kvserve_on"]), ("kvserve, cache off", p["kvserve_off"]), ("HF", p["hf"])]
    x = range(len(groups))
    ax.bar([i - 0.2 for i in x], [g["ttft_first_s"] * 1000 for _, g in groups], 0.4, label="request 1")
    ax.bar([i + 0.2 for i in x], [g["ttft_rest_mean_s"] * 1000 for _, g in groups], 0.4, label="mean of 2..10")
    ax.set_xticks(list(x), [n for n, _ in groups])
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("Shared ~2000-token system prompt")
    ax.legend()
    paths.append(_save(fig, stem, "prefix"))
    fig, ax = plt.subplots(figsize=(6, 4))
    clients = [r["clients"] for r in lat["kvserve"]]
    for who, color in (("kvserve", "#2b6cb0"), ("hf_generate", "#a0aec0")):
        for key, style in (("ttft_p50_s", "o-"), ("ttft_p99_s", "o--"), ("tpot_p50_s", "s-")):
            ax.plot(clients, [r[key] * 1000 for r in lat[who]], style, color=color,
                    label=f"{'kvserve' if who == 'kvserve' else 'HF generate()'} {key.replace('_s', '')}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(clients, [str(c) for c in clients])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("ms")
    ax.set_title("Latency under load (closed-loop clients)")
    ax.legend(fontsize=7)
    paths.append(_save(fig, stem, "latency"))
    fig, ax = plt.subplots(figsize=(6, 4))
    pages = mem["pages"]
    _bars(ax, ["pages of 16", "padded to longest"], [100 * pages["paged_utilisation"],
                                                      100 * pages["padded_utilisation"]],
          "KV slots holding a token (mixed workload)", "% of allocated slots")
    paths.append(_save(fig, stem, "memory"))
    return paths + peer_output.plot(out, stem, _bars, _save)


def _save(fig, stem: Path, name: str) -> Path:
    path = stem.with_name(f"{stem.name}-{name}.png")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def markdown(out: dict, plot_names: list[str]) -> str:
    t, c, p, k, mem, lat = (out[key] for key in ("throughput", "concurrency", "prefix", "kv_cache", "memory",
                                                 "latency"))
    rows = ["| workload | kvserve | HF / reference | ratio |", "|---|---:|---:|---:|",
            f"| mixed burst, tok/s, vs HF `generate()` one at a time | {t['kvserve']['tokens_per_s']:.1f} | "
            f"{t['hf_generate']['tokens_per_s']:.1f} | {t['kvserve_over_hf_generate']:.2f}x |",
            f"| mixed burst, tok/s, vs HF continuous batching | {t['kvserve']['tokens_per_s']:.1f} | "
            f"{t['hf_generate_batch']['tokens_per_s']:.1f} | {t['kvserve_over_hf_generate_batch']:.2f}x |",
            *([f"| mixed burst, tok/s, through HTTP (openai client) vs gRPC (SDK) | "
               f"{t['kvserve_http']['tokens_per_s']:.1f} | {t['kvserve']['tokens_per_s']:.1f} (gRPC) | "
               f"{t['kvserve_http']['tokens_per_s'] / t['kvserve']['tokens_per_s']:.2f}x |"]
              if "kvserve_http" in t else []),
            f"| {c['num_requests']} concurrent, tok/s, vs the raw batched forward | "
            f"{c['kvserve']['tokens_per_s']:.1f} | {c['raw_runner']['tokens_per_s']:.1f} | "
            f"{c['kvserve_over_raw_runner']:.0%} |",
            f"| prefix: TTFT of requests 2..10, cache on (vs HF, no reuse) | "
            f"{p['kvserve_on']['ttft_rest_mean_s'] * 1000:.0f} ms | {p['hf']['ttft_rest_mean_s'] * 1000:.0f} ms | "
            f"{p['cached_ttft_over_hf_ttft']:.1%} |",
            f"| prefix: TTFT 2..10 / TTFT 1, cache on / off | {p['kvserve_on']['rest_over_first']:.1%} | "
            f"{p['kvserve_off']['rest_over_first']:.1%} (off) | |",
            f"| {k['generated_tokens']} tokens, tok/s with KV cache (vs HF with cache) | "
            f"{k['kvserve_with_cache_tok_s']:.1f} | {k['hf_with_cache_tok_s']:.1f} | "
            f"{k['kvserve_over_hf_with_cache']:.2f}x |",
            f"| KV cache vs none, speed-up (HF's) | {k['speedup_kvserve']:.1f}x | {k['speedup_hf']:.1f}x | |",
            f"| bytes per token ({mem['kv_dtype']}), calculator vs worker | {mem['bytes_per_token_calculator']:,} | "
            f"{mem['bytes_per_token_worker']:,} | "
            f"{mem['bytes_per_token_calculator'] / mem['bytes_per_token_worker']:.2f} |",
            f"| pool bytes, calculator vs the real tensor | {mem['pool_bytes_calculator']:,} | "
            f"{mem['pool_bytes_measured']:,} | {mem['calculator_over_measured']:.2f} |",
            f"| KV slots holding a token: pages of 16 vs padding to the longest | "
            f"{mem['pages']['paged_utilisation']:.1%} | {mem['pages']['padded_utilisation']:.1%} | |"]
    rows.append(f"| bytes per token, HF's DynamicCache measured | | {mem['bytes_per_token_hf_measured']:,.0f} | |")
    if "long_prompt" in out:  # reports before 2026-12-01 have none
        lp = out["long_prompt"]
        ours, theirs = lp["kvserve"], lp["hf"]
        rows.append(f"| long prompt ({lp['prompt_tokens']:,} tokens, fresh): TTFT vs HF `generate()` | "
                    f"{ours['ttft_s']:.2f} s | {theirs['ttft_s']:.2f} s | {ours['ttft_s'] / theirs['ttft_s']:.2f}x |")
        rows.append(f"| long prompt: time per output token after it (HF's / kvserve's) | "
                    f"{1e3 * ours['tpot_s']:.1f} ms | {1e3 * theirs['tpot_s']:.1f} ms | "
                    f"{theirs['tpot_s'] / ours['tpot_s']:.2f}x |")
    if "tracing" in out:
        tr = out["tracing"]
        rows.append(f"| tracing on vs off, tok/s | {tr['on_tokens_per_s']:.1f} | {tr['off_tokens_per_s']:.1f} | "
                    f"{tr['on_over_off']:.1%} |")
    load = ["", f"Latency under load: closed-loop clients, {lat['requests_per_client']} requests each, "
            f"{lat['max_tokens']} new tokens; HF `generate()` serves one request at a time (first come, first served).",
            "", "| clients | server | TTFT p50 | TTFT p90 | TTFT p99 | TPOT p50 | TPOT p90 | TPOT p99 |",
            "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for k, h in zip(lat["kvserve"], lat["hf_generate"], strict=True):
        for name, r in (("kvserve", k), ("HF generate()", h)):
            load.append(f"| {r['clients']} | {name} | " + " | ".join(
                f"{r[f'{m}_p{q}_s'] * 1000:.0f} ms" for m in ("ttft", "tpot") for q in (50, 90, 99)) + " |")
    share = out.get("kv_wait_share_pct")
    compute = out.get("compute_share_pct")
    calls = out.get("kv_call_share_pct")
    calls_note = f" (a StepPages round trip in {calls:.0f}% of steps)" if calls is not None else ""
    tail = [f"\nShare of the gateway's step time waiting on the kvmanager: {share:.2f}%{calls_note}."
            if share is not None else "",
            f"Share of it in the worker's forward pass and sampling: {compute:.1f}% (the rest: gRPC, scheduling, "
            f"detokenising)." if compute is not None else ""]
    if out.get("rerun"):  # a stage measured again after the run and merged into it (the JSON says which, and why)
        tail.append(f"\nStage \"{out['rerun']['stage']}\" was rerun and merged: {out['rerun']['why']}.")
    images = [f"![{name}]({name})" for name in plot_names]
    return "\n".join(rows + load + tail + [peer_output.markdown(out)] + images) + "\n"
