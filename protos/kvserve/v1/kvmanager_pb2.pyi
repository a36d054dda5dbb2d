from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PageOpStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAGE_OP_STATUS_UNSPECIFIED: _ClassVar[PageOpStatus]
    PAGE_OP_STATUS_OK: _ClassVar[PageOpStatus]
    PAGE_OP_STATUS_OUT_OF_PAGES: _ClassVar[PageOpStatus]
    PAGE_OP_STATUS_STALE_EPOCH: _ClassVar[PageOpStatus]
    PAGE_OP_STATUS_UNKNOWN_REQUEST: _ClassVar[PageOpStatus]
PAGE_OP_STATUS_UNSPECIFIED: PageOpStatus
PAGE_OP_STATUS_OK: PageOpStatus
PAGE_OP_STATUS_OUT_OF_PAGES: PageOpStatus
PAGE_OP_STATUS_STALE_EPOCH: PageOpStatus
PAGE_OP_STATUS_UNKNOWN_REQUEST: PageOpStatus

class PoolSpec(_message.Message):
    __slots__ = ("worker_id", "epoch", "num_pages", "page_size", "model_fingerprint", "kv_dtype", "bytes_per_token", "release_requests", "kv_scales", "sliding_window", "attention_sinks", "kv_store", "role", "sliding_group_pages", "sliding_group_window", "sliding_group_bytes_per_token")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RELEASE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_SCALES_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_SINKS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SLIDING_GROUP_PAGES_FIELD_NUMBER: _ClassVar[int]
    SLIDING_GROUP_WINDOW_FIELD_NUMBER: _ClassVar[int]
    SLIDING_GROUP_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    num_pages: int
    page_size: int
    model_fingerprint: str
    kv_dtype: str
    bytes_per_token: int
    release_requests: bool
    kv_scales: str
    sliding_window: int
    attention_sinks: int
    kv_store: bool
    role: str
    sliding_group_pages: int
    sliding_group_window: int
    sliding_group_bytes_per_token: int
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., num_pages: _Optional[int] = ..., page_size: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., bytes_per_token: _Optional[int] = ..., release_requests: _Optional[bool] = ..., kv_scales: _Optional[str] = ..., sliding_window: _Optional[int] = ..., attention_sinks: _Optional[int] = ..., kv_store: _Optional[bool] = ..., role: _Optional[str] = ..., sliding_group_pages: _Optional[int] = ..., sliding_group_window: _Optional[int] = ..., sliding_group_bytes_per_token: _Optional[int] = ...) -> None: ...

class RegisterResult(_message.Message):
    __slots__ = ("ok", "previous_epoch", "dropped_req_ids", "released_req_ids")
    OK_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_EPOCH_FIELD_NUMBER: _ClassVar[int]
    DROPPED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    previous_epoch: int
    dropped_req_ids: _containers.RepeatedScalarFieldContainer[str]
    released_req_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ok: _Optional[bool] = ..., previous_epoch: _Optional[int] = ..., dropped_req_ids: _Optional[_Iterable[str]] = ..., released_req_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class JoinWorkerRequest(_message.Message):
    __slots__ = ("pool", "address")
    POOL_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    pool: PoolSpec
    address: str
    def __init__(self, pool: _Optional[_Union[PoolSpec, _Mapping]] = ..., address: _Optional[str] = ...) -> None: ...

class JoinResult(_message.Message):
    __slots__ = ("registered", "lease_ms")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    registered: RegisterResult
    lease_ms: int
    def __init__(self, registered: _Optional[_Union[RegisterResult, _Mapping]] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "epoch", "draining")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    draining: bool
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...

class HeartbeatResult(_message.Message):
    __slots__ = ("known", "num_requests", "lease_ms")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    known: bool
    num_requests: int
    lease_ms: int
    def __init__(self, known: _Optional[bool] = ..., num_requests: _Optional[int] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class LeaveWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "epoch")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class LeaveWorkerResponse(_message.Message):
    __slots__ = ("dropped_req_ids",)
    DROPPED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    dropped_req_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, dropped_req_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerMember(_message.Message):
    __slots__ = ("worker_id", "epoch", "address", "draining", "num_requests")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    address: str
    draining: bool
    num_requests: int
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., address: _Optional[str] = ..., draining: _Optional[bool] = ..., num_requests: _Optional[int] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerMember]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerMember, _Mapping]]] = ...) -> None: ...

