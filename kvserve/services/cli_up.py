"""``kvserve up``: the whole stack on one machine in one command.

    KV store ── kvmanager (embedded Redis) ── workers × N ── gateway      started in this order, each once
                                                                         the previous printed its ready line;
                                                                         stopped in reverse

The KV store is the shared KV tier's Redis (cli_up_store.py). The workers are of role both (--workers), or
prefill and decode workers (--prefill-workers, --decode-workers: cli_up_workers.py).

Each service is a child process in its own process group (so a terminal's Ctrl-C reaches ``up`` alone and the
stop order holds: the gateway drains and frees its pages while the kvmanager still runs), and dies with ``up``
if ``up`` is killed. If any child exits on its own, ``up`` stops the rest and exits 1; with
``--kvmanager-replicas N`` > 1 (a leader and standbys on a Redis ``up`` runs: cli_up_replicas.py) a kvmanager that
exits is started again instead.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import re
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.services.cli_up_store import DEFAULT_KV_STORE_BYTES, kv_store_argv, open_kv_store
from kvserve.services.cli_up_workers import WorkerSpec, add_worker_flags, cpu_argv, worker_specs

READY = re.compile(r"kvserve \S+(?: \S+)? ready on (?P<host>[^\s:]+):(?P<port>\d+)")
READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 20.0


def _env(name, default=None):
    from kvserve.services.cli_flags import env_default

    return env_default(name, default)


def add_commands(sub) -> None:
    from kvserve.services.cli_flags import non_negative_int, parse_bytes, parse_bytes_or_zero, positive_int
    from kvserve.services.cli_gateway import DEFAULT_GATEWAY_PORT, add_gateway_flags
    from kvserve.services.cli_kvmanager import DEFAULT_KVMANAGER_PORT
    from kvserve.services.cli_worker import add_kv_format_flags, add_page_group_flags, add_window_flags

    u = sub.add_parser("up", help="run the whole stack: embedded Redis, kvmanager, workers, gateway")
    u.add_argument("--host", default="127.0.0.1")
    u.add_argument("--port", type=int, default=DEFAULT_GATEWAY_PORT, help="gateway port (0 = a free port)")
    u.add_argument("--kvmanager-port", type=int, default=DEFAULT_KVMANAGER_PORT, help="0 = a free port")
    add_worker_flags(u)
    u.add_argument("--kvmanager-replicas", type=positive_int, default=_env("kvmanager_replicas", "1"),
                   help="kvmanager processes: one leads, the others stand by to take over (default 1). With more "
                        "than 1, up runs the Redis they share (unless --redis-url) and their ports are "
                        "--kvmanager-port, +1, ... (free ports if 0)")
    u.add_argument("--model", default=_env("model"))
    u.add_argument("--cache-dir", type=Path, default=_env("cache_dir"))
    u.add_argument("--data-dir", type=Path, default=_env("data_dir"),
                   help="kvmanager data: embedded Redis files and the admin token (default: <cache dir>/kvmanager)")
    u.add_argument("--redis-url", default=_env("redis_url"), help="an external Redis instead of the embedded one")
    u.add_argument("--kv-store-bytes", type=parse_bytes_or_zero,
                   default=_env("kv_store_bytes", DEFAULT_KV_STORE_BYTES),
                   help=f"bound of the shared KV tier, which keeps committed KV pages past the pools' evictions, "
                        f"worker restarts and up's own restarts (default {DEFAULT_KV_STORE_BYTES}; 0 = off)")
    u.add_argument("--tenants-file", type=Path, default=_env("tenants_file"),
                   help="the kvmanager's per-tenant cache policy (TOML: weights, floors, caps, pin budgets)")
    u.add_argument("--cache-policy", choices=("fair", "lru"), default=_env("cache_policy", "fair"),
                   help="eviction across tenants: fair share (default) or one global LRU")
    u.add_argument("--load-penalty-pages", type=non_negative_int, default=_env("load_penalty_pages", "4"),
                   help="the kvmanager's placement: pages of prefix hit one queued or running request outweighs")
    u.add_argument("--kv-store-url", default=_env("kv_store_url"),
                   help="the shared KV tier's Redis (default: an embedded one under <data dir>/kv-store)")
    size = u.add_mutually_exclusive_group()
    size.add_argument("--kv-cache-bytes", type=parse_bytes, help="KV pool budget per worker (default 512MiB)")
    size.add_argument("--num-pages", type=positive_int, help="KV pool pages per worker")
    u.add_argument("--page-size", type=positive_int, default=16)
    add_kv_format_flags(u, "auto", "token_head")
    add_window_flags(u, "0", "0")
    add_page_group_flags(u)
    add_gateway_flags(u)
    # The worker counts are checked together, as argparse checks one flag: usage and exit code 2.
    u.set_defaults(func=functools.partial(run_up, usage_error=u.error))


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    address: str = ""
    ready_line: str = ""
    lines: queue.Queue = field(default_factory=queue.Queue)


def _pump(child: Child) -> None:
    for line in child.proc.stdout:
        child.lines.put(line)
    child.lines.put(None)


def start_child(name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
    """Starts `kvserve ARGV` and returns once it printed its ready line. Raises RuntimeError otherwise."""
    from kvserve.common.processes import die_with_parent  # imported here, never in the forked child

    proc = subprocess.Popen([sys.executable, "-m", "kvserve.services.cli", *argv], stdout=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, process_group=0, preexec_fn=die_with_parent,
                            env=env)
    child = Child(name, proc)
    threading.Thread(target=_pump, args=(child,), daemon=True).start()
    try:
        line = child.lines.get(timeout=READY_TIMEOUT_S)
    except queue.Empty:
        line = None
    match = READY.match(line or "")
    if not match:
        stop_child(child)
        raise RuntimeError(f"{name} did not start (exit code {proc.returncode}); its log is above")
    child.address, child.ready_line = f"{match['host']}:{match['port']}", line.strip()
    return child


def stop_child(child: Child) -> None:
    if child.proc.poll() is None:
        child.proc.terminate()
        try:
            child.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()


def _kvmanager_argv(args, model_dir: Path) -> list[str]:
    """The kvmanager gets the workers' model folder: its tokenizer serves `kvserve admin probe --text`."""
    argv = ["kvmanager", "--host", args.host, "--port", str(args.kvmanager_port), "--model", str(model_dir)]
    if args.data_dir:
        argv += ["--data-dir", str(args.data_dir)]
    if args.redis_url:
        argv += ["--redis-url", args.redis_url]
    if args.tenants_file:
        argv += ["--tenants-file", str(args.tenants_file)]
    argv += ["--cache-policy", args.cache_policy, "--load-penalty-pages", str(args.load_penalty_pages)]
    return argv + kv_store_argv(args)


