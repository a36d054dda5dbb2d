"""Write-ahead log persistence: each call that changed state is appended to one Redis list, and every
``snapshot_every`` records the full state is written and the log emptied, in one MULTI/EXEC.

Why: writing the resulting state costs one record per touched block (thousands when a step admits or frees
long prompts); the call itself is one small append. Recovery loads the snapshot (RedisStore's tenant-namespaced
layout) and replays the logged calls through the same KVManager code, which is deterministic: same state and
same calls give the same pages, hits and answers (the restart tests check exactly that).

    <prefix>:log    list of JSON records, oldest first: {"k": "step"|"register"|"admin", ...}

A record is appended only when its call changed state. Retried calls (same step_id) replay their answers,
so a record logged twice (its first write failed) changes nothing the second time.
"""

from __future__ import annotations

import base64
import json
import sys
from array import array
from dataclasses import asdict

import redis

from kvserve.kvmanager import admin
from kvserve.kvmanager.hashing import UINT32, le_uint32
from kvserve.kvmanager.manager import KVManager
from kvserve.kvmanager.state import Changes
from kvserve.kvmanager.store import RedisStore
from kvserve.kvmanager.types import Allocate, Commit, Extend, Free, PoolSpec, StepOps

ADMIN_MUTATIONS = {f.__name__: f for f in (admin.evict_tenant, admin.pin, admin.unpin, admin.reset)}
DEFAULT_SNAPSHOT_EVERY = 2000


def pack_tokens(token_ids: tuple[int, ...]) -> str:
    """Token ids (uint32, validated before a call is applied) as base64 of little-endian uint32: 4x smaller
    than JSON numbers and ~20x faster to encode for a 2000-token prompt."""
    return base64.b64encode(le_uint32(token_ids)).decode()


def unpack_tokens(text: str) -> tuple[int, ...]:
    words = array(UINT32, base64.b64decode(text))
    if sys.byteorder == "big":
        words.byteswap()
    return tuple(words)


def encode(record: tuple) -> str:
    kind = record[0]
    if kind == "step":
        ops: StepOps = record[1]
        body = {"s": ops.step_id,
                "a": [[a.req_id, a.tenant, a.worker_id, a.skip_prefix_cache, pack_tokens(a.token_ids)]
                      for a in ops.allocations],
                "e": [[e.req_id, e.num_tokens] for e in ops.extensions],
                "c": [[c.req_id, c.start_pos, pack_tokens(c.token_ids), c.num_computed_tokens] for c in ops.commits],
                "f": [f.req_id for f in ops.frees]}
    elif kind == "register":
        body = {"spec": asdict(record[1])}
    else:
        body = {"fn": record[1], "args": list(record[2])}
    return json.dumps({"k": kind, **body}, separators=(",", ":"))


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def apply(mgr: KVManager, raw: str | bytes) -> None:
    """Replays one logged call on ``mgr``."""
    d = json.loads(raw)
    if d["k"] == "step":
        mgr.step(StepOps(
            step_id=d["s"],
            allocations=tuple(Allocate(r, t, unpack_tokens(tok), w, skip) for r, t, w, skip, tok in d["a"]),
            extensions=tuple(Extend(r, n) for r, n in d["e"]),
            commits=tuple(Commit(r, s, unpack_tokens(tok), n) for r, s, tok, n in d["c"]),
            frees=tuple(Free(r) for r in d["f"])))
    elif d["k"] == "register":
        mgr.register_worker(PoolSpec(**d["spec"]))
    else:
        ADMIN_MUTATIONS[d["fn"]](mgr, *_tuples(d["args"]))


class LoggedStore:
    """Store (service.py) that logs calls and snapshots state. Thread-unsafe: KVService holds its lock."""

    def __init__(self, client: redis.Redis, prefix: str = "kvserve", snapshot_every: int = DEFAULT_SNAPSHOT_EVERY):
        self.client = client
        self.snapshots = RedisStore(client, prefix)
        self.log_key = f"{prefix}:log"
        self.snapshot_every = snapshot_every
        self.num_logged = 0
        self.pending: list[str] = []  # records whose append failed, in call order
        self.last_record = ""

    def write(self, mgr: KVManager, changes: Changes, record: tuple | None = None) -> None:
        if record is not None:
            encoded = encode(record)
            if encoded != self.last_record:  # a retried call after a failed write: logged once
                self.pending.append(encoded)
                self.last_record = encoded
        if changes.reset or record is None or self.num_logged + len(self.pending) >= self.snapshot_every:
            self.snapshot(mgr)
            return
        self.client.rpush(self.log_key, *self.pending)
        self.num_logged += len(self.pending)
        self.pending.clear()

    def snapshot(self, mgr: KVManager) -> None:
        """Writes the whole state and empties the log, atomically (RedisStore's reset write deletes every key
        under the prefix, the log included, in the same MULTI/EXEC as the snapshot)."""
        self.snapshots.write(mgr, Changes(reset=True))
        self.num_logged = 0
        self.pending.clear()

    def load(self, mgr: KVManager) -> None:
        """Loads the snapshot, then replays the log. Raises as RedisStore.load."""
        self.snapshots.load(mgr)
        records = self.client.lrange(self.log_key, 0, -1)
        for raw in records:
            apply(mgr, raw)
        mgr.take_changes()
        self.num_logged = len(records)
        from kvserve.kvmanager.invariants import check_invariants

        check_invariants(mgr)
