"""The Markdown of bench_roofline.py's report: the limits, the targets, then one table per workload."""

from __future__ import annotations


def _g(rate: float) -> str:
    return f"{rate / 1e9:.1f}"


def limits(lim: dict) -> list[str]:
    first = lim["runs"][0]
    workers = lim.get("worker_threads", "its default")  # results before --worker-threads was passed: up's default
    lines = [f"Limits of this machine, measured at the start and again at the end of the run, {first['threads']} "
             f"torch threads (`kvserve up`'s worker: {workers}). Float32 GEMM (torch.mm, MKL's sgemm), "
             "multiply-adds per second:", "",
             "| shape | m x k x n | " + " | ".join(f"G MAC/s, {w}" for w in ("start", "end")[:len(lim["runs"])]) + " |",
             "|---|---|" + "---:|" * len(lim["runs"])]
    for i, g in enumerate(first["gemm"]):
        rates = " | ".join(_g(run["gemm"][i]["macs_per_s"]) for run in lim["runs"])
        lines.append(f"| {g['name']} | {g['m']} x {g['k']} x {g['n']} | {rates} |")
    reads = " and ".join(f"{_g(run['read_bytes_per_s'])}" for run in lim["runs"])
    lines += ["", f"GEMM limit (the best of these): **{_g(lim['gemm_macs_per_s'])} G MAC/s**. Read bandwidth (the "
              f"better of {reads} GB/s): **{_g(lim['read_bytes_per_s'])} GB/s**, measured as {first['read_method']}, "
              f"read_bytes = {first['read_bytes'] / 2 ** 30:g} GiB."]
    return lines


def targets(rows: list[dict]) -> list[str]:
    lines = ["", "| target | wanted | measured | |", "|---|---:|---:|---|"]
    for t in rows:
        measured = f"{t['measured']:.0%}" if t["name"] == "decode_attention" else f"{t['measured']:.2f}x"
        where = f" ({t['at']})" if "at" in t else ""
        lines.append(f"| {t['what']} | {t['target']} | {measured}{where} | {'met' if t['met'] else '**missed**'} |")
    return lines


def prefill(rows: list[dict]) -> list[str]:
    lines = ["", "Prefill: one 512-token chunk over a cached context, in a ModelRunner (the paged prefill kernel; "
             "the reference path beside it), medians:", "",
             "| cached tokens | kernel ms | reference ms | kernel G MAC/s | of the GEMM limit |",
             "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['start_pos']:,} | {r['kernel_ms']:.0f} | {r['reference_ms']:.0f} | "
              f"{_g(r['kernel_macs_per_s'])} | {r['of_gemm']:.0%} |" for r in rows]
    return lines


def decode(rows: list[dict]) -> list[str]:
    lines = ["", "Decode: one step through the ModelRunner (every sequence decoding one token, sampled), medians; "
             "bytes = the weights once + every sequence's K/V; floor = max(multiply-adds / GEMM limit, bytes / "
             "read bandwidth). Kernel alone: decode attention, one layer over a 1 GiB pool:", "",
             "| context | batch | step ms | MB read | GB/s | of read bw | of GEMM | floor ms | step / floor "
             "| kernel GB/s | kernel of read bw |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        k = r.get("kernel")
        kernel = f"{k['gbs']:.1f} | {k['of_machine']:.0%}" if k else "- | -"
        lines.append(f"| {r['context']:,} | {r['batch']} | {r['step_ms']:.1f} | {r['bytes'] / 1e6:,.0f} | "
                     f"{_g(r['read_bytes_per_s'])} | {r['of_read']:.0%} | {r['of_gemm']:.0%} | {r['floor_ms']:.1f} | "
                     f"{r['over_floor']:.2f}x | {kernel} |")
    return lines


def burst(b: dict) -> list[str]:
    f = b["floor"]
    return ["", f"The mixed burst ({len(b['requests'])} requests, {b['prompt_tokens']:,} prompt tokens, "
            f"{b['generated_tokens']:,} generated): its floor over the raw runner's {f['steps']} steps (each prompt "
            f"alone in chunks of up to 2,048 tokens, then one step per token for every request still generating; "
            f"{f['compute_bound_steps']} of them bound by the arithmetic), against its wall time, medians:", "",
            "| | seconds | over the floor |", "|---|---:|---:|",
            f"| floor: sum of max(compute, read) per step | {f['floor_s']:.2f} | 1.00x |",
            f"| (all multiply-adds at the GEMM limit / all bytes at the read bandwidth) | {f['compute_s']:.2f} / "
            f"{f['read_s']:.2f} | |",
            f"| kvserve up (as report.py measures it) | {b['kvserve_wall_s']:.2f} | {b['kvserve_over_floor']:.2f}x |",
            f"| the raw runner, in-process | {b['raw_runner_wall_s']:.2f} | {b['raw_runner_over_floor']:.2f}x |"]


def long(lg: dict) -> list[str]:
    return ["", f"A {lg['prompt_tokens']:,}-token prompt's TTFT (kvserve up with 2,048-token steps and prefix "
            "caching off; HF's generate), medians:", "",
            "| | TTFT s | over HF | over the floor |", "|---|---:|---:|---:|",
            f"| floor (its chunks' multiply-adds at the GEMM limit) | {lg['floor_s']:.2f} | "
            f"{lg['floor_s'] / lg['hf_ttft_s']:.2f}x | 1.00x |",
            f"| kvserve | {lg['kvserve_ttft_s']:.2f} | {lg['kvserve_over_hf']:.2f}x | "
            f"{lg['kvserve_over_floor']:.2f}x |",
            f"| HF | {lg['hf_ttft_s']:.2f} | 1.00x | {lg['hf_over_floor']:.2f}x |"]


def markdown(report: dict) -> str:
    lines = limits(report["limits"]) + targets(report["targets"])
    for key, table in (("prefill", prefill), ("decode", decode), ("burst", burst), ("long", long)):
        if report.get(key):
            lines += table(report[key])
    return "\n".join(lines) + "\n"
