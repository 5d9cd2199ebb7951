from hetero_pd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WatchEventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WATCH_EVENT_TYPE_UNSPECIFIED: _ClassVar[WatchEventType]
    WATCH_EVENT_TYPE_SNAPSHOT: _ClassVar[WatchEventType]
    WATCH_EVENT_TYPE_SNAPSHOT_END: _ClassVar[WatchEventType]
    WATCH_EVENT_TYPE_PUT: _ClassVar[WatchEventType]
    WATCH_EVENT_TYPE_LOAD: _ClassVar[WatchEventType]
    WATCH_EVENT_TYPE_DELETE: _ClassVar[WatchEventType]
    WATCH_EVENT_TYPE_RESYNC: _ClassVar[WatchEventType]
    WATCH_EVENT_TYPE_BOOKMARK: _ClassVar[WatchEventType]
WATCH_EVENT_TYPE_UNSPECIFIED: WatchEventType
WATCH_EVENT_TYPE_SNAPSHOT: WatchEventType
WATCH_EVENT_TYPE_SNAPSHOT_END: WatchEventType
WATCH_EVENT_TYPE_PUT: WatchEventType
WATCH_EVENT_TYPE_LOAD: WatchEventType
WATCH_EVENT_TYPE_DELETE: WatchEventType
WATCH_EVENT_TYPE_RESYNC: WatchEventType
WATCH_EVENT_TYPE_BOOKMARK: WatchEventType

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("capability", "credential", "lease_ttl_ms")
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    capability: _common_pb2.WorkerCapability
    credential: str
    lease_ttl_ms: int
    def __init__(self, capability: _Optional[_Union[_common_pb2.WorkerCapability, _Mapping]] = ..., credential: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("worker_id", "lease_ttl_ms", "heartbeat_interval_ms", "credential", "revision", "changed")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    lease_ttl_ms: int
    heartbeat_interval_ms: int
    credential: str
    revision: int
    changed: bool
    def __init__(self, worker_id: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ..., heartbeat_interval_ms: _Optional[int] = ..., credential: _Optional[str] = ..., revision: _Optional[int] = ..., changed: bool = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "credential", "load", "reported_health", "health_reason", "acked_directive_ids")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    REPORTED_HEALTH_FIELD_NUMBER: _ClassVar[int]
    HEALTH_REASON_FIELD_NUMBER: _ClassVar[int]
    ACKED_DIRECTIVE_IDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    credential: str
    load: _common_pb2.LoadReport
    reported_health: _common_pb2.HealthState
    health_reason: str
    acked_directive_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, worker_id: _Optional[str] = ..., credential: _Optional[str] = ..., load: _Optional[_Union[_common_pb2.LoadReport, _Mapping]] = ..., reported_health: _Optional[_Union[_common_pb2.HealthState, str]] = ..., health_reason: _Optional[str] = ..., acked_directive_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_ttl_ms", "lease_expires_at_unix_ms", "directives", "health")
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    DIRECTIVES_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_ms: int
    lease_expires_at_unix_ms: int
    directives: _containers.RepeatedCompositeFieldContainer[_common_pb2.Directive]
    health: _common_pb2.HealthState
    def __init__(self, lease_ttl_ms: _Optional[int] = ..., lease_expires_at_unix_ms: _Optional[int] = ..., directives: _Optional[_Iterable[_Union[_common_pb2.Directive, _Mapping]]] = ..., health: _Optional[_Union[_common_pb2.HealthState, str]] = ...) -> None: ...

class StreamHeartbeatsRequest(_message.Message):
    __slots__ = ("worker_id", "credential", "load", "reported_health", "health_reason", "acked_directive_ids")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    REPORTED_HEALTH_FIELD_NUMBER: _ClassVar[int]
    HEALTH_REASON_FIELD_NUMBER: _ClassVar[int]
    ACKED_DIRECTIVE_IDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    credential: str
    load: _common_pb2.LoadReport
    reported_health: _common_pb2.HealthState
    health_reason: str
    acked_directive_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, worker_id: _Optional[str] = ..., credential: _Optional[str] = ..., load: _Optional[_Union[_common_pb2.LoadReport, _Mapping]] = ..., reported_health: _Optional[_Union[_common_pb2.HealthState, str]] = ..., health_reason: _Optional[str] = ..., acked_directive_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class StreamHeartbeatsResponse(_message.Message):
    __slots__ = ("ack", "directive")
    ACK_FIELD_NUMBER: _ClassVar[int]
    DIRECTIVE_FIELD_NUMBER: _ClassVar[int]
    ack: LeaseAck
    directive: _common_pb2.Directive
    def __init__(self, ack: _Optional[_Union[LeaseAck, _Mapping]] = ..., directive: _Optional[_Union[_common_pb2.Directive, _Mapping]] = ...) -> None: ...

class LeaseAck(_message.Message):
    __slots__ = ("lease_ttl_ms", "heartbeat_interval_ms", "lease_expires_at_unix_ms")
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_ms: int
    heartbeat_interval_ms: int
    lease_expires_at_unix_ms: int
    def __init__(self, lease_ttl_ms: _Optional[int] = ..., heartbeat_interval_ms: _Optional[int] = ..., lease_expires_at_unix_ms: _Optional[int] = ...) -> None: ...

class DeregisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "credential")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    credential: str
    def __init__(self, worker_id: _Optional[str] = ..., credential: _Optional[str] = ...) -> None: ...