class PageAllocation(_message.Message):
    __slots__ = ("req_id", "tenant", "worker_id", "packed_token_ids", "skip_prefix_cache", "traceparent", "chunk_tokens", "skip_store", "load_s_per_page", "prefill_s_per_token", "pins", "pull_peers", "pull_s_per_page", "moved_from")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PACKED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SKIP_STORE_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_PER_PAGE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    PULL_PEERS_FIELD_NUMBER: _ClassVar[int]
    PULL_S_PER_PAGE_FIELD_NUMBER: _ClassVar[int]
    MOVED_FROM_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    tenant: str
    worker_id: str
    packed_token_ids: bytes
    skip_prefix_cache: bool
    traceparent: str
    chunk_tokens: int
    skip_store: bool
    load_s_per_page: float
    prefill_s_per_token: float
    pins: _containers.RepeatedCompositeFieldContainer[PinPoint]
    pull_peers: bool
    pull_s_per_page: float
    moved_from: str
    def __init__(self, req_id: _Optional[str] = ..., tenant: _Optional[str] = ..., worker_id: _Optional[str] = ..., packed_token_ids: _Optional[bytes] = ..., skip_prefix_cache: _Optional[bool] = ..., traceparent: _Optional[str] = ..., chunk_tokens: _Optional[int] = ..., skip_store: _Optional[bool] = ..., load_s_per_page: _Optional[float] = ..., prefill_s_per_token: _Optional[float] = ..., pins: _Optional[_Iterable[_Union[PinPoint, _Mapping]]] = ..., pull_peers: _Optional[bool] = ..., pull_s_per_page: _Optional[float] = ..., moved_from: _Optional[str] = ...) -> None: ...

class PeerLoad(_message.Message):
    __slots__ = ("page_id", "src_page_id", "block_hash", "namespace")
    PAGE_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_PAGE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    page_id: int
    src_page_id: int
    block_hash: bytes
    namespace: bytes
    def __init__(self, page_id: _Optional[int] = ..., src_page_id: _Optional[int] = ..., block_hash: _Optional[bytes] = ..., namespace: _Optional[bytes] = ...) -> None: ...

class PinPoint(_message.Message):
    __slots__ = ("num_tokens", "ttl_s")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    ttl_s: int
    def __init__(self, num_tokens: _Optional[int] = ..., ttl_s: _Optional[int] = ...) -> None: ...

class StoreLoad(_message.Message):
    __slots__ = ("page_id", "block_hash", "namespace")
    PAGE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    page_id: int
    block_hash: bytes
    namespace: bytes
    def __init__(self, page_id: _Optional[int] = ..., block_hash: _Optional[bytes] = ..., namespace: _Optional[bytes] = ...) -> None: ...

class StoreWrite(_message.Message):
    __slots__ = ("page_id", "block_hash", "namespace", "tenant")
    PAGE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    page_id: int
    block_hash: bytes
    namespace: bytes
    tenant: str
    def __init__(self, page_id: _Optional[int] = ..., block_hash: _Optional[bytes] = ..., namespace: _Optional[bytes] = ..., tenant: _Optional[str] = ...) -> None: ...

class PageAllocationResult(_message.Message):
    __slots__ = ("req_id", "status", "worker_id", "epoch", "page_table", "num_cached_tokens", "num_pages_short", "store_loads", "num_committed_tokens", "num_pinned_tokens", "peer_loads", "peer_worker_id", "peer_epoch", "lease_expires_ms", "group_page_table")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PAGE_TABLE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_SHORT_FIELD_NUMBER: _ClassVar[int]
    STORE_LOADS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PEER_LOADS_FIELD_NUMBER: _ClassVar[int]
    PEER_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_MS_FIELD_NUMBER: _ClassVar[int]
    GROUP_PAGE_TABLE_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    status: PageOpStatus
    worker_id: str
    epoch: int
    page_table: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: int
    num_pages_short: int
    store_loads: _containers.RepeatedCompositeFieldContainer[StoreLoad]
    num_committed_tokens: int
    num_pinned_tokens: int
    peer_loads: _containers.RepeatedCompositeFieldContainer[PeerLoad]
    peer_worker_id: str
    peer_epoch: int
    lease_expires_ms: int
    group_page_table: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, req_id: _Optional[str] = ..., status: _Optional[_Union[PageOpStatus, str]] = ..., worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., page_table: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[int] = ..., num_pages_short: _Optional[int] = ..., store_loads: _Optional[_Iterable[_Union[StoreLoad, _Mapping]]] = ..., num_committed_tokens: _Optional[int] = ..., num_pinned_tokens: _Optional[int] = ..., peer_loads: _Optional[_Iterable[_Union[PeerLoad, _Mapping]]] = ..., peer_worker_id: _Optional[str] = ..., peer_epoch: _Optional[int] = ..., lease_expires_ms: _Optional[int] = ..., group_page_table: _Optional[_Iterable[int]] = ...) -> None: ...

