"""The shared KV tier's index: which blocks' values the store holds, in LRU order, within --kv-store-bytes.

A block's locations are its pools (each pool's prefix index, pool.py) and the store (this index): in a pool, in
the store, or both. The two are independent: a pool evicting a block leaves its store entry, a worker lost drops
only its pool, and the store's LRU evicting an entry leaves any pool's copy.

An entry is added only when a worker reports that the store acknowledged the value (bytes before metadata);
it leaves when the LRU needs its bytes, when a worker reports its value absent or damaged, or with its tenant
(admin evict) or everything (admin reset). Every removal queues the value's key for deletion (``deleted``,
drained by the service's janitor after the call is durable): a deletion never precedes the removal. One race
remains: a block removed, then written again by a worker whose SET lands just before the janitor's deletion of
the old value, is recorded again with its value gone. Like a value the store itself lost (flushed, restarted
without its data), it is found absent by the next load, which recomputes, reports it, and its entry is dropped.

Deterministic, like the rest of the manager: the same reports give the same index (replay).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvserve.common.wire.tier import StoredBlock, TierCounters


@dataclass(slots=True)
class StoreEntry:
    tenant: str
    num_bytes: int


@dataclass(slots=True)
class TierTotals:
    """Counters of the store's index, and the workers' reported counters summed."""

    num_hit_pages: int = 0  # pages allocations took from the store (store hits)
    num_added: int = 0
    num_evicted: int = 0  # entries the LRU evicted to stay within capacity
    num_dropped_missing: int = 0  # entries dropped because a load found the value absent or damaged
    workers: TierCounters = field(default_factory=TierCounters)


class StoreIndex:
    def __init__(self, capacity_bytes: int = 0):
        self.capacity_bytes = capacity_bytes  # 0: the tier is off (nothing is written or served)
        self.entries: OrderedDict[bytes, StoreEntry] = OrderedDict()  # first = least recently used
        self.num_bytes = 0
        self.totals = TierTotals()
        self.deleted: list[bytes] = []  # block hashes whose values are to be deleted from the store
        self.tenant_hits: dict[str, int] = {}  # tenant -> store-hit tokens

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def touch(self, hashes) -> None:
        """Hit: the entries become the most recently used, in order."""
        for h in hashes:
            self.entries.move_to_end(h)

    def add(self, blocks: list[StoredBlock]) -> tuple[int, int]:
        """Records values the store acknowledged, evicting least recently used entries to stay within capacity.
        A block already recorded is only touched; one larger than the whole capacity is not recorded (its value
        is deleted). Returns (added, evicted)."""
        added = evicted = 0
        for b in blocks:
            entry = self.entries.get(b.block_hash)
            if entry is not None:
                self.entries.move_to_end(b.block_hash)
                continue
            if not self.enabled or b.num_bytes > self.capacity_bytes:
                self.deleted.append(b.block_hash)
                continue
            while self.num_bytes + b.num_bytes > self.capacity_bytes:
                self._remove(next(iter(self.entries)))
                evicted += 1
            self.entries[b.block_hash] = StoreEntry(b.tenant, b.num_bytes)
            self.num_bytes += b.num_bytes
            added += 1
        self.totals.num_added += added
        self.totals.num_evicted += evicted
        return added, evicted

    def drop_missing(self, hashes) -> int:
        """Entries whose values a worker found absent or damaged. Returns how many were recorded."""
        recorded = [h for h in dict.fromkeys(hashes) if h in self.entries]
        for h in recorded:
            self._remove(h)
        self.totals.num_dropped_missing += len(recorded)
        return len(recorded)

    def drop_tenant(self, tenant: str) -> int:
        doomed = [h for h, e in self.entries.items() if e.tenant == tenant]
        for h in doomed:
            self._remove(h)
        return len(doomed)

    def clear(self) -> None:
        self.deleted.extend(self.entries)
        self.entries.clear()
        self.num_bytes = 0
        self.totals = TierTotals()
        self.tenant_hits = {}

    def count_hits(self, tenant: str, num_pages: int, page_size: int) -> None:
        self.totals.num_hit_pages += num_pages
        self.tenant_hits[tenant] = self.tenant_hits.get(tenant, 0) + num_pages * page_size

    def fit_capacity(self) -> int:
        """Evicts least recently used entries until the index fits its capacity (all of them with the tier off):
        after a restart with a smaller --kv-store-bytes. Returns how many."""
        evicted = 0
        while self.entries and (not self.enabled or self.num_bytes > self.capacity_bytes):
            self._remove(next(iter(self.entries)))
            evicted += 1
        self.totals.num_evicted += evicted
        return evicted

    def take_deleted(self) -> list[bytes]:
        deleted, self.deleted = self.deleted, []
        return deleted

    def _remove(self, block_hash: bytes) -> StoreEntry:
        entry = self.entries.pop(block_hash)
        self.num_bytes -= entry.num_bytes
        self.deleted.append(block_hash)
        return entry
