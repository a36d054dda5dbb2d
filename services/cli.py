"""The ``kvserve`` command line: one subcommand per service or tool.

Flags fall back to environment variables (``KVSERVE_<FLAG>``), so Kubernetes manifests can configure
services without rewriting their command lines.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kvserve.services import cli_admin, cli_gateway, cli_kvmanager, cli_kvmem, cli_model, cli_up, cli_worker


def env_default(name: str, default=None):
    """The value of ``KVSERVE_<NAME>`` if set, else ``default``."""
    return os.environ.get(f"KVSERVE_{name.upper()}", default)


def parse_bytes(text: str) -> int:
    """'536870912', '512MiB', '1.5GiB', '64MB' -> bytes. Raises argparse.ArgumentTypeError on bad input."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    s = text.strip().lower()
    for suffix, factor in units.items():
        if s.endswith(suffix):
            s, scale = s[: -len(suffix)], factor
            break
    else:
        scale = 1
    try:
        value = float(s) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (try 536870912 or 512MiB)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"byte size must be positive, got {text!r}")
    return int(value)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def add_observability_flags(p: argparse.ArgumentParser) -> None:
    """--metrics-port (Prometheus text on http://HOST:PORT/metrics). Tracing is configured by the standard
    OTEL_* environment variables (common/telemetry.py)."""
    p.add_argument("--metrics-port", type=int, default=env_default("metrics_port"),
                   help="serve Prometheus metrics on this port (0 = a free one; default: no metrics)")


def metrics_note(host: str, port: int | None) -> str:
    return f", metrics on {host}:{port}" if port is not None else ""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="KV-cache-centric LLM serving.")
    parser.add_argument("--log-level", default=env_default("log_level", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)
    cli_model.add_commands(sub)
    cli_worker.add_commands(sub)
    cli_kvmanager.add_commands(sub)
    cli_admin.add_commands(sub)
    cli_gateway.add_commands(sub)
    cli_up.add_commands(sub)
    cli_kvmem.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args) or 0
    except BrokenPipeError:  # `kvserve admin stats | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141  # as a shell reports a process killed by SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
