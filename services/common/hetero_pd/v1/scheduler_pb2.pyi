from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ExecutionMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXECUTION_MODE_UNSPECIFIED: _ClassVar[ExecutionMode]
    EXECUTION_MODE_TRANSFER: _ClassVar[ExecutionMode]
    EXECUTION_MODE_RECOMPUTE: _ClassVar[ExecutionMode]
    EXECUTION_MODE_SAME_POOL: _ClassVar[ExecutionMode]

class ResourceNeed(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESOURCE_NEED_UNSPECIFIED: _ClassVar[ResourceNeed]
    RESOURCE_NEED_PREFILL: _ClassVar[ResourceNeed]
    RESOURCE_NEED_DECODE: _ClassVar[ResourceNeed]
    RESOURCE_NEED_SHARED: _ClassVar[ResourceNeed]

class RouteDecision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUTE_DECISION_UNSPECIFIED: _ClassVar[RouteDecision]
    ROUTE_DECISION_PRIMARY: _ClassVar[RouteDecision]
    ROUTE_DECISION_REROUTE: _ClassVar[RouteDecision]
    ROUTE_DECISION_REJECT: _ClassVar[RouteDecision]
EXECUTION_MODE_UNSPECIFIED: ExecutionMode
EXECUTION_MODE_TRANSFER: ExecutionMode
EXECUTION_MODE_RECOMPUTE: ExecutionMode
EXECUTION_MODE_SAME_POOL: ExecutionMode
RESOURCE_NEED_UNSPECIFIED: ResourceNeed
RESOURCE_NEED_PREFILL: ResourceNeed
RESOURCE_NEED_DECODE: ResourceNeed
RESOURCE_NEED_SHARED: ResourceNeed
ROUTE_DECISION_UNSPECIFIED: RouteDecision
ROUTE_DECISION_PRIMARY: RouteDecision
ROUTE_DECISION_REROUTE: RouteDecision
ROUTE_DECISION_REJECT: RouteDecision

class ScheduleRequest(_message.Message):
    __slots__ = ("request_id", "model_id", "prompt_tokens", "expected_output_tokens", "tier", "prefix_hints", "model_revision", "preferred_pool", "prefix_block_hashes", "prefix_block_tokens", "trace_context", "avoid_workers")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HINTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_REVISION_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_POOL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    AVOID_WORKERS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    prompt_tokens: int
    expected_output_tokens: int
    tier: str
    prefix_hints: _containers.RepeatedScalarFieldContainer[str]
    model_revision: str
    preferred_pool: str
    prefix_block_hashes: _containers.RepeatedScalarFieldContainer[int]
    prefix_block_tokens: int
    trace_context: _containers.ScalarMap[str, str]
    avoid_workers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., expected_output_tokens: _Optional[int] = ..., tier: _Optional[str] = ..., prefix_hints: _Optional[_Iterable[str]] = ..., model_revision: _Optional[str] = ..., preferred_pool: _Optional[str] = ..., prefix_block_hashes: _Optional[_Iterable[int]] = ..., prefix_block_tokens: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., avoid_workers: _Optional[_Iterable[str]] = ...) -> None: ...

class Estimates(_message.Message):
    __slots__ = ("kv_bytes", "transfer_ms", "recompute_ms", "conversion_ms", "prefill_wait_ms", "prefill_ms", "ttft_ms", "tpot_ms")
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    CONVERSION_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    kv_bytes: int
    transfer_ms: float
    recompute_ms: float
    conversion_ms: float
    prefill_wait_ms: float
    prefill_ms: float
    ttft_ms: float
    tpot_ms: float
    def __init__(self, kv_bytes: _Optional[int] = ..., transfer_ms: _Optional[float] = ..., recompute_ms: _Optional[float] = ..., conversion_ms: _Optional[float] = ..., prefill_wait_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., tpot_ms: _Optional[float] = ...) -> None: ...

class FallbackStep(_message.Message):
    __slots__ = ("mode", "prefill_worker_id", "decode_worker_id", "decode_pool_id", "reason", "est_ttft_ms", "remaining_budget_ms")
    MODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_POOL_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EST_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    REMAINING_BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    mode: ExecutionMode
    prefill_worker_id: str
    decode_worker_id: str
    decode_pool_id: str
    reason: str
    est_ttft_ms: float
    remaining_budget_ms: float
    def __init__(self, mode: _Optional[_Union[ExecutionMode, str]] = ..., prefill_worker_id: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., decode_pool_id: _Optional[str] = ..., reason: _Optional[str] = ..., est_ttft_ms: _Optional[float] = ..., remaining_budget_ms: _Optional[float] = ...) -> None: ...

