"""Per-request state, tenant counters, and what the calls since the last durable write changed."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class GroupPages:
    """A request on a grouped pool, in its sliding layers' pool (PagePool.group): its page table there (index i:
    positions [i * page_size, (i + 1) * page_size), as in the full layers' table; HOLE where its window released
    the page or a hit its first chunk does not read) and its chain under the group's seed, as long as the full
    layers' chain (the same token blocks)."""

    page_table: list[int]
    seed: bytes  # h_0 of the tenant's namespace in the sliding layers' pool
    block_hashes: list[bytes]


@dataclass(slots=True)
class RequestPages:
    """A live request: where it runs, its pages, and the hash chain of its committed (or hit) blocks."""

    req_id: str
    tenant: str
    worker_id: str
    epoch: int
    page_table: list[int]  # page ids by position; HOLE where its sliding window released the page (on a grouped
    # pool, the full layers' pages: never a hole)
    seed: bytes  # h_0 of the tenant's namespace on this pool
    block_hashes: list[bytes]  # chain of the full pages committed or hit so far, from position 0
    num_prompt_tokens: int
    num_committed_tokens: int = 0  # leading tokens whose full pages are committed (or were hit)
    skip_prefix_cache: bool = False
    pins: tuple = ()  # the PinPoints it asked for
    num_pinned_blocks: int = 0  # leading blocks of its chain its pins took or refreshed
    transfer: object | None = None  # a TransferHold (transfers.py): the source pages its pull reads, held
    # op kind ("allocate", "extend", "commit", "release") -> (step_id, result): replayed for a retried call
    last_ops: dict[str, tuple[int, object]] = field(default_factory=dict)
    group: GroupPages | None = None  # a grouped pool: its sliding layers' pages; None on other pools

    @property
    def last_step_id(self) -> int:
        """The newest call that applied an op to this request (0: none yet); an older call is stale."""
        return max([s for s, _ in self.last_ops.values()], default=0)

    def is_replay(self, kind: str, step_id: int) -> bool:
        """Whether an op of this kind was already applied by the call with this step_id."""
        return self.last_ops.get(kind, (None,))[0] == step_id


@dataclass(slots=True)
class TenantCounters:
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


@dataclass(slots=True)
class Changes:
    """What the calls since the last durable write did, as far as the store needs to know: a call that changed
    nothing is not logged, and a reset is persisted as a snapshot instead of a log record."""

    changed: bool = False
    reset: bool = False  # an admin reset dropped every request, block and counter

    def empty(self) -> bool:
        return not (self.changed or self.reset)