class PageExtension(_message.Message):
    __slots__ = ("req_id", "num_tokens", "traceparent")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    num_tokens: int
    traceparent: str
    def __init__(self, req_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., traceparent: _Optional[str] = ...) -> None: ...

class PageExtensionResult(_message.Message):
    __slots__ = ("req_id", "status", "new_page_ids", "num_pages", "num_pages_short", "group_new_page_ids")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NEW_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_SHORT_FIELD_NUMBER: _ClassVar[int]
    GROUP_NEW_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    status: PageOpStatus
    new_page_ids: _containers.RepeatedScalarFieldContainer[int]
    num_pages: int
    num_pages_short: int
    group_new_page_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, req_id: _Optional[str] = ..., status: _Optional[_Union[PageOpStatus, str]] = ..., new_page_ids: _Optional[_Iterable[int]] = ..., num_pages: _Optional[int] = ..., num_pages_short: _Optional[int] = ..., group_new_page_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PageCommit(_message.Message):
    __slots__ = ("req_id", "start_pos", "packed_token_ids", "num_computed_tokens", "traceparent")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    PACKED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    start_pos: int
    packed_token_ids: bytes
    num_computed_tokens: int
    traceparent: str
    def __init__(self, req_id: _Optional[str] = ..., start_pos: _Optional[int] = ..., packed_token_ids: _Optional[bytes] = ..., num_computed_tokens: _Optional[int] = ..., traceparent: _Optional[str] = ...) -> None: ...

class PageCommitResult(_message.Message):
    __slots__ = ("req_id", "status", "num_committed_tokens", "num_pinned_tokens")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    status: PageOpStatus
    num_committed_tokens: int
    num_pinned_tokens: int
    def __init__(self, req_id: _Optional[str] = ..., status: _Optional[_Union[PageOpStatus, str]] = ..., num_committed_tokens: _Optional[int] = ..., num_pinned_tokens: _Optional[int] = ...) -> None: ...

class PageFree(_message.Message):
    __slots__ = ("req_id", "traceparent")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    traceparent: str
    def __init__(self, req_id: _Optional[str] = ..., traceparent: _Optional[str] = ...) -> None: ...

class PageFreeResult(_message.Message):
    __slots__ = ("req_id", "status")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    status: PageOpStatus
    def __init__(self, req_id: _Optional[str] = ..., status: _Optional[_Union[PageOpStatus, str]] = ...) -> None: ...

class PageRelease(_message.Message):
    __slots__ = ("req_id", "page_indices", "traceparent")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_INDICES_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    page_indices: _containers.RepeatedScalarFieldContainer[int]
    traceparent: str
    def __init__(self, req_id: _Optional[str] = ..., page_indices: _Optional[_Iterable[int]] = ..., traceparent: _Optional[str] = ...) -> None: ...

class PageReleaseResult(_message.Message):
    __slots__ = ("req_id", "status", "num_released")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NUM_RELEASED_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    status: PageOpStatus
    num_released: int
    def __init__(self, req_id: _Optional[str] = ..., status: _Optional[_Union[PageOpStatus, str]] = ..., num_released: _Optional[int] = ...) -> None: ...

