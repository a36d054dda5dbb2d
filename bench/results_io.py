"""Where a benchmark's results go: bench/results/<name>-<date>.json and the Markdown table next to it, with the
CPU they were measured on (the documentation's benchmark pages show it beside each result)."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
from pathlib import Path

RESULTS_DIR = Path(__file__).parent / "results"
CPU_FLAGS = {"avx2", "fma", "avx512f", "avx512_bf16", "amx_tile"}  # what the CPU kernels' speed depends on


def cpu_info() -> dict:
    """The CPU model, its core count and the instruction sets among CPU_FLAGS it has (from /proc/cpuinfo)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", info, re.M)
    return {"model": model[1] if model else platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "flags": sorted(CPU_FLAGS & set(flags[1].split())) if flags else []}


def write_results(report: dict, name: str, table: str, out: Path | None = None) -> Path:
    """Writes ``report`` as JSON to ``out`` (default: bench/results/<name>-<today>.json) and ``table`` to the
    same path with .md; prints the table. Records the CPU as ``report["cpu"]`` unless it is there. Returns the
    JSON path."""
    report.setdefault("cpu", cpu_info())
    out = out or RESULTS_DIR / f"{name}-{dt.date.today().isoformat()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(table)
    print(table)
    return out
