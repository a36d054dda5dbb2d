"""The GPU check (issue 24), driven by bench/gpu_check.sh: one JSON of what a CUDA machine measures.

    python bench/gpu_check.py             # on a CUDA machine: the full check (a few minutes on an H200)
    python bench/gpu_check.py --dry-run   # anywhere: the same code on tiny shapes (CPU when there is no GPU)

Sections (each one's failure is recorded in the JSON, and the others still run):
- backends: each available backend (reference, triton, flash-attn) against the reference on a mixed step;
- decode_attention: one layer's decode attention, K/V bytes read per second of kernel time (CUDA events, median
  of repeats) at contexts 1k/4k/16k x batch 32/64, pages of 16, Llama-8B heads (32 q, 8 kv, d 128), bf16,
  against the HBM bandwidth (gpu_attention.H200_HBM_BYTES_PER_S);
- model_decode: a random-weight Llama-3-8B-shaped model (weights drawn on the GPU) decoding at batch 1/8/32/64
  through kvserve's runner, eager and with CUDA graphs, against the weight-read floor (weight bytes / HBM);
- hf_fidelity: a tiny random Llama against HF transformers on the GPU (float32 identical tokens, bf16
  agreement), skipped with a note where transformers does not import;
- families: tiny random-weight Gemma 3 and DeepSeek-V3 (MLA) runners on the GPU against float32 runners on the
  CPU over the same weights (greedy token agreement), as the GPU tests check the Llama shape.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_attention import H200_HBM_BYTES_PER_S, available_backends, backend_errors, decode_bandwidth  # noqa: E402
from gpu_models import (  # noqa: E402
    FAMILIES,
    LLAMA3_8B,
    TINY_LLAMA,
    cpu_agreement,
    decode_step_ms,
    hf_fidelity,
    random_runner,
    weight_bytes,
)

FULL = dict(dtype=torch.bfloat16, contexts=(1024, 4096, 16384), batches=(32, 64), heads=(32, 8, 128),
            model=LLAMA3_8B, model_batches=(1, 8, 32, 64), model_context=1024, steps=20, repeats=20,
            hf_tokens=32, hf_prompts=4)
DRY = dict(dtype=torch.float32, contexts=(64, 256), batches=(2, 4), heads=(4, 2, 16), model=TINY_LLAMA,
           model_batches=(1, 3), model_context=40, steps=3, repeats=3, hf_tokens=4, hf_prompts=2)


def section(results: dict, name: str, fn) -> None:
    """results[name] = fn(), or the error; with its wall time."""
    t0 = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as e:  # a failing section is a finding; the others still run
        results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=8)}
    results.setdefault("section_s", {})[name] = round(time.perf_counter() - t0, 2)


def attention_bandwidth(device, plan: dict) -> dict:
    heads, kv_heads, head_dim = plan["heads"]
    out = {}
    for name, backend in available_backends(device, plan["dtype"]).items():
        if isinstance(backend, str):
            out[name] = {"skipped": backend}
            continue
        rows = []
        for context in plan["contexts"]:
            for batch in plan["batches"]:
                rows.append(decode_bandwidth(backend, device, plan["dtype"], context, batch, heads, kv_heads,
                                             head_dim, repeats=plan["repeats"]))
        out[name] = rows
    return out


def model_decode(device, plan: dict, folder: Path, backend: str) -> dict:
    """Step time of the random-weight model per batch, eager and with graphs, against the weight-read floor."""
    dtype = str(plan["dtype"]).removeprefix("torch.")
    pages_per_seq = -(-(plan["model_context"] + plan["steps"] + 8) // 16)
    runner = random_runner(folder, plan["model"], device.type, dtype, max(plan["model_batches"]) * pages_per_seq,
                           backend=backend)
    floor_ms = weight_bytes(runner) / H200_HBM_BYTES_PER_S * 1000
    graphs = runner.cuda.graphs if runner.cuda is not None else None
    rows = []
    for batch in plan["model_batches"]:
        for mode in ("eager", "graphs"):
            if mode == "graphs" and graphs is None:
                rows.append({"batch": batch, "mode": mode, "skipped": "no decode graphs on this path "
                             f"(device {device.type}, backend {runner.info.attention_backend})"})
                continue
            if runner.cuda is not None:
                runner.cuda.graphs = graphs if mode == "graphs" else None
            ms = decode_step_ms(runner, batch, plan["model_context"], plan["steps"])
            rows.append({"batch": batch, "mode": mode, "step_ms": ms, "x_floor": ms / floor_ms})
    return {"backend": runner.info.attention_backend, "weight_bytes": weight_bytes(runner), "floor_ms": floor_ms,
            "context": plan["model_context"], "rows": rows}


def families(device, plan: dict, folder: Path, prompts: list[list[int]], backend: str) -> dict:
    """Each FAMILIES shape on the device in the plan's dtype against float32 on the CPU; a family's failure is
    recorded under its name and in "error", and the others still run. MLA decodes eagerly: its attention reads
    the step's lengths on the host (mla.seq_spans), which a CUDA graph cannot capture."""
    out: dict = {}
    for name, shape in FAMILIES.items():
        try:
            out[name] = cpu_agreement(folder / name, shape, device.type, prompts, plan["hf_tokens"],
                                      dtype=str(plan["dtype"]).removeprefix("torch."),
                                      cuda_graphs=name != "deepseek_v3", backend=backend)
        except Exception as e:  # a finding: the other family still runs
            out[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=8)}
    failed = [name for name, r in out.items() if "error" in r]
    return {**out, "error": f"failed: {', '.join(failed)}"} if failed else out


