"""bench_tenants.py's figures from its requests and the kvmanager's tenant stats: summaries, targets, Markdown."""

from __future__ import annotations

import statistics

LABELS = {"solo": "quiet alone", "lru": "both, global LRU", "fair": "both, fair share (equal weights)",
          "fair-3:1": "both, fair share, quiet 3 : noisy 1", "fair-1:3": "both, fair share, quiet 1 : noisy 3"}
TENANT_FIELDS = ("num_pages", "share_pages", "num_evicted_pages", "num_evictions_caused", "prefix_cache_queries",
                 "prefix_cache_hits", "weight")


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[8] if len(values) > 1 else values[0]


def quiet_summary(visits: list[dict]) -> dict:
    prompt = sum(v["prompt_tokens"] for v in visits)
    ttft = [v["ttft_s"] for v in visits]
    return {"num_visits": len(visits), "prompt_tokens": prompt, "hit_rate": sum(v["cached_tokens"] for v in visits)
            / prompt, "num_hit_visits": sum(v["cached_tokens"] > 0 for v in visits),
            "ttft_p50_s": statistics.median(ttft), "ttft_p90_s": p90(ttft)}


def tokens_per_s(noisy: list[dict]) -> float:
    """Prompt and completion tokens over the requests' summed latencies (they run one at a time)."""
    return sum(n["prompt_tokens"] + n["completion_tokens"] for n in noisy) / sum(n["latency_s"] for n in noisy)


def noisy_summary(noisy: list[dict]) -> dict | None:
    if not noisy:
        return None
    seconds = sum(n["latency_s"] for n in noisy)
    rounds = sorted({n["round"] for n in noisy})
    return {"num_requests": len(noisy), "tokens_per_s": tokens_per_s(noisy), "requests_per_s": len(noisy) / seconds,
            "tokens_per_s_by_round": {r: tokens_per_s([n for n in noisy if n["round"] == r]) for r in rounds},
            "latency_p50_s": statistics.median(n["latency_s"] for n in noisy),
            "cached_tokens": sum(n["cached_tokens"] for n in noisy), "prompt_tokens": sum(n["prompt_tokens"]
                                                                                          for n in noisy)}


def tenant_summary(stats: list[dict]) -> dict:
    """Per tenant: its last stats (TENANT_FIELDS), its pages after each measured round's noisy block (min,
    median), and the kvmanager's prefix hit rate over the measured rounds (counter deltas since round 0)."""
    first, last = stats[0]["tenants"], stats[-1]["tenants"]
    out = {}
    for tenant, t in last.items():
        pages = [s["tenants"][tenant]["num_pages"] for s in stats[1:] if tenant in s["tenants"]]
        t0 = first.get(tenant, {})
        queries = t["prefix_cache_queries"] - t0.get("prefix_cache_queries", 0)
        hits = t["prefix_cache_hits"] - t0.get("prefix_cache_hits", 0)
        out[tenant] = {**{f: t.get(f) for f in TENANT_FIELDS}, "pages_min": min(pages, default=0),
                       "pages_median": statistics.median(pages) if pages else 0,
                       "kvmanager_hit_rate": hits / queries if queries else None}
    return out


def summarise(report: dict) -> None:
    """Adds a "summary" to each configuration's run and the issue's "targets" to ``report``."""
    for run in report["runs"].values():
        measured = [v for v in run["visits"] if v["round"] > 0]
        run["summary"] = {"quiet": quiet_summary(measured),
                          "noisy": noisy_summary([n for n in run["noisy"] if n["round"] > 0]),
                          "tenants": tenant_summary(run["tenant_stats"])}
    report["targets"] = targets(report)


