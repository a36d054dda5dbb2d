"""bench_streaming.py's output: the Markdown tables and the plot, from the report dict alone (so that a JSON
written earlier can be rendered again)."""

from __future__ import annotations

from pathlib import Path


def nll_cell(r: dict, lo: int) -> str:
    b = next((b for b in r["buckets"] if b["from"] == lo), None)
    return f"{b['mean_nll']:.3f}" if b else "-"


def kv_points(sizes: dict) -> list[int]:
    """Tokens processed at which the KV table reads the bytes held: chunk, 2 x chunk, ... and the end."""
    points, n = [], sizes["chunk"]
    while n < sizes["tokens"]:
        points.append(n)
        n *= 2
    return [*points, sizes["tokens"]]


def markdown(report: dict) -> str:
    sz, runs = report["sizes"], report["runs"]
    lines = [f"Text: {report['text']}. Fed in {sz['chunk']}-token chunks through an in-process ModelRunner (cpu, "
             f"float32, page size {report['page_size']}); dense stops at {report['dense_tokens']:,} tokens (the "
             f"model's context: {report['context']:,}); recompute scores every {sz['recompute_stride']}th position "
             "only.",
             "", f"Mean log-perplexity (NLL of the next token, nats) per {sz['bucket']:,} positions (dense's last "
             f"window ends at its context, {report['dense_tokens'] - 1:,}):", "",
             "| positions | " + " | ".join(r["label"] for r in runs) + " |", "|---:|" + "---:|" * len(runs)]
    for lo in sorted({b["from"] for r in runs for b in r["buckets"]}):
        hi = max(b["end"] for r in runs for b in r["buckets"] if b["from"] == lo)
        lines.append(f"| {max(lo, 1):,} .. {hi - 1:,} | " + " | ".join(nll_cell(r, lo) for r in runs) + " |")
    return "\n".join(lines + vs_dense_lines(report) + summary_lines(report) + kv_lines(report)
                     + decode_lines(report)) + "\n"


def vs_dense_lines(report: dict) -> list[str]:
    runs = [r for r in report["runs"] if r["vs_dense"]]
    lines = ["", "Minus dense, position by position (nats; recompute at its positions only):", "",
             "| positions | " + " | ".join(r["label"] for r in runs) + " |", "|---:|" + "---:|" * len(runs)]
    for lo in sorted({b["from"] for r in runs for b in r["vs_dense"]}):
        hi = max(b["end"] for r in runs for b in r["vs_dense"] if b["from"] == lo)
        cells = [next((f"{b['mean_nll']:+.3f}" for b in r["vs_dense"] if b["from"] == lo), "-") for r in runs]
        lines.append(f"| {max(lo, 1):,} .. {hi - 1:,} | " + " | ".join(cells) + " |")
    return lines


