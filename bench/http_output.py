"""bench_http.py's Markdown: the mixed burst through HTTP vs gRPC, and guidellm's sweep."""

from __future__ import annotations

import statistics


def _burst(b: dict) -> list[str]:
    g = statistics.median(r["tokens_per_s"] for r in b["grpc"])
    h = statistics.median(r["tokens_per_s"] for r in b["http"])
    ttft = {k: statistics.median(r["ttft_p50_s"] for r in b[k]) for k in ("grpc", "http")}
    tpot = {k: statistics.median(r["tpot_p50_s"] for r in b[k]) for k in ("grpc", "http")}
    rounds = ", ".join(f"{r:.3f}" for r in b["ratio_per_round"])
    return [f"### Mixed burst: {b['num_requests']} requests at once, {b['generated_tokens']} generated tokens, "
            f"{len(b['grpc'])} alternated rounds", "",
            "| front-end | tokens/s (median) | TTFT p50 | TPOT p50 |", "|---|---:|---:|---:|",
            f"| gRPC (SDK) | {g:.1f} | {ttft['grpc']:.2f} s | {1000 * tpot['grpc']:.1f} ms |",
            f"| HTTP (openai client, SSE) | {h:.1f} | {ttft['http']:.2f} s | {1000 * tpot['http']:.1f} ms |", "",
            f"HTTP / gRPC throughput: median of rounds **{b['ratio_median']:.3f}** (rounds: {rounds}); "
            "target >= 0.95.", ""]


def _guidellm(g: dict) -> list[str]:
    rows = [f"### guidellm {g['guidellm']}: {g['prompt_tokens']}-token prompts, {g['output_tokens']} new tokens, "
            f"concurrent streams (requests per level: {', '.join(map(str, g['requests']))})", "",
            "| streams | concurrency seen | TTFT p50 | TTFT p90 | ITL p50 | ITL p90 | output tok/s | req/s "
            "| ok / errored |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for lv in g["levels"]:
        rows.append(f"| {lv['streams']} | {lv['concurrency_p50']:.0f} | {lv['ttft_ms_p50']:.0f} ms | "
                    f"{lv['ttft_ms_p90']:.0f} ms | {lv['itl_ms_p50']:.1f} ms | {lv['itl_ms_p90']:.1f} ms | "
                    f"{lv['output_tokens_per_s']:.1f} | {lv['requests_per_s']:.2f} | "
                    f"{lv['successful']} / {lv['errored']} |")
    return rows + ["", f"`guidellm {g['command']}`", ""]


def markdown(report: dict) -> str:
    lines = [f"## OpenAI HTTP API under load ({report['date']}, {report['cores']} cores"
             f"{', quick' if report['quick'] else ''})", ""]
    if "burst" in report:
        lines += _burst(report["burst"])
    if "guidellm" in report:
        lines += _guidellm(report["guidellm"])
    return "\n".join(lines) + "\n"
