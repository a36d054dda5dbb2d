"""Generations of the call log, and snapshots written by a forked child instead of by a call.

The call log (oplog.py) is cut into generations. Generation g is a snapshot of the whole state, stored under
``<prefix>:s<g>:`` in snapshot_layout.py's layout, plus the calls made after it, in the list
``<prefix>:log:<g>``. A restart loads the snapshot ``<prefix>:gen`` names, then replays that generation's log
and every newer one, oldest first::

    <prefix>:gen        the generation a restart loads. Absent means 0: no snapshot yet, the calls in
                        <prefix>:log (a kvmanager from before generations kept its snapshot directly under
                        <prefix>:, and generation 0 loads it from there)
    <prefix>:gens       the counter that numbers new generations (a number is never reused)
    <prefix>:owner      the counter a kvmanager increments when it claims the prefix; a snapshot child
                        switches generations only while its parent's claim is the latest
    <prefix>:s<g>:...   the snapshot of generation g; <prefix>:s<g>:order:<worker> (each pool's free list
                        and LRU in their exact order) and <prefix>:s<g>:recent (remembered answers) hold
                        what replaying the log depends on beyond the layout's records (replay_items)
    <prefix>:log:<g>    the calls after snapshot g, oldest first

Writing a snapshot means encoding and storing every block and request, which grows with the pool: for a big
one, long enough to stall the call that writes it. The call that makes one due therefore forks instead, as
Redis does for BGSAVE, and pays only for the fork. From that moment the kvmanager appends calls to the new
generation's log. The child holds a copy-on-write image of the state as it was at the fork, and:

1. deletes what earlier failed attempts left, then writes the state as the new generation's snapshot, in
   chunks, under keys nobody reads yet;
2. sets ``gen`` and deletes the older logs, in one MULTI/EXEC that fails if another kvmanager has claimed
   the prefix since its parent did (a child outliving a killed parent can never switch under a restarted one);
3. deletes the older snapshots and logs.

A child only ever deletes generations older than its own.

A kill -9 at any point leaves Redis holding a loadable generation and every call after it. The child never
touches gRPC. It closes the descriptors it inherited, talks to Redis on a connection of its own, and leaves
with os._exit.

gRPC's C core registers fork handlers of its own unless GRPC_ENABLE_FORK_SUPPORT is false when grpc is
imported; with them, a fork from inside an RPC handler can kill the child with SIGSEGV. ``kvserve kvmanager``
sets it to 0 before it imports grpc, and forking_is_safe() says whether a process can fork.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import signal
import sys
import traceback
from collections import OrderedDict, deque
from dataclasses import dataclass

import redis

from kvserve.kvmanager.fencing import fenced_call
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.redis_server import die_with_parent, fresh_client
from kvserve.kvmanager.snapshot_layout import (
    BATCH,
    Keys,
    SnapshotLayout,
    dumps,
    glob_escape,
    key_segment,
    result_dict,
    result_from_dict,
)

GRPC_FORK_SUPPORT = "GRPC_ENABLE_FORK_SUPPORT"
FALSE = {"0", "false", "f", "no", "n", "off"}
SWITCHED, SUPERSEDED, FAILED = 0, 3, 1  # the child's exit codes


def forking_is_safe() -> bool:
    """Whether this process may fork a snapshot child: it has no gRPC, or gRPC's fork handlers are off
    (GRPC_ENABLE_FORK_SUPPORT false, which only counts if it was set before grpc was imported)."""
    return hasattr(os, "fork") and ("grpc" not in sys.modules
                                    or os.environ.get(GRPC_FORK_SUPPORT, "").strip().lower() in FALSE)


class GenerationKeys:
    """The key layout above, for one prefix."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.gen = f"{prefix}:gen"
        self.gens = f"{prefix}:gens"
        self.owner = f"{prefix}:owner"
        self._gen0 = Keys(prefix)  # generation 0's snapshot keys: directly under the prefix
        self._numbered = re.compile(re.escape(prefix) + r":(?:s(\d+):|log:(\d+)$)")

    def state_prefix(self, gen: int) -> str:
        """The prefix of generation ``gen``'s snapshot keys, for SnapshotLayout."""
        return self.prefix if gen == 0 else f"{self.prefix}:s{gen}"

    def log(self, gen: int) -> str:
        return f"{self.prefix}:log" if gen == 0 else f"{self.prefix}:log:{gen}"

    def order(self, gen: int, worker_id: str) -> str:
        """A pool's free list and LRU order in generation ``gen``'s snapshot (replay_items)."""
        return f"{self.state_prefix(gen)}:order:{key_segment(worker_id)}"

    def recent(self, gen: int) -> str:
        """The manager's remembered answers in generation ``gen``'s snapshot (replay_items)."""
        return f"{self.state_prefix(gen)}:recent"

    def all_pattern(self) -> str:
        return glob_escape(self.prefix) + ":*"

    def log_pattern(self) -> str:
        return glob_escape(self.prefix) + ":log*"

    def classify(self, key: str) -> tuple[str, int] | None:
        """("state", g) or ("log", g) for a key of generation g; None for the keys above and unknown ones."""
        m = self._numbered.match(key)
        if m:
            return ("state", int(m[1])) if m[1] is not None else ("log", int(m[2]))
        if key == self.log(0):
            return "log", 0
        return ("state", 0) if self._gen0.kind(key) else None


