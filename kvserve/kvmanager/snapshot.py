"""Snapshots of the kvmanager's state: one format, one writer, and the forked child that writes them.

The format: the manager (pools with their ref_cnts, free lists and LRUs in their exact order, cached blocks,
live and stale requests, counters, remembered answers) and the member table, encoded as a whole (compact JSON;
a pool's blocks column by column, their hashes as one hex string), cut into chunks of CHUNK_BYTES. decode()
restores exactly what it reads, nothing derived, then check_invariants checks it (never serve from a state that
could hand out a page twice). A replayed allocation takes the free list's first pages, and must take the pages
the live kvmanager answered: so the orders are part of the state, like everything else. A grouped pool's
sliding group is a pool dict of its own under its pool's "group", and a request's group record (its group table,
seed and chain) under its "group"; both are absent elsewhere, so older snapshots load as they are.

The call log (call_log.py) is cut into generations. Generation g is a snapshot plus the calls made after it::

    <prefix>:gen        the generation a restart loads (absent: 0, no snapshot)
    <prefix>:gens       the counter that numbers new generations (a number is never reused)
    <prefix>:owner      the fencing token: incremented by each kvmanager when it claims the prefix (fencing.py)
    <prefix>:snap:<g>   the snapshot of generation g: a list of chunks
    <prefix>:log:<g>    the calls after snapshot g, oldest first

The one writer, write(): the chunks under a key nobody reads yet, then the switch (``gen`` set and the logs the
snapshot covers deleted, in one MULTI/EXEC fenced by the writer's claim), then the older generations deleted.
A call that makes a snapshot due forks, as Redis does for BGSAVE, and the child runs write() on its
copy-on-write image of the state while the parent appends calls to the new generation's log; an admin reset,
a resync, or a process that cannot fork runs it inline. A writer that fails or is killed leaves keys nobody
reads, deleted by the next one; a child only ever deletes generations older than its own, and cannot switch
under a kvmanager that claimed the prefix after its parent (a child outliving a kill -9'd parent).

The child never touches gRPC: it closes the descriptors it inherited, talks to Redis on a connection of its
own, and leaves with os._exit. gRPC's C core registers fork handlers unless GRPC_ENABLE_FORK_SUPPORT is false
when grpc is imported; with them a fork inside an RPC handler can kill the child. ``kvserve kvmanager`` sets it
to 0 before it imports grpc; forking_is_safe() says whether a process can fork.
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
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields

import redis

from kvserve.common.processes import die_with_parent
from kvserve.common.redis_client import fresh_client
from kvserve.common.wire.pages import (
    OpStatus,
    PageAllocationResult,
    PageCommitResult,
    PageExtensionResult,
    PageFreeResult,
    PageReleaseResult,
    PinPoint,
    PoolSpec,
)
from kvserve.common.wire.tier import StoreLoad, TierCounters
from kvserve.common.wire.transfer import PeerLoad
from kvserve.kvmanager.errors import Fenced, StateLayoutError
from kvserve.kvmanager.fencing import fenced_pipeline
from kvserve.kvmanager.invariants import check_invariants
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.membership import MemberRecord
from kvserve.kvmanager.pins import PinTable
from kvserve.kvmanager.pool import Block, PagePool
from kvserve.kvmanager.state import GroupPages, RequestPages, TenantCounters
from kvserve.kvmanager.tenants import policy_from_dict, policy_to_dict
from kvserve.kvmanager.tier import StoreEntry, StoreIndex, TierTotals
from kvserve.kvmanager.transfers import TransferHold, TransferTotals

CHUNK_BYTES = 1 << 20  # one RPUSH each: small commands keep Redis answering the parent's appends in between
BATCH = 1000  # keys per SCAN step and per UNLINK
HASH_BYTES = 16  # xxh3_128
RESULT_TYPES = {"allocate": PageAllocationResult, "extend": PageExtensionResult, "commit": PageCommitResult,
                "free": PageFreeResult, "release": PageReleaseResult}
GRPC_FORK_SUPPORT = "GRPC_ENABLE_FORK_SUPPORT"
FALSE = {"0", "false", "f", "no", "n", "off"}
SWITCHED, SUPERSEDED, FAILED = 0, 3, 1  # the child's exit codes


# -- the format ---------------------------------------------------------------------------------------------
def encode(mgr: KVManager, members: Iterable[MemberRecord]) -> list[bytes]:
    """The whole state, as chunks of at most CHUNK_BYTES."""
    state = {"clock": mgr.clock,
             "tenants": {t: [c.prefix_cache_queries, c.prefix_cache_hits] for t, c in mgr.tenants.items()},
             "pools": [_pool_dict(pool) for pool in mgr.pools.values()],
             "requests": [_request_dict(r) for r in mgr.requests.values()],
             "stale": [_request_dict(r) for r in mgr.stale.values()],
             "recent": [[kind, req_id, step_id, result_dict(result)]
                        for (kind, req_id), (step_id, result) in mgr.recent.items()],
             "members": [list(m) for m in members],
             "tier": _tier_dict(mgr.tier),
             "now_ms": mgr.now_ms, "active": mgr.fair.last_active, "pins": _pins_dict(mgr.pins),
             "policy": policy_to_dict(mgr.fair.policy),
             "retired_evictions": [mgr.retired_evicted_from, mgr.retired_evicted_by],
             "transfers": asdict(mgr.transfers)}
    data = json.dumps(state, separators=(",", ":")).encode()
    return [data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]


def decode(chunks: list[bytes], mgr: KVManager) -> list[MemberRecord]:
    """Fills an empty manager with the encoded state; returns the member records. Raises AssertionError when
    the state read is inconsistent."""
    assert not (mgr.pools or mgr.requests or mgr.stale), "load into an empty manager"
    if not chunks:
        return []
    d = json.loads(b"".join(chunks))
    mgr.clock = d["clock"]
    if "policy" in d:  # the policy the state was made under: the log after it replays under it
        mgr.fair.policy, mgr.policy_logged = policy_from_dict(d["policy"]), True
    mgr.tenants = {t: TenantCounters(q, h) for t, (q, h) in d["tenants"].items()}
    for p in d["pools"]:
        pool = _decode_pool(p)
        mgr.pools[pool.spec.worker_id] = pool
    mgr.requests = {r["req_id"]: _decode_request(r) for r in d["requests"]}
    mgr.stale = {r["req_id"]: _decode_request(r) for r in d["stale"]}
    mgr.num_holds = sum(1 for r in mgr.requests.values() if r.transfer is not None)
    mgr.transfers = TransferTotals(**d.get("transfers", {}))
    for pool in mgr.pools.values():
        pool.recount_owners(mgr.requests.values())
    mgr.now_ms = mgr.fair.now_ms = d.get("now_ms", 0)
    mgr.fair.last_active = dict(d.get("active", {}))
    mgr.retired_evicted_from, mgr.retired_evicted_by = map(dict, d.get("retired_evictions", ({}, {})))
    if "pins" in d:
        _decode_pins(d["pins"], mgr.pins)
    mgr.recent = OrderedDict(((kind, req_id), (step_id, result_from_dict(kind, result)))
                             for kind, req_id, step_id, result in d["recent"])
    if "tier" in d:  # absent from the snapshots of a kvmanager without the shared tier
        _decode_tier(d["tier"], mgr.tier)
    check_invariants(mgr)
    return [(w, e, a, dr) for w, e, a, dr in d["members"]]


def _pins_dict(pins: PinTable) -> list:
    items = pins.pins.items()
    return [b"".join(h for h, _ in items).hex(), [p.tenant for _, p in items], [p.ttl_ms for _, p in items],
            [p.expires_ms for _, p in items]]


def _decode_pins(d: list, pins: PinTable) -> None:
    hashes, *columns = d
    hashes = bytes.fromhex(hashes)
    pins.load((hashes[i * HASH_BYTES:(i + 1) * HASH_BYTES], *c) for i, c in enumerate(zip(*columns, strict=True)))


def _tier_dict(tier: StoreIndex) -> dict:
    """The store's index in LRU order (the tenants' LRUs keep its order); its capacity is configuration (the
    flag), not state."""
    entries, t = tier.entries, tier.totals
    return {"hashes": b"".join(entries).hex(), "tenants": [e.tenant for e in entries.values()],
            "bytes": [e.num_bytes for e in entries.values()], "pinned": [e.pinned for e in entries.values()],
            "deleted": b"".join(tier.deleted).hex(),
            "totals": [t.num_hit_pages, t.num_added, t.num_evicted, t.num_dropped_missing,
                       list(t.workers.as_tuple()), t.num_rejected], "tenant_hits": tier.tenant_hits,
            "evicted_from": tier.evicted_from, "rejected": tier.rejected}


def _decode_tier(d: dict, tier: StoreIndex) -> None:
    hashes, deleted = bytes.fromhex(d["hashes"]), bytes.fromhex(d["deleted"])
    pinned = d.get("pinned") or [False] * len(d["bytes"])
    for i, (tenant, num_bytes, is_pinned) in enumerate(zip(d["tenants"], d["bytes"], pinned, strict=True)):
        h = hashes[i * HASH_BYTES:(i + 1) * HASH_BYTES]
        tier.entries[h] = StoreEntry(tenant, num_bytes, is_pinned)
        tier.usage[tenant] = tier.usage.get(tenant, 0) + num_bytes
        if is_pinned:
            tier.pinned_bytes += num_bytes
        else:
            tier.lru.add(h, tenant)
    tier.num_bytes = sum(d["bytes"])
    tier.deleted = [deleted[i:i + HASH_BYTES] for i in range(0, len(deleted), HASH_BYTES)]
    counts, workers, rejected = d["totals"][:4], d["totals"][4], d["totals"][5:]
    tier.totals = TierTotals(*counts, TierCounters(*workers), *rejected)
    tier.tenant_hits = dict(d["tenant_hits"])
    tier.evicted_from, tier.rejected = dict(d.get("evicted_from", {})), dict(d.get("rejected", {}))
    tier.fit_capacity()  # a restart with a smaller --kv-store-bytes (or 0) than the state was written under


def _pool_dict(pool: PagePool) -> dict:
    blocks = pool.index.values()
    d = {"spec": asdict(pool.spec), "ref_cnt": pool.ref_cnt, "free": list(pool.free),
         "lru": list(pool.evictable), "num_requests": pool.num_requests, "num_evicted": pool.num_evicted,
         "num_window_released": pool.num_window_released, "evicted_from": pool.num_evicted_from,
         "evicted_by": pool.num_evicted_by,
         "blocks": [b"".join(b.block_hash for b in blocks).hex(), b"".join(b.parent_hash for b in blocks).hex(),
                    [b.tenant for b in blocks], [b.page_id for b in blocks], [b.block_index for b in blocks],
                    [b.last_used for b in blocks], [b.pinned for b in blocks]]}
    if pool.group is not None:
        d["group"] = _pool_dict(pool.group)
    return d


def _decode_pool(p: dict) -> PagePool:
    pool = PagePool(PoolSpec(**p["spec"]))
    _fill_pool(pool, p)
    assert (pool.group is None) == ("group" not in p), f"{pool.spec.worker_id}: its sliding group is missing"
    if pool.group is not None:
        _fill_pool(pool.group, p["group"])
        assert pool.group.spec == PoolSpec(**p["group"]["spec"]), f"{pool.spec.worker_id}: a bad sliding group"
    return pool


def _fill_pool(pool: PagePool, p: dict) -> None:
    """A fresh pool's state, as _pool_dict wrote it."""
    pool.ref_cnt, pool.free = p["ref_cnt"], deque(p["free"])
    pool.num_requests, pool.num_evicted, pool.num_window_released = (
        p["num_requests"], p["num_evicted"], p["num_window_released"])
    pool.num_evicted_from, pool.num_evicted_by = dict(p.get("evicted_from", {})), dict(p.get("evicted_by", {}))
    hashes, parents, *columns = p["blocks"]
    hashes, parents = bytes.fromhex(hashes), bytes.fromhex(parents)
    for i, (tenant, page_id, block_index, last_used, pinned) in enumerate(zip(*columns, strict=True)):
        at = slice(i * HASH_BYTES, (i + 1) * HASH_BYTES)
        block = Block(hashes[at], parents[at], tenant, page_id, block_index, last_used, pinned)
        pool.index[block.block_hash] = pool.block_of[page_id] = block
    for page_id in p["lru"]:  # in the global LRU's order: each tenant's LRU keeps it
        block = pool.block_of[page_id]
        assert block is not None, f"{pool.spec.worker_id}: page {page_id} is in the LRU without a block"
        pool.evictable.add(page_id, block.tenant)


