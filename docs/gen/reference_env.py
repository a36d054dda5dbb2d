"""reference/env.md: every environment variable kvserve reads, with what it sets.

Run by mkdocs-gen-files at build time. The flags' variables come from the parsers (cli_tree.py); the variables
the code reads directly are found in the source (os.environ reads and `_env("name")` calls outside a flag), and
each needs a line in DIRECT or STANDARD below: a new one without it, or a line for one no longer read, fails the
build.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import mkdocs_gen_files

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cli_tree as tree  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CODE = tuple(f"kvserve/{layer}" for layer in ("common", "worker", "kvmanager", "kernels", "services"))
PAGE = "reference/env.md"
ENVIRON = re.compile(r"os\.environ(?:\.get\(|\.setdefault\(|\[)\s*[\"']([A-Z][A-Z0-9_]*)[\"']")
ENV_CALL = re.compile(r"\b(?:_env|env_default|env_switch)\(\s*[\"']([a-z0-9_]+)[\"']")

# Variables the code reads itself (not, or not only, as a flag's default): what each one does.
DIRECT = {
    "KVSERVE_ADMIN_TOKEN": "`kvserve up` with several kvmanagers (`--kvmanager-replicas`) hands this token to "
                           "all of them instead of writing a new one into the data dir.",
    "KVSERVE_API_KEYS": "The gateway's API keys as `key=tenant,key=tenant` when `--api-keys-file` is not given; "
                        "with neither, the gateway runs in dev mode (no key, one tenant `default`).",
    "KVSERVE_BLOCK_WEIGHTS": "`0`: the cpu backend keeps every weight as float32 panels instead of the model's "
                             "exact 4-/8-bit blocks (for comparisons).",
    "KVSERVE_CACHE_DIR": "The cache root (converted models, the kvmanager's default data dir); default "
                         "`$XDG_CACHE_HOME/kvserve`, else `~/.cache/kvserve`.",
    "KVSERVE_CPU_MARCH": "The `-march` the cpu backend's C++ kernels are compiled for (default `native`); the "
                         "container image sets `x86-64-v3`. A CPU that lacks the level builds `native` instead.",
    "KVSERVE_PREFILL_KERNEL": "`0`: the cpu backend sends prefill chunks through the reference path (gather + "
                              "SDPA) instead of its paged prefill kernel (for comparisons).",
}
# Variables of other software that kvserve reads or sets, and where.
STANDARD = {
    "OTEL_EXPORTER_OTLP_ENDPOINT": ("kvserve/common/telemetry.py", "Export traces over OTLP/gRPC to this endpoint; "
                                    "without it (or the traces one) no tracing SDK is installed."),
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ("kvserve/common/telemetry.py", "The same, for traces only."),
    "OTEL_SDK_DISABLED": ("kvserve/common/telemetry.py", "`true`: no tracing, whatever the endpoint."),
    "OTEL_TRACES_SAMPLER": ("kvserve/common/telemetry.py", "The sampler (with `OTEL_TRACES_SAMPLER_ARG`), read by the "
                            "OpenTelemetry SDK."),
    "XDG_CACHE_HOME": ("kvserve/services/model_store.py",
                       "The cache root's parent when `KVSERVE_CACHE_DIR` is not set."),
    "TRITON_INTERPRET": ("kvserve/kernels/triton_paged.py", "`1`: the triton backend runs its kernels in Triton's "
                         "interpreter, on the CPU (how the tests run them)."),
    "GRPC_ENABLE_FORK_SUPPORT": ("kvserve/services/cli_kvmanager.py", "`kvserve kvmanager` sets it to `0` before it "
                                 "imports grpc, so that its call-log snapshots can be written by a forked child."),
}
IGNORED = {"PATH"}  # kvserve/kernels/cpu_paged.py puts ninja on it for the C++ build


def direct_reads(flag_vars: set[str]) -> dict[str, list[str]]:
    """KVSERVE_* variable -> the files that read it other than as a flag's default; other variables too."""
    found: dict[str, list[str]] = {}
    for folder in CODE:
        for path in sorted((ROOT / folder).rglob("*.py")):
            text, where = path.read_text(), str(path.relative_to(ROOT))
            names = set(ENVIRON.findall(text))
            names |= {f"KVSERVE_{n.upper()}" for n in ENV_CALL.findall(text)} - flag_vars
            for name in names - IGNORED:
                found.setdefault(name, []).append(where)
    return found


