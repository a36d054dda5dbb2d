"""bench_disagg.py's figures: per-run statistics, the summaries and targets, the Markdown tables and the plot."""

from __future__ import annotations

import statistics

LABELS = {"disagg": "disaggregated: 1 prefill + 1 decode worker", "both": "2 workers of role both",
          "pull": "pull from A (default)", "recompute": "recompute on B (--no-pull-peers)"}
P99_TARGET = 2.0  # decodes: p99 while long prompts are in flight <= 2x the baseline's, disaggregated
PULL_TARGET = 0.3  # pull: the revisit's TTFT with the pull <= 0.3x recompute's


def quantile(values: list[float], q: int) -> float:
    """The q-th percentile (inclusive method); the value itself for one."""
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def gap_stats(gaps: list[float]) -> dict:
    if not gaps:
        return {"num_gaps": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    return {"num_gaps": len(gaps), "p50_ms": 1e3 * statistics.median(gaps), "p99_ms": 1e3 * quantile(gaps, 99),
            "max_ms": 1e3 * max(gaps)}


def timeline(streams, t0: float, end: float, in_flight: list[tuple[float, float]], bin_s: float = 1.0) -> dict:
    """The short requests' gaps in bins of ``bin_s`` by arrival (seconds since t0): [start, p50 ms, max ms, n]."""
    bins: dict[int, list[float]] = {}
    for s in streams:
        for a, b in zip(s.times, s.times[1:], strict=False):
            if b <= end:
                bins.setdefault(int((b - t0) // bin_s), []).append(b - a)
    rows = [[k * bin_s, round(1e3 * statistics.median(v), 1), round(1e3 * max(v), 1), len(v)]
            for k, v in sorted(bins.items())]
    return {"bin_s": bin_s, "bins": rows, "in_flight": [[round(a, 2), round(b, 2)] for a, b in in_flight]}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def decodes_line(run: dict) -> str:
    s, t = run["short"], run["transfers"]
    ttfts = ", ".join(f"{r['ttft_s']:.1f}" for r in run["long"])
    return (f"short TPOT p50/p99 ms: baseline {_ms(s['baseline']['p50_ms'])}/{_ms(s['baseline']['p99_ms'])}, "
            f"long in flight {_ms(s['in_flight']['p50_ms'])}/{_ms(s['in_flight']['p99_ms'])}; long TTFT s {ttfts}; "
            f"{run['tokens_per_s']:.1f} tok/s; pulls {t['num_ok']} ok {t['num_failed']} failed; "
            f"{run.get('num_preempted', 0)} preempted")


def pull_line(r: dict) -> str:
    v = r["revisit"]
    return (f"{r['config']} round {r['round']}: A ({r['busy_worker']}) TTFT {r['busy_ttft_s']:.2f} s; revisit on "
            f"{r['revisit_worker']} TTFT {v['ttft_s']:.2f} s, {v['cached_tokens']}/{v['prompt_tokens']} cached; "
            f"pulls {r['transfers']['num_ok']} ok {r['transfers']['num_failed']} failed")


def _transfers(runs: list[dict]) -> dict:
    total = {k: sum(r["transfers"][k] for r in runs) for k in runs[0]["transfers"] if k != "num_holds"}
    reported = total["num_ok"] + total["num_failed"]
    total["mb_per_s"] = total["num_bytes"] / total["seconds"] / 1e6 if total["seconds"] else None
    total["s_per_pull"] = total["seconds"] / reported if reported else None
    total["mb_per_pull"] = total["num_bytes"] / reported / 1e6 if reported else None
    return total


def _med(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def decodes_summary(runs: list[dict]) -> dict:
    """Medians over a configuration's runs."""
    out = {f"{w}_{q}_ms": _med(r["short"][w][f"{q}_ms"] for r in runs)
           for w in ("baseline", "in_flight", "prefilling", "after") for q in ("p50", "p99")}
    for w in ("in_flight", "prefilling"):
        out[f"p99_{w}_over_baseline"] = _med(r["short"][w]["p99_ms"] / r["short"]["baseline"]["p99_ms"] for r in runs)
    out["long_second_token_gap_s"] = _med(x.get("second_token_gap_s") for r in runs for x in r["long"])
    out["long_ttft_s"] = _med(x["ttft_s"] for r in runs for x in r["long"])
    out["long_ttft_by_prompt_s"] = [_med(r["long"][i]["ttft_s"] for r in runs) for i in range(len(runs[0]["long"]))]
    out["long_prompt_tokens"] = [runs[0]["long"][i]["prompt_tokens"] for i in range(len(runs[0]["long"]))]
    out["tokens_per_s"] = _med(r["tokens_per_s"] for r in runs)
    out["transfers"] = _transfers(runs)
    return out


def pull_summary(rounds: list[dict]) -> dict:
    measured = [r for r in rounds if r["round"] > 0]
    return {"num_rounds": len(measured), "revisit_ttft_s": _med(r["revisit"]["ttft_s"] for r in measured),
            "busy_ttft_s": _med(r["busy_ttft_s"] for r in measured),
            "cached_tokens": _med(r["revisit"]["cached_tokens"] for r in measured),
            "prompt_tokens": _med(r["revisit"]["prompt_tokens"] for r in measured),
            "num_on_other_worker": sum(r["revisit_worker"] != r["busy_worker"] for r in measured),
            "transfers": _transfers(measured)}


def summarise(report: dict) -> None:
    """Adds the summaries, ratios and the issue's targets to ``report``."""
    targets = []
    if d := report.get("decodes"):
        d["summary"] = {c: decodes_summary([r for r in d["runs"] if r["config"] == c]) for c in d["configs"]}
        a, b = d["summary"].get("disagg"), d["summary"].get("both")
        if a and b:
            d["ratios"] = {k: a[k] / b[k] for k in ("baseline_p99_ms", "in_flight_p50_ms", "in_flight_p99_ms",
                                                    "long_ttft_s", "tokens_per_s") if a[k] and b[k]}
        if a:
            x = a["p99_in_flight_over_baseline"]
            targets.append({"what": "Decodes' TPOT p99 while long prompts are in flight / without long prompts, "
                                    "disaggregated", "value": x, "figure": f"{x:.2f}x", "target": f"<= {P99_TARGET:g}x",
                            "met": x <= P99_TARGET})
    if p := report.get("pull"):
        p["summary"] = {c: pull_summary([r for r in p["rounds"] if r["config"] == c]) for c in p["configs"]}
        pull, rec = p["summary"].get("pull"), p["summary"].get("recompute")
        if pull and rec and pull["revisit_ttft_s"] and rec["revisit_ttft_s"]:
            x = pull["revisit_ttft_s"] / rec["revisit_ttft_s"]
            paired = [a["revisit"]["ttft_s"] / b["revisit"]["ttft_s"] for a in p["rounds"] for b in p["rounds"]
                      if a["round"] == b["round"] > 0 and a["config"] == "pull" and b["config"] == "recompute"]
            p["ratio"] = {"medians": x, "paired_median": _med(paired), "paired": paired}
            targets.append({"what": "Revisit TTFT, pull / recompute (medians)", "value": x, "figure": f"{x:.2f}x",
                            "target": f"<= {PULL_TARGET:g}x", "met": x <= PULL_TARGET})
    report["targets"] = targets


def _decodes_tables(d: dict, sz: dict) -> list[str]:
    a, b, ratio = d["summary"].get("disagg"), d["summary"].get("both"), d.get("ratios", {})
    cols = [c for c in ("disagg", "both") if c in d["summary"]]
    lines = ["## Decodes while long prompts prefill", "",
             f"{sz['num_short']} lanes of short requests ({sz['short_prompt']}-token prompts, {sz['short_new']} new "
             "tokens, each lane sending its next as the last ends) decode throughout; long prompts "
             f"of {', '.join(f'{n:,}' for n in sz['long_prompts'])} tokens ({sz['long_new']} new tokens) arrive "
             f"{sz['long_every_s']:g} s apart after a {sz['baseline_s']:g} s baseline window. Time per output "
             "token (TPOT) = the short requests' inter-token gaps, in ms; *in flight*: gaps that end while a long "
             "prompt is between its arrival and its last token (its prefill, hand-off and pull, and its tokens); "
             f"*prefilling*: between its arrival and its first token. Medians over {sz['rounds']} alternated run(s) "
             "of each configuration.", "",
             "| | " + " | ".join(LABELS[c] for c in cols) + (" | disagg / both |" if a and b else " |"),
             "|---|" + "---:|" * (len(cols) + (1 if a and b else 0))]

    def row(label: str, key: str, fmt, ratio_key: str | None = None) -> None:
        cells = [fmt(d["summary"][c][key]) for c in cols]
        extra = [f"{ratio[ratio_key]:.2f}x" if ratio_key in ratio else "-"] if a and b else []
        lines.append(f"| {label} | " + " | ".join([*cells, *extra]) + " |")

    row("short TPOT p50, baseline (ms)", "baseline_p50_ms", _ms)
    row("short TPOT p99, baseline (ms)", "baseline_p99_ms", _ms, "baseline_p99_ms")
    row("short TPOT p50, while long prompts are in flight (ms)", "in_flight_p50_ms", _ms, "in_flight_p50_ms")
    row("short TPOT p99, while long prompts are in flight (ms)", "in_flight_p99_ms", _ms, "in_flight_p99_ms")
    row("**p99 in flight / p99 baseline**", "p99_in_flight_over_baseline", lambda x: f"**{x:.2f}x**")
    row("short TPOT p99, while long prompts prefill (ms)", "prefilling_p99_ms", _ms, "prefilling_p99_ms")
    row("p99 prefilling / p99 baseline", "p99_prefilling_over_baseline", lambda x: f"{x:.2f}x")
    row("short TPOT p50, after (ms)", "after_p50_ms", _ms)
    row("long prompts' TTFT, median (s)", "long_ttft_s", lambda x: f"{x:.2f}", "long_ttft_s")
    row("long prompts' TTFT by prompt (s)", "long_ttft_by_prompt_s", lambda v: " / ".join(f"{x:.1f}" for x in v))
    row("long prompts' first to second token, median (s)", "long_second_token_gap_s", lambda x: f"{x:.2f}")
    row("generated tokens/s over the run", "tokens_per_s", lambda x: f"{x:.1f}", "tokens_per_s")
    lines += _transfer_rows(d["summary"], cols, a and b) + [""]
    lines += ["Every run:", "", "| configuration | round | baseline p50 / p99 | in flight p50 / p99 | worst gap "
              "in flight | long TTFTs (s) | tok/s | pulls ok / failed | MB pulled | preempted |",
              "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in d["runs"]:
        s, t = r["short"], r["transfers"]
        ttfts = " / ".join(f"{x['ttft_s']:.1f}" for x in r["long"])
        preempted = r.get("num_preempted", "-")
        lines.append(f"| {r['config']} | {r['round'] + 1} | {_ms(s['baseline']['p50_ms'])} / "
                     f"{_ms(s['baseline']['p99_ms'])} | {_ms(s['in_flight']['p50_ms'])} / "
                     f"{_ms(s['in_flight']['p99_ms'])} | {_ms(s['in_flight']['max_ms'])} | "
                     f"{ttfts} | {r['tokens_per_s']:.1f} | "
                     f"{t['num_ok']} / {t['num_failed']} | {t['num_bytes'] / 1e6:,.0f} | {preempted} |")
    return lines + [""]


def _transfer_rows(summary: dict, cols: list[str], ratio: bool) -> list[str]:
    pad = " | -" if ratio else ""

    def cell(c: str, key: str, fmt) -> str:
        v = summary[c]["transfers"].get(key)
        return "-" if v is None else fmt(v)

    return ["| pulls ok / failed / expired (summed) | " + " | ".join(
                f"{cell(c, 'num_ok', str)} / {cell(c, 'num_failed', str)} / {cell(c, 'num_expired', str)}"
                for c in cols) + pad + " |",
            "| transfer MB/s (bytes / pull seconds) | " + " | ".join(cell(c, "mb_per_s", lambda x: f"{x:,.0f}")
                                                                   for c in cols) + pad + " |",
            "| seconds per pull (MB per pull) | " + " | ".join(
                f"{cell(c, 's_per_pull', lambda x: f'{x:.3f}')} ({cell(c, 'mb_per_pull', lambda x: f'{x:.0f}')})"
                for c in cols) + pad + " |"]


def _pull_tables(p: dict, sz: dict) -> list[str]:
    cols = [c for c in ("pull", "recompute") if c in p["summary"]]
    ratio = p.get("ratio")
    lines = ["## Cache-aware pull against recompute", "",
             f"A ~{sz['prefix_tokens']:,}-token prefix computed on worker A by a request that keeps decoding; the "
             f"revisit (same prefix, another question, 4 new tokens) placed on idle worker B "
             f"(--load-penalty-pages {sz['load_penalty_pages']}). Medians over {sz['pull_rounds']} measured "
             "rounds (round 0 left out), the two stacks alternated.", "",
             "| | " + " | ".join(LABELS[c] for c in cols) + " |", "|---|" + "---:|" * len(cols)]
    s = p["summary"]
    lines.append("| revisit TTFT (s) | " + " | ".join(f"**{s[c]['revisit_ttft_s']:.3f}**" for c in cols) + " |")
    lines.append("| revisit cached tokens / prompt tokens | " + " | ".join(
        f"{s[c]['cached_tokens']:,.0f} / {s[c]['prompt_tokens']:,.0f}" for c in cols) + " |")
    lines.append("| A's TTFT computing the prefix, idle (s) | " + " | ".join(f"{s[c]['busy_ttft_s']:.2f}"
                                                                           for c in cols) + " |")
    lines.append("| revisits run on B, not A | " + " | ".join(f"{s[c]['num_on_other_worker']} of "
                                                            f"{s[c]['num_rounds']}" for c in cols) + " |")
    lines += _transfer_rows(s, cols, False)
    if ratio:
        lines += ["", f"Revisit TTFT, pull / recompute: **{ratio['medians']:.2f}x** (medians); the rounds' own "
                  f"ratios: {', '.join(f'{x:.2f}x' for x in ratio['paired'])} (median {ratio['paired_median']:.2f}x)."]
    lines += ["", "Every round:", "", "| round | configuration | A | A's TTFT (s) | revisit on | revisit TTFT (s) | "
              "cached / prompt tokens | pulls ok / failed | MB pulled | pull s |", "|---:|---|---|---:|---|---:|---:|"
              "---:|---:|---:|"]
    for r in p["rounds"]:
        v, t = r["revisit"], r["transfers"]
        lines.append(f"| {r['round']}{' (warm-up)' if r['round'] == 0 else ''} | {r['config']} | {r['busy_worker']} | "
                     f"{r['busy_ttft_s']:.2f} | {r['revisit_worker']} | {v['ttft_s']:.3f} | {v['cached_tokens']:,} / "
                     f"{v['prompt_tokens']:,} | {t['num_ok']} / {t['num_failed']} | {t['num_bytes'] / 1e6:,.1f} | "
                     f"{t['seconds']:.3f} |")
    return lines + [""]


def markdown(report: dict) -> str:
    sz = report["sizes"]
    lines = [f"# Disaggregation and page pulls ({report['date']}{', quick' if report['quick'] else ''})", "",
             f"Two workers per stack, each pinned to one core and computing on one thread; shared KV tier off. "
             f"`{report['command']}`, kvserve `{report['kvserve']}`, {report['wall_s'] / 60:.1f} min.", ""]
    if report["targets"]:
        lines += ["## Targets", "", "| what | figure | target | met |", "|---|---:|---|---|"]
        lines += [f"| {t['what']} | **{t['figure']}** | {t['target']} | {'yes' if t['met'] else '**no**'} |"
                  for t in report["targets"]]
        lines.append("")
    if report.get("decodes"):
        lines += _decodes_tables(report["decodes"], sz)
        lines += ["![The short requests' inter-token gaps over one run of each configuration]"
                  f"(disagg{'-quick' if report['quick'] else ''}-{report['date']}.png)", ""]
    if report.get("pull"):
        lines += _pull_tables(report["pull"], sz)
    loads = [r["load_avg_1min"] for sec in ("decodes", "pull") for r in
             (report.get(sec) or {}).get("runs" if sec == "decodes" else "rounds", [])]
    if loads:
        lines += [f"Load average (1 min) after each run: {min(loads):.2f} to {max(loads):.2f} on "
                  f"{report['cpu']['cores'] if 'cpu' in report else 2} cores.", ""]
    return "\n".join(lines)


def plot(report: dict, path) -> None:
    """The short requests' gaps (median and worst per second) over the last run of each configuration, the
    windows in which a long prompt was in flight shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {r["config"]: r for r in report["decodes"]["runs"]}
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), sharey=True, squeeze=False)
    for ax, (name, run) in zip(axes[0], runs.items(), strict=True):
        tl = run["timeline"]
        t = [b[0] for b in tl["bins"]]
        ax.plot(t, [b[1] for b in tl["bins"]], label="median gap per second")
        ax.plot(t, [b[2] for b in tl["bins"]], label="worst gap per second", alpha=0.7)
        for a, b in tl["in_flight"]:
            ax.axvspan(a, b, color="tab:red", alpha=0.08)
        ax.set(title=LABELS[name], xlabel="seconds since the first short request", yscale="log")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("short requests' time per output token (ms)")
    axes[0][0].legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
