from kvserve.v1 import common_pb2 as _common_pb2
from kvserve.v1 import kvmanager_pb2 as _kvmanager_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StepItem(_message.Message):
    __slots__ = ("req_id", "token_ids", "start_pos", "page_table", "sample", "sampling", "traceparent", "store_loads", "group_page_table")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    PAGE_TABLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    STORE_LOADS_FIELD_NUMBER: _ClassVar[int]
    GROUP_PAGE_TABLE_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    start_pos: int
    page_table: _containers.RepeatedScalarFieldContainer[int]
    sample: bool
    sampling: _common_pb2.SamplingParams
    traceparent: str
    store_loads: _containers.RepeatedCompositeFieldContainer[_kvmanager_pb2.StoreLoad]
    group_page_table: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, req_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., start_pos: _Optional[int] = ..., page_table: _Optional[_Iterable[int]] = ..., sample: _Optional[bool] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., traceparent: _Optional[str] = ..., store_loads: _Optional[_Iterable[_Union[_kvmanager_pb2.StoreLoad, _Mapping]]] = ..., group_page_table: _Optional[_Iterable[int]] = ...) -> None: ...

class StepBatch(_message.Message):
    __slots__ = ("items", "epoch", "store_writes")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STORE_WRITES_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[StepItem]
    epoch: int
    store_writes: _containers.RepeatedCompositeFieldContainer[_kvmanager_pb2.StoreWrite]
    def __init__(self, items: _Optional[_Iterable[_Union[StepItem, _Mapping]]] = ..., epoch: _Optional[int] = ..., store_writes: _Optional[_Iterable[_Union[_kvmanager_pb2.StoreWrite, _Mapping]]] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("req_id", "token_id", "logprob", "top_logprobs")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, req_id: _Optional[str] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class RejectedItem(_message.Message):
    __slots__ = ("req_id", "message", "invalid")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    INVALID_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    message: str
    invalid: bool
    def __init__(self, req_id: _Optional[str] = ..., message: _Optional[str] = ..., invalid: _Optional[bool] = ...) -> None: ...

class StepOutput(_message.Message):
    __slots__ = ("results", "num_tokens", "compute_ms", "rejected", "unloaded", "num_loaded_pages", "load_ms")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    UNLOADED_FIELD_NUMBER: _ClassVar[int]
    NUM_LOADED_PAGES_FIELD_NUMBER: _ClassVar[int]
    LOAD_MS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SampledToken]
    num_tokens: int
    compute_ms: float
    rejected: _containers.RepeatedCompositeFieldContainer[RejectedItem]
    unloaded: _containers.RepeatedScalarFieldContainer[str]
    num_loaded_pages: int
    load_ms: float
    def __init__(self, results: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., num_tokens: _Optional[int] = ..., compute_ms: _Optional[float] = ..., rejected: _Optional[_Iterable[_Union[RejectedItem, _Mapping]]] = ..., unloaded: _Optional[_Iterable[str]] = ..., num_loaded_pages: _Optional[int] = ..., load_ms: _Optional[float] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "epoch", "model_name", "model_fingerprint", "page_size", "num_pages", "kv_dtype", "bytes_per_token", "pool_bytes", "num_layers", "num_kv_heads", "num_heads", "head_dim", "vocab_size", "max_model_len", "eos_token_ids", "device", "attention_backend", "kv_scales", "sliding_window", "attention_sinks", "kv_store", "role", "sliding_group_pages", "sliding_group_window", "sliding_group_bytes_per_token")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
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
    model_name: str
    model_fingerprint: str
    page_size: int
    num_pages: int
    kv_dtype: str
    bytes_per_token: int
    pool_bytes: int
    num_layers: int
    num_kv_heads: int
    num_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    device: str
    attention_backend: str
    kv_scales: str
    sliding_window: int
    attention_sinks: int
    kv_store: bool
    role: str
    sliding_group_pages: int
    sliding_group_window: int
    sliding_group_bytes_per_token: int
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., model_name: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., page_size: _Optional[int] = ..., num_pages: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., bytes_per_token: _Optional[int] = ..., pool_bytes: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., num_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., device: _Optional[str] = ..., attention_backend: _Optional[str] = ..., kv_scales: _Optional[str] = ..., sliding_window: _Optional[int] = ..., attention_sinks: _Optional[int] = ..., kv_store: _Optional[bool] = ..., role: _Optional[str] = ..., sliding_group_pages: _Optional[int] = ..., sliding_group_window: _Optional[int] = ..., sliding_group_bytes_per_token: _Optional[int] = ...) -> None: ...

class PullOrder(_message.Message):
    __slots__ = ("req_id", "epoch", "source_worker_id", "source_epoch", "source_address", "lease_expires_ms", "loads", "traceparent")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SOURCE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_MS_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    epoch: int
    source_worker_id: str
    source_epoch: int
    source_address: str
    lease_expires_ms: int
    loads: _containers.RepeatedCompositeFieldContainer[_kvmanager_pb2.PeerLoad]
    traceparent: str
    def __init__(self, req_id: _Optional[str] = ..., epoch: _Optional[int] = ..., source_worker_id: _Optional[str] = ..., source_epoch: _Optional[int] = ..., source_address: _Optional[str] = ..., lease_expires_ms: _Optional[int] = ..., loads: _Optional[_Iterable[_Union[_kvmanager_pb2.PeerLoad, _Mapping]]] = ..., traceparent: _Optional[str] = ...) -> None: ...

class PullResult(_message.Message):
    __slots__ = ("num_pages", "num_bytes", "seconds", "error")
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    num_pages: int
    num_bytes: int
    seconds: float
    error: str
    def __init__(self, num_pages: _Optional[int] = ..., num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class ReadOrder(_message.Message):
    __slots__ = ("epoch", "lease_expires_ms", "pages")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_MS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    lease_expires_ms: int
    pages: _containers.RepeatedCompositeFieldContainer[_kvmanager_pb2.PeerLoad]
    def __init__(self, epoch: _Optional[int] = ..., lease_expires_ms: _Optional[int] = ..., pages: _Optional[_Iterable[_Union[_kvmanager_pb2.PeerLoad, _Mapping]]] = ...) -> None: ...

class PageFrame(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, values: _Optional[_Iterable[bytes]] = ...) -> None: ...
