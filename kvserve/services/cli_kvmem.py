"""``kvserve kv-mem``: the exact KV-cache memory calculator (the arithmetic lives in kvserve/common/kvmem.py, the models
it knows in kvserve/common/kvmem_models.py); this module parses flags and prints the report."""

from __future__ import annotations

import argparse
import json
import re
import sys

from kvserve.common.kvmem import GIB, KvMemReport, params_text
from kvserve.common.kvmem_models import ModelSpec
from kvserve.common.wire.tier import PAGE_VALUE_HEADER_BYTES

PROG = "kvserve kv-mem"


def _env(name, default=None):
    from kvserve.services.cli_flags import env_default

    return env_default(name, default)



def _non_negative_bytes(text: str) -> int:
    from kvserve.services.cli_flags import parse_bytes

    if re.fullmatch(r"\s*0+(\.0*)?\s*([kmg]i?b|b)?\s*", text, re.IGNORECASE):
        return 0
    return parse_bytes(text)


def _fraction(text: str) -> float:
    from kvserve.services.cli_flags import number

    value = number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _one_line_error(message: str):
    """argparse errors as one line on stderr, exit 2 (instead of the usage block)."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(2)


def add_commands(sub) -> None:
    from kvserve.services.cli_flags import non_negative_int, parse_bytes, positive_int

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
                   help="fp32, bf16, fp16, fp8_e4m3 (fp8), fp8_e5m2 or int8 (default: the model's dtype)")
    p.add_argument("--kv-scales", default="token_head",
                   help="scales of a quantised dtype: token_head (default: one fp32 per token per KV head, as "
                        "kvserve's workers store them) or tensor (one per-tensor scale, nothing per token)")
    p.add_argument("--page-size", type=positive_int, default=None, help="tokens per page: pages and padding waste")
    p.add_argument("--sliding-window", type=non_negative_int, default=None,
                   help="attention window in tokens (default: the model's own; 0 = none)")
    p.add_argument("--sinks", type=non_negative_int, default=0,
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
    p.add_argument("--kv-store-bytes", type=parse_bytes, default=None,
                   help="size of a shared KV tier (kvserve up --kv-store-bytes): how many pages, tokens and "
                        "sequences of --seq-len it keeps (pages of --page-size, default 16)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=run_kv_mem)


def _list_models() -> str:
    from kvserve.common.kvmem_models import BUILTIN_MODELS

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
    from kvserve.common.kvmem import KvMemError, calculate
    from kvserve.common.kvmem_models import find_model

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
            model, batch=args.batch, seq_len=args.seq_len, kv_dtype=args.kv_dtype, kv_scales=args.kv_scales,
            page_size=args.page_size,
            sliding_window=args.sliding_window, sinks=args.sinks, gpu_memory=args.gpu_memory,
            weights_bytes=args.weights_bytes, weights_dtype=args.weights_dtype or "bf16",
            memory_utilization=0.9 if args.memory_utilization is None else args.memory_utilization,
            reserve=args.reserve or 0, store_bytes=args.kv_store_bytes,
        )
    except KvMemError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return 0


# -- the report as text ---------------------------------------------------------------------------------------
def human_bytes(n: int) -> str:
    """'1,073,741,824 B (1.00 GiB)'; small sizes in KiB/MiB."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n:,} B ({n / scale:.2f} {unit})"
    return f"{n:,} B"


def describe_model(m: ModelSpec) -> str:
    shape = (f"{m.num_layers} layers, MLA latent {m.latent_dim}" if m.attention == "mla" else
             f"{m.num_layers} layers, {m.num_kv_heads} KV heads, head_dim {m.head_dim}")
    extra = [f"max context {m.max_context:,}"] if m.max_context else []
    if m.sliding_window:
        extra.append(f"sliding window {m.sliding_window:,}")
    if m.params:
        extra.append(f"~{params_text(m.params)} params")
    return f"{m.name} ({m.source}: {', '.join([shape, *extra])})"