class StepOps(_message.Message):
    __slots__ = ("step_id", "allocations", "extensions", "commits", "frees", "releases", "transfers")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    ALLOCATIONS_FIELD_NUMBER: _ClassVar[int]
    EXTENSIONS_FIELD_NUMBER: _ClassVar[int]
    COMMITS_FIELD_NUMBER: _ClassVar[int]
    FREES_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    allocations: _containers.RepeatedCompositeFieldContainer[PageAllocation]
    extensions: _containers.RepeatedCompositeFieldContainer[PageExtension]
    commits: _containers.RepeatedCompositeFieldContainer[PageCommit]
    frees: _containers.RepeatedCompositeFieldContainer[PageFree]
    releases: _containers.RepeatedCompositeFieldContainer[PageRelease]
    transfers: _containers.RepeatedCompositeFieldContainer[TransferDone]
    def __init__(self, step_id: _Optional[int] = ..., allocations: _Optional[_Iterable[_Union[PageAllocation, _Mapping]]] = ..., extensions: _Optional[_Iterable[_Union[PageExtension, _Mapping]]] = ..., commits: _Optional[_Iterable[_Union[PageCommit, _Mapping]]] = ..., frees: _Optional[_Iterable[_Union[PageFree, _Mapping]]] = ..., releases: _Optional[_Iterable[_Union[PageRelease, _Mapping]]] = ..., transfers: _Optional[_Iterable[_Union[TransferDone, _Mapping]]] = ...) -> None: ...

class TransferDone(_message.Message):
    __slots__ = ("req_id", "ok", "num_bytes", "seconds")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    ok: bool
    num_bytes: int
    seconds: float
    def __init__(self, req_id: _Optional[str] = ..., ok: _Optional[bool] = ..., num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class PoolSummary(_message.Message):
    __slots__ = ("worker_id", "epoch", "num_free_pages", "num_evictable_pages")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTABLE_PAGES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    num_free_pages: int
    num_evictable_pages: int
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., num_free_pages: _Optional[int] = ..., num_evictable_pages: _Optional[int] = ...) -> None: ...

class StepResults(_message.Message):
    __slots__ = ("allocation_results", "extension_results", "commit_results", "free_results", "pools", "handle_ms", "release_results", "store_writes")
    ALLOCATION_RESULTS_FIELD_NUMBER: _ClassVar[int]
    EXTENSION_RESULTS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_RESULTS_FIELD_NUMBER: _ClassVar[int]
    FREE_RESULTS_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    HANDLE_MS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_RESULTS_FIELD_NUMBER: _ClassVar[int]
    STORE_WRITES_FIELD_NUMBER: _ClassVar[int]
    allocation_results: _containers.RepeatedCompositeFieldContainer[PageAllocationResult]
    extension_results: _containers.RepeatedCompositeFieldContainer[PageExtensionResult]
    commit_results: _containers.RepeatedCompositeFieldContainer[PageCommitResult]
    free_results: _containers.RepeatedCompositeFieldContainer[PageFreeResult]
    pools: _containers.RepeatedCompositeFieldContainer[PoolSummary]
    handle_ms: float
    release_results: _containers.RepeatedCompositeFieldContainer[PageReleaseResult]
    store_writes: _containers.RepeatedCompositeFieldContainer[StoreWriteOrder]
    def __init__(self, allocation_results: _Optional[_Iterable[_Union[PageAllocationResult, _Mapping]]] = ..., extension_results: _Optional[_Iterable[_Union[PageExtensionResult, _Mapping]]] = ..., commit_results: _Optional[_Iterable[_Union[PageCommitResult, _Mapping]]] = ..., free_results: _Optional[_Iterable[_Union[PageFreeResult, _Mapping]]] = ..., pools: _Optional[_Iterable[_Union[PoolSummary, _Mapping]]] = ..., handle_ms: _Optional[float] = ..., release_results: _Optional[_Iterable[_Union[PageReleaseResult, _Mapping]]] = ..., store_writes: _Optional[_Iterable[_Union[StoreWriteOrder, _Mapping]]] = ...) -> None: ...

class StoreWriteOrder(_message.Message):
    __slots__ = ("worker_id", "write")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WRITE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    write: StoreWrite
    def __init__(self, worker_id: _Optional[str] = ..., write: _Optional[_Union[StoreWrite, _Mapping]] = ...) -> None: ...