def grouped(uses: list, children: dict) -> list[tuple[tuple[str, ...], str, object]]:
    """(path, label, action) per use; a command whose subcommands all take the flag once, as `admin *`."""
    paths = {p for p, _ in uses}
    out, done = [], set()
    for path, action in uses:
        parent = path[:-1]
        if len(path) > 2 and len(children[parent]) > 1 and children[parent] <= paths:
            if parent not in done:
                done.add(parent)
                out.append((parent, f"{' '.join(parent[1:])} *", action))
        else:
            out.append((path, " ".join(path[1:]) or "kvserve", action))
    return out


def use(path: tuple[str, ...], label: str, action) -> str:
    """[`worker`](cli.md#kvserve-worker) `--port` = `50061`"""
    value = tree.default(action)
    return f"[`{label}`](cli.md#{tree.anchor(path)}) {tree.flag_name(action)}" + (f" = {value}" if value else "")


def sets_cell(uses: list, fallback: str) -> str:
    """The flags a variable sets, with their help: once when every command's is the same, else each one's."""
    helps = {tree.help_text(action, "kvserve") for _, _, action in uses if action.help}
    if len(helps) > 1:
        return "<br>".join(use(*u) + (f": {tree.help_text(u[2], 'kvserve')}" if u[2].help else "") for u in uses)
    text = next(iter(helps), fallback)
    return ", ".join(use(*u) for u in uses) + (f"<br>{text}" if text else "")


def render() -> str:
    envs = tree.env_vars()
    by_var: dict[str, list] = {}
    children: dict[tuple[str, ...], set] = {}
    for path, parser, _ in tree.commands():
        children.setdefault(path[:-1], set()).add(path)
        for action in tree.flags(parser):
            if (path, action.dest) in envs:
                by_var.setdefault(envs[path, action.dest], []).append((path, action))
    reads = direct_reads(set(by_var))
    kvserve_reads = {n: w for n, w in reads.items() if n.startswith("KVSERVE_")}
    missing = (set(kvserve_reads) - set(DIRECT)) | (set(reads) - set(kvserve_reads) - set(STANDARD))
    stale = set(DIRECT) - set(kvserve_reads)
    stale |= {n for n, (where, _) in STANDARD.items() if n not in (ROOT / where).read_text()}
    if missing or stale:
        raise RuntimeError(f"docs/gen/reference_env.py: describe {sorted(missing)}; no longer read: {sorted(stale)}")

    lines = ["# Environment variables", "",
             "Every environment variable kvserve reads, generated when this site is built: the flags' variables "
             "from the parsers in `kvserve/services/cli.py`, the others from the code that reads them.", "",
             "## Flags", "",
             "Every flag of a service falls back to `KVSERVE_<FLAG>` (upper case, `-` as `_`) when it is not on the "
             "command line, which is how `k8s/` configures the services. A variable sets the flag of every command "
             "listed (with that command's default); `admin *` is every `kvserve admin` subcommand.", "",
             '<div class="kv-vars" markdown>', "", "| variable | sets, and what it does |", "|---|---|"]
    for var in sorted(by_var):
        uses = grouped(by_var[var], children)
        lines.append(f"| `{var}` | {sets_cell(uses, DIRECT.get(var, ''))} |")
    lines += ["", "</div>", "", "## Read by the code", "",
              "Variables that are not (or not only) a flag's default.", "",
              "| variable | read in | what it does |", "|---|---|---|"]
    for var in sorted(DIRECT):
        lines.append(f"| `{var}` | {', '.join(f'`{w}`' for w in kvserve_reads[var])} | {DIRECT[var]} |")
    lines += ["", "## Other software's variables", "",
              "| variable | read in | what it does |", "|---|---|---|"]
    for var, (where, text) in STANDARD.items():
        lines.append(f"| `{var}` | `{where}` | {text} |")
    return "\n".join(lines) + "\n"


with mkdocs_gen_files.open(PAGE, "w") as f:
    f.write(render())
