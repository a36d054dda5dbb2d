"""Two in-process sections of bench_long.py: what a long prefill costs at least on this machine, and the paged
prefill kernel against the reference path step by step.

  floor   the model's multiply-adds for a prompt of n tokens (its linear layers, and causal attention's
          QK^T and PV), against the best rate this machine's float32 GEMM reaches (MKL's sgemm on 2048 x 2048,
          torch's threads) and torch's own flash attention (causal SDPA, the default model's heads): a prompt's
          TTFT cannot be below macs / sgemm rate on any path, kvserve's or HF's. HF's TTFT at 7,000 tokens is
          measured in the same section, so that the floor is quoted as a ratio to it.
  steps   one prefill step of a 512-token chunk whose first row sits at 0, 1.5k, 3.5k and 6.5k tokens of
          cached context, in a ModelRunner: the paged prefill kernel vs the reference backend's gather + SDPA
          (the backend's prefill_kernel switch), alternated, medians; less noisy than whole requests through
          the stack, where the same code's TPOT moves by 15% between runs.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int = 0  # the LM head's rows (bench_roofline.py counts its multiply-adds; the floor here does not)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def of(cls, model_dir: Path) -> Shape:
        c = json.loads((model_dir / "config.json").read_text())
        return cls(c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"], c["num_attention_heads"],
                   c["num_key_value_heads"], c["vocab_size"])


def linear_macs(s: Shape, tokens: int) -> int:
    """q, k, v, o, gate, up and down for `tokens` rows, every layer (the LM head runs for the last row only)."""
    per_token = (2 * s.hidden * s.hidden + 2 * s.hidden * s.kv_heads * s.head_dim
                 + 3 * s.hidden * s.intermediate)
    return s.layers * tokens * per_token


def attention_macs(s: Shape, first: int, rows: int) -> int:
    """QK^T and PV of `rows` query rows from position `first` on, each over the keys up to its own."""
    pairs = rows * first + rows * (rows + 1) // 2
    return s.layers * s.heads * pairs * s.head_dim * 2


def median_s(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def mm_rate(m: int, k: int, n: int, repeats: int = 9) -> float:
    """Multiply-adds per second of torch.mm on [m, k] x [k, n] float32, the median of ``repeats``."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    return m * k * n / median_s(lambda: torch.mm(a, b), repeats)


def gemm_rate(n: int = 2048, repeats: int = 9) -> float:
    return mm_rate(n, n, n, repeats)


def sdpa_rate(s: Shape, n: int = 4096, repeats: int = 3) -> float:
    q = torch.randn(1, s.heads, n, s.head_dim)
    k, v = torch.randn(1, s.heads, n, s.head_dim), torch.randn(1, s.heads, n, s.head_dim)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return attention_macs(s, 0, n) / s.layers / median_s(lambda: sdpa(q, k, v, is_causal=True), repeats)


HF_AT = 7000  # the length whose TTFT the floor is compared with HF's at


def floor_section(model_dir: Path, lengths: tuple[int, ...], hf_ttft) -> dict:
    """hf_ttft(n) -> HF's TTFT in seconds for a fresh n-token prompt (measured here at HF_AT tokens)."""
    s = Shape.of(model_dir)
    gemm, sdpa = gemm_rate(), sdpa_rate(s)
    rows = []
    for n in lengths:
        lin, att = linear_macs(s, n), attention_macs(s, 0, n)
        rows.append({"prompt_tokens": n, "linear_macs": lin, "attention_macs": att,
                     "floor_s": (lin + att) / gemm,  # every multiply-add at the GEMM's rate
                     "gemm_and_sdpa_s": lin / gemm + att / sdpa})  # attention at torch's flash-attention rate
    at = next((r for r in rows if r["prompt_tokens"] == HF_AT), rows[-1])  # issue 20's length, else the longest
    at["hf_ttft_s"] = hf_ttft(at["prompt_tokens"])
    at["floor_over_hf"] = at["floor_s"] / at["hf_ttft_s"]
    at["hf_rate_of_gemm"] = (at["linear_macs"] + at["attention_macs"]) / at["hf_ttft_s"] / gemm
    return {"gemm_macs_per_s": gemm, "sdpa_macs_per_s": sdpa, "threads": torch.get_num_threads(), "rows": rows}