def targets(report: dict) -> list[dict]:
    runs = {name: run["summary"] for name, run in report["runs"].items()}
    rows = []

    def add(what: str, value: float, shown: str, target: str, met: bool | None) -> None:
        rows.append({"what": what, "value": value, "figure": shown, "target": target, "met": met})

    solo = runs.get("solo", {}).get("quiet")
    for name in ("fair", "lru", "fair-3:1", "fair-1:3"):
        if name not in runs or not solo:
            continue
        q, goal = runs[name]["quiet"], name == "fair"
        hit = q["hit_rate"] / solo["hit_rate"]
        add(f"Quiet hit rate, {name} / solo", hit, f"{100 * hit:.1f}%", ">= 95%" if goal else "(report)",
            hit >= 0.95 if goal else None)
        slow = q["ttft_p90_s"] / solo["ttft_p90_s"]
        add(f"Quiet TTFT p90, {name} / solo", slow, f"{slow:.2f}x", "<= 1.2x" if goal else "(report)",
            slow <= 1.2 if goal else None)
    for name in ("fair", "fair-3:1", "fair-1:3"):
        if name in runs and "lru" in runs:
            fair, lru = runs[name]["noisy"], runs["lru"]["noisy"]
            cost = fair["tokens_per_s"] / lru["tokens_per_s"]
            paired = statistics.median(fair["tokens_per_s_by_round"][r] / lru["tokens_per_s_by_round"][r]
                                       for r in fair["tokens_per_s_by_round"])
            add(f"Noisy tokens/s, {name} / lru (the cost), all rounds; median of the rounds' ratios", cost,
                f"{cost:.3f}x; {paired:.3f}x", "(report)", None)
    return rows


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:,.0f} ms"


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.1f}%"


def _met(met: bool | None) -> str:
    return "" if met is None else "yes" if met else "**no**"


def _quiet_table(report: dict) -> list[str]:
    lines = ["### Quiet tenant and noisy tenant, per configuration", "",
             "| configuration | quiet hit rate (usage) | quiet visits with a hit | quiet TTFT p50 | quiet TTFT p90 | "
             "noisy tokens/s | noisy requests/s | noisy latency p50 |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, run in report["runs"].items():
        q, n = run["summary"]["quiet"], run["summary"]["noisy"]
        noisy = (f"{n['tokens_per_s']:,.0f} | {n['requests_per_s']:.3f} | {_ms(n['latency_p50_s'])}" if n
                 else "- | - | -")
        lines.append(f"| {LABELS.get(name, name)} | **{_pct(q['hit_rate'])}** | {q['num_hit_visits']} of "
                     f"{q['num_visits']} | {_ms(q['ttft_p50_s'])} | {_ms(q['ttft_p90_s'])} | {noisy} |")
    return lines + [""]


def _tenants_table(report: dict) -> list[str]:
    lines = ["### The kvmanager's view (kvserve admin stats)", "",
             "Pages: after each measured round's noisy block (min / median), and the last reading's share. "
             "Evicted: the tenant's pages evicted from the pool; caused: pages its allocations evicted (its own "
             "included). Hit rate: the kvmanager's prefix_cache_hits / prefix_cache_queries over the measured "
             "rounds.", "",
             "| configuration | tenant | weight | pages min / median | share (pages) | evicted | caused | "
             "hit rate |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, run in report["runs"].items():
        for tenant, t in sorted(run["summary"]["tenants"].items(), key=lambda kv: kv[0] != "quiet"):
            lines.append(f"| {LABELS.get(name, name)} | {tenant} | {t['weight']:g} | {t['pages_min']} / "
                         f"{t['pages_median']:g} | {t['share_pages']} | {t['num_evicted_pages']:,} | "
                         f"{t['num_evictions_caused']:,} | {_pct(t['kvmanager_hit_rate'])} |")
    return lines + [""]


def markdown(report: dict) -> str:
    c = report["config"]
    lines = [f"## Noisy neighbour ({report['date']}; a pool of {c['num_pages']} pages = {c['pool_tokens']:,} "
             f"tokens, shared KV tier off, {c['rounds']} measured rounds)", "",
             f"Quiet: a ~{c['system_tokens']:,}-token system prompt and a new question per visit. Noisy: "
             f"{c['noisy_requests']} unique prompts of ~{c['noisy_prompt_tokens']:,} tokens ({c['noisy_factor']:g}x "
             f"the pool) between quiet visits. One request at a time, {c['max_tokens']} new tokens, greedy.", "",
             "### Targets", "", "| what | figure | target | met |", "|---|---:|---|---|"]
    lines += [f"| {t['what']} | **{t['figure']}** | {t['target']} | {_met(t['met'])} |" for t in report["targets"]]
    lines.append("")
    lines += _quiet_table(report)
    lines += _tenants_table(report)
    load = report.get("load_avg_rounds")
    busy = (f" The machine's 1-minute load average after each round: median {statistics.median(load):.1f}, "
            f"max {max(load):.1f} (this run's one request at a time keeps it near 2 on two cores; above that, "
            f"other work shared the cores).") if load else ""
    lines += [f"`{report['command']}` at kvserve {report.get('kvserve') or '(commit not recorded)'}, "
              f"{report['wall_s'] / 60:.0f} min.{busy}", ""]
    return "\n".join(lines)
