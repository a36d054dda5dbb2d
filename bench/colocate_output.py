"""bench_colocate.py's Markdown: one row per server configuration, unloaded and loaded side by side."""

from __future__ import annotations

TARGET = 0.45  # kvserve keeps at least this share of its unloaded throughput with one core taken


def markdown(report: dict) -> str:
    rows = report["rows"]
    cpu = report["cpu"]
    lines = [f"# Co-location: one core taken by a busy process ({report.get('date', '')})".replace(" ()", ""), "",
             f"{cpu['model']}, {cpu['cores']} cores. The mixed burst ({report['requests']} requests, up to "
             f"{report['max_new']} new tokens) through the OpenAI API; *loaded*: a busy loop pinned to CPU "
             f"{report['busy_cpu']} for the burst. Medians over {report['rounds']} alternated round(s) per server "
             f"started once. `python bench/bench_colocate.py{' --quick' if report['quick'] else ''}`, kvserve "
             f"`{report['kvserve']}`, {report['wall_min']:.1f} min.", ""]
    main = rows.get("kvserve")
    if main and "loaded_over_unloaded" in main:
        met = "yes" if main["loaded_over_unloaded"] >= TARGET else "no"
        lines += ["| what | figure | target | met |", "|---|---:|---|---|",
                  f"| kvserve (defaults) loaded / unloaded throughput | **{main['loaded_over_unloaded']:.2f}x** | "
                  f">= {TARGET}x | {met} |", ""]
    lines += ["| server | tok/s unloaded | tok/s loaded | loaded / unloaded | each round's loaded / unloaded | "
              "TTFT p50 unloaded / loaded (s) | TPOT p50 unloaded / loaded (ms) |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        if "skipped" in r:
            lines.append(f"| {name} | skipped: {r['skipped']} | | | | | |")
            continue
        lines.append(f"| {name} | {r['unloaded_tokens_per_s']:.1f} | {r['loaded_tokens_per_s']:.1f} | "
                     f"**{r['loaded_over_unloaded']:.2f}x** | {per_round(r)} | {r['unloaded_ttft_p50_s']:.2f} / "
                     f"{r['loaded_ttft_p50_s']:.2f} | {1000 * r['unloaded_tpot_p50_s']:.0f} / "
                     f"{1000 * r['loaded_tpot_p50_s']:.0f} |")
    lines += ["", "| server | what it runs |", "|---|---|"]
    for name, r in rows.items():
        if "why" in r:
            lines.append(f"| {name} | {r['why']} |")
    return "\n".join(lines) + "\n"


def per_round(row: dict) -> str:
    """Each round's loaded / unloaded throughput (the two bursts of one round ran back to back)."""
    pairs = zip(row["runs"]["loaded"], row["runs"]["unloaded"], strict=True)
    return " / ".join(f"{lo['tokens_per_s'] / un['tokens_per_s']:.2f}" for lo, un in pairs)
