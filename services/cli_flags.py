"""Flag types and defaults shared by the ``kvserve`` subcommands: every flag falls back to an environment
variable ``KVSERVE_<FLAG>``, so Kubernetes manifests can configure services without rewriting command lines."""

from __future__ import annotations

import argparse
import os


def env_default(name: str, default=None):
    """The value of ``KVSERVE_<NAME>`` if set, else ``default``."""
    return os.environ.get(f"KVSERVE_{name.upper()}", default)


def env_switch(name: str, default: bool) -> bool:
    """An on/off flag's default from ``KVSERVE_<NAME>``: 0, false, no or off (any case) is off, anything else on."""
    value = env_default(name)
    return default if value is None else value.strip().lower() not in ("0", "false", "no", "off")


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


def number(text: str) -> float:
    """A float flag's value; argparse.ArgumentTypeError when it is none."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def positive_float(text: str) -> float:
    value = number(text)
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def positive_int(text: str) -> int:
    value = _integer(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def add_observability_flags(p: argparse.ArgumentParser) -> None:
    """--metrics-port (Prometheus text on http://HOST:PORT/metrics). Tracing is configured by the standard
    OTEL_* environment variables (common/telemetry.py)."""
    p.add_argument("--metrics-port", type=int, default=env_default("metrics_port"),
                   help="serve Prometheus metrics on this port (0 = a free one; default: no metrics)")


def metrics_note(host: str, port: int | None) -> str:
    return f", metrics on {host}:{port}" if port is not None else ""