def format_report(r: KvMemReport) -> str:
    pt = r.per_token
    lines = [f"model         {describe_model(r.model)}",
             f"per token     {pt.formula}"]
    if pt.scale_bytes:
        lines += [f"  + scales    {pt.scale_formula}",
                  f"  = total     {pt.kv_bytes:,} + {pt.scale_bytes:,} = {pt.bytes:,} B per token"]
    if r.tokens_per_sequence != r.seq_len:
        lines.append(f"window        min({r.seq_len:,}, {r.sliding_window:,} window + {r.sinks} sinks) = "
                     f"{r.tokens_per_sequence:,} tokens kept per sequence")
    elif r.sliding_window:
        lines.append(f"window        {r.sliding_window:,} window + {r.sinks} sinks >= {r.seq_len:,}: "
                     "the whole sequence is kept")
    lines.append(f"per sequence  {r.tokens_per_sequence:,} tokens x {pt.bytes:,} B = "
                 f"{human_bytes(r.bytes_per_sequence)}")
    lines.append(f"total         {r.batch} x {r.tokens_per_sequence:,} tokens = {r.total_tokens:,} tokens = "
                 f"{human_bytes(r.total_bytes)}")
    if p := r.paging:
        lines += [
            f"pages         ceil({r.tokens_per_sequence:,} / {p.page_size}) = {p.pages_per_sequence:,} pages per "
            f"sequence = {p.allocated_tokens_per_sequence:,} tokens = {human_bytes(p.allocated_bytes_per_sequence)}",
            f"padding       {p.padding_tokens_per_sequence:,} tokens = {p.padding_bytes_per_sequence:,} B per sequence "
            f"({p.padding_percent:.2f} % of allocated); batch total {human_bytes(p.total_padding_bytes)}",
            f"allocated     {r.batch} x {p.pages_per_sequence:,} = {p.total_pages:,} pages = "
            f"{human_bytes(p.total_allocated_bytes)}",
        ]
    if c := r.capacity:
        paged = f" = {c.max_pages:,} pages x {r.paging.page_size}" if c.max_pages is not None else ""
        per_req = (f"{c.request_pages:,} pages = {human_bytes(c.request_bytes)}" if c.request_pages is not None
                   else human_bytes(c.request_bytes))
        lines += [
            f"GPU memory    {human_bytes(c.gpu_memory_bytes)} x {c.memory_utilization} = {human_bytes(c.usable_bytes)}"
            " usable",
            f"weights       {c.weights_source} = {human_bytes(c.weights_bytes)}",
            f"reserve       {human_bytes(c.reserve_bytes)}",
            f"KV budget     {human_bytes(c.kv_budget_bytes)}",
            f"fits          {c.max_tokens:,} tokens{paged}",
            f"requests      {c.max_concurrent_requests:,} concurrent requests of {r.seq_len:,} tokens "
            f"({c.request_tokens:,} kept, {per_req} each)",
            f"batch         {r.batch} x {r.seq_len:,} tokens {'fits' if c.batch_fits else 'does NOT fit'}",
        ]
    if s := r.store:
        lines += [
            f"KV store      a value per page: {PAGE_VALUE_HEADER_BYTES} B header + {s.page_size} x {pt.bytes:,} B = "
            f"{s.value_bytes:,} B",
            f"  holds       {human_bytes(s.store_bytes)} / {s.value_bytes:,} B = {s.max_pages:,} pages = "
            f"{s.max_tokens:,} tokens = {s.max_sequences:,} sequences of {r.seq_len:,} tokens",
        ]
    if g := r.page_groups:
        lines += [
            "page groups   what kvserve's worker holds by default for a mixed model, a page table per layer group "
            "(the sliding layers' pages released past their window); the figures above keep every layer's pages "
            "(--no-page-groups)",
            f"  per seq     {g.full_layers} full layers x {g.full_tokens:,} tokens + {g.sliding_layers} sliding layers "
            f"x {g.sliding_tokens:,} tokens (window {g.window:,}) = {human_bytes(g.bytes_per_sequence)}, "
            f"{g.saving:.2f}x less than {human_bytes(g.every_page_bytes)}",
        ]
    lines += [f"note          {n}" for n in r.notes]
    return "\n".join(lines)