def _request_dict(req: RequestPages) -> dict:
    d = {f.name: getattr(req, f.name) for f in fields(req)}
    d["seed"], d["block_hashes"] = req.seed.hex(), b"".join(req.block_hashes).hex()
    d["pins"] = [[p.num_tokens, p.ttl_s] for p in req.pins]
    d["last_ops"] = {kind: [step_id, result_dict(result)] for kind, (step_id, result) in req.last_ops.items()}
    d["transfer"] = asdict(req.transfer) if req.transfer is not None else None
    g = req.group
    if g is None:
        del d["group"]
    else:
        d["group"] = {"page_table": g.page_table, "seed": g.seed.hex(), "block_hashes": b"".join(g.block_hashes).hex()}
    return d


def _split_hashes(joined: str) -> list[bytes]:
    hashes = bytes.fromhex(joined)
    return [hashes[i:i + HASH_BYTES] for i in range(0, len(hashes), HASH_BYTES)]


def _decode_request(d: dict) -> RequestPages:
    pins = tuple(PinPoint(*p) for p in d.get("pins", ()))
    hold, g = d.get("transfer"), d.get("group")
    group = GroupPages(g["page_table"], bytes.fromhex(g["seed"]), _split_hashes(g["block_hashes"])) if g else None
    return RequestPages(**{**d, "seed": bytes.fromhex(d["seed"]), "pins": pins, "group": group,
                           "transfer": TransferHold(**hold) if hold else None,
                           "block_hashes": _split_hashes(d["block_hashes"]),
                           "last_ops": {kind: (step_id, result_from_dict(kind, result))
                                        for kind, (step_id, result) in d["last_ops"].items()}})