class StoredBlock(_message.Message):
    __slots__ = ("block_hash", "tenant", "num_bytes")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    tenant: str
    num_bytes: int
    def __init__(self, block_hash: _Optional[bytes] = ..., tenant: _Optional[str] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class TierCounters(_message.Message):
    __slots__ = ("num_loaded_pages", "num_loaded_bytes", "load_s", "num_failed_loads", "num_verify_failures", "num_written_pages", "num_written_bytes", "num_dropped_writes")
    NUM_LOADED_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_LOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_LOADS_FIELD_NUMBER: _ClassVar[int]
    NUM_VERIFY_FAILURES_FIELD_NUMBER: _ClassVar[int]
    NUM_WRITTEN_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_WRITTEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_DROPPED_WRITES_FIELD_NUMBER: _ClassVar[int]
    num_loaded_pages: int
    num_loaded_bytes: int
    load_s: float
    num_failed_loads: int
    num_verify_failures: int
    num_written_pages: int
    num_written_bytes: int
    num_dropped_writes: int
    def __init__(self, num_loaded_pages: _Optional[int] = ..., num_loaded_bytes: _Optional[int] = ..., load_s: _Optional[float] = ..., num_failed_loads: _Optional[int] = ..., num_verify_failures: _Optional[int] = ..., num_written_pages: _Optional[int] = ..., num_written_bytes: _Optional[int] = ..., num_dropped_writes: _Optional[int] = ...) -> None: ...

class TierReport(_message.Message):
    __slots__ = ("worker_id", "epoch", "written", "missing", "counters")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    written: _containers.RepeatedCompositeFieldContainer[StoredBlock]
    missing: _containers.RepeatedScalarFieldContainer[bytes]
    counters: TierCounters
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., written: _Optional[_Iterable[_Union[StoredBlock, _Mapping]]] = ..., missing: _Optional[_Iterable[bytes]] = ..., counters: _Optional[_Union[TierCounters, _Mapping]] = ...) -> None: ...

class TierReportResult(_message.Message):
    __slots__ = ("num_added", "num_evicted")
    NUM_ADDED_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTED_FIELD_NUMBER: _ClassVar[int]
    num_added: int
    num_evicted: int
    def __init__(self, num_added: _Optional[int] = ..., num_evicted: _Optional[int] = ...) -> None: ...

