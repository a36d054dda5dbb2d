"""Per-request state and the record of changes since the last write-through to the store."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestPages:
    """A live request: where it runs, its pages, and the hash chain of its committed (or hit) blocks."""

    req_id: str
    tenant: str
    worker_id: str
    epoch: int
    page_table: list[int]
    seed: bytes  # h_0 of the tenant's namespace on this pool
    block_hashes: list[bytes]  # chain of the full pages committed or hit so far, from position 0
    num_prompt_tokens: int
    num_committed_tokens: int = 0  # leading tokens whose full pages are committed (or were hit)
    skip_prefix_cache: bool = False
    # op kind ("allocate", "extend", "commit") -> (step_id, result): replayed for a retried call
    last_ops: dict[str, tuple[int, object]] = field(default_factory=dict)

    @property
    def last_step_id(self) -> int:
        """The newest call that applied an op to this request (0: none tracked); an older call is stale."""
        return max([s for s, _ in self.last_ops.values()], default=0)

    def is_replay(self, kind: str, step_id: int) -> bool:
        """Whether an op of this kind was already applied by the call with this step_id."""
        return bool(step_id) and self.last_ops.get(kind, (None,))[0] == step_id


@dataclass(slots=True)
class TenantCounters:
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


@dataclass(slots=True)
class Changes:
    """What changed since the last successful write-through. Keys only: the store reads current values."""

    requests: dict[str, str] = field(default_factory=dict)  # req_id -> tenant, upserted or deleted
    blocks: dict[tuple[str, bytes], str] = field(default_factory=dict)  # (worker_id, hash) -> tenant
    # blocks whose only change is last_used (a hit, or joining the LRU): written as one small per-pool hash
    touched: dict[tuple[str, bytes], str] = field(default_factory=dict)
    pools: set[str] = field(default_factory=set)  # worker_ids, upserted or deleted
    counters: bool = False
    reset: bool = False  # everything was dropped: the store deletes all before writing the rest

    def empty(self) -> bool:
        return not (self.requests or self.blocks or self.touched or self.pools or self.counters or self.reset)
