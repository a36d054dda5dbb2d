"""Deletes from the shared KV tier the values whose entries the kvmanager removed (LRU eviction, a missing or
damaged value reported, an admin evict or reset), on a thread of its own, after the call that removed them is
durable: the call path never waits for the store.

A value whose block was recorded again before its deletion ran (written anew by a worker) is kept. A deletion
that fails (the store down) is dropped with a log line and counted: the value stays in the store unrecorded,
which wastes its bytes but is never read (the index no longer names it), until the store's own eviction
(``maxmemory``) or a later write of the same block replaces it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

import redis

from kvserve.common.wire.tier import store_key

log = logging.getLogger("kvserve.kvmanager")
BATCH = 256  # keys per UNLINK


class TierJanitor:
    def __init__(self, client: redis.Redis, is_recorded: Callable[[bytes], bool]):
        self.client = client
        self.is_recorded = is_recorded
        self.queue: deque[bytes] = deque()
        self.cond = threading.Condition()
        self.num_deleted = 0
        self.num_failed = 0
        self.busy = False
        self._stopping = False
        self.thread = threading.Thread(target=self._run, name="kvserve-tier-janitor", daemon=True)
        self.thread.start()

    def delete(self, block_hashes: list[bytes]) -> None:
        with self.cond:
            self.queue.extend(block_hashes)
            self.cond.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Until every queued deletion ran (tests, a graceful stop)."""
        with self.cond:
            return self.cond.wait_for(lambda: not self.queue and not self.busy, timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        self.wait_idle(timeout_s)
        with self.cond:
            self._stopping = True
            self.cond.notify_all()
        self.thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.queue or self._stopping)
                if self._stopping and not self.queue:
                    return
                batch = [self.queue.popleft() for _ in range(min(BATCH, len(self.queue)))]
                self.busy = True
            try:
                self._unlink([h for h in batch if not self.is_recorded(h)])
            finally:
                with self.cond:
                    self.busy = False
                    self.cond.notify_all()

    def _unlink(self, hashes: list[bytes]) -> None:
        if not hashes:
            return
        try:
            self.client.unlink(*map(store_key, hashes))
            self.num_deleted += len(hashes)
        except redis.RedisError as e:
            self.num_failed += len(hashes)
            log.warning("kv store: %d values could not be deleted (%s: %s); they stay in the store unrecorded",
                        len(hashes), type(e).__name__, e)