class DeregisterWorkerResponse(_message.Message):
    __slots__ = ("revision",)
    REVISION_FIELD_NUMBER: _ClassVar[int]
    revision: int
    def __init__(self, revision: _Optional[int] = ...) -> None: ...

class DrainWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "reason", "credential")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    reason: str
    credential: str
    def __init__(self, worker_id: _Optional[str] = ..., reason: _Optional[str] = ..., credential: _Optional[str] = ...) -> None: ...

class DrainWorkerResponse(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: _common_pb2.Worker
    def __init__(self, worker: _Optional[_Union[_common_pb2.Worker, _Mapping]] = ...) -> None: ...

class CordonWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "reason")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    reason: str
    def __init__(self, worker_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CordonWorkerResponse(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: _common_pb2.Worker
    def __init__(self, worker: _Optional[_Union[_common_pb2.Worker, _Mapping]] = ...) -> None: ...

class UncordonWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class UncordonWorkerResponse(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: _common_pb2.Worker
    def __init__(self, worker: _Optional[_Union[_common_pb2.Worker, _Mapping]] = ...) -> None: ...

class GetWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class GetWorkerResponse(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: _common_pb2.Worker
    def __init__(self, worker: _Optional[_Union[_common_pb2.Worker, _Mapping]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("pool_id", "model_id", "stage", "health", "labels", "page_size", "page_token")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    model_id: str
    stage: _common_pb2.Stage
    health: _common_pb2.HealthState
    labels: _containers.ScalarMap[str, str]
    page_size: int
    page_token: str
    def __init__(self, pool_id: _Optional[str] = ..., model_id: _Optional[str] = ..., stage: _Optional[_Union[_common_pb2.Stage, str]] = ..., health: _Optional[_Union[_common_pb2.HealthState, str]] = ..., labels: _Optional[_Mapping[str, str]] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers", "next_page_token", "revision")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[_common_pb2.Worker]
    next_page_token: str
    revision: int
    def __init__(self, workers: _Optional[_Iterable[_Union[_common_pb2.Worker, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., revision: _Optional[int] = ...) -> None: ...

class ListPoolsRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class ListPoolsResponse(_message.Message):
    __slots__ = ("pools", "revision")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[_common_pb2.PoolSummary]
    revision: int
    def __init__(self, pools: _Optional[_Iterable[_Union[_common_pb2.PoolSummary, _Mapping]]] = ..., revision: _Optional[int] = ...) -> None: ...

class WatchWorkersRequest(_message.Message):
    __slots__ = ("from_revision", "model_id", "event_types")
    FROM_REVISION_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_TYPES_FIELD_NUMBER: _ClassVar[int]
    from_revision: int
    model_id: str
    event_types: _containers.RepeatedScalarFieldContainer[WatchEventType]
    def __init__(self, from_revision: _Optional[int] = ..., model_id: _Optional[str] = ..., event_types: _Optional[_Iterable[_Union[WatchEventType, str]]] = ...) -> None: ...

class WatchWorkersResponse(_message.Message):
    __slots__ = ("events", "sent_at_unix_ms")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[WorkerEvent]
    sent_at_unix_ms: int
    def __init__(self, events: _Optional[_Iterable[_Union[WorkerEvent, _Mapping]]] = ..., sent_at_unix_ms: _Optional[int] = ...) -> None: ...

class WorkerEvent(_message.Message):
    __slots__ = ("type", "revision", "worker_id", "worker", "reason")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    type: WatchEventType
    revision: int
    worker_id: str
    worker: _common_pb2.Worker
    reason: str
    def __init__(self, type: _Optional[_Union[WatchEventType, str]] = ..., revision: _Optional[int] = ..., worker_id: _Optional[str] = ..., worker: _Optional[_Union[_common_pb2.Worker, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class SendDirectiveRequest(_message.Message):
    __slots__ = ("worker_id", "directive")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DIRECTIVE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    directive: _common_pb2.Directive
    def __init__(self, worker_id: _Optional[str] = ..., directive: _Optional[_Union[_common_pb2.Directive, _Mapping]] = ...) -> None: ...

class SendDirectiveResponse(_message.Message):
    __slots__ = ("directive_id", "delivered_now")
    DIRECTIVE_ID_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_NOW_FIELD_NUMBER: _ClassVar[int]
    directive_id: str
    delivered_now: bool
    def __init__(self, directive_id: _Optional[str] = ..., delivered_now: bool = ...) -> None: ...

class KvCacheEvent(_message.Message):
    __slots__ = ("stored", "removed", "all_cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALL_CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: KvBlocks
    removed: KvBlocks
    all_cleared: bool
    def __init__(self, stored: _Optional[_Union[KvBlocks, _Mapping]] = ..., removed: _Optional[_Union[KvBlocks, _Mapping]] = ..., all_cleared: bool = ...) -> None: ...

class KvBlocks(_message.Message):
    __slots__ = ("block_hashes", "from_prompt_start")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    FROM_PROMPT_START_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    from_prompt_start: bool
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., from_prompt_start: bool = ...) -> None: ...

class ReportKvEventsRequest(_message.Message):
    __slots__ = ("worker_id", "credential", "block_tokens", "events")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    credential: str
    block_tokens: int
    events: _containers.RepeatedCompositeFieldContainer[KvCacheEvent]
    def __init__(self, worker_id: _Optional[str] = ..., credential: _Optional[str] = ..., block_tokens: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KvCacheEvent, _Mapping]]] = ...) -> None: ...

class ReportKvEventsResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    def __init__(self, accepted: _Optional[int] = ...) -> None: ...