def _worker_argv(args, spec: WorkerSpec, kvmanager: str) -> list[str]:
    """Every worker's argv but its id, role, threads and CPUs (``spec``): the same model, pool and KV format, as
    pools that hand pages to each other must have. The role is given even when it is both, so a KVSERVE_ROLE in
    up's environment cannot change it."""
    argv = ["worker", "--host", args.host, "--port", "0", "--worker-id", spec.worker_id, "--role", spec.role,
            "--kvmanager", kvmanager, "--page-size", str(args.page_size), "--kv-cache-dtype", args.kv_cache_dtype,
            "--kv-scales", args.kv_scales, "--sliding-window", str(args.sliding_window), "--attention-sinks",
            str(args.attention_sinks)]
    argv += ["--kv-cache-bytes", str(args.kv_cache_bytes)] if args.kv_cache_bytes else []
    argv += ["--num-pages", str(args.num_pages)] if args.num_pages else []
    argv += ["--page-groups" if args.page_groups else "--no-page-groups"]
    argv += ["--sliding-group-pages", str(args.sliding_group_pages)] if args.sliding_group_pages else []
    return argv + cpu_argv(spec) + kv_store_argv(args, worker=True) + _model_argv(args)


def _model_argv(args) -> list[str]:
    return (["--model", args.model] if args.model else []) + (["--cache-dir", str(args.cache_dir)]
                                                              if args.cache_dir else [])


