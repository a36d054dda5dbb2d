"""``kvserve model prepare``: converts the default model's GGUF into an HF-layout folder, once."""

from __future__ import annotations

import sys
from pathlib import Path


def add_commands(sub) -> None:
    model = sub.add_parser("model", help="manage model folders")
    msub = model.add_subparsers(dest="model_command", required=True)
    prep = msub.add_parser("prepare", help="convert the default model (SmolLM2-135M-Instruct GGUF) once")
    prep.add_argument("--cache-dir", type=Path, default=None, help="default: $KVSERVE_CACHE_DIR or ~/.cache/kvserve")
    prep.add_argument("--force", action="store_true", help="convert again even if the folder is complete")
    prep.set_defaults(func=prepare)


def prepare(args) -> int:
    from kvserve.services.model_store import ModelNotFound, prepare_default_model

    try:
        folder = prepare_default_model(args.cache_dir, force=args.force, progress=sys.stderr.isatty())
    except ModelNotFound as e:
        print(f"kvserve: {e}", file=sys.stderr)
        return 2
    print(folder)
    return 0
