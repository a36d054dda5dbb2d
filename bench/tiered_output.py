"""bench_tiered.py's figures from its turns: medians, hit fractions per tier, the targets; Markdown and a plot."""

from __future__ import annotations

import statistics
from pathlib import Path

TIERS = ("store", "pool", "computed")
RESTARTS = {"worker_kill9": "after the worker's kill -9 and restart (separate processes)",
            "stack_restart": "after `kvserve up` stopped and started on its data dir",
            "stack_restart_own_store": "after every process stopped and started (separate processes, the run's "
                                       "own KV store Redis)"}


def hit_fractions(turns: list[dict]) -> dict:
    """Of the turns' prompt tokens: the shares loaded from the store, hit in the pool and computed; TTFT median."""
    prompt = sum(t["prompt_tokens"] for t in turns)
    store, pool = sum(t["store_tokens"] for t in turns), sum(t["pool_tokens"] for t in turns)
    return {"num_turns": len(turns), "prompt_tokens": prompt, "store": store / prompt, "pool": pool / prompt,
            "computed": 1 - (store + pool) / prompt,
            "usage_cached": sum(t["cached_tokens"] for t in turns) / prompt,
            "kvmanager_store_hits": sum(t["kvmanager_store_hits"] for t in turns) / prompt,
            "num_failed_loads": sum(t["failed_load"] for t in turns),
            "ttft_s": statistics.median(t["ttft_s"] for t in turns)}


def multi_summary(m: dict) -> dict:
    turns = m["turns"]
    s = {mode: {"first": hit_fractions([t for t in ts if t["round"] == 0]),
                "revisit": hit_fractions([t for t in ts if t["round"] > 0])} for mode, ts in turns.items()}
    on = {(t["round"], t["conversation"]): t for t in turns["on"]}
    pairs = [(t, on[t["round"], t["conversation"]]) for t in turns["off"]]
    s["revisit_on_over_off"] = s["on"]["revisit"]["ttft_s"] / s["off"]["revisit"]["ttft_s"]
    s["revisit_paired_ratio_median"] = statistics.median(b["ttft_s"] / a["ttft_s"] for a, b in pairs
                                                         if a["round"] > 0)
    s["same_answers"], s["compared"] = sum(a["text"] == b["text"] for a, b in pairs), len(pairs)
    s["prefill_tokens_per_s"] = statistics.median((t["prompt_tokens"] - t["cached_tokens"]) / t["ttft_s"]
                                                  for t in turns["off"] if t["round"] == 0)
    kv = m["kv_store"]["on"]
    s["load_mb_per_s"] = kv["num_loaded_bytes"] / kv["load_s"] / 1e6 if kv["load_s"] else None
    s["break_even_mb_per_s"] = m["bytes_per_token"] * s["prefill_tokens_per_s"] / 1e6
    return s


def summarise(report: dict) -> None:
    """Adds a "summary" to each section and the issue's "targets" to ``report``."""
    for m in report["multi_turn"].values():
        m["summary"] = multi_summary(m)
    for r in report["restarts"].values():
        if "turns" in r:
            r["summary"] = hit_fractions(r["turns"])
    if "burst" in report:
        b = report["burst"]
        b["summary"] = {"off_tok_s": statistics.median(r["off_tok_s"] for r in b["rounds"]),
                        "on_tok_s": statistics.median(r["on_tok_s"] for r in b["rounds"]),
                        "ratio_median": statistics.median(r["ratio"] for r in b["rounds"])}
    report["targets"] = targets(report)


def targets(report: dict) -> list[dict]:
    rows = []

    def add(what: str, value: float, shown: str, target: str, met: bool) -> None:
        rows.append({"what": what, "value": value, "figure": shown, "target": target, "met": bool(met)})

    for dtype, m in report["multi_turn"].items():
        s = m["summary"]
        ratio = s["revisit_on_over_off"]
        add(f"Revisit TTFT, tier on / off, {dtype} pages (medians)", ratio, f"{ratio:.3f}x", "<= 0.3x", ratio <= 0.3)
        add(f"Greedy answers equal, tier on vs off, {dtype}", s["same_answers"],
            f"{s['same_answers']} of {s['compared']}", "all", s["same_answers"] == s["compared"])
    if "burst" in report:
        ratio = report["burst"]["summary"]["ratio_median"]
        add("Mixed burst output tok/s, tier on / off (median of rounds)", ratio, f"{ratio:.3f}x", ">= 0.95x",
            ratio >= 0.95)
    for key, label in RESTARTS.items():
        if key in report["restarts"]:
            share = report["restarts"][key]["summary"]["store"]
            add(f"Revisit prompt tokens loaded from the store, {label}", share, f"{100 * share:.1f}%", ">= 90%",
                share >= 0.9)
    return rows


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:,.0f} ms" if seconds >= 0.1 else f"{1000 * seconds:.1f} ms"


