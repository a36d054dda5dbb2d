"""Where a benchmark's results go: bench/results/<name>-<date>.json and the Markdown table next to it."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

RESULTS_DIR = Path(__file__).parent / "results"


def write_results(report: dict, name: str, table: str, out: Path | None = None) -> Path:
    """Writes ``report`` as JSON to ``out`` (default: bench/results/<name>-<today>.json) and ``table`` to the
    same path with .md; prints the table. Returns the JSON path."""
    out = out or RESULTS_DIR / f"{name}-{dt.date.today().isoformat()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(table)
    print(table)
    return out