class PlaceRequest(_message.Message):
    __slots__ = ("tenant", "packed_token_ids", "num_queued", "worker_ids", "pull_peers")
    class NumQueuedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PACKED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_FIELD_NUMBER: _ClassVar[int]
    WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    PULL_PEERS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    packed_token_ids: bytes
    num_queued: _containers.ScalarMap[str, int]
    worker_ids: _containers.RepeatedScalarFieldContainer[str]
    pull_peers: bool
    def __init__(self, tenant: _Optional[str] = ..., packed_token_ids: _Optional[bytes] = ..., num_queued: _Optional[_Mapping[str, int]] = ..., worker_ids: _Optional[_Iterable[str]] = ..., pull_peers: _Optional[bool] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("worker_id", "num_cached_tokens")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    num_cached_tokens: int
    def __init__(self, worker_id: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("worker_id", "epoch", "model_fingerprint", "kv_dtype", "page_size", "num_pages", "num_used_pages", "num_cached_pages", "num_free_pages", "num_pinned_pages", "num_requests", "pool_bytes", "used_bytes", "cached_bytes", "kv_scales", "sliding_window", "attention_sinks", "num_window_released_pages", "role", "sliding_group")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_SCALES_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_SINKS_FIELD_NUMBER: _ClassVar[int]
    NUM_WINDOW_RELEASED_PAGES_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SLIDING_GROUP_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    model_fingerprint: str
    kv_dtype: str
    page_size: int
    num_pages: int
    num_used_pages: int
    num_cached_pages: int
    num_free_pages: int
    num_pinned_pages: int
    num_requests: int
    pool_bytes: int
    used_bytes: int
    cached_bytes: int
    kv_scales: str
    sliding_window: int
    attention_sinks: int
    num_window_released_pages: int
    role: str
    sliding_group: PoolStats
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., page_size: _Optional[int] = ..., num_pages: _Optional[int] = ..., num_used_pages: _Optional[int] = ..., num_cached_pages: _Optional[int] = ..., num_free_pages: _Optional[int] = ..., num_pinned_pages: _Optional[int] = ..., num_requests: _Optional[int] = ..., pool_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., cached_bytes: _Optional[int] = ..., kv_scales: _Optional[str] = ..., sliding_window: _Optional[int] = ..., attention_sinks: _Optional[int] = ..., num_window_released_pages: _Optional[int] = ..., role: _Optional[str] = ..., sliding_group: _Optional[_Union[PoolStats, _Mapping]] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("tenant", "num_blocks", "num_pinned_blocks", "num_requests", "prefix_cache_queries", "prefix_cache_hits", "store_hits", "num_store_blocks", "weight", "active", "num_pages", "share_pages", "floor_pages", "cap_pages", "store_bytes", "store_floor_bytes", "store_cap_bytes", "num_pin_blocks", "num_soft_pin_blocks", "pin_budget_blocks", "num_evicted_pages", "num_evictions_caused", "num_store_evicted", "num_store_rejected")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    STORE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_STORE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    SHARE_PAGES_FIELD_NUMBER: _ClassVar[int]
    FLOOR_PAGES_FIELD_NUMBER: _ClassVar[int]
    CAP_PAGES_FIELD_NUMBER: _ClassVar[int]
    STORE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORE_FLOOR_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORE_CAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_PIN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SOFT_PIN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PIN_BUDGET_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTIONS_CAUSED_FIELD_NUMBER: _ClassVar[int]
    NUM_STORE_EVICTED_FIELD_NUMBER: _ClassVar[int]
    NUM_STORE_REJECTED_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    num_blocks: int
    num_pinned_blocks: int
    num_requests: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    store_hits: int
    num_store_blocks: int
    weight: float
    active: bool
    num_pages: int
    share_pages: int
    floor_pages: int
    cap_pages: int
    store_bytes: int
    store_floor_bytes: int
    store_cap_bytes: int
    num_pin_blocks: int
    num_soft_pin_blocks: int
    pin_budget_blocks: int
    num_evicted_pages: int
    num_evictions_caused: int
    num_store_evicted: int
    num_store_rejected: int
    def __init__(self, tenant: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_pinned_blocks: _Optional[int] = ..., num_requests: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., store_hits: _Optional[int] = ..., num_store_blocks: _Optional[int] = ..., weight: _Optional[float] = ..., active: _Optional[bool] = ..., num_pages: _Optional[int] = ..., share_pages: _Optional[int] = ..., floor_pages: _Optional[int] = ..., cap_pages: _Optional[int] = ..., store_bytes: _Optional[int] = ..., store_floor_bytes: _Optional[int] = ..., store_cap_bytes: _Optional[int] = ..., num_pin_blocks: _Optional[int] = ..., num_soft_pin_blocks: _Optional[int] = ..., pin_budget_blocks: _Optional[int] = ..., num_evicted_pages: _Optional[int] = ..., num_evictions_caused: _Optional[int] = ..., num_store_evicted: _Optional[int] = ..., num_store_rejected: _Optional[int] = ...) -> None: ...

class StoreStats(_message.Message):
    __slots__ = ("capacity_bytes", "num_blocks", "num_bytes", "num_hit_pages", "num_added_blocks", "num_evicted_blocks", "num_dropped_missing", "num_loaded_pages", "num_loaded_bytes", "load_s", "num_failed_loads", "num_verify_failures", "num_written_pages", "num_written_bytes", "num_dropped_writes")
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_HIT_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_ADDED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_DROPPED_MISSING_FIELD_NUMBER: _ClassVar[int]
    NUM_LOADED_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_LOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_LOADS_FIELD_NUMBER: _ClassVar[int]
    NUM_VERIFY_FAILURES_FIELD_NUMBER: _ClassVar[int]
    NUM_WRITTEN_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_WRITTEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_DROPPED_WRITES_FIELD_NUMBER: _ClassVar[int]
    capacity_bytes: int
    num_blocks: int
    num_bytes: int
    num_hit_pages: int
    num_added_blocks: int
    num_evicted_blocks: int
    num_dropped_missing: int
    num_loaded_pages: int
    num_loaded_bytes: int
    load_s: float
    num_failed_loads: int
    num_verify_failures: int
    num_written_pages: int
    num_written_bytes: int
    num_dropped_writes: int
    def __init__(self, capacity_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ..., num_hit_pages: _Optional[int] = ..., num_added_blocks: _Optional[int] = ..., num_evicted_blocks: _Optional[int] = ..., num_dropped_missing: _Optional[int] = ..., num_loaded_pages: _Optional[int] = ..., num_loaded_bytes: _Optional[int] = ..., load_s: _Optional[float] = ..., num_failed_loads: _Optional[int] = ..., num_verify_failures: _Optional[int] = ..., num_written_pages: _Optional[int] = ..., num_written_bytes: _Optional[int] = ..., num_dropped_writes: _Optional[int] = ...) -> None: ...

class ClusterStats(_message.Message):
    __slots__ = ("pools", "tenants", "prefix_cache_queries", "prefix_cache_hits", "num_evicted_blocks", "store_ok", "kv_store", "transfers")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORE_OK_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStats]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_evicted_blocks: int
    store_ok: bool
    kv_store: StoreStats
    transfers: TransferStats
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolStats, _Mapping]]] = ..., tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_evicted_blocks: _Optional[int] = ..., store_ok: _Optional[bool] = ..., kv_store: _Optional[_Union[StoreStats, _Mapping]] = ..., transfers: _Optional[_Union[TransferStats, _Mapping]] = ...) -> None: ...

