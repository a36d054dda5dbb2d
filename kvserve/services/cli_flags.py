"""Flag types and defaults shared by the ``kvserve`` subcommands: every flag falls back to an environment
variable ``KVSERVE_<FLAG>``, so Kubernetes manifests can configure services without rewriting command lines."""

from __future__ import annotations

import argparse
import os

from kvserve.common.units import byte_size


def env_default(name: str, default=None):
    """The value of ``KVSERVE_<NAME>`` if set, else ``default``."""
    return os.environ.get(f"KVSERVE_{name.upper()}", default)


def env_switch(name: str, default: bool) -> bool:
    """An on/off flag's default from ``KVSERVE_<NAME>``: 0, false, no or off (any case) is off, anything else on."""
    value = env_default(name)
    return default if value is None else value.strip().lower() not in ("0", "false", "no", "off")


def parse_bytes(text: str, allow_zero: bool = False) -> int:
    """'536870912', '512MiB', '1.5GiB', '64MB' -> bytes (> 0, or >= 0 with ``allow_zero``). Raises
    argparse.ArgumentTypeError on bad input."""
    try:
        return byte_size(text, allow_zero)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_bytes_or_zero(text: str) -> int:
    """parse_bytes for a bound where 0 means off."""
    return parse_bytes(text, allow_zero=True)


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
    OTEL_* environment variables (kvserve/common/telemetry.py)."""
    p.add_argument("--metrics-port", type=int, default=env_default("metrics_port"),
                   help="serve Prometheus metrics on this port (0 = a free one; default: no metrics)")


def metrics_note(host: str, port: int | None) -> str:
    return f", metrics on {host}:{port}" if port is not None else ""


TLS_HELP = {
    "server": ("serve TLS with this PEM certificate (with --tls-key; default: plaintext)",
               "require client certificates signed by this PEM CA (mutual TLS)"),
    "client": ("a PEM client certificate, for a server that requires one (mutual TLS; with --tls-key)",
               "dial with TLS and verify the server's certificate with this PEM CA (default: plaintext)"),
    "both": ("serve TLS with this PEM certificate (with --tls-key), also presented as the client certificate to "
             "the services this one dials, which it dials with TLS too (default: plaintext)",
             "require client certificates signed by this PEM CA (mutual TLS) and verify the services dialled "
             "with it"),
}


def add_tls_flags(p: argparse.ArgumentParser, role: str, dials: str = "the server") -> None:
    """--tls-cert, --tls-key, --tls-ca (KVSERVE_TLS_CERT, _KEY, _CA) for a ``role``: "server", "client" or "both"
    (the gateway, a worker: one certificate both ways). A role that dials gets --tls-server-name too, the name
    that ``dials``' certificate is verified against when it is not the host dialled (kvserve/common/tls.py)."""
    cert_help, ca_help = TLS_HELP[role]
    p.add_argument("--tls-cert", default=env_default("tls_cert"), help=cert_help)
    p.add_argument("--tls-key", default=env_default("tls_key"), help="the PEM private key of --tls-cert")
    p.add_argument("--tls-ca", default=env_default("tls_ca"), help=ca_help)
    if role != "server":
        p.add_argument("--tls-server-name", default=env_default("tls_server_name"),
                       help=f"verify {dials}'s certificate against this name (default: the host dialled; for a "
                            "list of addresses, the first one's)")


def tls_from_args(args, server: bool):
    """The TLS files the flags name, loaded (common.tls.Tls), or None for plaintext. Raises common.tls.TlsError
    (a ValueError) naming the flag and path of a file that is missing or wrong."""
    from kvserve.common.tls import load_tls

    return load_tls(args.tls_cert, args.tls_key, args.tls_ca, server=server,
                    server_name=getattr(args, "tls_server_name", None))


def tls_note(tls) -> str:
    """For a ready line: ", TLS" or ", mutual TLS" when serving it; nothing for plaintext."""
    return "" if tls is None else f", {tls.describe()}"