def result_dict(result) -> dict:
    """An op's result (PageAllocationResult, ...) as JSON-ready fields; result_from_dict reads it back."""
    out = {f.name: getattr(result, f.name) for f in fields(result)}
    out["status"] = result.status.value
    if "store_loads" in out:
        out["store_loads"] = [[x.page_id, x.block_hash.hex(), x.namespace.hex()] for x in out["store_loads"]]
    if "peer_loads" in out:
        out["peer_loads"] = [[x.page_id, x.src_page_id, x.block_hash.hex(), x.namespace.hex()]
                             for x in out["peer_loads"]]
    return out


def result_from_dict(kind: str, d: dict):
    d = {**d, "status": OpStatus(d["status"])}
    if "store_loads" in d:
        d["store_loads"] = [StoreLoad(p, bytes.fromhex(h), bytes.fromhex(n)) for p, h, n in d["store_loads"]]
    if "peer_loads" in d:
        d["peer_loads"] = [PeerLoad(p, q, bytes.fromhex(h), bytes.fromhex(n)) for p, q, h, n in d["peer_loads"]]
    return RESULT_TYPES[kind](**d)


# -- generations and the writer -----------------------------------------------------------------------------
class GenerationKeys:
    """The key layout above, for one prefix."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.gen, self.gens, self.owner = f"{prefix}:gen", f"{prefix}:gens", f"{prefix}:owner"
        self._numbered = re.compile(re.escape(prefix) + r":(snap|log):(\d+)$")

    def snapshot(self, gen: int) -> str:
        return f"{self.prefix}:snap:{gen}"

    def log(self, gen: int) -> str:
        return f"{self.prefix}:log:{gen}"

    def classify(self, key: str) -> tuple[str, int] | None:
        """("snap", g) or ("log", g) for a key of generation g; None for the other keys."""
        m = self._numbered.match(key)
        return (m[1], int(m[2])) if m else None

    def scan(self, client: redis.Redis, kind: str = "*") -> list[tuple[str, str, int]]:
        """(key, kind, generation) of every stored snapshot and log (``kind``: "log" for the logs alone)."""
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in self.prefix) + f":{kind}:*"
        found = dict.fromkeys(_text(k) for k in client.scan_iter(match=pattern, count=BATCH))
        return [(key, *c) for key in found if (c := self.classify(key)) is not None]


def claim(client: redis.Redis, keys: GenerationKeys) -> tuple[int, int, list[int]]:
    """Claims the prefix for this kvmanager: (owner token, generation to load, generations of the logs to
    replay, oldest first; calls are appended to the last)."""
    owner = int(client.incr(keys.owner))
    gen = int(client.get(keys.gen) or 0)
    check_layout(client, keys, gen)
    return owner, gen, sorted({g for _, _, g in keys.scan(client, "log") if g >= gen} | {gen})


def check_layout(client: redis.Redis, keys: GenerationKeys, gen: int) -> None:
    """Raises StateLayoutError when the prefix holds state this layout cannot read: a generation without its
    snapshot (the one writer switches to a generation only once its snapshot is stored), or generation 0's
    log under ``<prefix>:log`` (the layout of kvserve before the one snapshot format). Replaying such a log
    onto an empty state would serve pages that are not free."""
    if (gen and not client.exists(keys.snapshot(gen))) or client.exists(f"{keys.prefix}:log"):
        raise StateLayoutError(
            f"redis prefix {keys.prefix!r} holds kvmanager state in a layout this kvmanager does not read (from an "
            f"earlier kvserve, or damaged): start it with another --redis-prefix, or delete the keys "
            f"{keys.prefix}:* (redis-cli --scan --pattern '{keys.prefix}:*' | xargs redis-cli unlink)")


def write(client: redis.Redis, keys: GenerationKeys, gen: int, chunks: list[bytes], old_log_gens: list[int],
          owner: int, before_switch=None) -> None:
    """The one writer: ``chunks`` as generation ``gen``'s snapshot, then the switch to it, fenced by
    ``owner`` (raises Fenced, nothing switched), then the deletion of older generations. ``before_switch``
    (tests): called between the two."""
    for chunk in chunks:
        client.rpush(keys.snapshot(gen), chunk)
    if before_switch is not None:
        before_switch()
    with fenced_pipeline(client, keys.owner, owner) as pipe:
        pipe.set(keys.gen, gen)
        pipe.delete(*(keys.log(g) for g in old_log_gens))
    with contextlib.suppress(redis.RedisError):  # garbage, not state: the next snapshot deletes it
        delete_stale(client, keys, gen)


def delete_stale(client: redis.Redis, keys: GenerationKeys, loaded: int, below: int | None = None) -> int:
    """Deletes the logs older than ``loaded``, the generation a restart loads, and the snapshots older than
    ``below`` (default: ``loaded``) other than ``loaded``; the number of keys deleted. Never a newer generation:
    a child that outlived its parent must not delete a snapshot a restarted kvmanager's child is writing."""
    below = loaded if below is None else below
    stale = [key for key, kind, g in keys.scan(client)
             if (g < loaded if kind == "log" else g < below and g != loaded)]
    for i in range(0, len(stale), BATCH):
        client.unlink(*stale[i:i + BATCH])
    return len(stale)