class TransferStats(_message.Message):
    __slots__ = ("num_pulls", "num_pages", "num_ok", "num_failed", "num_expired", "num_bytes", "seconds", "num_moved", "num_holds")
    NUM_PULLS_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_OK_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_MOVED_FIELD_NUMBER: _ClassVar[int]
    NUM_HOLDS_FIELD_NUMBER: _ClassVar[int]
    num_pulls: int
    num_pages: int
    num_ok: int
    num_failed: int
    num_expired: int
    num_bytes: int
    seconds: float
    num_moved: int
    num_holds: int
    def __init__(self, num_pulls: _Optional[int] = ..., num_pages: _Optional[int] = ..., num_ok: _Optional[int] = ..., num_failed: _Optional[int] = ..., num_expired: _Optional[int] = ..., num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., num_moved: _Optional[int] = ..., num_holds: _Optional[int] = ...) -> None: ...

class ListTenantsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTenantsResponse(_message.Message):
    __slots__ = ("tenants",)
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    def __init__(self, tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ...) -> None: ...

class InspectTenantRequest(_message.Message):
    __slots__ = ("tenant", "max_blocks", "max_prefixes")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_PREFIXES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    max_blocks: int
    max_prefixes: int
    def __init__(self, tenant: _Optional[str] = ..., max_blocks: _Optional[int] = ..., max_prefixes: _Optional[int] = ...) -> None: ...

class CachedBlock(_message.Message):
    __slots__ = ("block_hash", "parent_block_hash", "worker_id", "epoch", "page_id", "ref_cnt", "pinned", "block_index", "last_used")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PAGE_ID_FIELD_NUMBER: _ClassVar[int]
    REF_CNT_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_FIELD_NUMBER: _ClassVar[int]
    block_hash: str
    parent_block_hash: str
    worker_id: str
    epoch: int
    page_id: int
    ref_cnt: int
    pinned: bool
    block_index: int
    last_used: int
    def __init__(self, block_hash: _Optional[str] = ..., parent_block_hash: _Optional[str] = ..., worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., page_id: _Optional[int] = ..., ref_cnt: _Optional[int] = ..., pinned: _Optional[bool] = ..., block_index: _Optional[int] = ..., last_used: _Optional[int] = ...) -> None: ...

