from hetero_pd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CompatibilityVerdict(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPATIBILITY_VERDICT_UNSPECIFIED: _ClassVar[CompatibilityVerdict]
    COMPATIBILITY_VERDICT_COMPATIBLE: _ClassVar[CompatibilityVerdict]
    COMPATIBILITY_VERDICT_CONVERTIBLE: _ClassVar[CompatibilityVerdict]
    COMPATIBILITY_VERDICT_INCOMPATIBLE: _ClassVar[CompatibilityVerdict]

class SessionState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_STATE_UNSPECIFIED: _ClassVar[SessionState]
    SESSION_STATE_NEGOTIATED: _ClassVar[SessionState]
    SESSION_STATE_RESERVED: _ClassVar[SessionState]
    SESSION_STATE_TRANSFERRING: _ClassVar[SessionState]
    SESSION_STATE_COMPLETE: _ClassVar[SessionState]
    SESSION_STATE_FAILED: _ClassVar[SessionState]
    SESSION_STATE_EXPIRED: _ClassVar[SessionState]
    SESSION_STATE_ABORTED: _ClassVar[SessionState]
COMPATIBILITY_VERDICT_UNSPECIFIED: CompatibilityVerdict
COMPATIBILITY_VERDICT_COMPATIBLE: CompatibilityVerdict
COMPATIBILITY_VERDICT_CONVERTIBLE: CompatibilityVerdict
COMPATIBILITY_VERDICT_INCOMPATIBLE: CompatibilityVerdict
SESSION_STATE_UNSPECIFIED: SessionState
SESSION_STATE_NEGOTIATED: SessionState
SESSION_STATE_RESERVED: SessionState
SESSION_STATE_TRANSFERRING: SessionState
SESSION_STATE_COMPLETE: SessionState
SESSION_STATE_FAILED: SessionState
SESSION_STATE_EXPIRED: SessionState
SESSION_STATE_ABORTED: SessionState

class ConversionStep(_message.Message):
    __slots__ = ("kind", "detail", "cost_ms_per_gib", "lossy")
    KIND_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    COST_MS_PER_GIB_FIELD_NUMBER: _ClassVar[int]
    LOSSY_FIELD_NUMBER: _ClassVar[int]
    kind: str
    detail: str
    cost_ms_per_gib: float
    lossy: bool
    def __init__(self, kind: _Optional[str] = ..., detail: _Optional[str] = ..., cost_ms_per_gib: _Optional[float] = ..., lossy: bool = ...) -> None: ...

class Negotiation(_message.Message):
    __slots__ = ("verdict", "reasons", "details", "steps", "cost_ms_per_gib")
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    COST_MS_PER_GIB_FIELD_NUMBER: _ClassVar[int]
    verdict: CompatibilityVerdict
    reasons: _containers.RepeatedScalarFieldContainer[str]
    details: _containers.RepeatedScalarFieldContainer[str]
    steps: _containers.RepeatedCompositeFieldContainer[ConversionStep]
    cost_ms_per_gib: float
    def __init__(self, verdict: _Optional[_Union[CompatibilityVerdict, str]] = ..., reasons: _Optional[_Iterable[str]] = ..., details: _Optional[_Iterable[str]] = ..., steps: _Optional[_Iterable[_Union[ConversionStep, _Mapping]]] = ..., cost_ms_per_gib: _Optional[float] = ...) -> None: ...

class NegotiateRequest(_message.Message):
    __slots__ = ("source_worker_id", "source_format", "destination_worker_id", "destination_format", "kv_bytes")
    SOURCE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FORMAT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    source_worker_id: str
    source_format: _common_pb2.KvFormat
    destination_worker_id: str
    destination_format: _common_pb2.KvFormat
    kv_bytes: int
    def __init__(self, source_worker_id: _Optional[str] = ..., source_format: _Optional[_Union[_common_pb2.KvFormat, _Mapping]] = ..., destination_worker_id: _Optional[str] = ..., destination_format: _Optional[_Union[_common_pb2.KvFormat, _Mapping]] = ..., kv_bytes: _Optional[int] = ...) -> None: ...

class NegotiateResponse(_message.Message):
    __slots__ = ("negotiation", "source_format", "destination_format", "conversion_ms")
    NEGOTIATION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FORMAT_FIELD_NUMBER: _ClassVar[int]
    CONVERSION_MS_FIELD_NUMBER: _ClassVar[int]
    negotiation: Negotiation
    source_format: _common_pb2.KvFormat
    destination_format: _common_pb2.KvFormat
    conversion_ms: float
    def __init__(self, negotiation: _Optional[_Union[Negotiation, _Mapping]] = ..., source_format: _Optional[_Union[_common_pb2.KvFormat, _Mapping]] = ..., destination_format: _Optional[_Union[_common_pb2.KvFormat, _Mapping]] = ..., conversion_ms: _Optional[float] = ...) -> None: ...

class GetCompatibilityMatrixRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class WorkerPair(_message.Message):
    __slots__ = ("prefill_worker_id", "decode_worker_id", "negotiation")
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NEGOTIATION_FIELD_NUMBER: _ClassVar[int]
    prefill_worker_id: str
    decode_worker_id: str
    negotiation: Negotiation
    def __init__(self, prefill_worker_id: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., negotiation: _Optional[_Union[Negotiation, _Mapping]] = ...) -> None: ...

class GetCompatibilityMatrixResponse(_message.Message):
    __slots__ = ("model_id", "prefill_worker_ids", "decode_worker_ids", "pairs", "registry_revision")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    PAIRS_FIELD_NUMBER: _ClassVar[int]
    REGISTRY_REVISION_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    prefill_worker_ids: _containers.RepeatedScalarFieldContainer[str]
    decode_worker_ids: _containers.RepeatedScalarFieldContainer[str]
    pairs: _containers.RepeatedCompositeFieldContainer[WorkerPair]
    registry_revision: int
    def __init__(self, model_id: _Optional[str] = ..., prefill_worker_ids: _Optional[_Iterable[str]] = ..., decode_worker_ids: _Optional[_Iterable[str]] = ..., pairs: _Optional[_Iterable[_Union[WorkerPair, _Mapping]]] = ..., registry_revision: _Optional[int] = ...) -> None: ...

class SessionCaller(_message.Message):
    __slots__ = ("worker_id", "credential", "scheduler_token", "gateway_token")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_TOKEN_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    credential: str
    scheduler_token: str
    gateway_token: str
    def __init__(self, worker_id: _Optional[str] = ..., credential: _Optional[str] = ..., scheduler_token: _Optional[str] = ..., gateway_token: _Optional[str] = ...) -> None: ...

class KvSession(_message.Message):
    __slots__ = ("session_id", "request_id", "source_worker_id", "destination_worker_id", "state", "negotiation", "expected_bytes", "bytes_done", "created_at_unix_ms", "updated_at_unix_ms", "deadline_unix_ms", "lease_expires_at_unix_ms", "lease_ttl_ms", "reason", "version", "updated_by")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NEGOTIATION_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPDATED_BY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    request_id: str
    source_worker_id: str
    destination_worker_id: str
    state: SessionState
    negotiation: Negotiation
    expected_bytes: int
    bytes_done: int
    created_at_unix_ms: int
    updated_at_unix_ms: int
    deadline_unix_ms: int
    lease_expires_at_unix_ms: int
    lease_ttl_ms: int
    reason: str
    version: int
    updated_by: str
    def __init__(self, session_id: _Optional[str] = ..., request_id: _Optional[str] = ..., source_worker_id: _Optional[str] = ..., destination_worker_id: _Optional[str] = ..., state: _Optional[_Union[SessionState, str]] = ..., negotiation: _Optional[_Union[Negotiation, _Mapping]] = ..., expected_bytes: _Optional[int] = ..., bytes_done: _Optional[int] = ..., created_at_unix_ms: _Optional[int] = ..., updated_at_unix_ms: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ..., lease_expires_at_unix_ms: _Optional[int] = ..., lease_ttl_ms: _Optional[int] = ..., reason: _Optional[str] = ..., version: _Optional[int] = ..., updated_by: _Optional[str] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("request_id", "source_worker_id", "destination_worker_id", "expected_bytes", "deadline_ms", "lease_ttl_ms", "caller")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    CALLER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    source_worker_id: str
    destination_worker_id: str
    expected_bytes: int
    deadline_ms: int
    lease_ttl_ms: int
    caller: SessionCaller
    def __init__(self, request_id: _Optional[str] = ..., source_worker_id: _Optional[str] = ..., destination_worker_id: _Optional[str] = ..., expected_bytes: _Optional[int] = ..., deadline_ms: _Optional[int] = ..., lease_ttl_ms: _Optional[int] = ..., caller: _Optional[_Union[SessionCaller, _Mapping]] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session", "created")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    session: KvSession
    created: bool
    def __init__(self, session: _Optional[_Union[KvSession, _Mapping]] = ..., created: bool = ...) -> None: ...

class ReportProgressRequest(_message.Message):
    __slots__ = ("session_id", "caller", "bytes_done", "state", "reason")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CALLER_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    caller: SessionCaller
    bytes_done: int
    state: SessionState
    reason: str
    def __init__(self, session_id: _Optional[str] = ..., caller: _Optional[_Union[SessionCaller, _Mapping]] = ..., bytes_done: _Optional[int] = ..., state: _Optional[_Union[SessionState, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class ReportProgressResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: KvSession
    def __init__(self, session: _Optional[_Union[KvSession, _Mapping]] = ...) -> None: ...

class CompleteSessionRequest(_message.Message):
    __slots__ = ("session_id", "caller", "all_bytes_arrived")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CALLER_FIELD_NUMBER: _ClassVar[int]
    ALL_BYTES_ARRIVED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    caller: SessionCaller
    all_bytes_arrived: bool
    def __init__(self, session_id: _Optional[str] = ..., caller: _Optional[_Union[SessionCaller, _Mapping]] = ..., all_bytes_arrived: bool = ...) -> None: ...

class CompleteSessionResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: KvSession
    def __init__(self, session: _Optional[_Union[KvSession, _Mapping]] = ...) -> None: ...

class AbortSessionRequest(_message.Message):
    __slots__ = ("session_id", "caller", "reason")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CALLER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    caller: SessionCaller
    reason: str
    def __init__(self, session_id: _Optional[str] = ..., caller: _Optional[_Union[SessionCaller, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortSessionResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: KvSession
    def __init__(self, session: _Optional[_Union[KvSession, _Mapping]] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id", "request_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    request_id: str
    def __init__(self, session_id: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class GetSessionResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: KvSession
    def __init__(self, session: _Optional[_Union[KvSession, _Mapping]] = ...) -> None: ...

class WatchSessionRequest(_message.Message):
    __slots__ = ("session_id", "request_id", "from_version")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_VERSION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    request_id: str
    from_version: int
    def __init__(self, session_id: _Optional[str] = ..., request_id: _Optional[str] = ..., from_version: _Optional[int] = ...) -> None: ...

class WatchSessionResponse(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: KvSession
    def __init__(self, session: _Optional[_Union[KvSession, _Mapping]] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("state", "worker_id", "page_size", "page_token")
    STATE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    state: SessionState
    worker_id: str
    page_size: int
    page_token: str
    def __init__(self, state: _Optional[_Union[SessionState, str]] = ..., worker_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions", "next_page_token")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[KvSession]
    next_page_token: str
    def __init__(self, sessions: _Optional[_Iterable[_Union[KvSession, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...
