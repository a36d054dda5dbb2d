"""The shared KV tier's messages, as plain data: which pages a worker writes to the store or fills from it, and
what it reports back to the kvmanager (docs/features/kv-tier.md).

The kvmanager decides (it owns every block's locations); the gateway carries its decisions to the worker with
the step; the worker moves the bytes and reports to the kvmanager which blocks landed, which values were missing
or damaged, and its counters.
"""

from __future__ import annotations

from dataclasses import dataclass

STORE_KEY_PREFIX = b"kvpage:"
# A value's header (kvserve/worker/page_codec.py's HEADER): magic, version, element bytes, scales flag, reserved,
# namespace and block hash digests, payload bytes, checksum. A value is this plus page_size x bytes per token.
PAGE_VALUE_HEADER_BYTES = 56


def store_key(block_hash: bytes) -> bytes:
    """The store's key of a block. The block hash chains over the tenant's namespace (tenant, model fingerprint,
    KV dtype and scales, page size, window), so no other tenant or pool format can ever name the same key."""
    return STORE_KEY_PREFIX + block_hash.hex().encode()


@dataclass(frozen=True, slots=True)
class StoreWrite:
    """Write page ``page_id`` (a committed block) to the store, copying its bytes before the step computes."""

    page_id: int
    block_hash: bytes
    namespace: bytes  # h_0 of the block's chain: the value's header names it
    tenant: str  # echoed back in StoredBlock (per-tenant accounting)


@dataclass(frozen=True, slots=True)
class StoreLoad:
    """Fill page ``page_id`` of a request from the store's value of ``block_hash`` before its first chunk."""

    page_id: int
    block_hash: bytes
    namespace: bytes


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """A block whose value the store acknowledged: only now may the kvmanager record it as in the store."""

    block_hash: bytes
    tenant: str
    num_bytes: int


@dataclass(frozen=True, slots=True)
class TierCounters:
    """A worker's tier counters since its previous report (deltas, summed by the kvmanager)."""

    num_loaded_pages: int = 0  # pages filled from the store and verified
    num_loaded_bytes: int = 0
    load_s: float = 0.0  # wall time of those loads (the store's round trips, verification, the copy in)
    num_failed_loads: int = 0  # requests whose loads failed (missing, damaged, store down): recomputed
    num_verify_failures: int = 0  # values that were there but failed verification (checksum, header)
    num_written_pages: int = 0
    num_written_bytes: int = 0
    num_dropped_writes: int = 0  # not written: the queue was full, or the store was down

    def __add__(self, other: TierCounters) -> TierCounters:
        return TierCounters(*(a + b for a, b in zip(self.as_tuple(), other.as_tuple(), strict=True)))

    def as_tuple(self) -> tuple:
        return (self.num_loaded_pages, self.num_loaded_bytes, self.load_s, self.num_failed_loads,
                self.num_verify_failures, self.num_written_pages, self.num_written_bytes, self.num_dropped_writes)

    def empty(self) -> bool:
        return not any(self.as_tuple())


@dataclass(frozen=True, slots=True)
class TierReport:
    """What a worker tells the kvmanager about its store traffic (ReportTier)."""

    worker_id: str
    epoch: int
    written: tuple[StoredBlock, ...] = ()
    missing: tuple[bytes, ...] = ()  # block hashes whose values were absent or failed verification
    counters: TierCounters = TierCounters()

    def empty(self) -> bool:
        return not (self.written or self.missing) and self.counters.empty()
