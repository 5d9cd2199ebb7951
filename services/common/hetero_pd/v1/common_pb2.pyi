from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Stage(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STAGE_UNSPECIFIED: _ClassVar[Stage]
    STAGE_PREFILL: _ClassVar[Stage]
    STAGE_DECODE: _ClassVar[Stage]

class HealthState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HEALTH_STATE_UNSPECIFIED: _ClassVar[HealthState]
    HEALTH_STATE_HEALTHY: _ClassVar[HealthState]
    HEALTH_STATE_SUSPECT: _ClassVar[HealthState]
    HEALTH_STATE_EXPIRED: _ClassVar[HealthState]
    HEALTH_STATE_DRAINING: _ClassVar[HealthState]
    HEALTH_STATE_CORDONED: _ClassVar[HealthState]
    HEALTH_STATE_UNHEALTHY: _ClassVar[HealthState]

class KvDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_DTYPE_UNSPECIFIED: _ClassVar[KvDtype]
    KV_DTYPE_FP32: _ClassVar[KvDtype]
    KV_DTYPE_FP16: _ClassVar[KvDtype]
    KV_DTYPE_BF16: _ClassVar[KvDtype]
    KV_DTYPE_FP8_E4M3: _ClassVar[KvDtype]
    KV_DTYPE_FP8_E5M2: _ClassVar[KvDtype]
    KV_DTYPE_INT8: _ClassVar[KvDtype]

class KvLayout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_LAYOUT_UNSPECIFIED: _ClassVar[KvLayout]
    KV_LAYOUT_PAGED_NHD: _ClassVar[KvLayout]
    KV_LAYOUT_PAGED_HND: _ClassVar[KvLayout]
    KV_LAYOUT_CONTIGUOUS: _ClassVar[KvLayout]

class DirectiveKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DIRECTIVE_KIND_UNSPECIFIED: _ClassVar[DirectiveKind]
    DIRECTIVE_KIND_DRAIN: _ClassVar[DirectiveKind]
    DIRECTIVE_KIND_SET_MAX_BATCH_SIZE: _ClassVar[DirectiveKind]
    DIRECTIVE_KIND_MIGRATE: _ClassVar[DirectiveKind]
    DIRECTIVE_KIND_THROTTLE: _ClassVar[DirectiveKind]
STAGE_UNSPECIFIED: Stage
STAGE_PREFILL: Stage
STAGE_DECODE: Stage
HEALTH_STATE_UNSPECIFIED: HealthState
HEALTH_STATE_HEALTHY: HealthState
HEALTH_STATE_SUSPECT: HealthState
HEALTH_STATE_EXPIRED: HealthState
HEALTH_STATE_DRAINING: HealthState
HEALTH_STATE_CORDONED: HealthState
HEALTH_STATE_UNHEALTHY: HealthState
KV_DTYPE_UNSPECIFIED: KvDtype
KV_DTYPE_FP32: KvDtype
KV_DTYPE_FP16: KvDtype
KV_DTYPE_BF16: KvDtype
KV_DTYPE_FP8_E4M3: KvDtype
KV_DTYPE_FP8_E5M2: KvDtype
KV_DTYPE_INT8: KvDtype
KV_LAYOUT_UNSPECIFIED: KvLayout
KV_LAYOUT_PAGED_NHD: KvLayout
KV_LAYOUT_PAGED_HND: KvLayout
KV_LAYOUT_CONTIGUOUS: KvLayout
DIRECTIVE_KIND_UNSPECIFIED: DirectiveKind
DIRECTIVE_KIND_DRAIN: DirectiveKind
DIRECTIVE_KIND_SET_MAX_BATCH_SIZE: DirectiveKind
DIRECTIVE_KIND_MIGRATE: DirectiveKind
DIRECTIVE_KIND_THROTTLE: DirectiveKind

class KvFormat(_message.Message):
    __slots__ = ("dtype", "layout", "block_size_tokens", "num_layers", "num_kv_heads", "head_dim", "tp_size", "attention_backend", "model_revision")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    MODEL_REVISION_FIELD_NUMBER: _ClassVar[int]
    dtype: KvDtype
    layout: KvLayout
    block_size_tokens: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_size: int
    attention_backend: str
    model_revision: str
    def __init__(self, dtype: _Optional[_Union[KvDtype, str]] = ..., layout: _Optional[_Union[KvLayout, str]] = ..., block_size_tokens: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., tp_size: _Optional[int] = ..., attention_backend: _Optional[str] = ..., model_revision: _Optional[str] = ...) -> None: ...

class NetworkLocation(_message.Message):
    __slots__ = ("zone", "rack", "host", "nic_gbps")
    ZONE_FIELD_NUMBER: _ClassVar[int]
    RACK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    NIC_GBPS_FIELD_NUMBER: _ClassVar[int]
    zone: str
    rack: str
    host: str
    nic_gbps: float
    def __init__(self, zone: _Optional[str] = ..., rack: _Optional[str] = ..., host: _Optional[str] = ..., nic_gbps: _Optional[float] = ...) -> None: ...

class WorkerCapability(_message.Message):
    __slots__ = ("worker_id", "pool_id", "endpoint", "stages", "model_id", "model_revision", "engine", "engine_version", "gpu_type", "gpu_count", "tp_size", "pp_size", "peak_tflops", "hbm_gbps", "kv_memory_total_bytes", "max_batch_size", "kv_format", "network", "labels", "max_context_tokens")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_REVISION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    GPU_TYPE_FIELD_NUMBER: _ClassVar[int]
    GPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PEAK_TFLOPS_FIELD_NUMBER: _ClassVar[int]
    HBM_GBPS_FIELD_NUMBER: _ClassVar[int]
    KV_MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_FORMAT_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    pool_id: str
    endpoint: str
    stages: _containers.RepeatedScalarFieldContainer[Stage]
    model_id: str
    model_revision: str
    engine: str
    engine_version: str
    gpu_type: str
    gpu_count: int
    tp_size: int
    pp_size: int
    peak_tflops: float
    hbm_gbps: float
    kv_memory_total_bytes: int
    max_batch_size: int
    kv_format: KvFormat
    network: NetworkLocation
    labels: _containers.ScalarMap[str, str]
    max_context_tokens: int
    def __init__(self, worker_id: _Optional[str] = ..., pool_id: _Optional[str] = ..., endpoint: _Optional[str] = ..., stages: _Optional[_Iterable[_Union[Stage, str]]] = ..., model_id: _Optional[str] = ..., model_revision: _Optional[str] = ..., engine: _Optional[str] = ..., engine_version: _Optional[str] = ..., gpu_type: _Optional[str] = ..., gpu_count: _Optional[int] = ..., tp_size: _Optional[int] = ..., pp_size: _Optional[int] = ..., peak_tflops: _Optional[float] = ..., hbm_gbps: _Optional[float] = ..., kv_memory_total_bytes: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., kv_format: _Optional[_Union[KvFormat, _Mapping]] = ..., network: _Optional[_Union[NetworkLocation, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., max_context_tokens: _Optional[int] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("gpu_util", "memory_util", "kv_blocks_free", "kv_blocks_total", "queue_depth", "queue_max", "running_prefills", "batch_size", "itl_p50_ms", "itl_p99_ms", "itl_trend_ms_per_s", "prefill_tokens_per_s", "reported_at_unix_ms", "prefix_cache_hit_rate", "prefill_busy")
    GPU_UTIL_FIELD_NUMBER: _ClassVar[int]
    MEMORY_UTIL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MAX_FIELD_NUMBER: _ClassVar[int]
    RUNNING_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    ITL_P50_MS_FIELD_NUMBER: _ClassVar[int]
    ITL_P99_MS_FIELD_NUMBER: _ClassVar[int]
    ITL_TREND_MS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    REPORTED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_BUSY_FIELD_NUMBER: _ClassVar[int]
    gpu_util: float
    memory_util: float
    kv_blocks_free: int
    kv_blocks_total: int
    queue_depth: int
    queue_max: int
    running_prefills: int
    batch_size: int
    itl_p50_ms: float
    itl_p99_ms: float
    itl_trend_ms_per_s: float
    prefill_tokens_per_s: float
    reported_at_unix_ms: int
    prefix_cache_hit_rate: float
    prefill_busy: float
    def __init__(self, gpu_util: _Optional[float] = ..., memory_util: _Optional[float] = ..., kv_blocks_free: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., queue_depth: _Optional[int] = ..., queue_max: _Optional[int] = ..., running_prefills: _Optional[int] = ..., batch_size: _Optional[int] = ..., itl_p50_ms: _Optional[float] = ..., itl_p99_ms: _Optional[float] = ..., itl_trend_ms_per_s: _Optional[float] = ..., prefill_tokens_per_s: _Optional[float] = ..., reported_at_unix_ms: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ..., prefill_busy: _Optional[float] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("health", "health_reason", "draining", "cordoned", "registered_at_unix_ms", "last_heartbeat_unix_ms", "lease_expires_at_unix_ms", "lease_ttl_ms")
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    HEALTH_REASON_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    CORDONED_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    health: HealthState
    health_reason: str
    draining: bool
    cordoned: bool
    registered_at_unix_ms: int
    last_heartbeat_unix_ms: int
    lease_expires_at_unix_ms: int
    lease_ttl_ms: int
    def __init__(self, health: _Optional[_Union[HealthState, str]] = ..., health_reason: _Optional[str] = ..., draining: bool = ..., cordoned: bool = ..., registered_at_unix_ms: _Optional[int] = ..., last_heartbeat_unix_ms: _Optional[int] = ..., lease_expires_at_unix_ms: _Optional[int] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class Worker(_message.Message):
    __slots__ = ("capability", "status", "load", "revision")
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    capability: WorkerCapability
    status: WorkerStatus
    load: LoadReport
    revision: int
    def __init__(self, capability: _Optional[_Union[WorkerCapability, _Mapping]] = ..., status: _Optional[_Union[WorkerStatus, _Mapping]] = ..., load: _Optional[_Union[LoadReport, _Mapping]] = ..., revision: _Optional[int] = ...) -> None: ...

class PoolSummary(_message.Message):
    __slots__ = ("pool_id", "model_id", "stages", "gpu_type", "worker_count", "workers_by_health", "kv_memory_total_bytes", "gpu_count", "peak_tflops_total", "gpu_util_mean", "memory_util_mean", "queue_depth_total", "batch_size_total", "max_batch_size_total")
    class WorkersByHealthEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    GPU_TYPE_FIELD_NUMBER: _ClassVar[int]
    WORKER_COUNT_FIELD_NUMBER: _ClassVar[int]
    WORKERS_BY_HEALTH_FIELD_NUMBER: _ClassVar[int]
    KV_MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    PEAK_TFLOPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GPU_UTIL_MEAN_FIELD_NUMBER: _ClassVar[int]
    MEMORY_UTIL_MEAN_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_TOTAL_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    model_id: str
    stages: _containers.RepeatedScalarFieldContainer[Stage]
    gpu_type: str
    worker_count: int
    workers_by_health: _containers.ScalarMap[str, int]
    kv_memory_total_bytes: int
    gpu_count: int
    peak_tflops_total: float
    gpu_util_mean: float
    memory_util_mean: float
    queue_depth_total: int
    batch_size_total: int
    max_batch_size_total: int
    def __init__(self, pool_id: _Optional[str] = ..., model_id: _Optional[str] = ..., stages: _Optional[_Iterable[_Union[Stage, str]]] = ..., gpu_type: _Optional[str] = ..., worker_count: _Optional[int] = ..., workers_by_health: _Optional[_Mapping[str, int]] = ..., kv_memory_total_bytes: _Optional[int] = ..., gpu_count: _Optional[int] = ..., peak_tflops_total: _Optional[float] = ..., gpu_util_mean: _Optional[float] = ..., memory_util_mean: _Optional[float] = ..., queue_depth_total: _Optional[int] = ..., batch_size_total: _Optional[int] = ..., max_batch_size_total: _Optional[int] = ...) -> None: ...

class Directive(_message.Message):
    __slots__ = ("directive_id", "kind", "max_batch_size", "target_worker_id", "fraction", "reason", "created_at_unix_ms", "issuer")
    DIRECTIVE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    TARGET_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FRACTION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ISSUER_FIELD_NUMBER: _ClassVar[int]
    directive_id: str
    kind: DirectiveKind
    max_batch_size: int
    target_worker_id: str
    fraction: float
    reason: str
    created_at_unix_ms: int
    issuer: str
    def __init__(self, directive_id: _Optional[str] = ..., kind: _Optional[_Union[DirectiveKind, str]] = ..., max_batch_size: _Optional[int] = ..., target_worker_id: _Optional[str] = ..., fraction: _Optional[float] = ..., reason: _Optional[str] = ..., created_at_unix_ms: _Optional[int] = ..., issuer: _Optional[str] = ...) -> None: ...