class CachedPrefix(_message.Message):
    __slots__ = ("worker_id", "last_block_hash", "num_blocks", "num_tokens")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    last_block_hash: str
    num_blocks: int
    num_tokens: int
    def __init__(self, worker_id: _Optional[str] = ..., last_block_hash: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class TenantReport(_message.Message):
    __slots__ = ("stats", "blocks", "prefixes")
    STATS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIXES_FIELD_NUMBER: _ClassVar[int]
    stats: TenantStats
    blocks: _containers.RepeatedCompositeFieldContainer[CachedBlock]
    prefixes: _containers.RepeatedCompositeFieldContainer[CachedPrefix]
    def __init__(self, stats: _Optional[_Union[TenantStats, _Mapping]] = ..., blocks: _Optional[_Iterable[_Union[CachedBlock, _Mapping]]] = ..., prefixes: _Optional[_Iterable[_Union[CachedPrefix, _Mapping]]] = ...) -> None: ...

class PrefixRequest(_message.Message):
    __slots__ = ("tenant", "token_ids", "text", "worker_id", "ttl_s")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    token_ids: TokenIds
    text: str
    worker_id: str
    ttl_s: int
    def __init__(self, tenant: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., text: _Optional[str] = ..., worker_id: _Optional[str] = ..., ttl_s: _Optional[int] = ...) -> None: ...

class ProbeHit(_message.Message):
    __slots__ = ("worker_id", "epoch", "num_cached_tokens")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    num_cached_tokens: int
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class ProbeResult(_message.Message):
    __slots__ = ("num_query_tokens", "num_cached_tokens", "worker_id", "hits")
    NUM_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    num_query_tokens: int
    num_cached_tokens: int
    worker_id: str
    hits: _containers.RepeatedCompositeFieldContainer[ProbeHit]
    def __init__(self, num_query_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., worker_id: _Optional[str] = ..., hits: _Optional[_Iterable[_Union[ProbeHit, _Mapping]]] = ...) -> None: ...

class EvictTenantRequest(_message.Message):
    __slots__ = ("tenant", "worker_id", "include_pinned")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_PINNED_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    worker_id: str
    include_pinned: bool
    def __init__(self, tenant: _Optional[str] = ..., worker_id: _Optional[str] = ..., include_pinned: _Optional[bool] = ...) -> None: ...

class EvictResult(_message.Message):
    __slots__ = ("num_evicted_blocks", "num_kept_blocks")
    NUM_EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_KEPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_evicted_blocks: int
    num_kept_blocks: int
    def __init__(self, num_evicted_blocks: _Optional[int] = ..., num_kept_blocks: _Optional[int] = ...) -> None: ...

class PinResult(_message.Message):
    __slots__ = ("num_pinned_blocks", "num_pinned_tokens", "expires_ms", "num_over_budget_blocks")
    NUM_PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_OVER_BUDGET_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_pinned_blocks: int
    num_pinned_tokens: int
    expires_ms: int
    num_over_budget_blocks: int
    def __init__(self, num_pinned_blocks: _Optional[int] = ..., num_pinned_tokens: _Optional[int] = ..., expires_ms: _Optional[int] = ..., num_over_budget_blocks: _Optional[int] = ...) -> None: ...

class UnpinResponse(_message.Message):
    __slots__ = ("num_unpinned_blocks",)
    NUM_UNPINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_unpinned_blocks: int
    def __init__(self, num_unpinned_blocks: _Optional[int] = ...) -> None: ...

class GetPageTableRequest(_message.Message):
    __slots__ = ("req_id",)
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    def __init__(self, req_id: _Optional[str] = ...) -> None: ...

class PageInfo(_message.Message):
    __slots__ = ("page_id", "ref_cnt", "block_hash", "pinned", "kind")
    PAGE_ID_FIELD_NUMBER: _ClassVar[int]
    REF_CNT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    page_id: int
    ref_cnt: int
    block_hash: str
    pinned: bool
    kind: str
    def __init__(self, page_id: _Optional[int] = ..., ref_cnt: _Optional[int] = ..., block_hash: _Optional[str] = ..., pinned: _Optional[bool] = ..., kind: _Optional[str] = ...) -> None: ...

class PageTable(_message.Message):
    __slots__ = ("req_id", "tenant", "worker_id", "epoch", "page_table", "pages", "num_committed_tokens", "num_prompt_tokens", "last_step_id", "page_size", "group_page_table", "group_pages")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PAGE_TABLE_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_COMMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUP_PAGE_TABLE_FIELD_NUMBER: _ClassVar[int]
    GROUP_PAGES_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    tenant: str
    worker_id: str
    epoch: int
    page_table: _containers.RepeatedScalarFieldContainer[int]
    pages: _containers.RepeatedCompositeFieldContainer[PageInfo]
    num_committed_tokens: int
    num_prompt_tokens: int
    last_step_id: int
    page_size: int
    group_page_table: _containers.RepeatedScalarFieldContainer[int]
    group_pages: _containers.RepeatedCompositeFieldContainer[PageInfo]
    def __init__(self, req_id: _Optional[str] = ..., tenant: _Optional[str] = ..., worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., page_table: _Optional[_Iterable[int]] = ..., pages: _Optional[_Iterable[_Union[PageInfo, _Mapping]]] = ..., num_committed_tokens: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., last_step_id: _Optional[int] = ..., page_size: _Optional[int] = ..., group_page_table: _Optional[_Iterable[int]] = ..., group_pages: _Optional[_Iterable[_Union[PageInfo, _Mapping]]] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("confirm", "force")
    CONFIRM_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    confirm: bool
    force: bool
    def __init__(self, confirm: _Optional[bool] = ..., force: _Optional[bool] = ...) -> None: ...

class ForgetWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "force")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    force: bool
    def __init__(self, worker_id: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class DropResult(_message.Message):
    __slots__ = ("num_dropped_requests", "num_dropped_blocks")
    NUM_DROPPED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_DROPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_dropped_requests: int
    num_dropped_blocks: int
    def __init__(self, num_dropped_requests: _Optional[int] = ..., num_dropped_blocks: _Optional[int] = ...) -> None: ...
