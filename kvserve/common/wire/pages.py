"""The kvmanager's page ops and their answers, as plain data (inputs frozen): what the gateway's scheduler sends
in one StepPages call per step, and what it reads back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvserve.common.attention_window import AttentionWindow
from kvserve.common.wire.tier import StoreLoad, StoreWrite
from kvserve.common.wire.transfer import PeerLoad, TransferDone
from kvserve.common.wire.worker import WorkerInfo


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """One worker incarnation's page pool, as its Info reports it."""

    worker_id: str
    epoch: int
    num_pages: int
    page_size: int
    model_fingerprint: str
    kv_dtype: str
    bytes_per_token: int
    kv_scales: str = ""  # a quantised pool's scale scheme ("" for the others); with kv_dtype, the KV format
    sliding_window: int = 0  # tokens of the attention window; 0 = none. Pages older than it may be released
    attention_sinks: int = 0  # leading tokens never released (their pages stay with the request); 0 = none
    kv_store: bool = False  # the worker reads and writes the shared KV tier
    role: str = "both"  # "prefill", "decode" or "both" (kvserve/common/wire/transfer.py): what the gateway sends it
    # Page groups (a model mixing full-attention and sliding-window layers): the fields above describe the full
    # layers' pool; the sliding layers' pages are a second pool of sliding_group_pages pages, each request with a
    # second page table (group_page_table) whose pages fall out of sliding_group_window. 0 pages: one group.
    sliding_group_pages: int = 0
    sliding_group_window: int = 0
    sliding_group_bytes_per_token: int = 0

    @property
    def grouped(self) -> bool:
        """Whether the pool has a sliding layers' group beside its full layers' pages."""
        return self.sliding_group_pages > 0

    @classmethod
    def of(cls, info: WorkerInfo) -> PoolSpec:
        """The pool a worker's Info describes, as the kvmanager registers it."""
        return cls(info.worker_id, info.epoch, info.num_pages, info.page_size, info.model_fingerprint,
                   info.kv_dtype, info.bytes_per_token, info.kv_scales, info.sliding_window, info.attention_sinks,
                   info.kv_store, info.role, info.sliding_group_pages, info.sliding_group_window,
                   info.sliding_group_bytes_per_token)

    def attention_window(self) -> AttentionWindow:
        """The policy of which positions this pool's requests keep and which pages they may release. Raises
        InvalidRequest for bad settings (a negative one, sinks without a window, a window under a page)."""
        return AttentionWindow.checked(self.sliding_window, self.attention_sinks, self.page_size)


class OpStatus(enum.Enum):
    OK = "ok"
    OUT_OF_PAGES = "out_of_pages"
    STALE_EPOCH = "stale_epoch"


MAX_PINS = 8  # per request: Anthropic allows 4 cache_control breakpoints, with prompt_cache_retention room to spare
MAX_PIN_TTL_S = 7 * 24 * 3600


@dataclass(frozen=True, slots=True)
class PinPoint:
    """A soft pin a request asks for: its full pages up to num_tokens, kept for ttl_s seconds after the pin is
    taken or last hit, within its tenant's pin budget (kvserve/kvmanager/pins.py)."""

    num_tokens: int
    ttl_s: int


@dataclass(frozen=True, slots=True)
class PageAllocation:
    req_id: str
    tenant: str
    token_ids: tuple[int, ...]
    worker_id: str = ""  # "" = let the kvmanager place it
    skip_prefix_cache: bool = False
    # A pool with a sliding window: cover the prefix hit and this many positions past it (0: the whole prompt);
    # hit pages the first chunk does not read stay holes (placement.allocation_plan).
    chunk_tokens: int = 0
    skip_store: bool = False  # pool hits only (an earlier load from the store failed)
    # The worker's measured costs (0: not measured yet): store hits are taken only when loading beats recomputing
    load_s_per_page: float = 0.0
    prefill_s_per_token: float = 0.0
    pins: tuple[PinPoint, ...] = ()  # taken as its pages are cached (hit now, or committed later)
    pull_peers: bool = False  # the worker can pull pages from other workers: serve peer hits
    pull_s_per_page: float = 0.0  # the worker's measured seconds to pull a page from a peer (0: not measured)
    # The request's pages live on this worker's pool (its prefill ran there): the allocation takes them as
    # peer hits, held for the pull, then frees that incarnation. "" = a new request.
    moved_from: str = ""


@dataclass(frozen=True, slots=True)
class PageExtension:
    req_id: str
    num_tokens: int  # positions the page table must cover after this op


@dataclass(frozen=True, slots=True)
class PageCommit:
    req_id: str
    start_pos: int  # tokens committed before; a multiple of page_size
    token_ids: tuple[int, ...]  # tokens of the newly full pages
    num_computed_tokens: int