def summary_lines(report: dict) -> list[str]:
    sz, runs = report["sizes"], report["runs"]
    c = runs[0]["common"]
    lines = ["", f"Over positions {c['from']:,} .. {c['to'] - 1:,} (every config scores them, the window full), and "
             f"past dense's context ({report['dense_tokens']:,} .. {sz['tokens'] - 1:,}):", "",
             f"| config | positions | mean NLL | perplexity | mean NLL at every {sz['recompute_stride']}th position "
             "| positions past dense | mean NLL there | perplexity there | mean NLL there at every "
             f"{sz['recompute_stride']}th | most KV held MB | wall s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        t, c, strided = r["tail"], r["common"], r["common_strided"]["mean_nll"]
        tail = f"{t['positions']:,} | {t['mean_nll']:.3f} | {t['perplexity']:.2f} | " \
               f"{r['tail_strided']['mean_nll']:.3f}" if t else "- | - | - | -"
        kv = f"{max(k['kv_bytes'] for k in r['kv']) / 1e6:.1f}" if r["kv"] else "-"
        lines.append(f"| {r['label']} | {c['positions']:,} | {c['mean_nll']:.3f} | {c['perplexity']:.2f} | "
                     f"{strided:.3f} | {tail} | {kv} | {r['wall_s']:.0f} |")
    return lines


def kv_lines(report: dict) -> list[str]:
    runs = [r for r in report["runs"] if r["kv"]]
    lines = ["", f"KV bytes the request holds while a chunk computes (pages held x {report['page_size']} x "
             f"{runs[0]['bytes_per_token']:,} bytes per token), MB:", "",
             "| tokens processed | " + " | ".join(r["label"] for r in runs) + " |",
             "|---:|" + "---:|" * len(runs)]
    for n in kv_points(report["sizes"]):
        cells = [next((f"{k['kv_bytes'] / 1e6:.1f}" for k in r["kv"] if k["tokens"] == n), "-") for r in runs]
        lines.append(f"| {n:,} | " + " | ".join(cells) + " |")
    return lines


def decode_lines(report: dict) -> list[str]:
    runs = [r for r in report["runs"] if r.get("decode")]
    if not runs:
        return []
    sz = report["sizes"]
    lines = ["", f"One request, greedy decode through runner.step, median of {sz['decode_rounds']} rounds of "
             f"{sz['decode_steps']} steps, the two requests' steps alternated (dense goes back to the same position "
             "each round); the fastest tenth of the steps too, as other work on the machine stretches some of them:",
             "", "| config | tokens before the steps | KV held MB | ms per step, median | tokens/s | 10th percentile "
             "ms | tokens/s | fastest ms |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        d = r["decode"]
        lines.append(f"| {r['label']} | {d['context_tokens']:,} | {d['kv_bytes'] / 1e6:.1f} | "
                     f"{d['median_step_ms']:.1f} | {d['tokens_per_s']:.1f} | {d['p10_step_ms']:.1f} | "
                     f"{d['p10_tokens_per_s']:.1f} | {d['fastest_step_ms']:.1f} |")
    load = runs[0]["decode"]["load_average_before"][0]
    return lines + ratio_lines(report, runs) + [
        "", f"The machine's load average (1 min) when the decode steps began: {load:.2f} (this run's own "
        f"{report['machine']['threads']} threads among it)."]


def ratio_lines(report: dict, runs: list[dict]) -> list[str]:
    """Sinks' decode speed over dense's, against the target (issue 41: at least 2x), where the report has it."""
    r = report.get("decode_ratio")
    if not r:
        return []
    by_name = {x["config"]["name"]: x["decode"] for x in runs}
    verdict = "met" if r["met"] else "missed"
    return ["", f"**Decode with sinks after {by_name['sinks']['context_tokens']:,} tokens: "
            f"{r['sinks_over_dense']:.2f}x dense's speed after {by_name['dense']['context_tokens']:,}** (median "
            f"tokens/s; {r['p10_sinks_over_dense']:.2f}x at the 10th percentile). Target: at least "
            f"{r['target']:.0f}x, {verdict}. Attention: the {r['backend']} backend, whose windowed steps prepare a "
            f"{r['state']}."]


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, d, b) = plt.subplots(1, 3, figsize=(16, 4.2))
    for i, r in enumerate(report["runs"]):
        style = dict(marker="x", ls="none", label=f"{r['label']} (every {report['sizes']['recompute_stride']}th)") \
            if r["config"]["recompute"] else dict(marker=".", label=r["label"])
        a.plot([x["end"] for x in r["buckets"]], [x["mean_nll"] for x in r["buckets"]], color=f"C{i}", **style)
        d.plot([x["end"] for x in r["vs_dense"]], [x["mean_nll"] for x in r["vs_dense"]], color=f"C{i}", **style)
        if r["kv"]:
            b.plot([k["tokens"] for k in r["kv"]], [k["kv_bytes"] / 1e6 for k in r["kv"]], label=r["label"])
    a.axvline(report["dense_tokens"], color="grey", ls=":", lw=1)
    d.axhline(0, color="C0", lw=1)
    per = f"per {report['sizes']['bucket']:,} tokens (nats)"
    a.set(xlabel="tokens processed", ylabel=f"mean log-PPL {per}", title=f"{report['model']}: log-perplexity")
    d.set(xlabel="tokens processed", ylabel=f"minus dense, {per}", title="vs dense, the same positions")
    b.set(xlabel="tokens processed", ylabel="KV held by the request (MB)", title="KV cache")
    for ax in (a, d, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