def claim(client: redis.Redis, keys: GenerationKeys) -> tuple[int, int, list[int]]:
    """Claims the prefix for this kvmanager: (owner token, generation to load, generations of the logs to
    replay, oldest first; calls are appended to the last)."""
    owner = int(client.incr(keys.owner))
    gen = int(client.get(keys.gen) or 0)
    log_gens = set()
    for key in client.scan_iter(match=keys.log_pattern(), count=BATCH):
        kind = keys.classify(_text(key))
        if kind is not None and kind[0] == "log" and kind[1] >= gen:
            log_gens.add(kind[1])
    return owner, gen, sorted(log_gens | {gen})


def new_generation(client: redis.Redis, keys: GenerationKeys, owner: int | None = None) -> int:
    """A new generation number; fenced by ``owner`` when given (raises errors.Fenced)."""
    if owner is None:
        return int(client.incr(keys.gens))
    return int(fenced_call(client, keys.owner, owner, "INCR", keys.gens))


def write_state(client: redis.Redis, keys: GenerationKeys, gen: int, mgr: KVManager) -> None:
    """The whole state as generation ``gen``'s snapshot, in chunks of BATCH keys (not one transaction: nobody
    reads these keys until switch() names them, and small commands keep Redis answering the parent's appends
    in between)."""
    layout = SnapshotLayout(client, keys.state_prefix(gen))
    upserts, tenants = layout.items(mgr)
    items = [*upserts.items(), *replay_items(keys, gen, mgr).items()]
    for i in range(0, len(items), BATCH):
        client.mset(dict(items[i:i + BATCH]))
    if tenants:
        client.sadd(layout.keys.tenants, *sorted(tenants))


def replay_items(keys: GenerationKeys, gen: int, mgr: KVManager) -> dict[str, str]:
    """What replaying the log after generation ``gen``'s snapshot depends on, beyond the layout's records
    (from which recovery derives a free list and an LRU, and no remembered answers). The replay runs on:

    - each pool's free list and LRU in their exact order. Recovery derives them (free pages ascending, the
      LRU by last use), but the live ones drift from that, and an allocation takes the free list's first
      pages. Replayed on a derived order, it could take other pages than the live kvmanager answered, pages
      that a worker then writes for two requests.
    - the manager's remembered answers (KVManager.recent). A retried call whose first attempt came before the
      snapshot is answered from them; without them its replay fails validation, and the restart with it."""
    items = {keys.order(gen, worker_id): dumps({"free": list(pool.free), "lru": list(pool.evictable)})
             for worker_id, pool in mgr.pools.items()}
    items[keys.recent(gen)] = dumps([[kind, req_id, step_id, result_dict(result)]
                                      for (kind, req_id), (step_id, result) in mgr.recent.items()])
    return items


def restore_replay_state(client: redis.Redis, keys: GenerationKeys, gen: int, mgr: KVManager) -> None:
    """Puts back what replay_items() stored, over the freshly loaded state. Raises AssertionError when a stored
    order is not the same pages as the loaded state's (never serve from a state that could hand out a page
    twice). Generation 0 has none (no snapshot, or one from before generations): its derived orders stand."""
    if not gen:
        return
    for worker_id, pool in mgr.pools.items():
        order = json.loads(client.get(keys.order(gen, worker_id)))
        assert sorted(order["free"]) == sorted(pool.free), f"pool {worker_id}: stored free list != loaded state"
        assert sorted(order["lru"]) == sorted(pool.evictable), f"pool {worker_id}: stored LRU != loaded state"
        pool.free = deque(order["free"])
        pool.evictable = OrderedDict.fromkeys(order["lru"])
    mgr.recent = OrderedDict(((kind, req_id), (step_id, result_from_dict(kind, result)))
                             for kind, req_id, step_id, result in json.loads(client.get(keys.recent(gen))))