class ServingAction(_message.Message):
    __slots__ = ("action", "protects", "ladder_steps")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    PROTECTS_FIELD_NUMBER: _ClassVar[int]
    LADDER_STEPS_FIELD_NUMBER: _ClassVar[int]
    action: str
    protects: str
    ladder_steps: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, action: _Optional[str] = ..., protects: _Optional[str] = ..., ladder_steps: _Optional[_Iterable[str]] = ...) -> None: ...

class RoutePlan(_message.Message):
    __slots__ = ("request_id", "resource_need", "decision", "mode", "prefill_worker_id", "prefill_pool_id", "prefill_endpoint", "decode_worker_id", "decode_pool_id", "decode_endpoint", "estimates", "serving_action", "kv_session_id", "fallbacks", "route_record_id", "tier", "reserved_kv_bytes", "reservation_expires_at_unix_ms", "mode_reason", "planned_at_unix_ms", "cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESOURCE_NEED_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_POOL_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_POOL_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ESTIMATES_FIELD_NUMBER: _ClassVar[int]
    SERVING_ACTION_FIELD_NUMBER: _ClassVar[int]
    KV_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    ROUTE_RECORD_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    RESERVED_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_EXPIRES_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    MODE_REASON_FIELD_NUMBER: _ClassVar[int]
    PLANNED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    resource_need: ResourceNeed
    decision: RouteDecision
    mode: ExecutionMode
    prefill_worker_id: str
    prefill_pool_id: str
    prefill_endpoint: str
    decode_worker_id: str
    decode_pool_id: str
    decode_endpoint: str
    estimates: Estimates
    serving_action: ServingAction
    kv_session_id: str
    fallbacks: _containers.RepeatedCompositeFieldContainer[FallbackStep]
    route_record_id: str
    tier: str
    reserved_kv_bytes: int
    reservation_expires_at_unix_ms: int
    mode_reason: str
    planned_at_unix_ms: int
    cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., resource_need: _Optional[_Union[ResourceNeed, str]] = ..., decision: _Optional[_Union[RouteDecision, str]] = ..., mode: _Optional[_Union[ExecutionMode, str]] = ..., prefill_worker_id: _Optional[str] = ..., prefill_pool_id: _Optional[str] = ..., prefill_endpoint: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., decode_pool_id: _Optional[str] = ..., decode_endpoint: _Optional[str] = ..., estimates: _Optional[_Union[Estimates, _Mapping]] = ..., serving_action: _Optional[_Union[ServingAction, _Mapping]] = ..., kv_session_id: _Optional[str] = ..., fallbacks: _Optional[_Iterable[_Union[FallbackStep, _Mapping]]] = ..., route_record_id: _Optional[str] = ..., tier: _Optional[str] = ..., reserved_kv_bytes: _Optional[int] = ..., reservation_expires_at_unix_ms: _Optional[int] = ..., mode_reason: _Optional[str] = ..., planned_at_unix_ms: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class ScheduleResponse(_message.Message):
    __slots__ = ("plan", "replayed")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    plan: RoutePlan
    replayed: bool
    def __init__(self, plan: _Optional[_Union[RoutePlan, _Mapping]] = ..., replayed: bool = ...) -> None: ...

class ScheduleStreamResponse(_message.Message):
    __slots__ = ("request_id", "response", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    response: ScheduleResponse
    error: ScheduleError
    def __init__(self, request_id: _Optional[str] = ..., response: _Optional[_Union[ScheduleResponse, _Mapping]] = ..., error: _Optional[_Union[ScheduleError, _Mapping]] = ...) -> None: ...

class ScheduleError(_message.Message):
    __slots__ = ("code", "message", "retry_after_ms", "field")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    retry_after_ms: int
    field: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., retry_after_ms: _Optional[int] = ..., field: _Optional[str] = ...) -> None: ...

class ReportOutcomeRequest(_message.Message):
    __slots__ = ("request_id", "success", "error_class", "ttft_ms", "tpot_ms", "mode_used", "prefill_ms", "transfer_ms", "output_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    ERROR_CLASS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    MODE_USED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    success: bool
    error_class: str
    ttft_ms: float
    tpot_ms: float
    mode_used: ExecutionMode
    prefill_ms: float
    transfer_ms: float
    output_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., success: bool = ..., error_class: _Optional[str] = ..., ttft_ms: _Optional[float] = ..., tpot_ms: _Optional[float] = ..., mode_used: _Optional[_Union[ExecutionMode, str]] = ..., prefill_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., output_tokens: _Optional[int] = ...) -> None: ...

class ReportOutcomeResponse(_message.Message):
    __slots__ = ("released", "first_report")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    FIRST_REPORT_FIELD_NUMBER: _ClassVar[int]
    released: bool
    first_report: bool
    def __init__(self, released: bool = ..., first_report: bool = ...) -> None: ...

class Outcome(_message.Message):
    __slots__ = ("success", "error_class", "ttft_ms", "tpot_ms", "mode_used", "prefill_ms", "transfer_ms", "output_tokens", "reported_at_unix_ms")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    ERROR_CLASS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    MODE_USED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPORTED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    success: bool
    error_class: str
    ttft_ms: float
    tpot_ms: float
    mode_used: ExecutionMode
    prefill_ms: float
    transfer_ms: float
    output_tokens: int
    reported_at_unix_ms: int
    def __init__(self, success: bool = ..., error_class: _Optional[str] = ..., ttft_ms: _Optional[float] = ..., tpot_ms: _Optional[float] = ..., mode_used: _Optional[_Union[ExecutionMode, str]] = ..., prefill_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., output_tokens: _Optional[int] = ..., reported_at_unix_ms: _Optional[int] = ...) -> None: ...

class RouteRecord(_message.Message):
    __slots__ = ("request_id", "model_id", "tier", "created_at_unix_ms", "decision", "resource_need", "plan", "serving_action", "reject_reasons", "reject_class", "summary", "explanation", "outcome", "scheduler_id", "trace_id")
    class SummaryEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    RESOURCE_NEED_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    SERVING_ACTION_FIELD_NUMBER: _ClassVar[int]
    REJECT_REASONS_FIELD_NUMBER: _ClassVar[int]
    REJECT_CLASS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    EXPLANATION_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    tier: str
    created_at_unix_ms: int
    decision: RouteDecision
    resource_need: ResourceNeed
    plan: RoutePlan
    serving_action: ServingAction
    reject_reasons: _containers.RepeatedScalarFieldContainer[str]
    reject_class: str
    summary: _containers.ScalarMap[str, str]
    explanation: _struct_pb2.Struct
    outcome: Outcome
    scheduler_id: str
    trace_id: str
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ..., tier: _Optional[str] = ..., created_at_unix_ms: _Optional[int] = ..., decision: _Optional[_Union[RouteDecision, str]] = ..., resource_need: _Optional[_Union[ResourceNeed, str]] = ..., plan: _Optional[_Union[RoutePlan, _Mapping]] = ..., serving_action: _Optional[_Union[ServingAction, _Mapping]] = ..., reject_reasons: _Optional[_Iterable[str]] = ..., reject_class: _Optional[str] = ..., summary: _Optional[_Mapping[str, str]] = ..., explanation: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., outcome: _Optional[_Union[Outcome, _Mapping]] = ..., scheduler_id: _Optional[str] = ..., trace_id: _Optional[str] = ...) -> None: ...

class GetRouteRecordRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class GetRouteRecordResponse(_message.Message):
    __slots__ = ("record",)
    RECORD_FIELD_NUMBER: _ClassVar[int]
    record: RouteRecord
    def __init__(self, record: _Optional[_Union[RouteRecord, _Mapping]] = ...) -> None: ...

class ListRouteRecordsRequest(_message.Message):
    __slots__ = ("since_unix_ms", "until_unix_ms", "tier", "worker_id", "decision", "mode", "model_id", "page_size", "page_token")
    SINCE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    UNTIL_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    since_unix_ms: int
    until_unix_ms: int
    tier: str
    worker_id: str
    decision: RouteDecision
    mode: ExecutionMode
    model_id: str
    page_size: int
    page_token: str
    def __init__(self, since_unix_ms: _Optional[int] = ..., until_unix_ms: _Optional[int] = ..., tier: _Optional[str] = ..., worker_id: _Optional[str] = ..., decision: _Optional[_Union[RouteDecision, str]] = ..., mode: _Optional[_Union[ExecutionMode, str]] = ..., model_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListRouteRecordsResponse(_message.Message):
    __slots__ = ("records", "next_page_token")
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[RouteRecord]
    next_page_token: str
    def __init__(self, records: _Optional[_Iterable[_Union[RouteRecord, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class Tier(_message.Message):
    __slots__ = ("name", "ttft_ms", "tpot_ms", "queue_budget_ms", "priority", "may_throttle", "may_shed", "hard_ttft_ms")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MAY_THROTTLE_FIELD_NUMBER: _ClassVar[int]
    MAY_SHED_FIELD_NUMBER: _ClassVar[int]
    HARD_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    name: str
    ttft_ms: float
    tpot_ms: float
    queue_budget_ms: float
    priority: int
    may_throttle: bool
    may_shed: bool
    hard_ttft_ms: float
    def __init__(self, name: _Optional[str] = ..., ttft_ms: _Optional[float] = ..., tpot_ms: _Optional[float] = ..., queue_budget_ms: _Optional[float] = ..., priority: _Optional[int] = ..., may_throttle: bool = ..., may_shed: bool = ..., hard_ttft_ms: _Optional[float] = ...) -> None: ...

class Policy(_message.Message):
    __slots__ = ("profile", "pairing", "prefill_weights", "decode_weights", "tiers", "default_tier", "source_yaml", "generation", "loaded_at_unix_ms")
    class PrefillWeightsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class DecodeWeightsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    PAIRING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_TIER_FIELD_NUMBER: _ClassVar[int]
    SOURCE_YAML_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LOADED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    profile: str
    pairing: str
    prefill_weights: _containers.ScalarMap[str, float]
    decode_weights: _containers.ScalarMap[str, float]
    tiers: _containers.RepeatedCompositeFieldContainer[Tier]
    default_tier: str
    source_yaml: str
    generation: int
    loaded_at_unix_ms: int
    def __init__(self, profile: _Optional[str] = ..., pairing: _Optional[str] = ..., prefill_weights: _Optional[_Mapping[str, float]] = ..., decode_weights: _Optional[_Mapping[str, float]] = ..., tiers: _Optional[_Iterable[_Union[Tier, _Mapping]]] = ..., default_tier: _Optional[str] = ..., source_yaml: _Optional[str] = ..., generation: _Optional[int] = ..., loaded_at_unix_ms: _Optional[int] = ...) -> None: ...

class GetPolicyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetPolicyResponse(_message.Message):
    __slots__ = ("policy",)
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: Policy
    def __init__(self, policy: _Optional[_Union[Policy, _Mapping]] = ...) -> None: ...

class ReloadPolicyRequest(_message.Message):
    __slots__ = ("builtin_profile", "profile_yaml", "dry_run")
    BUILTIN_PROFILE_FIELD_NUMBER: _ClassVar[int]
    PROFILE_YAML_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    builtin_profile: str
    profile_yaml: str
    dry_run: bool
    def __init__(self, builtin_profile: _Optional[str] = ..., profile_yaml: _Optional[str] = ..., dry_run: bool = ...) -> None: ...

class ReloadPolicyResponse(_message.Message):
    __slots__ = ("policy", "applied")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    policy: Policy
    applied: bool
    def __init__(self, policy: _Optional[_Union[Policy, _Mapping]] = ..., applied: bool = ...) -> None: ...

class GetRecommendationsRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class RebalanceMove(_message.Message):
    __slots__ = ("src_worker_id", "dst_worker_id", "fraction", "requests")
    SRC_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DST_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FRACTION_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    src_worker_id: str
    dst_worker_id: str
    fraction: float
    requests: int
    def __init__(self, src_worker_id: _Optional[str] = ..., dst_worker_id: _Optional[str] = ..., fraction: _Optional[float] = ..., requests: _Optional[int] = ...) -> None: ...

class BatchSizeRecommendation(_message.Message):
    __slots__ = ("worker_id", "current_max_batch_size", "recommended_max_batch_size", "change", "reason", "itl_p99_ms", "target_itl_ms")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CURRENT_MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    RECOMMENDED_MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHANGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ITL_P99_MS_FIELD_NUMBER: _ClassVar[int]
    TARGET_ITL_MS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    current_max_batch_size: int
    recommended_max_batch_size: int
    change: str
    reason: str
    itl_p99_ms: float
    target_itl_ms: float
    def __init__(self, worker_id: _Optional[str] = ..., current_max_batch_size: _Optional[int] = ..., recommended_max_batch_size: _Optional[int] = ..., change: _Optional[str] = ..., reason: _Optional[str] = ..., itl_p99_ms: _Optional[float] = ..., target_itl_ms: _Optional[float] = ...) -> None: ...

class WorkerEstimate(_message.Message):
    __slots__ = ("worker_id", "prefill_tokens_per_s", "itl_ms", "samples", "reserved_kv_bytes", "reserved_requests", "load", "learned_prefill_fixed_ms", "learned_prefill_scale", "learned_prefill_samples", "learned_prefill_queue_share", "learned_decode_scale", "learned_decode_seq_ms", "learned_decode_samples")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    ITL_MS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LEARNED_PREFILL_FIXED_MS_FIELD_NUMBER: _ClassVar[int]
    LEARNED_PREFILL_SCALE_FIELD_NUMBER: _ClassVar[int]
    LEARNED_PREFILL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LEARNED_PREFILL_QUEUE_SHARE_FIELD_NUMBER: _ClassVar[int]
    LEARNED_DECODE_SCALE_FIELD_NUMBER: _ClassVar[int]
    LEARNED_DECODE_SEQ_MS_FIELD_NUMBER: _ClassVar[int]
    LEARNED_DECODE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    prefill_tokens_per_s: float
    itl_ms: float
    samples: int
    reserved_kv_bytes: int
    reserved_requests: int
    load: float
    learned_prefill_fixed_ms: float
    learned_prefill_scale: float
    learned_prefill_samples: int
    learned_prefill_queue_share: float
    learned_decode_scale: float
    learned_decode_seq_ms: float
    learned_decode_samples: int
    def __init__(self, worker_id: _Optional[str] = ..., prefill_tokens_per_s: _Optional[float] = ..., itl_ms: _Optional[float] = ..., samples: _Optional[int] = ..., reserved_kv_bytes: _Optional[int] = ..., reserved_requests: _Optional[int] = ..., load: _Optional[float] = ..., learned_prefill_fixed_ms: _Optional[float] = ..., learned_prefill_scale: _Optional[float] = ..., learned_prefill_samples: _Optional[int] = ..., learned_prefill_queue_share: _Optional[float] = ..., learned_decode_scale: _Optional[float] = ..., learned_decode_seq_ms: _Optional[float] = ..., learned_decode_samples: _Optional[int] = ...) -> None: ...

class LinkEstimate(_message.Message):
    __slots__ = ("src_pool_id", "dst_pool_id", "gbps", "samples")
    SRC_POOL_ID_FIELD_NUMBER: _ClassVar[int]
    DST_POOL_ID_FIELD_NUMBER: _ClassVar[int]
    GBPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    src_pool_id: str
    dst_pool_id: str
    gbps: float
    samples: int
    def __init__(self, src_pool_id: _Optional[str] = ..., dst_pool_id: _Optional[str] = ..., gbps: _Optional[float] = ..., samples: _Optional[int] = ...) -> None: ...

class ModelRecommendations(_message.Message):
    __slots__ = ("model_id", "imbalanced", "mean_load", "moves", "batch_sizes")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    IMBALANCED_FIELD_NUMBER: _ClassVar[int]
    MEAN_LOAD_FIELD_NUMBER: _ClassVar[int]
    MOVES_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    imbalanced: bool
    mean_load: float
    moves: _containers.RepeatedCompositeFieldContainer[RebalanceMove]
    batch_sizes: _containers.RepeatedCompositeFieldContainer[BatchSizeRecommendation]
    def __init__(self, model_id: _Optional[str] = ..., imbalanced: bool = ..., mean_load: _Optional[float] = ..., moves: _Optional[_Iterable[_Union[RebalanceMove, _Mapping]]] = ..., batch_sizes: _Optional[_Iterable[_Union[BatchSizeRecommendation, _Mapping]]] = ...) -> None: ...

class GetRecommendationsResponse(_message.Message):
    __slots__ = ("models", "workers", "links", "computed_at_unix_ms")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelRecommendations]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerEstimate]
    links: _containers.RepeatedCompositeFieldContainer[LinkEstimate]
    computed_at_unix_ms: int
    def __init__(self, models: _Optional[_Iterable[_Union[ModelRecommendations, _Mapping]]] = ..., workers: _Optional[_Iterable[_Union[WorkerEstimate, _Mapping]]] = ..., links: _Optional[_Iterable[_Union[LinkEstimate, _Mapping]]] = ..., computed_at_unix_ms: _Optional[int] = ...) -> None: ...