def _pct(share: float) -> str:
    return f"{100 * share:.1f}%"


def _multi(report: dict) -> list[str]:
    c = report["config"]
    lines = [f"### Multi-turn: time to first token ({c['conversations']} conversations, {c['rounds']} revisit rounds, "
             f"medians)", "",
             "| KV pages | first visit, off | first visit, on | revisit, off | revisit, on | revisit on / off | "
             "paired on / off | same answers |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for dtype, m in report["multi_turn"].items():
        s = m["summary"]
        lines.append(f"| {dtype} | {_ms(s['off']['first']['ttft_s'])} | {_ms(s['on']['first']['ttft_s'])} | "
                     f"{_ms(s['off']['revisit']['ttft_s'])} | {_ms(s['on']['revisit']['ttft_s'])} | "
                     f"**{s['revisit_on_over_off']:.3f}x** | {s['revisit_paired_ratio_median']:.3f}x | "
                     f"{s['same_answers']} of {s['compared']} |")
    lines += ["", "### Multi-turn: where the revisits' prompt tokens came from", "",
              "| KV pages | tier | store | pool | computed | prompt tokens | cached_tokens (usage) |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for dtype, m in report["multi_turn"].items():
        for mode in ("off", "on"):
            f = m["summary"][mode]["revisit"]
            lines.append(f"| {dtype} | {mode} | {_pct(f['store'])} | {_pct(f['pool'])} | {_pct(f['computed'])} | "
                         f"{f['prompt_tokens']:,} | {_pct(f['usage_cached'])} |")
    lines += ["", "### Load rate against the break-even", "",
              "| KV pages | bytes/token | prefill tok/s (first visits) | break-even MB/s | loaded pages | load MB/s | "
              "load / break-even |", "|---|---:|---:|---:|---:|---:|---:|"]
    for dtype, m in report["multi_turn"].items():
        s, kv = m["summary"], m["kv_store"]["on"]
        load, even = s["load_mb_per_s"], s["break_even_mb_per_s"]
        rate = ("-", "-") if load is None else (f"{load:.0f}", f"{load / even:.1f}x")
        lines.append(f"| {dtype} | {m['bytes_per_token']:,.0f} | {s['prefill_tokens_per_s']:,.0f} | {even:.0f} | "
                     f"{kv['num_loaded_pages']:,} | {rate[0]} | {rate[1]} |")
    return lines + [""]


def _burst(b: dict) -> list[str]:
    lines = [f"### Mixed burst ({b['num_requests']} requests at once, pools of {b['num_pages']} pages, "
             f"{len(b['rounds'])} alternated rounds)", "",
             "| round | burst seed | tier off tok/s | tier on tok/s | on / off | TPOT p50, off / on |",
             "|---:|---:|---:|---:|---:|---:|"]
    for i, r in enumerate(b["rounds"], 1):
        lines.append(f"| {i} | {r['seed']} | {r['off_tok_s']:.1f} | {r['on_tok_s']:.1f} | {r['ratio']:.3f}x | "
                     f"{_ms(r['off']['tpot_p50_s'])} / {_ms(r['on']['tpot_p50_s'])} |")
    s = b["summary"]
    return lines + ["", f"Medians: tier off {s['off_tok_s']:.1f} tok/s, tier on {s['on_tok_s']:.1f} tok/s; median of "
                        f"the rounds' ratios **{s['ratio_median']:.3f}x**.", ""]


def _restarts(restarts: dict) -> list[str]:
    lines = ["### Revisits after restarts (tier on)", "",
             "| revisits | requests | store | pool | computed | TTFT median | store hits allocated | failed loads |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for key, label in RESTARTS.items():
        if key in restarts:
            f = restarts[key]["summary"]
            lines.append(f"| {label} | {f['num_turns']} | **{_pct(f['store'])}** | {_pct(f['pool'])} | "
                         f"{_pct(f['computed'])} | {_ms(f['ttft_s'])} | {_pct(f['kvmanager_store_hits'])} | "
                         f"{f['num_failed_loads']} |")
    return lines + [""]


def _counters(report: dict) -> list[str]:
    stacks = {f"multi-turn {d}, tier on": m["kv_store"]["on"] for d, m in report["multi_turn"].items()}
    stacks.update({"burst, tier on": report["burst"]["kv_store_on"]} if "burst" in report else {})
    stacks.update({RESTARTS[k]: r["kv_store"] for k, r in report["restarts"].items() if k in RESTARTS})
    lines = ["### The tier's counters (kvserve admin stats, each stack's last reading)", "",
             "| stack | blocks | written pages | dropped writes | loaded pages | failed loads | values missing | "
             "verify failures |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, kv in stacks.items():
        lines.append(f"| {name} | {kv['num_blocks']:,} | {kv['num_written_pages']:,} | {kv['num_dropped_writes']} | "
                     f"{kv['num_loaded_pages']:,} | {kv['num_failed_loads']} | {kv['num_dropped_missing']} | "
                     f"{kv['num_verify_failures']} |")
    return lines + [""]


def markdown(report: dict, png_name: str) -> str:
    c = report["config"]
    lines = [f"## Shared KV tier, on vs off ({report['date']}; pools of {c['num_pages']} pages, "
             f"~{c['doc_tokens']:,}-token documents, --kv-store-bytes {c['kv_store_bytes']})", "",
             "### Targets (issue 38)", "", "| what | figure | target | met |", "|---|---:|---|---|"]
    lines += [f"| {t['what']} | **{t['figure']}** | {t['target']} | {'yes' if t['met'] else '**no**'} |"
              for t in report["targets"]]
    lines.append("")
    if report["multi_turn"]:
        lines += _multi(report)
    if "burst" in report:
        lines += _burst(report["burst"])
    if report["restarts"]:
        lines += _restarts(report["restarts"])
    lines += _counters(report)
    lines += [f"![TTFT and hit fractions]({png_name})", "", f"`{report['command']}`, {report['wall_s'] / 60:.0f} min.",
              ""]
    return "\n".join(lines)


def _scenarios(report: dict) -> dict[str, dict]:
    """Label -> hit fractions, for the plot's right panel."""
    out = {}
    for dtype, m in report["multi_turn"].items():
        for mode in ("off", "on"):
            out[f"{dtype} revisits, tier {mode}"] = m["summary"][mode]["revisit"]
    short = {"worker_kill9": "after worker kill -9", "stack_restart": "after kvserve up restart",
             "stack_restart_own_store": "after restart, own store"}
    out.update({short[k]: r["summary"] for k, r in report["restarts"].items() if k in short})
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    dtypes = list(report["multi_turn"])
    bars = (("first visit, tier off", "off", "first", "#a0aec0"), ("revisit, tier off", "off", "revisit", "#718096"),
            ("revisit, tier on", "on", "revisit", "#2b6cb0"))
    for i, (label, mode, kind, color) in enumerate(bars):
        values = [1000 * report["multi_turn"][d]["summary"][mode][kind]["ttft_s"] for d in dtypes]
        drawn = left.bar([j + (i - 1) * 0.27 for j in range(len(dtypes))], values, 0.27, label=label, color=color)
        left.bar_label(drawn, fmt="%.0f")
    left.set_xticks(range(len(dtypes)), [f"{d} pages" for d in dtypes])
    left.set_ylabel("time to first token, median (ms)")
    left.set_title("Multi-turn conversations, working set > pool")
    left.legend()
    scenarios = _scenarios(report)
    start = [0.0] * len(scenarios)
    for tier, color in zip(TIERS, ("#2b6cb0", "#68d391", "#e2e8f0"), strict=True):
        shares = [100 * f[tier] for f in scenarios.values()]
        right.barh(list(scenarios), shares, left=start, color=color, label=tier)
        start = [a + b for a, b in zip(start, shares, strict=True)]
    right.invert_yaxis()
    right.set_xlim(0, 100)
    right.set_xlabel("% of revisit prompt tokens")
    right.set_title("Where revisit prompt tokens came from")
    right.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