def _gateway_argv(args, kvmanager: str) -> list[str]:
    """The gateway follows the workers that join the kvmanager: the stack's workers, and any started later."""
    argv = ["gateway", "--host", args.host, "--port", str(args.port), "--kvmanager", kvmanager,
            "--worker-timeout", str(args.worker_timeout), "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--long-prefill-token-threshold", str(args.long_prefill_token_threshold),
            "--default-max-tokens", str(args.default_max_tokens), "--max-tokens-limit", str(args.max_tokens_limit),
            "--max-queued-requests", str(args.max_queued_requests), "--http-port", str(args.http_port),
            "--max-local-prefill", str(args.max_local_prefill)]
    argv += ["--no-pull-peers"] if args.no_pull_peers else []
    argv += ["--served-model-name", args.served_model_name] if args.served_model_name else []
    argv += ["--no-prefix-caching"] if args.no_prefix_caching else []
    argv += ["--no-overlap-page-ops"] if args.no_overlap_page_ops else []
    argv += ["--no-reserve-ahead"] if args.no_reserve_ahead else []
    argv += ["--api-keys-file", str(args.api_keys_file)] if args.api_keys_file else []
    return argv + _model_argv(args)


def _watch(children: list[Child], stop: threading.Event, died: list[str], restart: dict | None = None) -> None:
    """One thread per child: a child that exits on its own stops the whole stack, but one named in ``restart``
    (a kvmanager replica: its argv for a port, and its environment) is started again."""
    from kvserve.services.cli_up_replicas import keep_running

    def wait(child: Child) -> None:
        child.proc.wait()
        if not stop.is_set():
            died.append(child.name)
            stop.set()

    for child in children:
        if child.name in (restart or {}):
            argv_for_port, env = restart[child.name]
            target, targs = keep_running, (child, argv_for_port, env, stop, died, start_child, stop_child)
        else:
            target, targs = wait, (child,)
        threading.Thread(target=target, args=targs, daemon=True).start()


def _start_kvmanagers(args, children: list[Child], stack: contextlib.ExitStack) -> dict:
    """The kvmanager (or, with --kvmanager-replicas N > 1, N of them on a Redis up runs); what _watch restarts."""
    from kvserve.services import cli_up_replicas as replicas
    from kvserve.services.model_store import resolve_model

    model_dir = resolve_model(args.model, args.cache_dir)
    if args.kvmanager_replicas == 1:
        children.append(start_child("kvmanager", _kvmanager_argv(args, model_dir)))
        return {}
    try:
        shared = replicas.open_shared_redis(args, stack)
    except (ValueError, OSError) as e:
        raise RuntimeError(str(e)) from e

    def argv_for_port(port: int) -> list[str]:
        return replicas.replica_argv(args, model_dir, shared, port)

    for i in range(args.kvmanager_replicas):
        children.append(start_child(f"kvmanager-{i}", argv_for_port(replicas.replica_port(args, i)), shared.env))
    return {child.name: (argv_for_port, shared.env) for child in children}


def _start_stack(args, children: list[Child], stack: contextlib.ExitStack) -> tuple[str, dict]:
    """Starts every service; (the --kvmanager value the gateway got, the kvmanagers _watch restarts)."""
    try:
        open_kv_store(args, stack)
    except (RuntimeError, OSError) as e:
        raise RuntimeError(f"the KV store did not start: {e}") from e
    restart = _start_kvmanagers(args, children, stack)
    kvmanager = ",".join(child.address for child in children)
    for spec in worker_specs(args):
        children.append(start_child(spec.worker_id, _worker_argv(args, spec, kvmanager)))
    children.append(start_child("gateway", _gateway_argv(args, kvmanager)))
    return kvmanager, restart


