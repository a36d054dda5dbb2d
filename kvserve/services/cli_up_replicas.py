"""``kvserve up --kvmanager-replicas N`` with N > 1: a kvmanager leader and N - 1 standbys on one Redis.

    Redis (embedded, run by up) ── kvmanager × N (one leads) ── workers × M ── gateway (--kvmanager a1,a2,..)

``up`` runs the Redis itself (an EmbeddedRedis under <data-dir>/redis, where a single kvmanager keeps it too),
unless ``--redis-url`` names one, and gives every kvmanager the same admin token (KVSERVE_ADMIN_TOKEN in their
environment, not their argv; written to <data-dir>/admin_token for ``kvserve admin``, as a single kvmanager
does). A kvmanager that exits while the stack runs is started again on the port it had (the lists the gateway
and the workers hold name it), where it comes back as a standby; the rest of the stack keeps running.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("kvserve.cli")


@dataclass(frozen=True, slots=True)
class SharedRedis:
    """What the kvmanagers of one stack share: the Redis URL, their environment (the admin token), and where
    ``kvserve admin`` finds that token (None: it was given in KVSERVE_ADMIN_TOKEN)."""

    url: str
    env: dict[str, str]
    token_path: Path | None


def open_shared_redis(args, stack: contextlib.ExitStack) -> SharedRedis:
    """Locks the data dir (as a kvmanager does: one Redis on its files), starts the embedded Redis unless
    --redis-url, and makes the admin token. Raises ValueError (the data dir is in use), RuntimeError (Redis did
    not start), OSError."""
    from kvserve.common.embedded_redis import EmbeddedRedis
    from kvserve.services.cli_kvmanager import default_data_dir, lock_data_dir, write_admin_token

    data_dir = (args.data_dir or default_data_dir()).expanduser()
    lock_data_dir(data_dir, stack)
    url = args.redis_url or stack.enter_context(EmbeddedRedis(data_dir / "redis")).url
    if os.environ.get("KVSERVE_ADMIN_TOKEN"):
        return SharedRedis(url, dict(os.environ), None)
    token_path = write_admin_token(data_dir)
    return SharedRedis(url, {**os.environ, "KVSERVE_ADMIN_TOKEN": token_path.read_text().strip()}, token_path)


def replica_port(args, i: int) -> int:
    """kvmanager i's port: --kvmanager-port + i, or a free one (0) when --kvmanager-port is 0."""
    return args.kvmanager_port + i if args.kvmanager_port else 0


def replica_argv(args, model_dir: Path, shared: SharedRedis, port: int) -> list[str]:
    from kvserve.services.cli_up_store import kv_store_argv

    return ["kvmanager", "--host", args.host, "--port", str(port), "--model", str(model_dir), "--redis-url",
            shared.url, *kv_store_argv(args)]


def keep_running(child, argv_for_port: Callable[[int], list[str]], env: dict[str, str], stop: threading.Event,
                 died: list[str], start_child, stop_child) -> None:
    """In a thread: each time the kvmanager ``child`` exits while the stack runs, starts it again on its port
    (as a standby, until it wins an election). A restart that fails stops the stack, as a child's exit does
    without replicas."""
    while True:
        code = child.proc.wait()
        if stop.is_set():
            return
        log.warning("kvserve up: %s exited with %s; starting it again (as a standby)", child.name, code)
        port = int(child.address.rsplit(":", 1)[1])
        try:
            fresh = start_child(child.name, argv_for_port(port), env)
        except RuntimeError:
            died.append(child.name)
            stop.set()
            return
        child.proc, child.lines, child.ready_line = fresh.proc, fresh.lines, fresh.ready_line
        if stop.is_set():  # the stack stopped while it started: it may have been passed over
            stop_child(child)
            return