def switch(client: redis.Redis, keys: GenerationKeys, gen: int, old_log_gens: list[int], owner: int) -> bool:
    """Makes ``gen`` the generation a restart loads and deletes the logs its snapshot covers, atomically.
    False (nothing changed) when a kvmanager has claimed the prefix after ``owner``."""
    with client.pipeline(transaction=True) as pipe:
        pipe.watch(keys.owner)
        if int(pipe.get(keys.owner) or 0) != owner:
            return False
        pipe.multi()
        pipe.set(keys.gen, gen)
        pipe.delete(*(keys.log(g) for g in old_log_gens))
        try:
            pipe.execute()
        except redis.WatchError:
            return False
    return True


def switch_ops(keys: GenerationKeys, gen: int, old_log_gens: list[int], mgr: KVManager):
    """switch()'s writes, plus replay_items(), for a caller that adds them to a transaction of its own (an
    inline snapshot)."""
    def queue(pipe) -> None:
        pipe.mset(replay_items(keys, gen, mgr))
        pipe.set(keys.gen, gen)
        pipe.delete(*(keys.log(g) for g in old_log_gens))
    return queue


def delete_stale(client: redis.Redis, keys: GenerationKeys, loaded: int, below: int | None = None) -> int:
    """Deletes the logs older than ``loaded``, the generation a restart loads, and the snapshots of the
    generations older than ``below`` (default: ``loaded``) other than ``loaded``. Returns the number of keys
    deleted. Never a newer generation: a child that outlived its parent must not delete the snapshot that a
    restarted kvmanager's child is writing (generation numbers only grow)."""
    below = loaded if below is None else below
    stale = []
    for key in client.scan_iter(match=keys.all_pattern(), count=BATCH):
        key = _text(key)
        kind = keys.classify(key)
        if kind is not None and (kind[1] < loaded if kind[0] == "log" else kind[1] < below and kind[1] != loaded):
            stale.append(key)
    for i in range(0, len(stale), BATCH):
        client.unlink(*stale[i:i + BATCH])
    return len(stale)


@dataclass(frozen=True, slots=True)
class Child:
    """A snapshot child, as its parent tracks it: the snapshot covers the first ``num_records`` logged calls
    (``num_bytes`` of them) of the logs its parent had when it forked."""

    pid: int
    gen: int
    num_records: int
    num_bytes: int
    started: float  # time.monotonic() at the fork


def fork_snapshot(client: redis.Redis, keys: GenerationKeys, mgr: KVManager, gen: int, old_log_gens: list[int],
                  owner: int, stop_before_switch: bool = False) -> int:
    """Forks a child that writes ``mgr``'s state as generation ``gen`` and switches to it; returns its pid.
    The caller must not change ``mgr`` until fork returns (it holds the service lock). ``stop_before_switch``
    (tests): the child stops itself (SIGSTOP) between writing and switching."""
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = FAILED
    try:
        _detach(parent)
        own = fresh_client(client)  # reads the parent's settings, not its connections (a Sentinel one too)
        # Partial snapshots of failed attempts first: with Redis near its memory limit, each failed attempt
        # would otherwise leave another one behind, and make the next one likelier to fail. The generation
        # to keep is read here, not taken from the parent: a child it killed may have switched just before.
        delete_stale(own, keys, int(own.get(keys.gen) or 0), below=gen)
        write_state(own, keys, gen, mgr)
        if stop_before_switch:
            os.kill(os.getpid(), signal.SIGSTOP)
        code = SWITCHED if switch(own, keys, gen, old_log_gens, owner) else SUPERSEDED
        if code == SWITCHED:
            with contextlib.suppress(redis.RedisError):  # leftovers are deleted by the next snapshot
                delete_stale(own, keys, gen)
    except BaseException:  # noqa: BLE001 - whatever happens, the child must leave through os._exit
        with contextlib.suppress(BaseException):
            traceback.print_exc()
            sys.stderr.flush()
    finally:
        os._exit(code)


def reap(child: Child, block: bool = False) -> int | None:
    """The child's exit code once it has exited (SWITCHED, SUPERSEDED, FAILED, or -signal); None while it
    runs."""
    pid, status = os.waitpid(child.pid, 0 if block else os.WNOHANG)
    return None if pid == 0 else os.waitstatus_to_exitcode(status)


def kill(child: Child) -> int:
    """Kills the child and reaps it; its exit code (SWITCHED if it got there first)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(child.pid, signal.SIGKILL)
    return reap(child, block=True)


def _detach(parent: int) -> None:
    """In the child: nothing of the parent's but memory. Closes inherited descriptors (the gRPC listening
    socket among them, which a child outliving its parent would otherwise keep bound), keeps the collector
    from touching every object (each touched page is a copy), yields the CPU to the parent, and dies with it."""
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    gc.disable()
    try:  # run only when the CPU has nothing else to do: the parent's calls meanwhile wait less than at nice 10
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux
        with contextlib.suppress(OSError):
            os.nice(10)
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(FAILED)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
