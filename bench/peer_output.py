"""The report's kvserve / vLLM / HF transformers section (Markdown and a plot), from its JSON."""

from __future__ import annotations

from pathlib import Path

NAMES = {"kvserve": "kvserve", "vllm_bf16": "vLLM bf16", "vllm_fp32": "vLLM fp32"}


def _hf(out: dict) -> dict:
    """HF's figures for the same workloads, from the report's in-process HF stage (None where absent)."""
    lat = out.get("latency", {}).get("hf_generate") or []
    return {"burst_tokens_per_s": out.get("throughput", {}).get("hf_generate_batch", {}).get("tokens_per_s"),
            "prefix_ttft_first_s": out.get("prefix", {}).get("hf", {}).get("ttft_first_s"),
            "prefix_ttft_rest_mean_s": out.get("prefix", {}).get("hf", {}).get("ttft_rest_mean_s"),
            "long_ttft_s": out.get("long_prompt", {}).get("hf", {}).get("ttft_s"),
            "long_tpot_s": out.get("long_prompt", {}).get("hf", {}).get("tpot_s"),
            "latency": lat}


def _rows(out: dict) -> list[tuple[str, str, float, bool]]:
    """(label, median key or latency key, scale, higher is better) for each row."""
    peers = out["peers"]
    counts = [lat["clients"] for lat in peers["servers"]["kvserve"]["median"]["latency"]]
    rows = [("mixed burst, generated tok/s", "burst_tokens_per_s", 1, True),
            ("prefix: TTFT of requests 2..10 (a hit), ms", "prefix_ttft_rest_mean_s", 1e3, False),
            ("prefix: TTFT of request 1 (~2,000 tokens, a miss), ms", "prefix_ttft_first_s", 1e3, False),
            ("long prompt: TTFT, s", "long_ttft_s", 1, False),
            ("long prompt: time per output token after it, ms", "long_tpot_s", 1e3, False)]
    for i, c in enumerate(counts):
        rows += [(f"{c} closed-loop clients: TTFT p50, ms", ("latency", i, "ttft_p50_s"), 1e3, False),
                 (f"{c} closed-loop clients: TPOT p50, ms", ("latency", i, "tpot_p50_s"), 1e3, False)]
    return rows


def _get(figures: dict, key):
    if isinstance(key, str):
        return figures.get(key)
    section, i, name = key
    items = figures.get(section) or []
    return items[i].get(name) if i < len(items) else None


def markdown(out: dict) -> str:
    peers = out.get("peers")
    if not peers:
        return ""
    if "skipped" in peers:
        return f"\nkvserve vs vLLM: not run ({peers['skipped']}).\n"
    servers = peers["servers"]
    names = list(servers)
    columns = [servers[n]["median"] for n in names] + [_hf(out)]
    header = ["workload", *(NAMES.get(n, n) for n in names), "HF",
              *(f"kvserve vs {NAMES.get(n, n)}" for n in names[1:]), "kvserve vs HF"]
    lines = ["", "## kvserve, vLLM and HF transformers", "",
             f"The same weights and the same workloads through the OpenAI protocol (the official `openai` client, "
             f"streaming, greedy, `ignore_eos`), each server started in turn, {peers['rounds']} round(s) with the "
             f"order rotated; medians. HF is the report's in-process run (continuous batching for the burst, "
             f"`generate()` one request at a time otherwise; it reuses no prefix). \"kvserve vs X\" is how many "
             f"times faster kvserve is (X's time / kvserve's, or kvserve's tok/s / X's).", "",
             "| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for label, key, scale, higher in _rows(out):
        values = [_get(c, key) for c in columns]
        ours = values[0]
        cells = [f"{v * scale:,.1f}" if v is not None else "–" for v in values]
        speed = [(ours / v if higher else v / ours) if v and ours else None for v in values[1:]]
        cells += [f"{r:.2f}x" if r is not None else "–" for r in speed]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    kv = servers["kvserve"]["median"]
    lines += ["", f"Cached prompt tokens reported on a prefix hit (of {kv['prefix_prompt_tokens']:.0f}): " + ", ".join(
        f"{NAMES.get(n, n)} {servers[n]['median']['prefix_cached_tokens_rest_mean']:.0f}" for n in names) + "."]
    lines += ["", "Greedy agreement on the mixed burst's completions (same weights): " + "; ".join(
        f"kvserve and {NAMES.get(n, n)} identical on {a['identical']} of {a['of']}"
        for n, a in peers.get("agreement", {}).items()) + "."]
    lines += ["", "| server | dtype | command | environment |", "|---|---|---|---|"]
    for n in names:
        cfg = servers[n]["config"]
        env = " ".join(f"{k}={v}" for k, v in sorted(cfg.get("env", {}).items()))
        version = f" {cfg['version']}" if cfg.get("version") else ""
        lines.append(f"| {NAMES.get(n, n)}{version} | {cfg['dtype']} | `{cfg['command']}` | "
                     f"{f'`{env}`' if env else '–'} |")
    lines += [f"\n{NAMES.get(n, n)}: {servers[n]['config']['why']}." for n in names if servers[n]["config"].get("why")]
    return "\n".join(lines) + "\n"


def plot(out: dict, stem: Path, bars, save) -> list[Path]:
    """A bar chart of the mixed burst's throughput per server (nothing when vLLM was not run)."""
    peers = out.get("peers") or {}
    if "servers" not in peers:
        return []
    import matplotlib.pyplot as plt

    names = list(peers["servers"])
    labels = [NAMES.get(n, n) for n in names] + ["HF (cont. batching)"]
    values = [peers["servers"][n]["median"]["burst_tokens_per_s"] for n in names]
    values.append(_hf(out)["burst_tokens_per_s"] or 0.0)
    fig, ax = plt.subplots(figsize=(7, 4))
    bars(ax, labels, values, "Mixed burst through the OpenAI API", "generated tokens/s")
    return [save(fig, stem, "peers")]