def steps_section(model_dir: Path, starts: tuple[int, ...] = (0, 1536, 3584, 6500), chunk: int = 512,
                  repeats: int = 5, compute=None) -> list[dict]:
    """compute: the ModelRunner's executor (its default: a thread of its own)."""
    from kvserve.common.wire.worker import StepBatch, StepItem
    from kvserve.worker.runner import ModelRunner, RunnerConfig

    page = 16
    runner = ModelRunner(RunnerConfig(model_dir=model_dir, num_pages=-(-(max(starts) + chunk) // page) + 8,
                                      page_size=page, device="cpu", dtype="float32"), compute)
    backend = runner.model.backend
    if not hasattr(backend, "prefill_kernel"):
        return []
    s = Shape.of(model_dir)
    gen = torch.Generator().manual_seed(0)
    out = []
    for start in starts:
        ids = tuple(torch.randint(100, 20000, (chunk,), generator=gen).tolist())
        batch = StepBatch((StepItem("long", ids, start, tuple(range(-(-(start + chunk) // page)))),))
        times: dict[bool, list[float]] = {True: [], False: []}
        for rep in range(repeats + 1):  # the first round warms both paths up and is not counted
            for kernel in (True, False):
                backend.prefill_kernel = kernel
                t0 = time.perf_counter()
                runner.call(runner._run, batch)
                if rep:
                    times[kernel].append(time.perf_counter() - t0)
        backend.prefill_kernel = True
        kernel_s, reference_s = (statistics.median(times[k]) for k in (True, False))
        macs = linear_macs(s, chunk) + attention_macs(s, start, chunk)
        out.append({"start_pos": start, "chunk": chunk, "kernel_ms": 1e3 * kernel_s, "reference_ms": 1e3 * reference_s,
                    "kernel_over_reference": kernel_s / reference_s,
                    "kernel_over_reference_each": [k / r for k, r in zip(times[True], times[False], strict=True)],
                    "kernel_macs_per_s": macs / kernel_s})
    return out


def markdown(floor: dict | None, steps: list[dict]) -> list[str]:
    lines: list[str] = []
    if floor:
        g, a = floor["gemm_macs_per_s"], floor["sdpa_macs_per_s"]
        lines += ["", f"The least a prefill can cost here: the model's multiply-adds at this machine's float32 GEMM "
                  f"rate ({g / 1e9:.1f} G/s, MKL's sgemm on 2048 x 2048, {floor['threads']} threads) and with "
                  f"attention at torch's causal flash-attention rate ({a / 1e9:.1f} G/s), measured in the same run:",
                  "",
                  "| prompt tokens | linear G MAC | attention G MAC | floor s (all at GEMM rate) "
                  "| GEMM + SDPA s | HF TTFT s | floor / HF |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in floor["rows"]:
            hf = f"{r['hf_ttft_s']:.2f}" if "hf_ttft_s" in r else "-"
            ratio = f"{r['floor_over_hf']:.2f}x" if "floor_over_hf" in r else "-"
            lines.append(f"| {r['prompt_tokens']:,} | {r['linear_macs'] / 1e9:.0f} | {r['attention_macs'] / 1e9:.0f} | "
                         f"{r['floor_s']:.2f} | {r['gemm_and_sdpa_s']:.2f} | {hf} | {ratio} |")
    if steps:
        lines += ["", "One prefill step of a 512-token chunk over a cached context, in-process, the paged prefill "
                  "kernel vs the reference path (gather + SDPA), alternated, medians:", "",
                  "| cached tokens before the chunk | kernel ms | reference ms | kernel / reference "
                  "| worst of the rounds | kernel G MAC/s |", "|---:|---:|---:|---:|---:|---:|"]
        for r in steps:
            lines.append(f"| {r['start_pos']:,} | {r['kernel_ms']:.0f} | {r['reference_ms']:.0f} | "
                         f"{r['kernel_over_reference']:.3f} | {max(r['kernel_over_reference_each']):.3f} | "
                         f"{r['kernel_macs_per_s'] / 1e9:.1f} |")
    return lines
