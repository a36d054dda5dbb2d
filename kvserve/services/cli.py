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
from kvserve.services.cli_flags import env_default


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