@dataclass(frozen=True, slots=True)
class PageFree:
    req_id: str


@dataclass(frozen=True, slots=True)
class PageRelease:
    """A sliding-window request gives back pages that hold only positions older than its window: each index of
    its page table becomes a hole (common.pages.HOLE). An index that is a hole already releases nothing. On a
    grouped pool (PoolSpec.sliding_group_pages) the indices are of its group_page_table: only the sliding
    layers' pages fall out of a window."""

    req_id: str
    page_indices: tuple[int, ...]  # indices into the request's page table, not page ids


@dataclass(frozen=True, slots=True)
class StepOps:
    """All page operations of one scheduler step, applied as frees, commits, releases, extensions, allocations
    (the commit of a request freed in the same step goes before the frees; a page committed in the step is
    indexed before it is released, and pages released serve the step's extensions and allocations)."""

    step_id: int  # >= 1, increasing per caller: a retried call sends the same one (see the proto's StepOps)
    allocations: tuple[PageAllocation, ...] = ()
    extensions: tuple[PageExtension, ...] = ()
    commits: tuple[PageCommit, ...] = ()
    frees: tuple[PageFree, ...] = ()
    releases: tuple[PageRelease, ...] = ()
    transfers: tuple[TransferDone, ...] = ()  # pulls that ended: their sources' holds are released


@dataclass(slots=True)
class PageOpResult:
    """What happened to one op (OK, or the outcome the caller acts on); each kind adds what it produced."""

    req_id: str
    status: OpStatus


@dataclass(slots=True)
class PageAllocationResult(PageOpResult):
    worker_id: str = ""
    epoch: int = 0
    page_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # leading prompt tokens found in the prefix cache (whole pages), store hits included
    num_pages_short: int = 0  # OUT_OF_PAGES: how many more pages it needed
    # Store hits: pages the worker fills from the shared KV tier before the first chunk. They count in
    # num_cached_tokens, not in num_committed_tokens (the pool hits): they are committed with the first
    # computed pages, once their load succeeded.
    store_loads: list[StoreLoad] = field(default_factory=list)
    num_committed_tokens: int = 0
    num_pinned_tokens: int = 0  # leading prompt tokens under a pin this request took or refreshed
    # Peer hits: pages the worker pulls from another worker's pool (held there until the gateway reports the
    # pull, or until lease_expires_ms) before the first chunk; counted like store_loads.
    peer_loads: list[PeerLoad] = field(default_factory=list)
    peer_worker_id: str = ""
    peer_epoch: int = 0
    lease_expires_ms: int = 0
    # A grouped pool (PoolSpec.sliding_group_pages): the sliding layers' page table, HOLE where no page is held
    group_page_table: list[int] = field(default_factory=list)


@dataclass(slots=True)
class PageExtensionResult(PageOpResult):
    new_page_ids: list[int] = field(default_factory=list)  # appended to the page table, in order
    num_pages: int = 0  # the page table's length after the op
    num_pages_short: int = 0
    group_new_page_ids: list[int] = field(default_factory=list)  # a grouped pool: appended to group_page_table


@dataclass(slots=True)
class PageCommitResult(PageOpResult):
    num_committed_tokens: int = 0
    num_pinned_tokens: int = 0  # as PageAllocationResult's, after this op


@dataclass(slots=True)
class PageFreeResult(PageOpResult):
    """A free produces nothing but its status."""


@dataclass(slots=True)
class PageReleaseResult(PageOpResult):
    num_released: int = 0  # pages this op released (indices that were holes already count nothing)


@dataclass(slots=True)
class PoolSummary:
    worker_id: str
    epoch: int
    num_free_pages: int
    num_evictable_pages: int


@dataclass(slots=True)
class StepResults:
    allocations: list[PageAllocationResult] = field(default_factory=list)
    extensions: list[PageExtensionResult] = field(default_factory=list)
    commits: list[PageCommitResult] = field(default_factory=list)
    frees: list[PageFreeResult] = field(default_factory=list)
    releases: list[PageReleaseResult] = field(default_factory=list)
    pools: list[PoolSummary] = field(default_factory=list)
    store_writes: list[StoreWriteOrder] = field(default_factory=list)  # committed blocks the store lacks


@dataclass(frozen=True, slots=True)
class StoreWriteOrder:
    worker_id: str
    write: StoreWrite


@dataclass(frozen=True, slots=True)
class RegisterResult:
    previous_epoch: int
    dropped_req_ids: tuple[str, ...]  # requests of the old epoch, voided
    released_req_ids: tuple[str, ...] = ()  # requests freed by release_requests