def run(args) -> dict:
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        raise SystemExit("gpu_check: no CUDA device; --dry-run runs the same code on tiny shapes on the CPU")
    device = torch.device("cuda" if cuda else "cpu")
    plan = DRY if args.dry_run else FULL
    results = {"date": datetime.date.today().isoformat(), "dry_run": args.dry_run, "device": _device_name(device),
               "torch": torch.__version__, "triton": _version("triton"), "python": platform.python_version(),
               "hbm_bytes_per_s": H200_HBM_BYTES_PER_S, "pytest": _pytest(args)}
    backend = args.attention_backend
    prompts = [[1 + (7 * b + 3 * i) % 250 for i in range(5 + 3 * b)] for b in range(plan["hf_prompts"])]
    with tempfile.TemporaryDirectory() as tmp:
        section(results, "backends", lambda: backend_errors(device, plan["dtype"], plan["heads"][2]))
        section(results, "decode_attention", lambda: attention_bandwidth(device, plan))
        section(results, "model_decode", lambda: model_decode(device, plan, Path(tmp) / "model", backend))
        section(results, "hf_fidelity",
                lambda: hf_fidelity(Path(tmp) / "hf", device.type, plan["hf_tokens"], prompts, backend))
        section(results, "families", lambda: families(device, plan, Path(tmp) / "families", prompts, backend))
    return results


def _device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or '?'})"


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:
        return None


def _pytest(args) -> dict | None:
    """The GPU tests' outcome as gpu_check.sh ran them: exit status and the log's summary lines."""
    if args.pytest_log is None:
        return None
    lines = Path(args.pytest_log).read_text(errors="replace").splitlines() if Path(args.pytest_log).exists() else []
    keep = ("FAILED", "ERROR", "SKIPPED", "gpu_check:")
    return {"rc": args.pytest_rc, "summary": [ln for ln in lines if ln.startswith(keep) or
                                              any(w in ln for w in (" passed", " failed", " skipped", " error"))][-30:]}


def output_path(args) -> Path:
    if args.out:
        return Path(args.out)
    folder = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).resolve().parent / "results"
    suffix = "-dry" if args.dry_run else ""
    return folder / f"gpu-check-{datetime.date.today().isoformat()}{suffix}.json"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes (on the CPU when there is no GPU)")
    p.add_argument("--out", help="JSON path (default: $OUT/ or bench/results/gpu-check-<date>.json)")
    p.add_argument("--attention-backend", default="auto", help="the runners' backend (default auto)")
    p.add_argument("--pytest-log", help="the GPU tests' log, from gpu_check.sh")
    p.add_argument("--pytest-rc", type=int, default=None)
    args = p.parse_args(argv)
    results = run(args)
    path = output_path(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"gpu_check: wrote {path}")
    errors = [name for name, r in results.items() if isinstance(r, dict) and "error" in r]
    print("gpu_check: sections failed: " + ", ".join(errors) if errors else "gpu_check: every section ran")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
