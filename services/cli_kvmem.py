"""``kvserve kv-mem``: the exact KV-cache memory calculator (the arithmetic lives in common/kvmem.py)."""

from __future__ import annotations

import argparse
import json
import re
import sys

PROG = "kvserve kv-mem"


def _env(name, default=None):
    from kvserve.services.cli_flags import env_default

    return env_default(name, default)


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _non_negative_bytes(text: str) -> int:
    from kvserve.services.cli_flags import parse_bytes

    if re.fullmatch(r"\s*0+(\.0*)?\s*([kmg]i?b|b)?\s*", text, re.IGNORECASE):
        return 0
    return parse_bytes(text)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _one_line_error(message: str):
    """argparse errors as one line on stderr, exit 2 (instead of the usage block)."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(2)


def add_commands(sub) -> None:
    from kvserve.services.cli_flags import parse_bytes, positive_int

    p = sub.add_parser(
        "kv-mem", help="exact KV-cache memory: bytes per token / sequence / batch, pages, and what fits in a GPU",
        description="Exact KV-cache memory. Per token: 2 x layers x kv_heads x head_dim x bytes per element "
                    "(MLA: layers x latent x bytes). With --gpu-memory, also how many tokens and requests fit.")
    p.error = _one_line_error  # a bad flag is one clear line and exit code 2
    p.add_argument("model", nargs="?", default=_env("model"),
                   help="a built-in model name (see --list-models; case-insensitive, HF ids accepted) or an HF "
                        "config.json / model folder (default: $KVSERVE_MODEL, else the worker's default model)")
    p.add_argument("--list-models", action="store_true", help="list the built-in models and exit")
    p.add_argument("--batch", type=positive_int, default=1, help="sequences (default 1)")
    p.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence (default: max context)")
    p.add_argument("--kv-dtype", default=_env("kv_dtype"),
                   help="fp32, bf16, fp16, fp8 or int8 (default: the model's dtype)")
    p.add_argument("--page-size", type=positive_int, default=None, help="tokens per page: pages and padding waste")
    p.add_argument("--sliding-window", type=_non_negative_int, default=None,
                   help="attention window in tokens (default: the model's own; 0 = none)")
    p.add_argument("--sinks", type=_non_negative_int, default=0,
                   help="attention-sink tokens kept besides the window (StreamingLLM)")
    rev = p.add_argument_group("what fits (the reverse question)")
    rev.add_argument("--gpu-memory", type=parse_bytes, default=_env("gpu_memory"),
                     help="GPU memory, e.g. 80GiB: answer how many tokens / requests of --seq-len fit")
    rev.add_argument("--weights-bytes", type=parse_bytes, default=None,
                     help="weight bytes (default: parameter count x --weights-dtype bytes)")
    rev.add_argument("--weights-dtype", default=None, help="dtype of the weights (default bf16)")
    rev.add_argument("--memory-utilization", type=_fraction, default=None,
                     help="fraction of GPU memory usable (default 0.9, like vLLM's gpu_memory_utilization)")
    rev.add_argument("--reserve", type=_non_negative_bytes, default=None,
                     help="bytes kept back for activations (default 0)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=run_kv_mem)


def _list_models() -> str:
    from kvserve.common.kvmem import BUILTIN_MODELS, describe_model

    return "\n".join(describe_model(m) + (f"  aliases: {', '.join(m.aliases)}" if m.aliases else "")
                     for m in BUILTIN_MODELS)


def _default_model() -> str:
    from kvserve.common.kvmem import KvMemError
    from kvserve.services.model_store import ModelNotFound, prepare_default_model

    try:
        return str(prepare_default_model(progress=False))
    except ModelNotFound as e:
        raise KvMemError(f"no model given and the default model is unavailable: {e}") from None


def run_kv_mem(args) -> int:
    from kvserve.common.kvmem import KvMemError, calculate, find_model, format_report

    if args.list_models:
        print(_list_models())
        return 0
    reverse_flags = {"--weights-bytes": args.weights_bytes, "--weights-dtype": args.weights_dtype,
                     "--memory-utilization": args.memory_utilization, "--reserve": args.reserve}
    try:
        if args.gpu_memory is None and (given := [k for k, v in reverse_flags.items() if v is not None]):
            raise KvMemError(f"{', '.join(given)} only apply with --gpu-memory")
        model = find_model(args.model or _default_model())
        report = calculate(
            model, batch=args.batch, seq_len=args.seq_len, kv_dtype=args.kv_dtype, page_size=args.page_size,
            sliding_window=args.sliding_window, sinks=args.sinks, gpu_memory=args.gpu_memory,
            weights_bytes=args.weights_bytes, weights_dtype=args.weights_dtype or "bf16",
            memory_utilization=0.9 if args.memory_utilization is None else args.memory_utilization,
            reserve=args.reserve or 0,
        )
    except KvMemError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return 0