def _check_window(args) -> None:
    """--sliding-window / --attention-sinks against the model's own window, as each worker will check them."""
    from kvserve.services.model_store import resolve_model
    from kvserve.worker.config import ModelConfig, resolve_window

    resolve_window(ModelConfig.from_folder(resolve_model(args.model, args.cache_dir)), args.sliding_window,
                   args.attention_sinks, args.page_size)


def _admin_hint(args, kvmanager_address: str) -> str:
    """The kvserve admin command line that reaches this stack's kvmanager with its token."""
    from kvserve.services.cli_kvmanager import DEFAULT_KVMANAGER_PORT

    flags = "" if kvmanager_address == f"127.0.0.1:{DEFAULT_KVMANAGER_PORT}" else f" --kvmanager {kvmanager_address}"
    flags += f" --data-dir {args.data_dir}" if args.data_dir else ""
    return f"kvserve admin stats{flags}"


def run_up(args, usage_error=None) -> int:
    """``usage_error(message)``: the parser's error (prints the usage, exits 2); None: print and return 2."""
    from kvserve.common.grpc_server import install_stop_signals
    from kvserve.services.cli_kvmanager import ADMIN_TOKEN_FILE, default_data_dir
    from kvserve.services.model_store import ModelNotFound
    from kvserve.worker.kv_pool import check_kv_format

    try:
        worker_specs(args)
    except ValueError as e:
        if usage_error is not None:
            usage_error(str(e))
        print(f"kvserve up: error: {e}", file=sys.stderr)
        return 2
    try:  # checked before anything starts, not by each worker a minute later
        check_kv_format(args.kv_cache_dtype, args.kv_scales)
        if args.sliding_window or args.attention_sinks:
            _check_window(args)
    except (ValueError, ModelNotFound) as e:
        print(f"kvserve: {e}", file=sys.stderr)
        return 2
    if args.tenants_file:  # as the keys: checked before anything starts
        from kvserve.kvmanager.tenants import TenantsFileError, load_policy

        try:
            load_policy(args.tenants_file)
        except TenantsFileError as e:
            print(f"kvserve: --tenants-file {e}", file=sys.stderr)
            return 2
    if args.api_keys_file:  # checked before anything starts, not by the gateway a minute later
        from kvserve.services.gateway.auth import load_keys

        try:
            load_keys(args.api_keys_file, None)
        except (OSError, ValueError) as e:
            print(f"kvserve: --api-keys-file {args.api_keys_file}: {e}", file=sys.stderr)
            return 2
    stop = install_stop_signals()
    children: list[Child] = []
    died: list[str] = []
    stack = contextlib.ExitStack()  # the KV store, the Redis of --kvmanager-replicas N > 1: closed after the children
    try:
        kvmanager, restart = _start_stack(args, children, stack)
        _watch(children, stop, died, restart)
        gateway = children[-1]
        token = (args.data_dir or default_data_dir()).expanduser() / ADMIN_TOKEN_FILE
        # "HTTP http://host:port/v1, N workers, prefix caching .., keys"
        http, details = gateway.ready_line.split("(", 1)[1].rstrip(")").split(", ", 1)
        print(f"kvserve up ready: gateway on {gateway.address}, OpenAI API at {http.removeprefix('HTTP ')} "
              f"(kvmanager {kvmanager}, {details}; "
              f"admin token in {token}: {_admin_hint(args, kvmanager)})", flush=True)
        stop.wait()
    except (RuntimeError, ModelNotFound) as e:
        print(f"kvserve: {e}", file=sys.stderr)
        died.append("start-up")
    finally:
        stop.set()
        for child in reversed(children):  # gateway first: it frees its pages while the kvmanager runs
            stop_child(child)
        stack.close()
    if died:
        print(f"kvserve: stopped because {died[0]} exited", file=sys.stderr)
        return 1
    return 0