# -- the forked child ---------------------------------------------------------------------------------------
def forking_is_safe() -> bool:
    """Whether this process may fork a snapshot child: it has no gRPC, or gRPC's fork handlers are off
    (GRPC_ENABLE_FORK_SUPPORT false, which only counts if it was set before grpc was imported)."""
    return hasattr(os, "fork") and ("grpc" not in sys.modules
                                    or os.environ.get(GRPC_FORK_SUPPORT, "").strip().lower() in FALSE)


@dataclass(frozen=True, slots=True)
class Child:
    """A snapshot child, as its parent tracks it: the snapshot covers the first ``num_records`` logged calls
    (``num_bytes`` of them) of the logs its parent had when it forked."""

    pid: int
    gen: int
    num_records: int
    num_bytes: int
    started: float  # time.monotonic() at the fork


def fork(client: redis.Redis, keys: GenerationKeys, mgr: KVManager, members: list[MemberRecord], gen: int,
         old_log_gens: list[int], owner: int, stop_before_switch: bool = False) -> int:
    """Forks a child that encodes the state and runs write(); returns its pid. The caller must not change the
    state until fork returns (it holds the service lock). ``stop_before_switch`` (tests): the child stops
    itself (SIGSTOP) between writing and switching."""
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = FAILED
    try:
        _detach(parent)
        own = fresh_client(client, decode_responses=False)  # the parent's settings, not its connections
        # Partial snapshots of failed attempts first: with Redis near its memory limit each would make the next
        # attempt likelier to fail. The generation to keep is read here: a child the parent killed may have
        # switched just before.
        delete_stale(own, keys, int(own.get(keys.gen) or 0), below=gen)
        stop = (lambda: os.kill(os.getpid(), signal.SIGSTOP)) if stop_before_switch else None
        try:
            write(own, keys, gen, encode(mgr, members), old_log_gens, owner, stop)
            code = SWITCHED
        except Fenced:
            code = SUPERSEDED
    except BaseException:  # noqa: BLE001 - whatever happens, the child must leave through os._exit
        with contextlib.suppress(BaseException):
            traceback.print_exc()
            sys.stderr.flush()
    finally:
        os._exit(code)


def reap(child: Child, block: bool = False) -> int | None:
    """The child's exit code once it has exited (SWITCHED, SUPERSEDED, FAILED, or -signal); None while it runs."""
    pid, status = os.waitpid(child.pid, 0 if block else os.WNOHANG)
    return None if pid == 0 else os.waitstatus_to_exitcode(status)


def kill(child: Child) -> int:
    """Kills the child and reaps it; its exit code (SWITCHED if it got there first)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(child.pid, signal.SIGKILL)
    return reap(child, block=True)


def _detach(parent: int) -> None:
    """In the child: nothing of the parent's but memory. Closes inherited descriptors (the gRPC listening
    socket among them), keeps the collector from touching every object (each touched page is a copy), yields
    the CPU to the parent, and dies with it."""
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    gc.disable()
    try:  # run only when the CPU has nothing else to do
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux
        with contextlib.suppress(OSError):
            os.nice(10)
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(FAILED)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
