"""The member table's persistence (membership.py), apart from the call log: one Redis hash.

    <prefix>:members   worker_id -> {"epoch": E, "address": "host:port", "draining": false}   (compact JSON)

Written when a member joins, leaves, is declared dead or changes its draining flag, fenced by the call log's
claim (fencing.py: a deposed leader's write is refused); never for a plain heartbeat (the lease deadlines are
not stored: a loaded member's lease starts fresh). Kept apart from the call
log because a member is not page state: replaying the log rebuilds pools, and the hash says which of them are
held by a lease. A mismatch (a write of one that failed) is reconciled on load (KVService.load).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # redis is only needed with persistence (a build without it runs --no-persistence)
    import redis

MemberRecord = tuple[str, int, str, bool]  # worker_id, epoch, address, draining


class RedisMemberStore:
    """The hash above, for one Redis prefix."""

    def __init__(self, client: redis.Redis, prefix: str = "kvserve", fence=None):
        self.client = client
        self.key = f"{prefix}:members"
        self.fence = fence  # () -> (owner key, token) of the call log's claim: writes are fenced by it

    def write(self, upserts: Iterable[MemberRecord], deletes: Iterable[str]) -> None:
        """Sets the members ``upserts`` and removes those named in ``deletes``, in one MULTI/EXEC. Raises
        redis.RedisError when Redis cannot be written (nothing is changed then)."""
        mapping = {w: json.dumps({"epoch": e, "address": a, "draining": d}, separators=(",", ":"))
                   for w, e, a, d in upserts}
        deletes = list(deletes)
        if not mapping and not deletes:
            return
        if self.fence is None:
            with self.client.pipeline(transaction=True) as pipe:
                self._queue(pipe, mapping, deletes)
                pipe.execute()
            return
        from kvserve.kvmanager.fencing import fenced_pipeline

        with fenced_pipeline(self.client, *self.fence()) as pipe:  # a deposed leader's write: Fenced
            self._queue(pipe, mapping, deletes)

    def _queue(self, pipe, mapping: dict, deletes: list[str]) -> None:
        if mapping:
            pipe.hset(self.key, mapping=mapping)
        if deletes:
            pipe.hdel(self.key, *deletes)

    def load(self) -> list[MemberRecord]:
        """Every stored member, by worker_id."""
        out = []
        for worker_id, raw in sorted(self.client.hgetall(self.key).items()):
            d = json.loads(raw)
            worker_id = worker_id.decode() if isinstance(worker_id, bytes) else worker_id
            out.append((worker_id, int(d["epoch"]), d["address"], bool(d["draining"])))
        return out


class NullMemberStore:
    """No persistence (--no-persistence): the table lives in memory only."""

    def write(self, upserts: Iterable[MemberRecord], deletes: Iterable[str]) -> None:
        pass

    def load(self) -> list[MemberRecord]:
        return []


def member_store_for(store) -> RedisMemberStore | NullMemberStore:
    """The member store beside a call-log store (oplog.LoggedStore: on its Redis client, under its prefix); the
    null one beside a store without Redis (NullStore)."""
    client, keys = getattr(store, "client", None), getattr(store, "keys", None)
    if client is not None and keys is not None:
        fence = (lambda: store.fence) if hasattr(store, "fence") else None
        return RedisMemberStore(client, keys.prefix, fence)
    return NullMemberStore()
