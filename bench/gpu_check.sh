#!/usr/bin/env bash
# The GPU check (issue 24): the GPU tests, then bench/gpu_check.py (backends against the reference, decode
# attention bandwidth, an 8B-shaped random-weight model's decode step against the weight-read floor, fidelity
# against HF transformers). Writes one JSON: $OUT/gpu-check-<date>.json when OUT is set, else bench/results/.
# Under 8 minutes on an H200.
#
#   bench/gpu_check.sh              # on a CUDA machine
#   bench/gpu_check.sh --dry-run    # anywhere: the same code on tiny shapes
#
# Needs only python with torch (and triton for the triton backend): kvserve is not installed. Its import root
# `kvserve` maps the repository's folders (pyproject's package-dir: kvserve.kernels = kvserve/kernels/, kvserve.v1 =
# protos/kvserve/v1, ...), so a temporary folder of symlinks stands in for the install. Wheels shipped beside
# the repository (pytest and its dependencies, say; $KVSERVE_WHEELHOUSE, default bench/wheelhouse) are installed
# offline first when present, e.g. made on a machine with network by
#   pip download -d bench/wheelhouse --only-binary=:all: pytest
# Without pytest the GPU tests are not run and the JSON says so; without grpc (tests/conftest.py imports it) or
# the default model, the one GPU test that loads the default model is left out.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
cd "$ROOT"

SHIM=$(mktemp -d)
trap 'rm -rf "$SHIM"' EXIT
mkdir "$SHIM/kvserve" && touch "$SHIM/kvserve/__init__.py"
for d in common kernels kvmanager worker services; do ln -s "$ROOT/$d" "$SHIM/kvserve/$d"; done
ln -s "$ROOT/protos/kvserve/v1" "$SHIM/kvserve/v1"
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$SHIM/torch_extensions}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

WHEELS=${KVSERVE_WHEELHOUSE:-$ROOT/bench/wheelhouse}
if compgen -G "$WHEELS/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --find-links "$WHEELS" "$WHEELS"/*.whl || echo "gpu_check: wheelhouse install failed"
fi

LOG="$SHIM/pytest.log"
RC=-1
if $PY -c "import pytest" 2> /dev/null; then
    ARGS=(-m gpu tests/unit/kernels/test_gpu.py -q -rfEs -p no:cacheprovider -o addopts="" -o timeout=0)
    if ! $PY -c "import grpc; from kvserve.services.model_store import default_gguf_path; default_gguf_path()" \
            2> /dev/null; then
        ARGS+=(--noconftest --deselect tests/unit/kernels/test_gpu.py::test_runner_on_cuda_fp32_matches_cpu)
        echo "gpu_check: no grpc or default model here: test_runner_on_cuda_fp32_matches_cpu left out" | tee "$LOG"
    fi
    timeout 180 $PY -m pytest "${ARGS[@]}" 2>&1 | tee -a "$LOG" | tail -15
    RC=${PIPESTATUS[0]}
else
    echo "gpu_check: pytest is not importable: the GPU tests did not run" | tee "$LOG"
fi

timeout 270 $PY bench/gpu_check.py --pytest-log "$LOG" --pytest-rc "$RC" "$@"
