"""bench/gpu_check.sh runs before it ever sees a GPU: its dry run (tiny shapes, on the CPU here) goes through the
same shim of the import root, the GPU tests' invocation and every section of bench/gpu_check.py, and writes a
JSON with no failed section."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_dry_run_writes_every_section(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    env.pop("PYTHONPATH", None)  # the script makes its own import root from the repository's folders
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run", "--attention-backend",
                           "reference"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (path,) = tmp_path.glob("gpu-check-*-dry.json")
    result = json.loads(path.read_text())
    assert result["dry_run"] and result["pytest"]["rc"] in (0, 5)  # 5: every GPU test skipped (no CUDA)
    assert result["backends"]["reference"]["max_abs_err"] == 0.0
    assert not result["backends"]["flash-attn"]["available"]
    rows = result["decode_attention"]["reference"]
    assert [(r["context"], r["batch"]) for r in rows] == [(64, 2), (64, 4), (256, 2), (256, 4)]
    assert all(r["gb_per_s"] > 0 for r in rows)
    decode = result["model_decode"]
    assert decode["backend"] == "reference" and [r["batch"] for r in decode["rows"]] == [1, 1, 3, 3]
    assert decode["rows"][0]["step_ms"] > 0 and "skipped" in decode["rows"][1]  # no graphs without CUDA
    assert result["hf_fidelity"]["float32"]["identical"]
