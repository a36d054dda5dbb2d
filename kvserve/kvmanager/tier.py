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

Eviction is tenant-aware as in the pools (fair_share.py, in bytes against the tier's capacity): a tenant at its
store cap gives up its own entries first, then the tenant furthest over its share does. Entries under a pin
(pins.py) are not evicted; a value that cannot be kept because everything else is pinned is not recorded (its
value is deleted) and counted as rejected for its tenant, never dropped silently.

Deterministic, like the rest of the manager: the same reports give the same index (replay).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvserve.common.wire.tier import StoredBlock, TierCounters
from kvserve.kvmanager.fair_share import FairShare, TenantLRU, store_limits


@dataclass(slots=True)
class StoreEntry:
    tenant: str
    num_bytes: int
    pinned: bool = False  # under a pin (pins.py): not in the LRU, never evicted


@dataclass(slots=True)
class TierTotals:
    """Counters of the store's index, and the workers' reported counters summed."""

    num_hit_pages: int = 0  # pages allocations took from the store (store hits)
    num_added: int = 0
    num_evicted: int = 0  # entries the LRU evicted to stay within capacity
    num_dropped_missing: int = 0  # entries dropped because a load found the value absent or damaged
    workers: TierCounters = field(default_factory=TierCounters)
    num_rejected: int = 0  # values not recorded: no room left that was not pinned


class StoreIndex:
    def __init__(self, capacity_bytes: int = 0, fair: FairShare | None = None):
        self.capacity_bytes = capacity_bytes  # 0: the tier is off (nothing is written or served)
        self.fair = fair or FairShare.global_lru()
        self.entries: OrderedDict[bytes, StoreEntry] = OrderedDict()  # first = least recently used
        self.lru = TenantLRU()  # the unpinned entries' hashes, per tenant
        self.num_bytes = 0
        self.pinned_bytes = 0  # of the pinned entries: no eviction frees them
        self.usage: dict[str, int] = {}  # tenant -> bytes of its entries (pinned ones included)
        self.totals = TierTotals()
        self.deleted: list[bytes] = []  # block hashes whose values are to be deleted from the store
        self.tenant_hits: dict[str, int] = {}  # tenant -> store-hit tokens
        self.evicted_from: dict[str, int] = {}  # tenant -> its entries evicted to make room
        self.rejected: dict[str, int] = {}  # tenant -> its values not recorded (no unpinned room)

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def touch(self, hashes) -> None:
        """Hit: the entries become the most recently used, in order."""
        entries, add = self.entries, self.lru.add
        for h in hashes:
            entries.move_to_end(h)
            entry = entries[h]
            if not entry.pinned:
                add(h, entry.tenant)

    def add(self, blocks: list[StoredBlock], pinned=frozenset()) -> tuple[int, int]:
        """Records values the store acknowledged (``pinned``: the hashes under a pin), evicting entries as
        fair_share.py orders them to stay within capacity. A block already recorded is only touched; one that
        cannot fit (larger than the whole capacity, or only pinned entries left to evict) is not recorded and
        its value is deleted. Returns (added, evicted)."""
        added = evicted = 0
        for b in blocks:
            if b.block_hash in self.entries:
                self.touch((b.block_hash,))
                continue
            made_room = self._make_room(b.tenant, b.num_bytes) if self.enabled else None
            if made_room is None:
                self.deleted.append(b.block_hash)
                if self.enabled:
                    self.totals.num_rejected += 1
                    self.rejected[b.tenant] = self.rejected.get(b.tenant, 0) + 1
                continue
            evicted += made_room
            is_pinned = b.block_hash in pinned
            self.entries[b.block_hash] = StoreEntry(b.tenant, b.num_bytes, is_pinned)
            if is_pinned:
                self.pinned_bytes += b.num_bytes
            else:
                self.lru.add(b.block_hash, b.tenant)
            self.num_bytes += b.num_bytes
            self.usage[b.tenant] = self.usage.get(b.tenant, 0) + b.num_bytes
            added += 1
        self.totals.num_added += added
        self.totals.num_evicted += evicted
        return added, evicted

    def _make_room(self, tenant: str, num_bytes: int) -> int | None:
        """Evicts until ``num_bytes`` more fit: the tenant's own entries first while it is at its store cap, then
        fair share's victims. Returns how many were evicted, or None (nothing evicted) when they cannot fit."""
        if num_bytes > self.capacity_bytes - self.pinned_bytes:
            return None
        evicted, lru, fair = 0, self.lru, self.fair
        if lru.count(tenant) and fair.over_cap(tenant, self.usage.get(tenant, 0), self.capacity_bytes,
                                               store_limits):
            while lru.count(tenant) and self.num_bytes + num_bytes > self.capacity_bytes:
                self._evict(lru.pop_oldest(tenant))
                evicted += 1
        if self.num_bytes + num_bytes > self.capacity_bytes:
            for victim in fair.victims(lru, self.usage, self.capacity_bytes, store_limits):
                self._evict(lru.pop_oldest(victim))
                evicted += 1
                if self.num_bytes + num_bytes <= self.capacity_bytes:
                    break
        return evicted

    def _evict(self, block_hash: bytes) -> None:
        entry = self._remove(block_hash)
        self.evicted_from[entry.tenant] = self.evicted_from.get(entry.tenant, 0) + 1

    def set_pinned(self, block_hash: bytes, pinned: bool) -> None:
        entry = self.entries.get(block_hash)
        if entry is None or entry.pinned == pinned:
            return
        entry.pinned = pinned
        if pinned:
            self.lru.discard(block_hash, entry.tenant)
            self.pinned_bytes += entry.num_bytes
        else:  # unpinned: used now, in both orders (a snapshot rebuilds the LRU from the entries' order)
            self.entries.move_to_end(block_hash)
            self.lru.add(block_hash, entry.tenant)
            self.pinned_bytes -= entry.num_bytes

    def drop_missing(self, hashes) -> int:
        """Entries whose values a worker found absent or damaged. Returns how many were recorded."""
        recorded = [h for h in dict.fromkeys(hashes) if h in self.entries]
        for h in recorded:
            self._remove(h)
        self.totals.num_dropped_missing += len(recorded)
        return len(recorded)

    def drop_tenant(self, tenant: str) -> int:
        """Drops the tenant's unpinned entries (pinned ones go once their pins are removed)."""
        doomed = [h for h, e in self.entries.items() if e.tenant == tenant and not e.pinned]
        for h in doomed:
            self._remove(h)
        return len(doomed)

    def clear(self) -> None:
        self.deleted.extend(self.entries)
        self.entries.clear()
        self.lru = TenantLRU()
        self.num_bytes = self.pinned_bytes = 0
        self.usage, self.totals, self.tenant_hits, self.evicted_from, self.rejected = {}, TierTotals(), {}, {}, {}

    def count_hits(self, tenant: str, num_pages: int, page_size: int) -> None:
        self.totals.num_hit_pages += num_pages
        self.tenant_hits[tenant] = self.tenant_hits.get(tenant, 0) + num_pages * page_size

    def fit_capacity(self) -> int:
        """Evicts least recently used entries until the index fits its capacity (all of them with the tier off):
        after a restart with a smaller --kv-store-bytes. Returns how many."""
        evicted = 0
        if not self.enabled:
            evicted = len(self.entries)
            for h in list(self.entries):
                self._remove(h)
        elif self.num_bytes > self.capacity_bytes:
            for victim in self.fair.victims(self.lru, self.usage, self.capacity_bytes, store_limits):
                self._evict(self.lru.pop_oldest(victim))
                evicted += 1
                if self.num_bytes <= self.capacity_bytes:
                    break
        self.totals.num_evicted += evicted
        return evicted

    def take_deleted(self) -> list[bytes]:
        deleted, self.deleted = self.deleted, []
        return deleted

    def _remove(self, block_hash: bytes) -> StoreEntry:
        entry = self.entries.pop(block_hash)
        if entry.pinned:
            self.pinned_bytes -= entry.num_bytes
        else:
            self.lru.discard(block_hash, entry.tenant)
        self.num_bytes -= entry.num_bytes
        self.usage[entry.tenant] -= entry.num_bytes
        if not self.usage[entry.tenant]:
            del self.usage[entry.tenant]
        self.deleted.append(block_hash)
        return entry
